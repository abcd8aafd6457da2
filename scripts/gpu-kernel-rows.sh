#!/usr/bin/env bash
# Per-kernel GPU times of verify-shaped forward passes, by Nsight Compute, one run per row count (on the device):
#   scripts/gpu-kernel-rows.sh BINARY OUTDIR "MODEL ARGS" ROWS...
# e.g. scripts/gpu-kernel-rows.sh specula "$OUT" "--random-weights qwen2.5-1.5b" 16 17
# Each run is `specula selftest MODEL ARGS --device cuda --timings-only --time-rows N` without CUDA graphs (ncu
# times launches one by one): a prefill of the selftest's prompt, then six forwards of N rows (one warm-up, five
# timed). Every launch goes to OUTDIR/kernels-N.csv (order, kernel, grid, block, us); the summary prints each
# kernel's total over the run, so two row counts' runs differ only by their forwards (the prefill is the same).
set -uo pipefail
bin="$1"; out="$2"; model="$3"; shift 3
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
for rows in "$@"; do
    echo "== $rows rows"
    # shellcheck disable=SC2086
    SPECULA_CUDA_GRAPHS=0 timeout 240 "$ncu" --clock-control none --cache-control none \
        --metrics gpu__time_duration.sum --csv \
        "$bin" selftest $model --device cuda --timings-only --time-rows "$rows" > "$out/ncu-$rows.out" 2>&1
    grep -E "forward of n rows|rror" "$out/ncu-$rows.out" | head -3
    ROWS="$rows" OUT="$out" python3 -c '
import csv, os, sys
lines = [l for l in sys.stdin if l.startswith("\"")]
rows = list(csv.reader(lines))
if not rows:
    sys.exit("ncu printed no kernels")
head, body = rows[0], rows[1:]
ix = {k: i for i, k in enumerate(head)}
scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}
by_name = {}
with open(os.path.join(os.environ["OUT"], "kernels-%s.csv" % os.environ["ROWS"]), "w") as f:
    w = csv.writer(f)
    w.writerow(["order", "kernel", "grid", "block", "us"])
    for r in body:
        if r[ix["Metric Name"]] != "gpu__time_duration.sum":
            continue
        us = float(r[ix["Metric Value"]].replace(",", "")) * scale.get(r[ix["Metric Unit"]], float("nan"))
        name = r[ix["Kernel Name"]].split("(")[0]
        w.writerow([r[ix["ID"]], name, r[ix["Grid Size"]], r[ix["Block Size"]], "%.3f" % us])
        agg = by_name.setdefault(name, [0, 0.0])
        agg[0] += 1
        agg[1] += us
total = sum(t for _, t in by_name.values())
for name, (calls, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:16]:
    print("%-28s x%5d %10.1f us %5.1f%%" % (name[:28], calls, t, 100 * t / total))
print("total %.1f us" % total)
' < "$out/ncu-$rows.out"
done
