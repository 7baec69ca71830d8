#!/usr/bin/env bash
# Copies the build's header-only dependencies that the lent GPU machine's
# image lacks (it reaches no package registry) into .devdeps/include, which
# git ignores and the device tool carries; scripts/gpu_check.sh puts it on
# CPATH. liburing and gloo stay behind: both are optional (the I/O engine
# falls back to its thread pool, Python users never need the C++ Gloo group).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/ensure_env.sh
rm -rf .devdeps && mkdir -p .devdeps/include
cp -r /usr/include/nlohmann .devdeps/include/
du -sh .devdeps
