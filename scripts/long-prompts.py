#!/usr/bin/env python3
"""Long-prompt variants of a prompts file for serving benchmarks: each prompt after ~1400 characters of Python
(the start of scripts/serve-phase-table.py) as context, ~480 tokens with Qwen's chat template; at most N prompts.

    scripts/long-prompts.py IN.jsonl OUT.jsonl [N]

(Session 32: a GPU head that caught up on at most 64 tokens beside other requests never drafted for such prompts.)
"""
import json
import pathlib
import sys

src, dst = sys.argv[1], sys.argv[2]
limit = int(sys.argv[3]) if len(sys.argv) > 3 else 8
context = (pathlib.Path(__file__).parent / "serve-phase-table.py").read_text()[:1400]
out = []
for line in open(src):
    if not line.strip() or len(out) == limit:
        continue
    d = json.loads(line)
    d["prompt"] = "Here is a Python script from our repository, for context:\n\n" + context + "\n\nNow the task. " + d["prompt"]
    out.append(json.dumps(d))
open(dst, "w").write("\n".join(out) + "\n")
