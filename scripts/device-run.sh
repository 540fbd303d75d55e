#!/usr/bin/env bash
# The one script for the GPU machine (device tool): runs the tests there, then the benchmarks, and
# prints a short table last. Binaries come prebuilt from the dev machine (scripts/device-prepare.sh puts
# them and the test fixtures into git-ignored folders that the run carries).
#   scripts/device-run.sh [MODE...]   MODE: all (default) tests cpu gpu gputests gpubench kv parallel profile skip ab sync
#                                     ncu ncu-detail ncu-source nsys toggles hybrid predict; several in one call run in this file's order
#   (SKIP_CONFIGS names GPU configs to skip)
# profile: where a decode step's GPU time goes, per op (FITMOE_PROFILE=1), all on the GPU and at 8 GiB.
set -uo pipefail
cd "$(dirname "$0")/.."
WHATS=("${@:-all}")  # several modes run in one call, in this script's order (one device start for all)
# want MODE...: whether any of these modes was asked for.
want() {
  local m w
  for m in "$@"; do for w in "${WHATS[@]}"; do [ "$m" = "$w" ] && return 0; done; done
  return 1
}
BIN=/tmp/fitmoe-bin
mkdir -p "$BIN"
. scripts/device-lib.sh
unpack_bins devbin/*
OUT=${OUT:-/tmp/fitmoe-out}
mkdir -p "$OUT"
export FITMOE_TESTDATA=$PWD/testdata-local
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}:/usr/local/cuda/lib64
MODEL=/tmp/fitmoe-q3moe-30b-a3b-q4_k_m.gguf
summary=()

echo "== machine"
echo "cores: $(nproc); $(lscpu | grep 'Model name' | sed 's/  */ /g'); $(ldd --version | head -1)"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$BIN/fitmoe" --version || { echo "the prebuilt binary does not run here"; ldd "$BIN/fitmoe"; exit 1; }

if want all tests; then
  echo "== tests (every ISA this CPU has; tokenizer tests need fixtures not carried)"
  "$BIN/fitmoe_tests" --gtest_filter='-*Tokenizer*:*Chat*:Cli.*:Gguf.ReadsEveryTestdataModel' --gtest_brief=1 2>&1 | tail -n 25
  summary+=("tests: $("$BIN/fitmoe_tests" --gtest_filter='-*Tokenizer*:*Chat*:Cli.*:Gguf.ReadsEveryTestdataModel' 2>&1 | grep -E '^\[  (PASSED|FAILED)' | tr '\n' ' ')")
fi

if want all gpu gputests; then
  echo "== GPU tests: kernels against the CPU reference, models against the reference fixtures"
  # GPU_TEST_FILTER narrows them (a negative gtest pattern for fixtures a call could not carry).
  "$BIN/fitmoe_tests" --gtest_filter="Gpu*:*Gpu*:MoeGemm*:*Batch*${GPU_TEST_FILTER:-}" > "$OUT/gpu-tests.log" 2>&1
  grep -E 'Failure|FAILED|first differing|got .* want|error' -A2 "$OUT/gpu-tests.log" | grep -v 'GetParam' | head -n 40
  summary+=("gpu tests: $(grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+ test' "$OUT/gpu-tests.log" | tr '\n' ' ')")
fi

