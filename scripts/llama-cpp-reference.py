#!/usr/bin/env python3
"""Records llama.cpp's greedy continuations of a few raw prompts, as the reference specula's tests compare with.

Runs an existing llama.cpp build (this script does not build it; see ../shared/PEERS.md):
    LLAMA_CPP_BIN=/path/to/llama.cpp/build/bin scripts/llama-cpp-reference.py > tests/fixtures/llama_cpp_greedy.json
Models are the registry's cached GGUF files (specula fetch NAME).
"""
import json
import os
import subprocess
import sys

CACHE = os.environ.get("SPECULA_CACHE", os.path.expanduser("~/.cache/specula/models"))
BIN = os.environ.get("LLAMA_CPP_BIN")
MODELS = ["smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]
N_TOKENS = 32


def continuation(model_path, prompt):
    cmd = [os.path.join(BIN, "llama-completion"), "-m", model_path, "-p", prompt, "-n", str(N_TOKENS),
           "--temp", "0", "-t", "2", "-no-cnv", "--seed", "0", "-c", "512"]
    out = subprocess.run(cmd, capture_output=True, timeout=600)
    if out.returncode != 0:
        sys.exit(f"llama-completion failed: {out.stderr.decode(errors='replace')[-2000:]}")
    text = out.stdout.decode("utf-8", errors="replace")
    if not text.startswith(prompt):
        sys.exit(f"unexpected llama-completion output (prompt not echoed): {text[:200]!r}")
    text = text[len(prompt):]
    # llama-completion prints a blank line ("\n\n") after the generated text; it is not part of the output.
    if text.endswith("\n\n"):
        text = text[:-2]
    return text


def main():
    if not BIN:
        sys.exit("set LLAMA_CPP_BIN to llama.cpp's build/bin directory")
    commit = os.environ.get("LLAMA_CPP_COMMIT", "unknown")
    cases = []
    for model in MODELS:
        path = os.path.join(CACHE, f"{model}.gguf")
        if not os.path.exists(path):
            sys.exit(f"{path} missing: run specula fetch {model}")
        for prompt in PROMPTS:
            cases.append({"model": model, "prompt": prompt, "max_tokens": N_TOKENS,
                          "text": continuation(path, prompt)})
    json.dump({"reference": "llama.cpp llama-completion, greedy (--temp 0), 2 threads",
               "llama_cpp_commit": commit, "cases": cases}, sys.stdout, indent=1, ensure_ascii=False)
    print()


if __name__ == "__main__":
    main()
