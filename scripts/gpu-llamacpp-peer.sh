#!/usr/bin/env bash
# llama.cpp's CUDA build as a peer on the device machine, next to specula, on the real Qwen2.5-Coder pair.
# Two device calls back to back (the machine stays warm 30 s; /tmp survives between them):
#   scripts/gpu-llamacpp-peer.sh build TARBALL          # llama.cpp source (a trimmed tar.xz; never committed)
#   scripts/gpu-llamacpp-peer.sh bench BINARY OUTDIR MODELDIR PROMPTS
# build: unpacks into /tmp/llama.cpp and builds llama-bench and llama-speculative-simple with CUDA for this card.
# bench: llama-bench tg128 and llama-speculative-simple (0.5B draft, several draft lengths) on each prompt, then
# specula's bench of plain decoding, the 0.5B draft model and prompt lookup on the same prompts, all in one call.
set -uo pipefail
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PATH="/usr/local/cuda/bin:$PATH"
mode="$1"; shift
src=/tmp/llama.cpp
if [ "$mode" = build ]; then
    tarball="$1"
    rm -rf "$src" && mkdir -p /tmp && tar xJf "$tarball" -C /tmp
    cd "$src" || exit 1
    nvcc --version | tail -1
    cmake -B build -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_SERVER=OFF > /tmp/llama-cmake.log 2>&1 || { tail -30 /tmp/llama-cmake.log; exit 1; }
    start=$(date +%s)
    cmake --build build -j "$(nproc)" --target llama-bench llama-speculative-simple > /tmp/llama-build.log 2>&1 \
        || { grep -m5 -B2 -A10 "error" /tmp/llama-build.log; tail -20 /tmp/llama-build.log; exit 1; }
    echo "llama.cpp CUDA build: $(( $(date +%s) - start )) s"
    ls -la build/bin
    exit 0
fi

bin="$1"; out="$2"; models="$3"; prompts="$4"
target="$models/qwen2.5-coder-1.5b.gguf"; draft="$models/qwen2.5-coder-0.5b.gguf"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/card.txt"
echo "== llama-bench tg128 (plain decoding, batch 1), 1.5B then 0.5B"
"$src/build/bin/llama-bench" -m "$target" -m "$draft" -ngl 99 -p 0 -n 128 -r 5 2>&1 | tee "$out/llama-bench.txt"
n=$(wc -l < "$prompts")
echo "== llama-speculative-simple, 0.5B draft, greedy, 128 tokens, each prompt"
for i in $(seq 1 "$n"); do
    line=$(sed -n "${i}p" "$prompts")
    id=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["id"])' "$line")
    python3 -c 'import json,sys; print(json.loads(sys.argv[1])["prompt"], end="")' "$line" > "$out/prompt-$id.txt"
    for k in 2 4 8; do
        timeout 60 "$src/build/bin/llama-speculative-simple" -m "$target" -md "$draft" -ngl 99 -ngld 99 \
            -f "$out/prompt-$id.txt" -n 128 --temp 0 --spec-type draft-simple --spec-draft-n-max $k -c 4096 \
            > "$out/spec-$id-k$k.log" 2>&1
        grep -E "decoded|n_drafted|n_accept" "$out/spec-$id-k$k.log" | tr '\n' ' ' | sed "s/^/$id k=$k: /"; echo
    done
done | tee "$out/llama-spec.txt"
export SPECULA_CACHE="$models"
echo "== specula bench: plain vs the 0.5B draft model (raw prompts, as llama.cpp ran them)"
timeout 300 "$bin" bench -m qwen2.5-coder-1.5b --device cuda --prompts "$prompts" --raw \
    --draft-model qwen2.5-coder-0.5b --draft-tokens 1,2,3,4 -n 128 --quiet \
    --json "$out/specula-pair.json" 2>&1 | tee "$out/specula-pair.txt"
echo "== specula bench: plain vs prompt lookup"
timeout 200 "$bin" bench -m qwen2.5-coder-1.5b --device cuda --prompts "$prompts" --raw --draft ngram \
    --draft-tokens 4,8 -n 128 --quiet --json "$out/specula-ngram.json" 2>&1 | tee "$out/specula-ngram.txt"
