#!/usr/bin/env bash
# Installs what zeroshard needs on a fresh machine (Debian, Python 3.10+),
# and does nothing for what is already there. Sourced by the other scripts.
set -euo pipefail

TORCH_VERSION="${ZEROSHARD_TORCH_VERSION:-2.11.0}"
PYTHON="${PYTHON:-python3}"

missing_debs=()
command -v cmake >/dev/null || missing_debs+=(cmake)
command -v ninja >/dev/null || missing_debs+=(ninja-build)
command -v ccache >/dev/null || missing_debs+=(ccache)
command -v g++ >/dev/null || missing_debs+=(g++)
[ -f /usr/include/gtest/gtest.h ] || missing_debs+=(libgtest-dev)
[ -f /usr/include/gloo/rendezvous/store.h ] || missing_debs+=(libgloo-dev)
[ -f /usr/include/nlohmann/json.hpp ] || missing_debs+=(nlohmann-json3-dev)
[ -f /usr/include/liburing.h ] || missing_debs+=(liburing-dev)
if [ ${#missing_debs[@]} -gt 0 ]; then
  echo "[zeroshard] installing Debian packages: ${missing_debs[*]}"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing_debs[@]}" >/dev/null
fi

have_torch=$("$PYTHON" -c "import torch; print(torch.__version__.split('+')[0])" 2>/dev/null || true)
if [ -z "$have_torch" ]; then
  echo "[zeroshard] installing torch==${TORCH_VERSION} (a CUDA build of several GB)"
  "$PYTHON" -m pip install -q "torch==${TORCH_VERSION}"
elif [ "$have_torch" != "$TORCH_VERSION" ]; then
  echo "[zeroshard] using the installed torch ${have_torch} (pinned: ${TORCH_VERSION})"
fi
for module in pytest numpy ninja matplotlib safetensors transformers; do
  "$PYTHON" -c "import ${module}" 2>/dev/null || "$PYTHON" -m pip install -q "${module}"
done

# ccache behind the name g++, which torch.utils.cpp_extension recognises.
if [ -x /usr/lib/ccache/g++ ]; then export CXX="${CXX:-/usr/lib/ccache/g++}"; fi
export CCACHE_DIR="${CCACHE_DIR:-$HOME/.cache/ccache}"
# Hash paths relative to the checkout, so a fresh clone elsewhere (CI) hits the cache.
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$PWD}"
export MAX_JOBS="${MAX_JOBS:-2}"
