#!/usr/bin/env bash
# Builds everything with CMake in build/cmake: the core library (for LibTorch
# programs), the Python extension (python/zeroshard/_C*.so, next to the core
# library it links), the C++ tests and the example. The core compiles once for
# all of them. ZEROSHARD_PYTHON_ONLY=1 builds the extension alone. Incremental.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/ensure_env.sh
mkdir -p build

prefix=$("$PYTHON" -c "import torch; print(torch.utils.cmake_prefix_path)")
cmake -S . -B build/cmake -G Ninja -DCMAKE_PREFIX_PATH="$prefix" \
  -DPython3_EXECUTABLE="$(command -v "$PYTHON")" -DZEROSHARD_BUILD_PYTHON=ON \
  -DZEROSHARD_PYTHON_PACKAGE_DIR="$PWD/python/zeroshard" \
  -DZEROSHARD_BUILD_TESTS=ON -DZEROSHARD_BUILD_EXAMPLES=ON \
  >build/cmake-configure.log 2>&1 || { cat build/cmake-configure.log; exit 1; }
targets=()
[ "${ZEROSHARD_PYTHON_ONLY:-0}" = "1" ] && targets=(--target zeroshard_python)
# A failed compile fails here: an older _C*.so left in place would otherwise
# run the tests against stale code.
cmake --build build/cmake -j "${MAX_JOBS}" "${targets[@]}"
ls python/zeroshard/_C*.so python/zeroshard/libzeroshard.so >/dev/null
