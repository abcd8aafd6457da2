#!/usr/bin/env python3
"""Decode speed of specula and llama.cpp side by side: same GGUF, same raw prompt, same threads, greedy,
fixed length (end-of-text ignored), runs interleaved round by round so machine drift hits both equally.

Runs an existing llama.cpp build (this script does not build it; see ../shared/PEERS.md):
    LLAMA_CPP_BIN=/path/to/llama.cpp/build/bin scripts/bench_vs_llama_cpp.py --model qwen2.5-coder-1.5b
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def specula_run(args, report):
    cmd = [args.specula, "generate", "-m", args.model, "--raw", "-p", args.prompt, "-n", str(args.tokens),
           "--ignore-eos", "-t", str(args.threads), "--quiet", "--report-json", report]
    subprocess.run(cmd, check=True, capture_output=True)
    with open(report) as f:
        return json.load(f)["timing"]["decode_tok_s"]


def llama_run(args, path):
    cmd = [os.path.join(args.llama_bin, "llama-completion"), "-m", path, "-p", args.prompt, "-n", str(args.tokens),
           "--ignore-eos", "--temp", "0", "-t", str(args.threads), "-no-cnv", "-c", "1024"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    m = re.search(r"eval time =\s*[\d.]+ ms /\s*\d+ runs\s*\(\s*[\d.]+ ms per token,\s*([\d.]+) tokens per second",
                  out.stderr)
    if not m:
        sys.exit("could not parse llama-completion's eval timing")
    return float(m.group(1))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--prompt", default="Write a Python function that checks whether a number is prime, with a docstring and tests.")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--specula", default=os.path.join(ROOT, "target", "release", "specula"))
    p.add_argument("--llama-bin", default=os.environ.get("LLAMA_CPP_BIN"))
    args = p.parse_args()
    if not args.llama_bin:
        sys.exit("set LLAMA_CPP_BIN (llama.cpp's build/bin) or pass --llama-bin")
    cache = os.environ.get("SPECULA_CACHE", os.path.expanduser("~/.cache/specula/models"))
    path = os.path.join(cache, f"{args.model}.gguf")
    ours, theirs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "r.json")
        for r in range(args.rounds):
            # Alternate who goes first.
            if r % 2 == 0:
                ours.append(specula_run(args, report)); theirs.append(llama_run(args, path))
            else:
                theirs.append(llama_run(args, path)); ours.append(specula_run(args, report))
            print(f"round {r + 1}: specula {ours[-1]:.2f} tok/s, llama.cpp {theirs[-1]:.2f} tok/s", file=sys.stderr)
    o, t = statistics.median(ours), statistics.median(theirs)
    print(f"model {args.model}, {args.threads} threads, {args.tokens} tokens, {args.rounds} rounds (median decode tok/s)")
    print(f"| engine | decode tok/s | ratio |\n|---|---|---|\n| llama.cpp | {t:.2f} | 1.00 |\n| specula | {o:.2f} | {o / t:.2f} |")


if __name__ == "__main__":
    main()
