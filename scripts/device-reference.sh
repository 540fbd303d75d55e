#!/usr/bin/env bash
# fitmoe and the reference (llama.cpp's llama-bench) on the same generated model, in one device run, so
# that issue #4's comparisons stand on figures from one machine and one session.
#   Here:   FITMOE_REF_BIN=/path/to/llama-bench scripts/device-prepare.sh   (also packs refbin/)
#   Device: command scripts/device-reference.sh, carry ["devbin", "refbin"]
# llama-bench must be a CUDA build for the device's GPU (sm_90), statically linked against ggml; it is
# built from the reference's public source and never committed (refbin/ is git-ignored).
# Placements compared: all on the GPU; the anchors' 8 GiB case (experts of the first 36 of 48 layers on
# the host for the Qwen3-30B-A3B shape, 30 of 40 for Qwen3.6-35B-A3B, 20 of 30 for Gemma 4 26B-A4B;
# pinned, q8_0 KV, flash attention) with the reference's default and best micro-batches; fitmoe at
# --vram 8G, at the reference's own placement (the same --override-tensor rule) and on the CPU only.
#   REF_ARCH=qwen3moe|qwen35moe|gemma4 (default qwen3moe): which full-size shape gen-model writes.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=/tmp/fitmoe-bin
mkdir -p "$BIN"
. scripts/device-lib.sh
unpack_bins devbin/* refbin/*
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}:/usr/local/cuda/lib64
# The reference's build links NCCL dynamically; the device image has it in its Python packages.
nccl=$(find / -name 'libnccl.so.2' -not -path '/proc/*' 2>/dev/null | head -n 1)
[ -n "$nccl" ] && export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$(dirname "$nccl")
ARCH=${REF_ARCH:-qwen3moe}
case "$ARCH" in
  qwen3moe) PRESET=30b-a3b; OT='blk\.([0-9]|[12][0-9]|3[0-5])\.ffn_(gate|up|down)_exps\.weight=CPU' ;;
  qwen35moe) PRESET=35b-a3b; OT='blk\.([0-9]|[12][0-9])\.ffn_(gate|up|down)_exps\.weight=CPU' ;;
  gemma4) PRESET=26b-a4b; OT='blk\.([0-9]|1[0-9])\.ffn_(gate_up|gate|up|down)_exps\.weight=CPU' ;;
  *) echo "REF_ARCH: qwen3moe, qwen35moe or gemma4"; exit 1 ;;
esac
MODEL=/tmp/fitmoe-$ARCH-$PRESET-q4_k_m.gguf
[ "$ARCH" = qwen3moe ] && MODEL=/tmp/fitmoe-q3moe-30b-a3b-q4_k_m.gguf  # (the name device-run.sh uses)
[ -x "$BIN/llama-bench" ] || { echo "no llama-bench in refbin/"; exit 1; }
# Shared libraries the reference's build wants (CUDA runtime, cuBLAS): wherever this machine has them.
for lib in $(ldd "$BIN/llama-bench" | awk '/not found/ {print $1}'); do
  f=$(find / -name "$lib" -not -path '/proc/*' 2>/dev/null | head -n 1)
  [ -n "$f" ] && export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$(dirname "$f")
done
ldd "$BIN/llama-bench" | grep 'not found' && echo "(the reference will not start: libraries missing)"
# Weights of host-resident tensors in pinned memory, not the file mapping: "-mmp 0" (builds from
# before that flag's rename take REF_LOAD="-lm none").
REF_LOAD=${REF_LOAD:--mmp 0}
[ -f "$MODEL" ] || "$BIN/fitmoe" gen-model --arch "$ARCH" --preset "$PRESET" --type q4_k_m -o "$MODEL" | tail -n 1
echo "== host: $(nproc) cores, $(lscpu | grep 'Model name' | sed 's/  */ /g'); load $(cat /proc/loadavg)"

