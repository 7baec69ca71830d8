#!/usr/bin/env bash
# Copies the build's header-only dependencies that the lent GPU machine's
# image lacks (it reaches no package registry) into .devdeps/include, which
# git ignores and the device tool carries; scripts/gpu_check.sh puts it on
# CPATH. liburing travels too, as its headers and its static library in
# .devdeps/lib (position-independent, ~20 KB), so the NVMe tier runs on
# io_uring there (gpu_check.sh puts .devdeps on CMAKE_PREFIX_PATH); without
# it the I/O engine falls back to its thread pool. Gloo's headers stay
# behind (Python users never need the C++ Gloo group).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/ensure_env.sh
rm -rf .devdeps && mkdir -p .devdeps/include .devdeps/lib
cp -r /usr/include/nlohmann .devdeps/include/
if [ -f /usr/include/liburing.h ] && [ -f /usr/lib/x86_64-linux-gnu/liburing.a ]; then
  cp -r /usr/include/liburing.h /usr/include/liburing .devdeps/include/
  cp /usr/lib/x86_64-linux-gnu/liburing.a .devdeps/lib/
fi
du -sh .devdeps
