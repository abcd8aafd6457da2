#!/usr/bin/env python3
"""llama.cpp's speculative decoding on the same prompts, models and threads as `specula bench`, for a table beside
ours. Runs plain decoding (llama-completion), draft-model speculation (llama-speculative-simple) at each k, and
prompt lookup (llama-lookup), interleaved per prompt; prints decode tok/s, speedup and acceptance.

Needs an existing llama.cpp build (../shared/PEERS.md says how):
    LLAMA_CPP_BIN=/path/to/llama.cpp/build/bin scripts/llama_cpp_speculative.py \
        --prompts ../shared/prompts/code.jsonl --draft-tokens 1,2,3,4 --tokens 128
"""
import argparse
import json
import os
import re
import subprocess
import sys

# The Qwen2.5 chat template with its default system message, as specula renders it from the GGUF.
CHATML = ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
          "<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n")


def run(cmd):
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{out.stderr[-2000:]}")
    return out.stdout + out.stderr


def plain(args, model, prompt):
    text = run([os.path.join(args.llama_bin, "llama-completion"), "-m", model, "-p", prompt, "-n", str(args.tokens),
                "--temp", "0", "-t", str(args.threads), "-no-cnv", "-c", "2048"])
    m = re.search(r"eval time =\s*([\d.]+) ms /\s*(\d+) runs", text)
    if not m:
        sys.exit("could not parse llama-completion's eval timing")
    return {"tokens": int(m.group(2)), "seconds": float(m.group(1)) / 1e3}


def speculative(args, tool, extra, prompt):
    text = run([os.path.join(args.llama_bin, tool), "-m", args.target_path, "-p", prompt, "-n", str(args.tokens),
                "--temp", "0", "-t", str(args.threads), "-c", "2048"] + extra)
    m = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", text)
    drafted = re.search(r"n_drafted\s*=\s*(\d+)", text)
    accepted = re.search(r"n_accept\s*=\s*(\d+)", text)
    if not (m and drafted and accepted):
        sys.exit(f"could not parse {tool} output:\n{text[-1500:]}")
    return {"tokens": int(m.group(1)), "seconds": float(m.group(2)),
            "drafted": int(drafted.group(1)), "accepted": int(accepted.group(1))}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prompts", required=True)
    p.add_argument("--target", default="qwen2.5-coder-1.5b")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b")
    p.add_argument("--draft-tokens", default="1,2,3,4")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--limit", type=int, default=0)
    p.add_argument("--llama-bin", default=os.environ.get("LLAMA_CPP_BIN"))
    args = p.parse_args()
    if not args.llama_bin:
        sys.exit("set LLAMA_CPP_BIN (llama.cpp's build/bin) or pass --llama-bin")
    cache = os.environ.get("SPECULA_CACHE", os.path.expanduser("~/.cache/specula/models"))
    args.target_path = os.path.join(cache, f"{args.target}.gguf")
    draft_path = os.path.join(cache, f"{args.draft}.gguf")
    ks = [int(k) for k in args.draft_tokens.split(",")]
    with open(args.prompts) as f:
        prompts = [json.loads(line)["prompt"] for line in f if line.strip()]
    if args.limit:
        prompts = prompts[:args.limit]
    configs = [("plain", None)] + [(f"draft k={k}", ("llama-speculative-simple",
                                                      ["-md", draft_path, "--spec-type", "draft-simple",
                                                       "--spec-draft-n-max", str(k), "--spec-draft-n-min", "0",
                                                       "-td", str(args.threads)]))
                                   for k in ks] + [(f"lookup k={k}", ("llama-lookup", ["--spec-draft-n-max", str(k)]))
                                                   for k in ks]
    totals = {name: {"tokens": 0, "seconds": 0.0, "drafted": 0, "accepted": 0} for name, _ in configs}
    for i, raw in enumerate(prompts):
        prompt = CHATML.format(prompt=raw)
        for name, spec in configs:
            r = plain(args, args.target_path, prompt) if spec is None else speculative(args, spec[0], spec[1], prompt)
            t = totals[name]
            for key in r:
                t[key] += r[key]
            print(f"prompt {i} {name}: {r['tokens'] / r['seconds']:.2f} tok/s", file=sys.stderr)
    base = totals["plain"]["tokens"] / totals["plain"]["seconds"]
    print(f"{'config':<12} {'tok/s':>8} {'speedup':>8} {'accept':>8}")
    for name, _ in configs:
        t = totals[name]
        tok_s = t["tokens"] / t["seconds"]
        acc = f"{100 * t['accepted'] / t['drafted']:.1f}%" if t["drafted"] else "-"
        print(f"{name:<12} {tok_s:>8.2f} {tok_s / base:>7.2f}x {acc:>8}")


if __name__ == "__main__":
    main()
