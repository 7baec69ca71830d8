#!/usr/bin/env bash
# GPU check, for a machine with one NVIDIA GPU and torch already installed
# (no network needed): builds the extension against that torch (RelWithDebInfo),
# runs the CUDA tests (stages 1-3 at world size 1 over NCCL, two ranks sharing
# the GPU over Gloo, CPU and NVMe offload), reruns the NVMe case alone under
# cuda-gdb if it fails, runs the main job (examples/train_gpt.py) on one GPU
# over NCCL at stage 3 with CPU offload and at stage 2 with NVMe offload, then
# a short optimizer benchmark against torch.optim.AdamW (default, foreach,
# fused) on the GPU and the host (CPU offload) Adam kernel benchmark on that
# machine's CPU. Headers that machine lacks (nlohmann/json) may travel in
# .devdeps/include (scripts/gpu_check_deps.sh fills it). Also: the offload
# and host-sync CUDA tests under TORCH_CUDA_SANITIZER=1, and
# benchmarks/bench_gpu_fake_world.py (one GPU as rank 0 of 8 on torch's fake
# group; docs/gpu.md). Everything goes to one folder: $OUT if set (the device
# tool's output folder), else gpu_check_results/. Budget: about 10 minutes on
# 16 cores.
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
  # liburing's headers and static library, when gpu_check_deps.sh carried them.
  [ -f .devdeps/lib/liburing.a ] && export CMAKE_PREFIX_PATH="$PWD/.devdeps${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
  if ! command -v ninja >/dev/null; then
    ninja_dir=$("$PYTHON" -c "import ninja, os; print(ninja.BIN_DIR)" 2>/dev/null || true)
    [ -n "$ninja_dir" ] && export PATH="$ninja_dir:$PATH"
  fi
  # Line numbers in a backtrace, at -O2 still.
  export ZEROSHARD_CMAKE_BUILD_TYPE="${ZEROSHARD_CMAKE_BUILD_TYPE:-RelWithDebInfo}"
  timeout 300 "$PYTHON" setup.py -q build_ext --inplace >"$RESULTS/build.txt" 2>&1 \
    || { echo "build FAILED (see build.txt)"; tail -30 "$RESULTS/build.txt"; exit 1; }
  echo "built in $(( $(date +%s) - start )) s"

  echo "== one C++ runtime (the NVMe crash: a toolchain that links libstdc++.a)"
  "$PYTHON" -m pytest tests/python/test_build.py -q -p no:cacheprovider || status=1

  echo "== CUDA tests"
  # --timeout: a crashed rank must not eat the machine's minutes (pytest-timeout
  # is in that machine's image; without it the outer timeout still holds).
  timeout_flag=()
  "$PYTHON" -c "import pytest_timeout" 2>/dev/null && timeout_flag=(--timeout 90)
  timeout 300 "$PYTHON" -m pytest tests/python/test_cuda.py -v -s -p no:cacheprovider \
    "${timeout_flag[@]}" --junitxml="$RESULTS/cuda_tests.xml" || status=1

  echo "== the side-stream and offload tests under the CUDA sanitizer (CSAN)"
  TORCH_CUDA_SANITIZER=1 timeout 180 "$PYTHON" -m pytest tests/python/test_cuda.py -q -s \
    -p no:cacheprovider "${timeout_flag[@]}" -k "offload or host_syncs" || status=1

  echo "== one GPU as rank 0 of 8 (fake group): stages 1-3 vs FSDP2 and fused AdamW"
  # A 0.67B bf16 GPT: step time, peak memory, host syncs (counted, profiled),
  # aligned vs misaligned GEMM, pinned vs pageable offload.
  PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" timeout 240 "$PYTHON" \
    benchmarks/bench_gpu_fake_world.py --out "$RESULTS/fake_world.md" || status=1

  echo "== NVMe offload on the GPU, one process (native backtrace if it crashes)"
  # It once crashed here (a second libstdc++, see cmake/shared_libstdcxx.cmake):
  # if it ever does again, with cuda-gdb there, every thread's backtrace goes
  # to nvme_backtrace.txt.
  nvme_run=("$PYTHON" tests/python/scripts/nvme_on_device.py --stage 2 --pin)
  export RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29731
  if timeout 60 "${nvme_run[@]}"; then
    echo "NVMe on the GPU: ok"
  else
    status=1
    if command -v cuda-gdb >/dev/null; then
      MASTER_PORT=29732 timeout 120 cuda-gdb -batch -ex run -ex "thread apply all bt 40" \
        --args "${nvme_run[@]}" >"$RESULTS/nvme_backtrace.txt" 2>&1
      grep -n -B2 -A40 "SIGSEGV" "$RESULTS/nvme_backtrace.txt" | head -80
    fi
  fi
  unset RANK WORLD_SIZE LOCAL_RANK MASTER_ADDR MASTER_PORT

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
