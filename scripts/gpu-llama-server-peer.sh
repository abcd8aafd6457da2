#!/usr/bin/env bash
# llama.cpp's llama-server with CUDA beside `specula serve --device cuda`, through the same `specula bench-serve`
# on the same prompts (issue 14's serving table on the GPU).
#   scripts/gpu-llama-server-peer.sh build TARBALL OUT
#       builds llama-server from a trimmed llama.cpp source tarball (never committed; docs/gpu.md) for this card
#       and writes it to OUT as llama-server.xz.NN pieces of 15 MiB (a device call returns files of 16 MiB at
#       most), so a later call carries the binary instead of building it again (~6 minutes on 16 cores).
#       Session 45's build (llama.cpp 0c1e57098 from the llama-cpp-python 0.3.36 sdist, CUDA 13.0, sm_90; 285 s):
#       dist/llama-server-cuda.xz, 42.9 MB, sha256 a8ab3473...; the tarball dist/llama.cpp-server.tar.xz, 6.3 MB,
#       sha256 6e120c53... (both ignored, never committed). On the device: xz -dc llama-server-cuda.xz > BIN.
#   [CONFIGS="specula llama specula-head llama specula"] [LEVELS=1,2,4,8,16] \
#       (also specula-draft and llama-draft: the 0.5B draft model at k = 3 in each server; MODELS then holds
#       qwen2.5-coder-0.5b.gguf too)
#   scripts/gpu-llama-server-peer.sh bench SPECULA_BIN LLAMA_SERVER_BIN OUT MODELS HEAD PROMPTS.jsonl
#       each config's server in turn, warmed up, then bench-serve (chat completions, greedy, --ignore-eos -n 128,
#       32 requests a level) at every level; llama-server with -ngl 99 -np 16 -c 32768 (2048 tokens a slot).
set -uo pipefail
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PATH="/usr/local/cuda/bin:$PATH"
mode="$1"; shift
if [ "$mode" = build ]; then
    tarball="$1"; out="$2"
    src=/tmp/llama-build
    rm -rf "$src" && mkdir -p "$src" && tar xJf "$tarball" -C "$src"
    cd "$src/llama.cpp" || exit 1
    nvcc --version | tail -1
    cmake -B build -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF \
        -DLLAMA_USE_PREBUILT_UI=OFF > "$src/cmake.log" 2>&1 || { tail -30 "$src/cmake.log"; exit 1; }
    start=$(date +%s)
    cmake --build build -j "$(nproc)" --target llama-server > "$src/build.log" 2>&1 \
        || { grep -m5 -B2 -A10 "error" "$src/build.log"; tail -20 "$src/build.log"; exit 1; }
    echo "llama-server CUDA build: $(( $(date +%s) - start )) s"
    strip build/bin/llama-server
    ls -la build/bin/llama-server
    xz -T0 -6 -c build/bin/llama-server | split -b 15M -d -a 2 - "$out/llama-server.xz."
    ls -la "$out"
    exit 0
fi

specula="$1"; llama="$2"; out="$3"; models="$4"; head="$5"; prompts="$6"
export SPECULA_CACHE="$models"
levels="${LEVELS:-1,2,4,8,16}"
logs=$(mktemp -d)  # serve logs stay on the device: a call returns 8 files at most
port=9300
for name in ${CONFIGS:-specula llama specula-head llama specula}; do
    port=$((port + 1)); tag=$port-$name
    case "$name" in
        specula) "$specula" serve -m qwen2.5-coder-1.5b --device cuda --port "$port" --max-batch 32 \
            > "$logs/serve-$tag.log" 2>&1 & ;;
        specula-head) "$specula" serve -m qwen2.5-coder-1.5b --device cuda --port "$port" --max-batch 32 \
            --draft eagle3 --draft-model "$head" --draft-tokens 3 --draft-confidence 0 > "$logs/serve-$tag.log" 2>&1 & ;;
        specula-draft) "$specula" serve -m qwen2.5-coder-1.5b --device cuda --port "$port" --max-batch 32 \
            --draft-model qwen2.5-coder-0.5b --draft-tokens 3 > "$logs/serve-$tag.log" 2>&1 & ;;
        llama) "$llama" -m "$models/qwen2.5-coder-1.5b.gguf" -ngl 99 -np 16 -c 32768 --port "$port" \
            > "$logs/serve-$tag.log" 2>&1 & ;;
        llama-draft) "$llama" -m "$models/qwen2.5-coder-1.5b.gguf" -ngl 99 -np 16 -c 32768 --port "$port" \
            -md "$models/qwen2.5-coder-0.5b.gguf" -ngld 99 --spec-type draft-simple --spec-draft-n-max 3 \
            > "$logs/serve-$tag.log" 2>&1 & ;;
        *) echo "unknown config $name" >&2; exit 2 ;;
    esac
    pid=$!
    # A server that exits (a missing model, a bad flag) is reported at once instead of waited for.
    for _ in $(seq 240); do
        curl -sf "localhost:$port/health" > /dev/null && break
        kill -0 "$pid" 2> /dev/null || break
        sleep 0.5
    done
    if ! kill -0 "$pid" 2> /dev/null; then
        echo "== $tag: the server exited before it was ready" >&2; tail -5 "$logs/serve-$tag.log" >&2; continue
    fi
    url="http://127.0.0.1:$port"
    "$specula" bench-serve --url "$url" --prompts "$prompts" --ignore-eos -n 32 --requests 16 \
        --concurrency "$levels" --quiet > /dev/null 2>&1
    echo "== $tag"
    timeout 300 "$specula" bench-serve --url "$url" --prompts "$prompts" --ignore-eos -n 128 --requests 32 \
        --concurrency "$levels" --quiet --json "$out/bench-$tag.json" 2>&1 | grep -E "^ *(conc|[0-9]+ )"
    kill "$pid"; wait "$pid" 2>/dev/null
    grep -m3 -iE "error|panic|failed" "$logs/serve-$tag.log"
done