# REF_KV=1 (issue 21): the KV cache types at depth, fitmoe and the reference in one run. Qwen3.6-35B-A3B
# at 8 GiB (the reference's anchors placement, q8_0 cache; fitmoe --vram 8G, automatic cache type) at
# depth 0 and 128k; the Qwen3-30B-A3B shape all on the GPU at depth 32k with f16 and q8_0 (both) and
# tq3 (fitmoe). Only these, then exit.
if [ -n "${REF_KV:-}" ]; then
  OUT=${OUT:-/tmp/fitmoe-out}
  mkdir -p "$OUT"
  M35=/tmp/fitmoe-qwen35moe-35b-a3b-q4_k_m.gguf
  OT35='blk\.([0-9]|[12][0-9])\.ffn_(gate|up|down)_exps\.weight=CPU'
  D35=${KV_DEPTH35:-131072}
  [ -f "$M35" ] || "$BIN/fitmoe" gen-model --arch qwen35moe --preset 35b-a3b --type q4_k_m -o "$M35" | tail -n 1
  echo "== kv: 35B-A3B, reference at its 8 GiB placement ($OT35, pinned, q8_0), depth 0 and $D35"
  "$BIN/llama-bench" -m "$M35" -ngl 99 -fa 1 -ot "$OT35" -ctk q8_0 -ctv q8_0 $REF_LOAD -ub 2048 -d 0,$D35 -p 0 -n 64 -r 1 2>&1 | grep -E '^\||error|failed' | tee -a "$OUT/kv-ref.md"
  echo "== kv: 35B-A3B, fitmoe --vram 8G (automatic cache type), depth 0 and $D35"
  "$BIN/fitmoe" plan -m "$M35" --vram 8G --ctx $((D35 + 65)) 2>&1 | grep -iE 'KV cache|experts' | head -n 4
  "$BIN/fitmoe" bench -m "$M35" --vram 8G -d 0,$D35 -p 0 -n 64 -r 1 2>/dev/null | grep '^|' | tee -a "$OUT/kv-ref.md"
  M30=/tmp/fitmoe-q3moe-30b-a3b-q4_k_m.gguf
  [ -f "$M30" ] || "$BIN/fitmoe" gen-model --arch qwen3moe --preset 30b-a3b --type q4_k_m -o "$M30" | tail -n 1
  for t in q8_0 f16; do
    echo "== kv: 30B-A3B all on the GPU, reference -ctk $t -ctv $t, depth 32768"
    "$BIN/llama-bench" -m "$M30" -ngl 99 -fa 1 -ctk $t -ctv $t -ub 2048 -d 32768 -p 0 -n 64 -r 1 2>&1 | grep -E '^\||error|failed' | tee -a "$OUT/kv-ref.md"
  done
  for t in q8_0 tq3 f16; do
    echo "== kv: 30B-A3B all on the GPU, fitmoe -ctk $t -ctv $t, depth 32768"
    "$BIN/fitmoe" bench -m "$M30" -ctk $t -ctv $t -d 32768 -p 0 -n 64 -r 1 2>/dev/null | grep '^|' | tail -n 1 | tee -a "$OUT/kv-ref.md"
  done
  exit 0
fi

echo "== reference, all on the GPU, micro-batch 512 and 2048"
"$BIN/llama-bench" -m "$MODEL" -ngl 99 -fa on -ub 512,2048 -p 512,2048 -n 128 -r 3 2>&1 | tee /tmp/ref-all.log | grep -E '^\||error|failed'
# A file the reference will not load: its own words why (llama-bench is silent unless -v).
if grep -q 'failed to load model' /tmp/ref-all.log; then
  "$BIN/llama-bench" -v -m "$MODEL" -ngl 0 -p 1 -n 0 -r 1 2>&1 | grep -iE 'error|failed|missing|key|wrong' | head -n 8
fi
echo "== reference, the anchors' host-expert placement $OT (pinned, q8_0 KV), micro-batch 512 and 2048"
"$BIN/llama-bench" -m "$MODEL" -ngl 99 -fa on -ot "$OT" -ctk q8_0 -ctv q8_0 $REF_LOAD -ub 512,2048 -p 512,2048 -n 128 -r 3 2>&1 | grep -E '^\|'

echo "== fitmoe, all on the GPU"
"$BIN/fitmoe" bench -m "$MODEL" -p 512,2048 -n 128 -r 3 2>/dev/null
echo "== fitmoe, --vram 8G"
FITMOE_HOST_PROFILE=1 "$BIN/fitmoe" bench -m "$MODEL" --vram 8G -p 512,2048 -n 128 -r 3 2>/tmp/fitmoe-8g.err
grep -E '^host experts|^GPU clock|^routing guesses' /tmp/fitmoe-8g.err
echo "== fitmoe, CPU only, $(nproc) threads (bound: the host RAM probe over the bytes read per token)"
"$BIN/fitmoe" bench -m "$MODEL" --gpu none -t "$(nproc)" -p 0 -n 32 -r 2 2>/dev/null
# REF_PROFILE=1: where fitmoe's GPU time goes, all on the GPU, per op: a 512-token prefill micro-batch
# and decode steps (FITMOE_PROFILE; graphs off).
if [ -n "${REF_PROFILE:-}" ]; then
  echo "== fitmoe, all on the GPU, per-op GPU profile (pp512, tg16)"
  FITMOE_PROFILE=1 "$BIN/fitmoe" bench -m "$MODEL" -p 512 -n 16 -r 1 2>&1 | grep -v '^load\|^plan\|^|' | tail -n 40
fi
# REF_QUICK=1: only the comparisons above (when device time is short).
[ -n "${REF_QUICK:-}" ] && exit 0
echo "== fitmoe, --vram 8G with the CPU computing every host expert (no GPU share)"
"$BIN/fitmoe" bench -m "$MODEL" --vram 8G --host-experts-gpu-share 0 -p 0 -n 128 -r 3 2>/dev/null
echo "== fitmoe, the reference's placement ($OT)"
"$BIN/fitmoe" bench -m "$MODEL" --override-tensor "$OT" -p 512,2048 -n 128 -r 3 2>/dev/null
