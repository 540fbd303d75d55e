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
TARGETS="fitmoe fitmoe_tests fitmoe_expert_prefetch"
case "$CUDA" in ON|on|1|TRUE|true|YES|yes) GPU_BENCH=1; TARGETS="$TARGETS fitmoe_gpu_phase_sync" ;; *) GPU_BENCH=0 ;; esac
cmake --build build-dev --target $TARGETS
mkdir -p devbin testdata-local
# Compressed with xz (scripts/device-lib.sh unpacks them there): the GPU kernels make each binary
# ~30 MiB, ~5.4 MiB packed, and the carry limit is 64 MiB in all, fixtures included (~44 MiB). For an
# A/B add another commit's build as devbin/fitmoe_old.xz.
rm -f devbin/*
pack() { strip -o "devbin/$2" "$1" && xz -9 -T0 -f "devbin/$2"; }
pack build-dev/fitmoe fitmoe
pack build-dev/tests/fitmoe_tests fitmoe_tests
pack build-dev/fitmoe_expert_prefetch fitmoe_expert_prefetch
if [ "$GPU_BENCH" = 1 ]; then pack build-dev/fitmoe_gpu_phase_sync fitmoe_gpu_phase_sync; fi
TD=${FITMOE_TESTDATA:-../shared/testdata}
# FITMOE_FIXTURES: which fixture folders travel (all of them exceed the 64 MiB carry beside devbin/),
# e.g. "quant-vectors gemma4-tiny gemma4moe-tiny" for a gemma4 run; the others are removed.
FIXTURES=${FITMOE_FIXTURES:-quant-vectors qwen3moe-tiny qwen3-draft}
rm -rf testdata-local/*
for d in $FIXTURES; do
  cp -r "$TD/$d" "testdata-local/$d"
done
# The reference's llama-bench for scripts/device-reference.sh (built elsewhere from its public source).
if [ -n "${FITMOE_REF_BIN:-}" ]; then
  mkdir -p refbin && rm -f refbin/*
  strip -o refbin/llama-bench "$FITMOE_REF_BIN" && xz -9 -T0 -f refbin/llama-bench
  du -sh refbin
fi
du -sh devbin testdata-local
