#!/usr/bin/env bash
# The test command (CI runs it through .ci/run): installs dependencies, builds (the CUDA code too when
# nvcc is present, so GPU code cannot rot unseen), runs every test with CTest, then fuzzes the GGUF
# parser for a bounded time.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh
(cd build && ctest --output-on-failure -j "$(nproc)" --timeout 900)
if command -v clang++ >/dev/null 2>&1; then
  CC=clang CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DFITMOE_FUZZ=ON -DFITMOE_TESTS=OFF -DFITMOE_BENCH=OFF \
    -DFITMOE_CUDA=OFF >/dev/null
  cmake --build build-fuzz --target fuzz_gguf
  mkdir -p build-fuzz/corpus
  cp tests/data/*.gguf build-fuzz/corpus/ 2>/dev/null || true
  build-fuzz/fuzz/fuzz_gguf -max_total_time="${FITMOE_FUZZ_SECONDS:-60}" -max_len=4096 -rss_limit_mb=2048 \
    build-fuzz/corpus 2>&1 | tail -n 3
fi
