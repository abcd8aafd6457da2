#!/usr/bin/env bash
# Per-kernel GPU times of one decode step, by Nsight Compute (on the device machine):
#   scripts/gpu-profile.sh BINARY SHAPE SKIP COUNT [ROWS]
# runs `generate --random-weights SHAPE` without CUDA graphs (ncu times launches one by one), skips SKIP launches
# (prefill and warm-up) and prints each of the next COUNT kernels' name, grid and time in microseconds, with the
# DRAM throughput. ROWS > 1 profiles a verify-shaped step instead (selftest's verify(n) timings).
set -uo pipefail
bin="$1"; shape="$2"; skip="$3"; count="$4"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
SPECULA_CUDA_GRAPHS=0 timeout 300 "$ncu" --clock-control none --cache-control none --launch-skip "$skip" --launch-count "$count" \
    --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed --csv \
    "$bin" generate --random-weights "$shape" --device cuda -p "hello world, this is a test" -n 64 \
    --ignore-eos --raw --quiet --profile off 2>/dev/null |
    python3 -c '
import csv, sys
rows = [r for r in csv.reader(l for l in sys.stdin if l.startswith("\""))]
head, body = rows[0], rows[1:]
ix = {k: i for i, k in enumerate(head)}
kernels = {}
for r in body:
    key = (r[ix["ID"]], r[ix["Kernel Name"]], r[ix["Grid Size"]], r[ix["Block Size"]])
    kernels.setdefault(key, {})[r[ix["Metric Name"]]] = (r[ix["Metric Value"]], r[ix["Metric Unit"]])
total = 0.0
by_name = {}
for n, ((i, name, grid, block), m) in enumerate(kernels.items()):
    value, unit_name = m.get("gpu__time_duration.sum", ("nan", "us"))
    t = float(value.replace(",", ""))
    unit = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}.get(unit_name, float("nan"))
    total += t * unit
    agg = by_name.setdefault(name.split("(")[0], [0, 0.0])
    agg[0] += 1
    agg[1] += t * unit
    if n >= int(__import__("os").environ.get("SHOW", "24")):
        continue
    dram = m.get("dram__throughput.avg.pct_of_peak_sustained_elapsed", ("?", ""))[0]
    print(f"{name[:24]:24s} grid {grid:16s} block {block:12s} {t * unit:8.2f} us  dram {dram}%")
for name, (calls, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1]):
    print(f"{name[:24]:24s} x{calls:4d} {t:9.2f} us {100 * t / total:5.1f}%")
print(f"total {total:.2f} us over {len(kernels)} launches")
'
