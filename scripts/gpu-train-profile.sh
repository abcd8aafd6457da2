#!/usr/bin/env bash
# Where a head's training step spends GPU time (on the device machine; docs/eagle3.md, "Training on the GPU"):
#   scripts/gpu-train-profile.sh BIN OUT [SKIP] [COUNT]
# BIN is dist/specula-train-cuda. Trains a head of the registry 1.5B head's shape (draft vocabulary 8192, MLP 4096)
# for random qwen2.5-1.5b weights on chunks of the device's Python standard library (no model upload), first for
# one minute to print the steps' own phase times (forward / backward / optimizer), then under Nsight Compute:
# SKIP launches (the target's passes and the first steps), then COUNT kernels timed one by one, summed by kernel
# name. The sum against the step's wall time says how much of a step is GPU work and how much is launches.
set -uo pipefail
bin=$1; out=$2; skip=${3:-30000}; count=${4:-3000}
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
stdlib=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
args=(--random-weights qwen2.5-1.5b --device cuda --corpus "$stdlib" --corpus-tokens 200000 --seq-len 384
      --draft-vocab 8192 --intermediate-size 4096 --ttt-steps 4 --batch 4 --epochs 1 --prefetch 0 --seed 0)
rm -rf /tmp/tp && mkdir -p /tmp/tp
"$bin" train-eagle3 "${args[@]}" --out /tmp/tp --data-only > "$out/tp-data.log" 2>&1
cp -r /tmp/tp /tmp/tp-data
"$bin" train-eagle3 "${args[@]}" --out /tmp/tp --resume --max-minutes 1 > "$out/tp-train.log" 2> "$out/tp-train.err"
echo "one minute, no profiler: $(tr '\r' '\n' < "$out/tp-train.err" | grep -E '^\[' | tail -1)"
rm -rf /tmp/tp && cp -r /tmp/tp-data /tmp/tp
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
timeout 420 "$ncu" --clock-control none --launch-skip "$skip" --launch-count "$count" \
    --metrics gpu__time_duration.sum --csv \
    "$bin" train-eagle3 "${args[@]}" --out /tmp/tp --resume --max-minutes 6 2> /dev/null |
    python3 -c '
import csv, sys
rows = [r for r in csv.reader(l for l in sys.stdin if l.startswith("\""))]
if not rows:
    sys.exit("no kernels profiled")
head, body = rows[0], rows[1:]
ix = {k: i for i, k in enumerate(head)}
unit = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}
by_name, total, n = {}, 0.0, 0
for r in body:
    if r[ix["Metric Name"]] != "gpu__time_duration.sum":
        continue
    t = float(r[ix["Metric Value"]].replace(",", "")) * unit.get(r[ix["Metric Unit"]], float("nan"))
    name = r[ix["Kernel Name"]].split("(")[0][:40]
    agg = by_name.setdefault(name, [0, 0.0])
    agg[0] += 1
    agg[1] += t
    total += t
    n += 1
for name, (calls, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:40]:
    print(f"{name:40s} x{calls:5d} {t:10.1f} us {100 * t / total:5.1f}%  {t / calls:7.1f} us each")
print(f"total {total / 1000:.1f} ms of GPU time over {n} launches")
' | tee "$out/tp-kernels.txt"
