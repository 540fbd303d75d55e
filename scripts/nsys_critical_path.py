#!/usr/bin/env python3
"""Reads Nsight Systems' cuda_gpu_trace CSV of `fitmoe bench -p 0 -n N` and prints, per kernel name,
how much each kernel adds to the decode step's critical path: the time from the end of the previous
GPU operation to its own end (kernels start early under programmatic dependent launch, so their own
durations overlap). Used by scripts/device-run.sh nsys."""
import csv
import sys
from collections import defaultdict

path, label = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else ""
rows = []
with open(path, newline="") as f:
    for r in csv.DictReader(f):
        try:
            start, dur = int(r["Start (ns)"]), int(r["Duration (ns)"])
        except (KeyError, ValueError):
            continue
        rows.append((start, start + dur, r.get("Name", "?"), dur))
rows.sort(key=lambda x: x[1])
# The last 60% of the trace: graphs are captured in the first steps.
rows = rows[len(rows) * 2 // 5:]
add, own, count = defaultdict(int), defaultdict(int), defaultdict(int)
prev_end = None
for start, end, name, dur in rows:
    short = name.split("(")[0].split("<")[0].replace("void ", "").strip()
    if prev_end is not None:
        add[short] += end - prev_end
        own[short] += dur
        count[short] += 1
    prev_end = end
steps = max(count.values()) if count else 1
total = sum(add.values())
print(f"== critical path per kernel ({label}): {total / 1e3:.0f} us over the traced span")
print(f"{'kernel':40s} {'calls':>7s} {'adds us/call':>13s} {'own us/call':>12s} {'share':>6s}")
for k in sorted(add, key=lambda k: -add[k])[:16]:
    print(f"{k:40s} {count[k]:7d} {add[k] / count[k] / 1e3:13.2f} {own[k] / count[k] / 1e3:12.2f} {100 * add[k] / total:5.1f}%")
