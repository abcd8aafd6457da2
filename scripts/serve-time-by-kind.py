#!/usr/bin/env python3
"""Where a `specula serve` profile's time went, by kind of step (POST /start_profile ... /stop_profile; .json or
.json.gz): steps with prompt rows (P), decoding steps the draft budget let draft (D), decoding steps without drafts
(.), each with its steps, total wall time, tokens committed and tokens a second, then the trace's total. Two
traces of the same load (plain and speculative) compared side by side show which kind of step a loss is in.

    scripts/serve-time-by-kind.py TRACE [TRACE ...]
"""
import collections
import gzip
import json
import sys


def load(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


for path in sys.argv[1:]:
    ev = load(path)
    batch = sorted((e for e in ev if e.get("name") == "batch"), key=lambda e: e["ts"])
    budget = sorted((e for e in ev if e.get("name") == "draft budget"), key=lambda e: e["ts"])
    total = collections.defaultdict(lambda: [0, 0.0, 0.0, 0])
    for b, u in zip(batch, budget):
        a, w = b["args"], u["args"]
        kind = "P" if a.get("prefill_rows", 0) > 0 else ("D" if a.get("drafts_allowed", 0) > 0 else ".")
        t = total[kind]
        t[0] += 1
        t[1] += w.get("wall_ms", 0.0)
        t[2] += w.get("tokens", 0)
        t[3] += a.get("rows", 0)
    print(path)
    print(f"  kind  steps   wall ms   tokens   tok/s   rows/step")
    for kind in ("P", "D", "."):
        n, ms, tok, rows = total[kind]
        if n:
            print(f"  {kind:>4} {n:>6} {ms:>9.1f} {tok:>8.0f} {1000 * tok / max(ms, 1e-9):>7.0f} {rows / n:>9.1f}")
    n = sum(t[0] for t in total.values())
    ms = sum(t[1] for t in total.values())
    tok = sum(t[2] for t in total.values())
    print(f"   all {n:>6} {ms:>9.1f} {tok:>8.0f} {1000 * tok / max(ms, 1e-9):>7.0f}")
