#!/usr/bin/env python3
"""Compares two OpenAI-compatible servers' chat log-probabilities on one greedy request (e.g. `specula serve`
against llama.cpp's `llama-server` on the same GGUF): the tokens, the alternatives and the largest difference.

    scripts/compare_logprobs.py http://127.0.0.1:8080 http://127.0.0.1:8081 [--tokens 24] [--top 3]
"""
import argparse
import json
import urllib.request


def post(base, path, body):
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req) as r:
        return json.load(r)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--top", type=int, default=3)
    ap.add_argument("--prompt", default="Write a Python function that reverses a string.")
    args = ap.parse_args()
    body = {"messages": [{"role": "user", "content": args.prompt}], "max_tokens": args.tokens, "temperature": 0,
            "logprobs": True, "top_logprobs": args.top}
    a, b = (post(u, "/v1/chat/completions", body) for u in (args.a, args.b))
    ea, eb = (r["choices"][0]["logprobs"]["content"] for r in (a, b))
    same_tokens = [x["token"] for x in ea] == [y["token"] for y in eb]
    same_alternatives = sum([t["token"] for t in x["top_logprobs"]] == [t["token"] for t in y["top_logprobs"]]
                            for x, y in zip(ea, eb))
    worst = max(abs(x["logprob"] - y["logprob"]) for x, y in zip(ea, eb))
    worst_top = max(abs(s["logprob"] - t["logprob"]) for x, y in zip(ea, eb)
                    for s, t in zip(x["top_logprobs"], y["top_logprobs"]) if s["token"] == t["token"])
    for x, y in zip(ea, eb):
        print(f"{x['token']!r:>14} {x['logprob']:9.4f}   {y['token']!r:>14} {y['logprob']:9.4f}")
    print(f"tokens identical: {same_tokens} ({len(ea)} vs {len(eb)}); alternatives in the same order at "
          f"{same_alternatives} of {min(len(ea), len(eb))} positions; max |logprob diff| chosen {worst:.4f}, "
          f"alternatives {worst_top:.4f}")


if __name__ == "__main__":
    main()
