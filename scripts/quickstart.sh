#!/usr/bin/env bash
# One command from a fresh Debian 12 machine to generated tokens:
#   scripts/quickstart.sh [MODEL.gguf]
# installs the dependencies, builds, and runs fitmoe on MODEL (or on a demo model it generates).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh
MODEL=${1:-}
if [ -z "$MODEL" ]; then
  MODEL=build/demo-qwen3moe-tiny-q4_k_m.gguf
  [ -f "$MODEL" ] || build/fitmoe gen-model --arch qwen3moe --preset tiny --type q4_k_m -o "$MODEL"
fi
build/fitmoe info -m "$MODEL"
build/fitmoe run -m "$MODEL" -p "Once upon a time" -n 32
