#!/usr/bin/env python3
"""Long prompts of mixed length for serving benchmarks: N slices of a text file (default docs/benchmarks.md), their
lengths spread evenly from 200 to 4000 characters, each after "Summarize this:" (about 60-1000 tokens).

    scripts/mixed-long-prompts.py OUT.jsonl [N] [FILE]

(Session 40: at 16 streams on an H200 the head server ran at 0.83-0.92x plain on such prompts.)
"""
import json
import pathlib
import sys

dst = sys.argv[1]
n = int(sys.argv[2]) if len(sys.argv) > 2 else 32
src = pathlib.Path(sys.argv[3] if len(sys.argv) > 3 else pathlib.Path(__file__).parent.parent / "docs" / "benchmarks.md")
text = src.read_text()
with open(dst, "w") as f:
    for i in range(n):
        length = 200 + (4000 - 200) * i // max(n - 1, 1)
        start = (len(text) - length) * i // max(n - 1, 1)
        f.write(json.dumps({"prompt": "Summarize this:\n\n" + text[start:start + length]}) + "\n")
