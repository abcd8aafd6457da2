#!/usr/bin/env python3
"""Where a `specula serve` step's wall time goes on the host, from profile traces (POST /start_profile ...
/stop_profile; .json or .json.gz), one line per trace:

    scripts/serve-host-time.py TRACE [TRACE ...]

For decoding steps (no prompt rows) of the most common batch size: the device's decode step (its phases by the
model's clock), and by the host's clock the draft budget's plan, the decode step proper, the engine's bookkeeping
after it (texts, metrics, budget observations) and the gap until the next step starts (the engine loop: finished
requests, admissions, the prefix cache), and the host work done while the step's forward pass ran (the last step's
bookkeeping and the next step's plan, since session 25; inside "decode"). Mean and median, microseconds.
"""
import collections
import gzip
import json
import statistics
import sys


def load(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def stats(values):
    if not values:
        return "      -       -"
    return f"{statistics.mean(values):7.0f} {statistics.median(values):7.0f}"


if len(sys.argv) < 2:
    sys.exit(__doc__)
print(f"{'trace':<28} {'reqs':>4} {'steps':>5}   {'device step':>15}   {'host: plan':>15}   {'decode':>15}"
      f"   {'after':>15}   {'gap to next':>15}   {'overlapped':>15}   (mean median, us)")
for path in sys.argv[1:]:
    events = load(path)
    batches = sorted((e for e in events if e.get("name") == "batch"), key=lambda e: e["ts"])
    budgets = sorted((e for e in events if e.get("name") == "draft budget"), key=lambda e: e["ts"])
    device = {round(e["ts"]): e["dur"] for e in events if e.get("ph") == "X" and e.get("name") == "decode step"}
    device_starts = sorted(device)
    if len(batches) != len(budgets):
        sys.exit(f"{path}: {len(batches)} batch counters but {len(budgets)} draft budget counters")
    common = collections.Counter(b["args"]["requests"] for b in batches if b["args"]["prefill_rows"] == 0)
    if not common:
        print(f"{path}: no decoding steps")
        continue
    size = common.most_common(1)[0][0]
    rows = collections.defaultdict(list)
    for i, (b, u) in enumerate(zip(batches, budgets)):
        if b["args"]["prefill_rows"] != 0 or b["args"]["requests"] != size:
            continue
        a = u["args"]
        if "plan_ms" not in a:
            sys.exit(f"{path}: the trace has no plan_ms (a server from before session 24)")
        wall_us = a["wall_ms"] * 1e3
        rows["plan"].append(a["plan_ms"] * 1e3)
        rows["decode"].append(a["decode_ms"] * 1e3)
        rows["after"].append(wall_us - (a["plan_ms"] + a["decode_ms"]) * 1e3)
        if "overlapped_ms" in a:
            rows["overlapped"].append(a["overlapped_ms"] * 1e3)
        if i + 1 < len(batches):
            rows["gap"].append(batches[i + 1]["ts"] - (b["ts"] + wall_us))
        # The device step span starts at or just after the counter's time stamp.
        j = next((t for t in device_starts if t >= round(b["ts"])), None)
        if j is not None and j - b["ts"] < wall_us:
            rows["device"].append(device[j])
    name = path.rsplit("/", 1)[-1][:28]
    print(f"{name:<28} {size:>4} {len(rows['plan']):>5}   {stats(rows['device'])}   {stats(rows['plan'])}   "
          f"{stats(rows['decode'])}   {stats(rows['after'])}   {stats(rows['gap'])}   {stats(rows['overlapped'])}")
