#!/usr/bin/env bash
# GPU check, for a machine with one NVIDIA GPU and torch already installed
# (no network needed): builds the extension against that torch, runs the CUDA
# test subset (CUDA tensors through stages 1 and 2 at world size 1 over NCCL,
# and two ranks sharing the GPU over Gloo), then a short optimizer benchmark
# against torch.optim.AdamW (default, foreach, fused) on the GPU, and the host
# (CPU offload) Adam kernel benchmark on that machine's CPU, and the main
# job (examples/train_gpt.py) on one GPU over NCCL at stage 3 with CPU
# offload and at stage 2 with NVMe offload. Headers that machine lacks
# (nlohmann/json) may travel in .devdeps/include (scripts/gpu_check_deps.sh
# fills it). Everything
# goes to one folder: $OUT if set (the device tool's output folder), else
# gpu_check_results/. Budget: about 8 minutes on 16 cores.
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS="${OUT:-gpu_check_results}"
mkdir -p "$RESULTS"
LOG="$RESULTS/log.txt"
PYTHON="${PYTHON:-python3}"
status=0
{
  echo "== machine"
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
  "$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'available', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"

  echo "== build (extension against the installed torch)"
  start=$(date +%s)
  command -v ccache >/dev/null && [ -x /usr/lib/ccache/g++ ] && export CXX=/usr/lib/ccache/g++
  export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
  [ -d .devdeps/include ] && export CPATH="$PWD/.devdeps/include${CPATH:+:$CPATH}"
  if ! command -v ninja >/dev/null; then
    ninja_dir=$("$PYTHON" -c "import ninja, os; print(ninja.BIN_DIR)" 2>/dev/null || true)
    [ -n "$ninja_dir" ] && export PATH="$ninja_dir:$PATH"
  fi
  timeout 300 "$PYTHON" setup.py -q build_ext --inplace >"$RESULTS/build.txt" 2>&1 \
    || { echo "build FAILED (see build.txt)"; tail -30 "$RESULTS/build.txt"; exit 1; }
  echo "built in $(( $(date +%s) - start )) s"

  echo "== CUDA tests"
  timeout 300 "$PYTHON" -m pytest tests/python/test_cuda.py -v -s -p no:cacheprovider \
    --junitxml="$RESULTS/cuda_tests.xml" || status=1

  echo "== the main job on one GPU (NCCL): stage 3 + CPU offload, stage 2 + NVMe offload"
  export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
  timeout 90 "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node 1 \
    examples/train_gpt.py --steps 40 --stage 3 --offload-optimizer cpu --offload-param cpu \
    || status=1
  mkdir -p /tmp/zeroshard_swap
  timeout 90 "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node 1 \
    examples/train_gpt.py --steps 40 --stage 2 --offload-optimizer nvme \
    --nvme-path /tmp/zeroshard_swap || status=1
  echo "== optimizer benchmark on the GPU"
  timeout 120 "$PYTHON" benchmarks/bench_cpu_optimizer.py --device cuda --numel 50000000 \
    --out "$RESULTS/gpu_optimizer.md" || status=1

  echo "== host Adam kernel (CPU offload) on this machine's CPU"
  timeout 120 "$PYTHON" benchmarks/bench_host_adam.py --sizes 16M,64M --threads 1,4 \
    --out "$RESULTS/host_adam.md" || status=1
  echo "== done, status $status"
  exit "$status"
} 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
