"""Hugging Face transformers as a peer on the GPU: random bf16 weights of a real shape, batch 1, greedy decode.

    python3 scripts/hf_peer.py SHAPE [--compile] [--tokens N]

SHAPE is llama-3.1-8b or qwen2.5-1.5b (the same shapes as `specula --random-weights`). Prints decode tok/s:
(N - 1) tokens over the time of a whole generate() minus a one-token generate() (the prefill). Without
--compile it runs eager with the dynamic cache (transformers' default); with --compile, a static cache and
the forward compiled by generate() itself, the fast path transformers documents.
"""
import argparse
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

SHAPES = {
    "llama-3.1-8b": lambda: LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rope_theta=500000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False),
    "qwen2.5-1.5b": lambda: Qwen2Config(
        vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
        num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=True),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", choices=SHAPES)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--tokens", type=int, default=256)
    args = ap.parse_args()
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(SHAPES[args.shape](), torch_dtype=torch.bfloat16)
    model.eval()
    prompt = torch.randint(0, 1000, (1, 24), device="cuda")
    kwargs = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    if args.compile:
        # A static cache makes generate() compile the forward pass itself (transformers' documented fast path;
        # wrapping model.forward in torch.compile(mode="reduce-overhead") by hand failed on 2026-12-01 with
        # "accessing tensor output of CUDAGraphs that has been overwritten by a subsequent run").
        kwargs["cache_implementation"] = "static"

    def run(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(prompt, max_new_tokens=n, min_new_tokens=n, **kwargs)
        torch.cuda.synchronize()
        assert out.shape[1] == prompt.shape[1] + n, out.shape
        return time.perf_counter() - t

    run(args.tokens)  # warm-up (and compilation)
    run(args.tokens)
    best = min(run(args.tokens) - run(1) for _ in range(2))
    mode = "static cache (generate compiles the forward)" if args.compile else "eager, dynamic cache"
    print(f"hf {args.shape} {mode}: decode {(args.tokens - 1) / best:.1f} tok/s "
          f"(torch {torch.__version__}, {torch.cuda.get_device_name()})")


if __name__ == "__main__":
    main()
