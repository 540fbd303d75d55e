#!/usr/bin/env bash
# Configures and builds fitmoe into build/ (CUDA backend too when nvcc is found, unless FITMOE_CUDA=OFF).
set -euo pipefail
cd "$(dirname "$0")/.."
CUDA=${FITMOE_CUDA:-auto}
if [ "$CUDA" = auto ]; then
  if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then CUDA=ON; else CUDA=OFF; fi
fi
[ -d src/cuda ] || CUDA=OFF
export PATH="$PATH:/usr/local/cuda/bin"
cmake -S . -B "${BUILD_DIR:-build}" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFITMOE_CUDA="$CUDA" "$@" >/dev/null
cmake --build "${BUILD_DIR:-build}" -j "$(nproc)"
