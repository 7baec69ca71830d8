#!/usr/bin/env bash
# Builds the Python extension in place (python/zeroshard/_C*.so) and the C++
# library, tests and example with CMake (build/cmake). Incremental.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/ensure_env.sh

"$PYTHON" setup.py -q build_ext --inplace 2>&1 | grep -vE "^(running|copying|ccache g\+\+|\[[0-9]+/[0-9]+\])" || true
ls python/zeroshard/_C*.so >/dev/null

if [ "${ZEROSHARD_SKIP_CMAKE:-0}" != "1" ]; then
  prefix=$("$PYTHON" -c "import torch; print(torch.utils.cmake_prefix_path)")
  if [ ! -f build/cmake/build.ninja ]; then
    cmake -S . -B build/cmake -G Ninja -DCMAKE_PREFIX_PATH="$prefix" >build/cmake-configure.log 2>&1 \
      || { cat build/cmake-configure.log; exit 1; }
  fi
  cmake --build build/cmake -j "${MAX_JOBS}"
fi
