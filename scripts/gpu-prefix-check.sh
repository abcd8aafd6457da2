#!/usr/bin/env bash
# The prefix cache on a device, checked by output: `specula serve` answers the same greedy prompt three times and
# then a prompt that continues the first answer, with the cache (default) and without (--no-prefix-cache), and
# with an EAGLE-3 head when one is given. Every answer must be the same in every server, and the cached servers
# must report reused prompt tokens (usage.prompt_tokens_details.cached_tokens) from the second request on.
#   scripts/gpu-prefix-check.sh BINARY OUTDIR MODEL [HEAD_DIR] [DEVICE]
# MODEL: a registry name or a GGUF path; DEVICE defaults to cuda. PROMPT, NEXT (what the follow-up adds after
# the first answer) and TOKENS (max_tokens) fit a small context, e.g. for the tiny models (context 64):
#   PROMPT="the tea and the cake, then the" NEXT=" and" TOKENS=10 \
#     scripts/gpu-prefix-check.sh BIN OUT fuzz/seeds/gguf/tiny-qwen2-f32.gguf dist/tinyhead
set -uo pipefail
bin=$1; out=$2; model=$3; head=${4:-}; device=${5:-cuda}
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
prompt=${PROMPT:-"def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number, computed iteratively in O(n) time.\"\"\"\n"}
next=${NEXT:-"\n\nprint(fibonacci(10))"}
tokens=${TOKENS:-48}
port=8950
configs="cache nocache"
[ -n "$head" ] && configs="$configs head"
for cfg in $configs; do
    port=$((port + 1))
    case $cfg in
        cache) flags=() ;;
        nocache) flags=(--no-prefix-cache) ;;
        head) flags=(--draft eagle3 --draft-model "$head" --draft-tokens 3) ;;
    esac
    "$bin" serve -m "$model" --device "$device" --port "$port" "${flags[@]}" > "$out/prefix-$cfg.log" 2>&1 &
    pid=$!
    for _ in $(seq 120); do curl -sf "localhost:$port/health" > /dev/null && break; sleep 0.5; done
    name=$(curl -s "localhost:$port/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
    ask() { # prompt-text outfile
        python3 -c 'import json,sys; print(json.dumps({"model": sys.argv[1], "prompt": sys.argv[2], "max_tokens": int(sys.argv[3]), "temperature": 0}))' \
            "$name" "$1" "$tokens" | curl -s "localhost:$port/v1/completions" -H 'Content-Type: application/json' -d @- > "$2"
    }
    for i in 1 2 3; do ask "$(printf "$prompt")" "$out/prefix-$cfg-$i.json"; done
    first=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["choices"][0]["text"], end="")' "$out/prefix-$cfg-1.json")
    ask "$(printf "$prompt")$first$(printf "$next")" "$out/prefix-$cfg-next.json"
    kill "$pid"; wait "$pid" 2>/dev/null
done
python3 - "$out" $configs <<'EOF'
import json, sys
out, configs = sys.argv[1], sys.argv[2:]
ok = True
texts = {}
for cfg in configs:
    for i in ["1", "2", "3", "next"]:
        v = json.load(open(f"{out}/prefix-{cfg}-{i}.json"))
        if "choices" not in v:
            print(f"{cfg} {i}: error {v}"); ok = False; continue
        cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
        print(f"{cfg:8} {i:5} prompt {v['usage']['prompt_tokens']:4} cached {cached:4} text {v['choices'][0]['text'][:40]!r}")
        texts.setdefault(i, set()).add(v["choices"][0]["text"])
        want_cached = cfg != "nocache" and i != "1"
        if (cached > 0) != want_cached:
            print(f"  {cfg} {i}: cached_tokens {cached}, expected {'some' if want_cached else 'none'}"); ok = False
for i, t in texts.items():
    if len(t) != 1:
        print(f"request {i}: {len(t)} different answers across servers"); ok = False
print("verdict:", "PASS" if ok else "FAIL")
EOF
