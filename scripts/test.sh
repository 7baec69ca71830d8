#!/usr/bin/env bash
# Runs every test: the GoogleTest suite (through ctest) and the pytest suite
# (ranks as processes over Gloo). Installs and builds what is missing first.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
source scripts/ensure_env.sh

echo "== C++ tests (GoogleTest via ctest)"
ctest --test-dir build/cmake --output-on-failure --timeout 300

echo "== Python tests (pytest)"
"$PYTHON" -m pytest tests/python -q -p no:cacheprovider "$@"