if want all gpu gpubench; then
  [ -f "$MODEL" ] || "$BIN/fitmoe" gen-model --arch qwen3moe --preset 30b-a3b --type q4_k_m -o "$MODEL" | tail -n 3
  ARGS=${GPU_BENCH_ARGS:--p 512,2048 -n 128 -r 3}
  # vram-8G picks its micro-batch itself (2048 when experts stay on the host); -ub512 is the
  # reference's default micro-batch for comparison.
  for cfg in "all-gpu|$ARGS" "vram-8G|--vram 8G $ARGS" "vram-8G-ub512|--vram 8G -b 512 -p 512,2048 -n 0 -r 2" "vram-8G-cpu-prefill|--vram 8G --prefill-experts cpu -p 512 -n 0 -r 2"; do
    name=${cfg%%|*}; flags=${cfg#*|}
    case " ${SKIP_CONFIGS:-} " in *" $name "*) continue ;; esac
    echo "== GPU bench: $name ($flags)"
    # (One log for all configurations: the device tool brings back at most 8 files per call.)
    "$BIN/fitmoe" bench -m "$MODEL" $flags --json > "$OUT/gpu-$name.json" 2> "$OUT/gpu-$name.err"
    tail -n 3 "$OUT/gpu-$name.err"
    { echo "== $name"; cat "$OUT/gpu-$name.err"; } >> "$OUT/gpu-bench.log"
    rm -f "$OUT/gpu-$name.err"
    python3 - "$OUT/gpu-$name.json" "$name" <<'PY'
import json, sys
try:
    rows = json.load(open(sys.argv[1]))
except Exception as e:
    print("no result:", e); sys.exit(0)
for r in rows:
    print(f"{sys.argv[2]} {r['test']}: {r['avg_ts']:.2f} +- {r['stddev_ts']:.2f} tok/s  samples {[round(x,1) for x in r['samples_ts']]}  machine {r.get('machine')}")
PY
  done
fi

if want profile; then
  [ -f "$MODEL" ] || "$BIN/fitmoe" gen-model --arch qwen3moe --preset 30b-a3b --type q4_k_m -o "$MODEL" | tail -n 3
  for flags in "" "--vram 8G"; do
    echo "== decode profile ${flags:-all on the GPU}"
    FITMOE_PROFILE=1 "$BIN/fitmoe" bench -m "$MODEL" $flags -p 0 -n 32 -r 1 2>&1 | grep -v '^load\|^plan' | tail -n 24
  done
fi

# A/B: devbin/fitmoe_old.xz (another commit's build) beside devbin/fitmoe on the same machine, the two
# interleaved twice per configuration so that drift hits both: AB_ARGS (default decode only).
if want ab; then
  [ -f "$MODEL" ] || "$BIN/fitmoe" gen-model --arch qwen3moe --preset 30b-a3b --type q4_k_m -o "$MODEL" | tail -n 3
  [ -x "$BIN/fitmoe_old" ] || { echo "no devbin/fitmoe_old.xz (xz -9 of another commit's stripped build)"; exit 1; }
  ARGS=${AB_ARGS:--p 0 -n 128 -r 3}
  for flags in "" "--vram 8G"; do
    for round in 1 2; do
      for b in fitmoe_old fitmoe; do
        r=$("$BIN/$b" bench -m "$MODEL" $flags $ARGS 2>/dev/null | grep '^|' | tail -n +3 | awk -F'|' '{printf "%s %s; ", $7, $8}')
        line="ab ${flags:-all-gpu} round $round $b: $r"
        echo "$line"; summary+=("$line")
      done
    done
  done
fi

