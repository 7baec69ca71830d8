#!/usr/bin/env bash
# Builds the Python extension in place (python/zeroshard/_C*.so) and the C++
# library, tests and example with CMake (build/cmake). Incremental.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/ensure_env.sh
mkdir -p build

# A failed compile must fail here: an older _C*.so left in place would
# otherwise run the tests against stale code.
"$PYTHON" setup.py -q build_ext --inplace >build/setup.log 2>&1 || {
  grep -vE "^(running|copying|ccache g\+\+|\[[0-9]+/[0-9]+\])" build/setup.log | tail -60
  echo "[zeroshard] building the Python extension failed (full log: build/setup.log)"
  exit 1
}
ls python/zeroshard/_C*.so >/dev/null

if [ "${ZEROSHARD_SKIP_CMAKE:-0}" != "1" ]; then
  prefix=$("$PYTHON" -c "import torch; print(torch.utils.cmake_prefix_path)")
  if [ ! -f build/cmake/build.ninja ]; then
    cmake -S . -B build/cmake -G Ninja -DCMAKE_PREFIX_PATH="$prefix" >build/cmake-configure.log 2>&1 \
      || { cat build/cmake-configure.log; exit 1; }
  fi
  cmake --build build/cmake -j "${MAX_JOBS}"
fi
