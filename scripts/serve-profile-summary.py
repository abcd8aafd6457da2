#!/usr/bin/env python3
"""Summarizes a `specula serve` profile trace (POST /start_profile ... /stop_profile): which steps drafted, how
their time and tokens compared with the draft budget's expectations, and why the budget refused drafts.

    scripts/serve-profile-summary.py TRACE.json
"""
import collections
import json
import statistics
import sys

trace = json.load(open(sys.argv[1]))
events = trace["traceEvents"] if isinstance(trace, dict) else trace
batch = sorted((e for e in events if e.get("name") == "batch"), key=lambda e: e["ts"])
budget = sorted((e for e in events if e.get("name") == "draft budget"), key=lambda e: e["ts"])
refused = sorted((e for e in events if e.get("name") == "draft refused"), key=lambda e: e["ts"])

kind = lambda a: "P" if a.get("prefill_rows", 0) > 0 else ("D" if a.get("drafts_allowed", 0) > 0 else ".")
print(f"{len(batch)} steps (P: with prompt rows, D: drafts allowed, .: neither), in order:")
line = "".join(kind(b["args"]) for b in batch)
for i in range(0, len(line), 120):
    print("  " + line[i:i + 120])
groups = collections.defaultdict(list)
for b, u in zip(batch, budget):
    groups[(kind(b["args"]), b["args"]["requests"])].append(u["args"])
print("kind requests  steps  wall ms (median)  tokens/step  tok/s  expected ms  expected tokens")
for (k, n), rows in sorted(groups.items()):
    wall = sum(r["wall_ms"] for r in rows)
    tokens = sum(r["tokens"] for r in rows)
    exp = [r for r in rows if "expected_ms" in r]
    e_ms = f"{statistics.mean(r['expected_ms'] for r in exp):8.2f}" if exp else "       -"
    e_tok = f"{statistics.mean(r['expected_tokens'] for r in exp):6.2f}" if exp else "     -"
    print(f"{k:>4} {n:>8} {len(rows):>6} {statistics.median(r['wall_ms'] for r in rows):16.2f} "
          f"{tokens / len(rows):12.2f} {1000 * tokens / wall:6.1f} {e_ms}     {e_tok}")
print(f"{len(refused)} refusals; by position: "
      f"{dict(sorted(collections.Counter(r['args']['position'] for r in refused).items()))}")
keys = ["gain", "rows", "cost_ms", "tokens_per_s", "tokens_per_s_with", "draft_token_ms", "draft_pass_ms",
        "catch_up_token_ms", "step_overhead_ms"]
for label, part in (("first", refused[:3]), ("last", refused[-3:])):
    for r in part:
        a = r["args"]
        print(f"  {label} refusal: position {a['position']}, " + ", ".join(
            f"{k} {a[k]:.3f}" if isinstance(a.get(k), float) else f"{k} {a.get(k)}" for k in keys))
# The draft phase: each step's shared head rounds and rows (session 58), and the drafting's wall time.
drafted = [b["args"] for b in batch if b["args"].get("draft_rounds", 0) > 0]
if drafted:
    spans = collections.defaultdict(float)
    for e in events:
        if e.get("name") == "draft" and e.get("ph") == "X" and isinstance(e.get("args", {}).get("step"), int):
            spans[e["args"]["step"]] = max(spans[e["args"]["step"]], e["dur"] / 1000)
    ms = sorted(spans.values())
    print(f"{len(drafted)} steps ran shared draft rounds: rounds/step median "
          f"{statistics.median(a['draft_rounds'] for a in drafted)}, head rows/step median "
          f"{statistics.median(a['draft_rows'] for a in drafted)}, max {max(a['draft_rows'] for a in drafted)}; "
          f"draft span ms median {ms[len(ms) // 2] if ms else float('nan'):.3f} (host clock "
          f"{statistics.median(a.get('draft_host_ms') or 0 for a in drafted):.3f}); "
          f"{sum(a.get('head_captures', 0) for a in batch)} steps captured head graphs")