# Measuring knobs (environment variables) of one binary, interleaved in ROUNDS rounds (default 2):
# TOGGLES="name|VAR=1 VAR2=x;name2|..." (';' between configurations; the name "old" runs
# devbin/fitmoe_old instead), each run `fitmoe bench -m M $AB_ARGS` (default all on the GPU, tg128).
if want toggles; then
  [ -f "$MODEL" ] || "$BIN/fitmoe" gen-model --arch qwen3moe --preset 30b-a3b --type q4_k_m -o "$MODEL" | tail -n 3
  ARGS=${AB_ARGS:--p 0 -n 128 -r 3}
  IFS=';' read -ra cfgs <<< "${TOGGLES:-base|}"
  for round in $(seq "${ROUNDS:-2}"); do
    for cfg in "${cfgs[@]}"; do
      name=${cfg%%|*}; envs=${cfg#*|}; b=fitmoe
      [ "$name" = old ] && b=fitmoe_old
      r=$(env $envs "$BIN/$b" bench -m "$MODEL" $ARGS 2>/dev/null | grep '^|' | tail -n +3 | awk -F'|' '{printf "%s %s; ", $7, $8}')
      line="toggle $name ($envs) round $round: $r"
      echo "$line"; summary+=("$line")
    done
  done
fi

# Hybrid decode, its CPU side and its GPU clock (FITMOE_HOST_PROFILE=1), for settings of knobs interleaved
# in ROUNDS rounds: TOGGLES as above (default: routing guesses on and off), HYB_ARGS (default the 8 GiB
# plan, tg128). Keeps the profile's lines, which the toggles mode drops.
if want hybrid; then
  [ -f "$MODEL" ] || "$BIN/fitmoe" gen-model --arch qwen3moe --preset 30b-a3b --type q4_k_m -o "$MODEL" | tail -n 3
  echo "== hybrid decode (cpus: $(nproc); $(lscpu | grep -E '^Thread\(s\) per core|^Core\(s\) per socket' | tr -s ' ' | tr '\n' ';'))"
  sync  # (the model file's write-back would compete for memory and disk with what is measured)
  echo "load: $(cat /proc/loadavg); vmstat:"; vmstat 1 3 | tail -n 3
  if [ -x "$BIN/fitmoe_expert_prefetch" ] && [ -z "${HYB_NO_PREFETCH_BENCH:-}" ]; then
    for w in ${HYB_WAITS:-40 80}; do
      echo "-- fitmoe_expert_prefetch $(( $(nproc) - 1 )) $w 300"
      "$BIN/fitmoe_expert_prefetch" "$(( $(nproc) - 1 ))" "$w" 300 | tee "$OUT/prefetch-$w.txt"
      while read -r l; do summary+=("prefetch wait $w us: $l"); done < <(tail -n +2 "$OUT/prefetch-$w.txt")
    done
  fi
  ARGS=${HYB_ARGS:---vram 8G -p 0 -n 128 -r 3}
  IFS=';' read -ra cfgs <<< "${HYB_TOGGLES:-guess|;noguess|--no-routing-guess}"
  for round in $(seq "${ROUNDS:-2}"); do
    for cfg in "${cfgs[@]}"; do
      name=${cfg%%|*}; envs=${cfg#*|}  # (fitmoe flags)
      FITMOE_HOST_PROFILE=1 "$BIN/fitmoe" bench -m "$MODEL" $ARGS $envs > "$OUT/hyb.out" 2> "$OUT/hyb.err"
      r=$(grep '^|' "$OUT/hyb.out" | tail -n +3 | awk -F'|' '{printf "%s %s tok/s, bound %s; ", $7, $8, $11}')
      line="hybrid $name ($envs) round $round: $r"
      echo "$line"; summary+=("$line")
      grep -E '^host experts|^GPU clock|^routing guesses' "$OUT/hyb.err" | sed 's/^/    /'
      while read -r l; do summary+=("    $l"); done < <(grep -E '^host experts|^GPU clock|^routing guesses' "$OUT/hyb.err")
    done
  done
fi

# What a launch boundary costs against a grid barrier in a persistent kernel (bench/gpu_phase_sync.cu):
# chains of dependent phases, each streaming 0 B to 6 MiB of its own weights, both ways.
if want all gpu sync; then
  if [ -x "$BIN/fitmoe_gpu_phase_sync" ]; then
    echo "== phase sync: kernel chain (graph, PDL) against a persistent kernel with grid barriers"
    "$BIN/fitmoe_gpu_phase_sync" 480 20 | tee "$OUT/phase-sync.txt"
    while read -r l; do summary+=("sync $l"); done < <(tail -n +3 "$OUT/phase-sync.txt")
  else
    echo "== phase sync: no fitmoe_gpu_phase_sync in devbin/ (FITMOE_CUDA=ON scripts/device-prepare.sh builds it)"
  fi
fi

# Each kernel's cost on the critical path of an all-GPU decode step (no nsys on the lent machines):
# decode timed with all the graph nodes of one kernel disabled (FITMOE_SKIP_KERNELS, outputs wrong),
# against the full step; the difference per layer is what that kernel costs. SKIP_FLAGS adds flags.
if want skip; then
  [ -f "$MODEL" ] || "$BIN/fitmoe" gen-model --arch qwen3moe --preset 30b-a3b --type q4_k_m -o "$MODEL" | tail -n 3
  FLAGS=${SKIP_FLAGS:-}          # e.g. "--vram 8G": the hybrid step (never skip the router there: the CPU waits for it)
  ARGS=${SKIP_ARGS:--p 0 -n 128 -r 3}
  tgs() { FITMOE_HOST_PROFILE=1 timeout 120 "$BIN/fitmoe" bench -m "$MODEL" $FLAGS $ARGS 2>"$OUT/skip.err" |
          grep tg | tail -n 1 | awk -F'|' '{print $8}' | awk '{print $1}';
          grep -o 'per layer [0-9.]* us waiting' "$OUT/skip.err" | sed 's/per layer/  (hybrid: per layer/; s/$/)/' >&2; }
  if [ -n "${SKIP_NAMES:-}" ]; then  # given names (substrings of the kernels' mangled names), one run each
    for n in $SKIP_NAMES; do echo "1 $n"; done > "$OUT/kernels.txt"
  else
    FITMOE_SKIP_KERNELS=list "$BIN/fitmoe" bench -m "$MODEL" $FLAGS -p 0 -n 2 -r 1 2>&1 | grep '^graph kernel' |
      sort -u -k4 | sort -k3 -n -r | awk '{print $3, $4}' > "$OUT/kernels.txt"
  fi
  cat "$OUT/kernels.txt"
  base=$(tgs); echo "full step: $base tok/s"
  while read -r count name; do
    t=$(FITMOE_SKIP_KERNELS=$name tgs)
    [ -n "$t" ] || { echo "skip $name: no result"; continue; }
    line=$(awk -v b="$base" -v t="$t" -v c="$count" -v n="${name:0:70}" \
           'BEGIN { printf "skip %-70s x%d: %8.2f tok/s, %6.3f ms/token, %6.2f us per launch", n, c, t, 1e3/b-1e3/t, (1e6/b-1e6/t)/c }')
    echo "$line"; summary+=("$line")
  done < "$OUT/kernels.txt"
  base2=$(tgs); summary+=("full step: $base then $base2 tok/s ${FLAGS}")
fi

# Kernel durations of one decode step from Nsight Compute (where the runtime lets it read the GPU), for
# fitmoe and, when refbin/ holds it, the reference: the per-kernel summary (count, mean duration).
if want ncu; then
  [ -f "$MODEL" ] || "$BIN/fitmoe" gen-model --arch qwen3moe --preset 30b-a3b --type q4_k_m -o "$MODEL" | tail -n 3
  NCU="ncu --clock-control none --cache-control ${NCU_CACHE:-none} --metrics gpu__time_duration.sum --print-summary per-kernel --csv"
  $NCU "$BIN/fitmoe" bench -m "$MODEL" --no-decode-graphs -p 0 -n 1 -r 1 > "$OUT/ncu-fitmoe.csv" 2> "$OUT/ncu-fitmoe.err"
  tail -n 3 "$OUT/ncu-fitmoe.err"
  unpack_bins refbin/*
  if [ -x "$BIN/llama-bench" ]; then
    $NCU "$BIN/llama-bench" -m "$MODEL" -ngl 99 -fa on -p 0 -n 1 -r 1 > "$OUT/ncu-reference.csv" 2> "$OUT/ncu-reference.err"
    tail -n 3 "$OUT/ncu-reference.err"
  fi
  for f in "$OUT"/ncu-*.csv; do echo "== $f"; wc -l < "$f"; done
fi

# Why given kernels take what they take, from Nsight Compute's detailed sections and stall reasons per
# kernel, on a few all-GPU decode launches without graphs. The sections take many replays of each
# kernel, so the caches are flushed before each (--cache-control all): a real step reads its weights
# cold, though its activations come warm from L2. NCU_KERNELS is a regex of kernel names (default: the
# decode attention, the router, the mat-vecs, the residual + norm), NCU_SKIP launches of them are
# skipped first, NCU_COUNT profiled.
if want ncu-detail; then
  [ -f "$MODEL" ] || "$BIN/fitmoe" gen-model --arch qwen3moe --preset 30b-a3b --type q4_k_m -o "$MODEL" | tail -n 3
  K=${NCU_KERNELS:-attn_dec_group|router_topk|mmvq_kernel|residual_norm}
  ncu --clock-control none --cache-control all --kernel-name "regex:$K" --launch-skip "${NCU_SKIP:-400}" \
    --launch-count "${NCU_COUNT:-24}" --section SpeedOfLight --section LaunchStats --section Occupancy \
    --section WarpStateStats --section MemoryWorkloadAnalysis --section SchedulerStats --section SourceCounters \
    --metrics 'regex:^smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$' \
    --import-source no --page details --print-summary none \
    "$BIN/fitmoe" bench -m "$MODEL" --no-decode-graphs -p 0 -n 8 -r 1 > "$OUT/ncu-detail.txt" 2> "$OUT/ncu-detail.err"
  tail -n 3 "$OUT/ncu-detail.err"
  grep -E '^  [a-z_].*\(|Duration|Registers Per|Achieved Occupancy|Memory Throughput|stalled|No Eligible|Issued Warp' \
    "$OUT/ncu-detail.txt" | head -n 200  # (the whole report comes back in $OUT/ncu-detail.txt)
fi

# Where inside one decode kernel the time goes: Nsight Compute's source page (SASS, with the warp-stall
# samples per instruction) for NCU_KERNEL (default the short-cache attention), warm caches, one launch
# at NCU_SKIP (past the first steps, so the cache holds some keys). The whole page comes back in
# $OUT/ncu-source.csv; the instructions with the most stall samples are printed.
if want ncu-source; then
  [ -f "$MODEL" ] || "$BIN/fitmoe" gen-model --arch qwen3moe --preset 30b-a3b --type q4_k_m -o "$MODEL" | tail -n 3
  ncu --clock-control none --cache-control none --kernel-name "regex:${NCU_KERNEL:-attn_dec_group}" \
    --warp-sampling-interval "${NCU_SAMPLING:-0}" \
    --launch-skip "${NCU_SKIP:-2000}" --launch-count 1 --section SourceCounters --section WarpStateStats \
    --import-source no --page source --print-source sass --csv \
    "$BIN/fitmoe" bench -m "$MODEL" --no-decode-graphs -p 0 -n 64 -r 1 > "$OUT/ncu-source.csv" 2> "$OUT/ncu-source.err"
  tail -n 3 "$OUT/ncu-source.err"
  python3 - "$OUT/ncu-source.csv" <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1], errors="replace")))
head = next((i for i, r in enumerate(rows) if any("Source" in c for c in r)), None)
if head is None:
    print("no source table in the report; its first lines:"); [print(",".join(r)[:160]) for r in rows[:8]]; sys.exit()
cols = rows[head]
stall = next((j for j, c in enumerate(cols) if "Warp Stall Sampling (All" in c), None)
src = next(j for j, c in enumerate(cols) if "Source" in c)
body = [r for r in rows[head + 1:] if len(r) == len(cols)]
if stall is None:
    print("columns:", cols[:12]); sys.exit()
num = lambda v: float(v.replace(",", "") or 0)
total = sum(num(r[stall]) for r in body) or 1
print(f"{len(body)} instructions, {total:.0f} stall samples; the top 25:")
for r in sorted(body, key=lambda r: -num(r[stall]))[:25]:
    print(f"{100 * num(r[stall]) / total:5.1f}%  {r[src][:110]}")
PY
fi

# A decode timeline from Nsight Systems (CUDA graphs traced per node): kernels overlap under programmatic
# dependent launch, so each kernel's cost on the step's critical path is read as the time from the end
# of the kernel before it to its own end; mean of that per kernel name, per decode step.
if want nsys; then
  [ -f "$MODEL" ] || "$BIN/fitmoe" gen-model --arch qwen3moe --preset 30b-a3b --type q4_k_m -o "$MODEL" | tail -n 3
  NSYS=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1)
  [ -n "$NSYS" ] || { echo "no nsys here"; exit 0; }
  for flags in "" "--vram 8G"; do
    tag=$([ -z "$flags" ] && echo gpu || echo 8g)
    "$NSYS" profile -o "$OUT/nsys-$tag" --force-overwrite true --trace=cuda --cuda-graph-trace=node \
      "$BIN/fitmoe" bench -m "$MODEL" $flags -p 0 -n 32 -r 1 > "$OUT/nsys-$tag.log" 2>&1
    "$NSYS" stats --report cuda_gpu_trace --format csv -o "$OUT/nsys-$tag" "$OUT/nsys-$tag.nsys-rep" > /dev/null 2>&1
    python3 scripts/nsys_critical_path.py "$OUT/nsys-${tag}_cuda_gpu_trace.csv" "${flags:-all on the GPU}"
  done
fi

if want all cpu; then
  echo "== gen-model: full Qwen3-30B-A3B shape, Q4_K_M"
  [ -f "$MODEL" ] || "$BIN/fitmoe" gen-model --arch qwen3moe --preset 30b-a3b --type q4_k_m -o "$MODEL" | tail -n 3
  echo "== CPU bench, $(nproc) threads"
  "$BIN/fitmoe" bench -m "$MODEL" -t "$(nproc)" -p 64,512 -n 32 -r 3 --json > "$OUT/cpu-bench.json"
  "$BIN/fitmoe" bench -m "$MODEL" -t "$(nproc)" -p 0 -n 32 -r 3 --mmap | tail -n 1 | sed 's/^/mmap: /'
  python3 - "$OUT/cpu-bench.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    line = f"cpu {r['test']}: {r['avg_ts']:.2f} +- {r['stddev_ts']:.2f} tok/s"
    if r['n_gen']:
        line += f", {r['weight_bytes_per_token']/1e9:.3f} GB/token -> {r['weight_gbps']:.1f} GB/s of 76.4 ({100*r['weight_gbps']/76.4:.0f}%)"
    print(line)
PY
fi

# predict: the plan's predicted speed against bench's measurement in the same run, for CPU only, all
# on the GPU and hybrid at 8 GiB (each bench plans with the machine profile it measured itself), and
# what the driver counts for the process next to its --vram budget (nvidia-smi sampled meanwhile).
if want predict; then
  [ -f "$MODEL" ] || "$BIN/fitmoe" gen-model --arch qwen3moe --preset 30b-a3b --type q4_k_m -o "$MODEL" | tail -n 1
  rm -f "${XDG_CACHE_HOME:-$HOME/.cache}/fitmoe/machine.json"  # measured afresh by this run's first bench
  for cfg in "cpu|--gpu none -p 512 -n 32 -r 2" "all-gpu|-p 512 -n 128 -r 3" "vram-8G|--vram 8G -p 512 -n 128 -r 3" \
             "vram-6G|--vram 6G -p 512 -n 64 -r 2"; do
    name=${cfg%%|*}; flags=${cfg#*|}
    case " ${SKIP_CONFIGS:-} " in *" $name "*) continue ;; esac
    nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits -lms 200 > "$OUT/smi-$name.txt" 2>/dev/null &
    smi=$!
    "$BIN/fitmoe" bench -m "$MODEL" $flags -o json > "$OUT/pred-$name.json" 2> "$OUT/pred-$name.err"
    kill $smi 2>/dev/null; wait $smi 2>/dev/null
    grep -E '^plan|GPU memory of this process' "$OUT/pred-$name.err" | head -n 3
    peak=$(awk -F', *' '{ if ($2 > m) m = $2 } END { print m + 0 }' "$OUT/smi-$name.txt")
    while read -r l; do echo "$l"; summary+=("$l"); done < <(python3 - "$OUT/pred-$name.json" "$name" "$peak" <<'PY'
import json, sys
try:
    rows = json.load(open(sys.argv[1]))
except Exception as e:
    print(f"predict {sys.argv[2]}: no result ({e})"); sys.exit(0)
for r in rows:
    p, m = r.get('predicted_ts', 0), r['avg_ts']
    extra = ""
    if r.get('gpu_budget_mib'):
        extra = f"; GPU memory: nvidia-smi peak {sys.argv[3]} MiB, driver {r.get('gpu_process_mib', '?')} MiB, budget {r['gpu_budget_mib']} MiB"
    print(f"predict {sys.argv[2]} {r['test']}: predicted {p:.1f}, measured {m:.1f} tok/s ({100*(p/m-1):+.0f}%){extra}")
PY
)
  done
fi

# kv: the KV cache types at depth (issue 21): the Qwen3-30B-A3B shape all on the GPU at depth 32k
# (f16, q8_0, tq3 caches: decode and pp2048), and the Qwen3.6-35B-A3B shape at --vram 8G with a 128k
# context (the plan's automatic choice) at depth 0 and 128k. KV_DEPTH overrides the 32k.
if want kv; then
  [ -f "$MODEL" ] || "$BIN/fitmoe" gen-model --arch qwen3moe --preset 30b-a3b --type q4_k_m -o "$MODEL" | tail -n 1
  D=${KV_DEPTH:-32768}
  for t in ${KV_TYPES:-f16 q8_0 tq3 tq4}; do
    echo "== kv: 30B-A3B all on the GPU, -ctk $t -ctv $t, depth $D"
    "$BIN/fitmoe" bench -m "$MODEL" -ctk $t -ctv $t -d "$D" -p 2048 -n 64 -r ${KV_REPS:-2} 2>"$OUT/kv-$t.err" | grep '^|' | tail -n 2 | tee -a "$OUT/kv.md"
    grep -iE 'error|plan:' "$OUT/kv-$t.err" | head -n 3
    while read -r l; do summary+=("kv 30B $t d$D $l"); done < <(tail -n 2 "$OUT/kv.md")
  done
  if [ -z "${KV_SKIP_35B:-}" ]; then
    M35=/tmp/fitmoe-qwen35moe-35b-a3b-q4_k_m.gguf
    [ -f "$M35" ] || "$BIN/fitmoe" gen-model --arch qwen35moe --preset 35b-a3b --type q4_k_m -o "$M35" | tail -n 1
    "$BIN/fitmoe" plan -m "$M35" --vram 8G --ctx 131072 2>&1 | grep -iE 'KV|experts on|budget' | head -n 8
    echo "== kv: 35B-A3B --vram 8G (automatic cache type for the deepest test's context), depth 0 and ${KV_DEPTH35:-131072}"
    "$BIN/fitmoe" bench -m "$M35" --vram 8G -d 0,${KV_DEPTH35:-131072} -p 0 -n 64 -r 1 2>"$OUT/kv-35b.err" | grep '^|' | tee -a "$OUT/kv.md"
    grep -iE 'error|KV cache type' "$OUT/kv-35b.err" | head -n 3
    while read -r l; do summary+=("kv 35B 8G $l"); done < <(tail -n 2 "$OUT/kv.md")
  fi
fi

# parallel: several sequences decoding together (issue 22): aggregate tg throughput of 1, 4 and 16
# sequences (one batch per step holding a token of each, what serve --parallel runs) on the
# Qwen3.6-35B-A3B shape all on the GPU and at --vram 8G; and a follow-up turn's prefill over a 30k
# history (pp64 @ d30000: only the new tokens are evaluated). PAR_CONFIGS picks "gpu 8g".
if want parallel; then
  M35=/tmp/fitmoe-qwen35moe-35b-a3b-q4_k_m.gguf
  [ -f "$M35" ] || "$BIN/fitmoe" gen-model --arch qwen35moe --preset 35b-a3b --type q4_k_m -o "$M35" | tail -n 1
  sync
  for cfgname in ${PAR_CONFIGS:-gpu 8g}; do
    flags=""; [ "$cfgname" = 8g ] && flags="--vram 8G"
    if [ -n "${PAR_PROFILE:-}" ]; then  # where a step of 16 sequences goes, per op (no graphs then)
      echo "== parallel: 35B-A3B $cfgname, per-op profile of tg8 x16 (FITMOE_PROFILE=1)"
      FITMOE_PROFILE=1 "$BIN/fitmoe" bench -m "$M35" $flags -p 0 -n 8 --parallel 16 -r 1 2>"$OUT/parprof-$cfgname.err" | grep '^|' | tail -n 1
      grep -vE '^(tg|pp|plan|writing|loading|\r)' "$OUT/parprof-$cfgname.err" | grep -E '[0-9]' | head -n 40
    fi
    echo "== parallel: 35B-A3B $cfgname, tg${PAR_N:-32} x 1/4/16 (-c 4096 per sequence)"
    "$BIN/fitmoe" bench -m "$M35" $flags -p 0 -n ${PAR_N:-32} --parallel ${PAR_P:-1,4,16} -r ${PAR_REPS:-2} 2>"$OUT/par-$cfgname.err" | grep '^|' | tee -a "$OUT/par.md"
    grep -iE 'error|plan:|KV cache type' "$OUT/par-$cfgname.err" | head -n 4
    while read -r l; do summary+=("par 35B $cfgname $l"); done < <(grep -E 'tg' "$OUT/par.md" | tail -n 3)
    if [ -z "${PAR_SKIP_TTFT:-}" ]; then
      echo "== parallel: 35B-A3B $cfgname, follow-up turn over a 30k history (pp64 @ d30000)"
      "$BIN/fitmoe" bench -m "$M35" $flags -d 30000 -p 64 -n 0 -r ${TTFT_REPS:-1} 2>"$OUT/ttft-$cfgname.err" | grep '^|' | tail -n 1 | tee -a "$OUT/par.md"
      grep -iE 'error' "$OUT/ttft-$cfgname.err" | head -n 3
      summary+=("ttft 35B $cfgname $(tail -n 1 "$OUT/par.md")")
    fi
  done
fi

echo "== summary"
for s in "${summary[@]}"; do echo "$s"; done
for f in "$OUT"/gpu-*.json; do [ -f "$f" ] && python3 -c "
import json,sys
try: rows=json.load(open('$f'))
except Exception: sys.exit(0)
for r in rows: print(f\"| {r['backend']} $(basename $f .json) | {r['test']} | {r['avg_ts']:.2f} ± {r['stddev_ts']:.2f} |\")"; done
[ -f "$OUT/cpu-bench.json" ] && python3 -c "
import json
for r in json.load(open('$OUT/cpu-bench.json')):
    print(f\"| cpu {r['n_threads']} threads | {r['test']} | {r['avg_ts']:.2f} ± {r['stddev_ts']:.2f} | {(str(round(r['weight_gbps'],1))+' GB/s') if r['n_gen'] else '-'} |\")"
exit 0
