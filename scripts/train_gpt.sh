#!/usr/bin/env bash
# The main job: a small GPT trained with zeroshard on 2 ranks (CPU/Gloo by
# default, NCCL when GPUs are present). Extra arguments go to the script,
# e.g. `bash scripts/train_gpt.sh --steps 50 --stage 1`.
set -euo pipefail
cd "$(dirname "$0")/.."
ZEROSHARD_PYTHON_ONLY=1 bash scripts/build.sh
source scripts/ensure_env.sh
NPROC="${NPROC:-2}"
PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" \
  "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" \
  examples/train_gpt.py "$@"
