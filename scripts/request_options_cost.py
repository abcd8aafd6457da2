#!/usr/bin/env python3
"""What per-request options cost a server, side by side in one run (ABAB): a scored prompt (`echo` +
`logprobs: 1`, max_tokens 1) against the same prompt plain; a greedy 96-token completion with `logprobs: 5`
against one without; and with penalties and a logit bias (`presence_penalty` 0.5, `frequency_penalty` 0.5,
`repetition_penalty` 1.1, one biased token) against one without, compared as tokens per second (the penalized text
differs; `ignore_eos` keeps both at 96 tokens). The scored prompt bypasses the prefix cache; the plain one is sent
with a unique prefix each time so neither is served from it.

    scripts/request_options_cost.py http://127.0.0.1:8080 FILE [--rounds 2] [--chars 1800]
"""
import argparse
import json
import time
import urllib.request


def post(base, body):
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(req) as r:
        v = json.load(r)
    return v, time.perf_counter() - start


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("file", help="a text file whose start is the prompt")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--chars", type=int, default=1800)
    args = ap.parse_args()
    text = open(args.file).read()[: args.chars]
    post(args.url, {"prompt": "def f(x):", "max_tokens": 4, "temperature": 0})
    prompt_plain, prompt_scored, gen_plain, gen_scored, gen_penalized = [], [], [], [], []
    drafted = {}
    for r in range(args.rounds):
        v, t = post(args.url, {"prompt": f"# round {r}\n" + text, "max_tokens": 1, "temperature": 0})
        prompt_plain.append(t)
        tokens = v["usage"]["prompt_tokens"]
        v, t = post(args.url, {"prompt": f"# round {r}\n" + text, "max_tokens": 1, "temperature": 0, "echo": True,
                               "logprobs": 1})
        prompt_scored.append(t)
        assert len(v["choices"][0]["logprobs"]["tokens"]) == tokens + 1
        body = {"prompt": "def quicksort(xs):", "max_tokens": 96, "temperature": 0, "ignore_eos": True}
        a, t = post(args.url, body)
        gen_plain.append(t)
        b, t = post(args.url, dict(body, logprobs=5))
        gen_scored.append(t)
        assert a["choices"][0]["text"] == b["choices"][0]["text"]
        c, t = post(args.url, dict(body, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1,
                                   logit_bias={"13": 1.0}))
        gen_penalized.append(t)
        for name, v in (("plain", a), ("penalized", c)):
            spec = v["usage"].get("speculation", {})
            drafted[name] = (spec.get("drafted", 0), spec.get("accepted", 0))
    best = min
    print(f"prompt of {tokens} tokens: plain {best(prompt_plain):.2f} s, scored {best(prompt_scored):.2f} s "
          f"({best(prompt_scored) / best(prompt_plain):.2f}x)")
    print(f"96 generated tokens: plain {best(gen_plain):.2f} s, logprobs=5 {best(gen_scored):.2f} s "
          f"({best(gen_scored) / best(gen_plain):.2f}x); same text")
    print(f"96 generated tokens: plain {best(gen_plain):.2f} s, penalties + bias {best(gen_penalized):.2f} s "
          f"({best(gen_penalized) / best(gen_plain):.2f}x); drafted/accepted (last round) {drafted}")


if __name__ == "__main__":
    main()
