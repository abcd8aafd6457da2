#!/usr/bin/env python3
"""Greedy answers of an OpenAI-compatible server to every prompt of a JSONL file, N requests at a time, written as
{id: text} JSON; with --against FILE, how many differ from another run's (a plain server's answers against a
speculating one's, or one concurrency against another: specula's greedy output must not depend on either).

    scripts/serve-answers.py http://127.0.0.1:8080 shared/prompts/code.jsonl plain.json --concurrency 4 -n 64
    scripts/serve-answers.py http://127.0.0.1:8081 shared/prompts/code.jsonl spec.json --against plain.json
"""
import argparse, json, sys, urllib.request
from concurrent.futures import ThreadPoolExecutor

ap = argparse.ArgumentParser()
ap.add_argument("url"); ap.add_argument("prompts"); ap.add_argument("out")
ap.add_argument("--concurrency", type=int, default=4); ap.add_argument("-n", type=int, default=64)
ap.add_argument("--raw", action="store_true"); ap.add_argument("--against")
a = ap.parse_args()
rows = [json.loads(l) for l in open(a.prompts) if l.strip()]

def ask(row):
    if a.raw:
        path, body = "/v1/completions", {"prompt": row["prompt"]}
    else:
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": row["prompt"]}]}
    body.update({"max_tokens": a.n, "temperature": 0, "ignore_eos": True})
    req = urllib.request.Request(a.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    r = json.load(urllib.request.urlopen(req, timeout=300))
    c = r["choices"][0]
    return row.get("id", row["prompt"]), (c["text"] if a.raw else c["message"]["content"]), r.get("usage", {})

with ThreadPoolExecutor(a.concurrency) as pool:
    got = list(pool.map(ask, rows))
texts = {k: t for k, t, _ in got}
json.dump(texts, open(a.out, "w"), indent=1)
print(f"{len(texts)} answers, usage keys {sorted(got[0][2].keys())}")
if a.against:
    ref = json.load(open(a.against))
    diff = [k for k in texts if texts[k] != ref.get(k)]
    print(f"differ from {a.against}: {len(diff)} of {len(texts)} {diff[:5]}")
