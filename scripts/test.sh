#!/usr/bin/env bash
# Runs every test: the GoogleTest suite (through ctest) and the pytest suite
# (ranks as processes over Gloo). Installs and builds what is missing first.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
source scripts/ensure_env.sh

echo "== C++ tests (GoogleTest via ctest)"
ctest --test-dir build/cmake --output-on-failure --timeout 300

# A test-only peer: the DeepSpeed migration test makes its fixtures with
# DeepSpeed itself (CPU). --no-deps keeps pip from replacing the pinned torch.
if ! "$PYTHON" -c "import deepspeed" 2>/dev/null; then
  echo "[zeroshard] installing deepspeed==0.19.8 for the migration test"
  "$PYTHON" -m pip install -q --no-deps deepspeed==0.19.8
  "$PYTHON" -m pip install -q hjson py-cpuinfo pydantic msgpack einops psutil nvidia-ml-py
fi

# The libraries the integration tests train inside (zeroshard.integrations);
# the versions are the ones those tests pin down (setup.py's "hf" and
# "lightning" extras). lightning and torchmetrics without their dependencies,
# so that pip keeps the torch installed, then the ones torch does not bring.
"$PYTHON" -c "import accelerate" 2>/dev/null || "$PYTHON" -m pip install -q "accelerate>=1.10,<2"
if ! "$PYTHON" -c "import lightning" 2>/dev/null; then
  "$PYTHON" -m pip install -q --no-deps "lightning>=2.6,<2.7" "lightning-utilities>=0.10,<2" \
    "torchmetrics>0.7,<3"
  "$PYTHON" -m pip install -q "PyYAML>5.4" "tqdm>=4.57" "packaging>=23" "numpy>1.20"
fi

echo "== Python tests (pytest)"
"$PYTHON" -m pytest tests/python -q -p no:cacheprovider "$@"
