#!/usr/bin/env bash
# Prepares what a device run carries: a portable build (static libstdc++, PCRE2, utf8proc) in devbin/ and
# the test fixtures it needs in testdata-local/ (both git-ignored). Then call the device tool with
#   command: scripts/device-run.sh all     carry: ["devbin", "testdata-local"]
set -euo pipefail
cd "$(dirname "$0")/.."
CUDA=${FITMOE_CUDA:-ON}
# Only the device tool's H200 (sm_90) for carried builds: the 64 MiB carry limit.
cmake -S . -B build-dev -G Ninja -DCMAKE_BUILD_TYPE=Release -DFITMOE_STATIC=ON -DFITMOE_BENCH=OFF -DFITMOE_CUDA="$CUDA" \
  -DCMAKE_CUDA_ARCHITECTURES="${FITMOE_CUDA_ARCH:-90}" >/dev/null
TARGETS="fitmoe fitmoe_tests"
case "$CUDA" in ON|on|1|TRUE|true|YES|yes) GPU_BENCH=1; TARGETS="$TARGETS fitmoe_gpu_phase_sync" ;; *) GPU_BENCH=0 ;; esac
cmake --build build-dev --target $TARGETS
mkdir -p devbin testdata-local
# Compressed: the GPU kernels make each binary ~15 MiB and the carry limit is 64 MiB in all.
rm -f devbin/*
strip -o devbin/fitmoe build-dev/fitmoe && gzip -f devbin/fitmoe
strip -o devbin/fitmoe_tests build-dev/tests/fitmoe_tests && gzip -f devbin/fitmoe_tests
if [ "$GPU_BENCH" = 1 ]; then
  strip -o devbin/fitmoe_gpu_phase_sync build-dev/fitmoe_gpu_phase_sync
  gzip -f devbin/fitmoe_gpu_phase_sync
fi
TD=${FITMOE_TESTDATA:-../shared/testdata}
for d in quant-vectors qwen3moe-tiny qwen3-draft; do
  rm -rf "testdata-local/$d" && cp -r "$TD/$d" "testdata-local/$d"
done
# The reference's llama-bench for scripts/device-reference.sh (built elsewhere from its public source).
if [ -n "${FITMOE_REF_BIN:-}" ]; then
  mkdir -p refbin && rm -f refbin/*
  strip -o refbin/llama-bench "$FITMOE_REF_BIN" && gzip -f refbin/llama-bench
  du -sh refbin
fi
du -sh devbin testdata-local
