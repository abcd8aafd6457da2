#!/usr/bin/env python3
"""Per-phase time of a `specula serve` profile's decoding steps, grouped by requests and rows in the step
(POST /start_profile ... /stop_profile; .json or .json.gz), one table per trace:

    scripts/serve-phase-table.py TRACE [TRACE ...]

Each row: a (requests, rows) group of decoding steps (no prompt rows), how many steps, the tokens committed a
step, the mean wall time of the step by the host's clock, and the mean time of each phase (draft, verify, accept,
feed, commit, emit, ...) by the model's clock (device time on a GPU), in microseconds. Steps with drafts and
without are told apart by their rows (rows > requests: drafted).
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
    steps = sorted((e for e in ev if e.get("cat") == "step"), key=lambda e: e["ts"])
    batches = sorted((e for e in ev if e.get("name") == "batch"), key=lambda e: e["ts"])
    budgets = sorted((e for e in ev if e.get("name") == "draft budget"), key=lambda e: e["ts"])
    phases = collections.defaultdict(lambda: collections.defaultdict(float))
    names = []
    for e in ev:
        if e.get("cat") == "phase" and "step" in e.get("args", {}):
            phases[e["args"]["step"]][e["name"]] += e["dur"]
            if e["name"] not in names:
                names.append(e["name"])
    groups = collections.defaultdict(list)
    for s, b, u in zip(steps, batches, budgets):
        a = b["args"]
        if s["name"] != "decode step" or a.get("prefill_rows", 0) > 0:
            continue
        groups[(a["requests"], a["rows"])].append((s, u["args"]))
    print(path)
    cols = [n for n in ("draft", "verify", "accept", "feed", "commit", "emit", "sample") if n in names]
    cols += [n for n in names if n not in cols and n != "prefill"]
    print(f"{'reqs':>4} {'rows':>4} {'steps':>5} {'tok/step':>8} {'wall':>7} {'step':>7} " +
          " ".join(f"{c:>7}" for c in cols))
    for (reqs, rows), items in sorted(groups.items()):
        if len(items) < 3:
            continue
        n = len(items)
        wall = sum(u.get("wall_ms", 0) for _, u in items) * 1000 / n
        tokens = sum(u.get("tokens", 0) for _, u in items) / n
        dur = sum(s["dur"] for s, _ in items) / n
        per = [sum(phases[s["args"]["step"]].get(c, 0.0) for s, _ in items) / n for c in cols]
        print(f"{reqs:>4} {rows:>4} {n:>5} {tokens:>8.2f} {wall:>7.0f} {dur:>7.0f} " +
              " ".join(f"{p:>7.0f}" for p in per))
