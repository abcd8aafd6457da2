#!/usr/bin/env bash
# This CPU, qwen2.5-coder-1.5b: specula serve against llama.cpp's llama-server, plain and with the 0.5B draft
# model, one server after the other on the same prompts and concurrency levels, through one client
# (specula bench-serve). Prints each server's table (aggregate tok/s, TTFT and ITL percentiles per level).
#   LLAMA_BIN=DIR_OF_llama-server [MODELS=~/.cache/specula/models] [LEVELS=1,2,4,8,16] [REQUESTS=16]
#   [SERVERS="specula llama specula-spec llama-spec"] scripts/cpu-serve-peers.sh
# llama.cpp is built from source outside the repository (shared/PEERS.md); its server runs -np 8 -c 16384, with the
# draft as --spec-type draft-simple --spec-draft-n-max 3 (k = 3, what specula's --speculate picks on a CPU).
set -uo pipefail
cd "$(dirname "$0")/.."
: "${LLAMA_BIN:?set LLAMA_BIN to the directory holding llama-server}"
M=${MODELS:-$HOME/.cache/specula/models}; B=${SPECULA_BIN:-target/release/specula}
P=${PROMPTS:-../shared/prompts/code.jsonl}; L=${LEVELS:-1,2,4,8,16}; N=${REQUESTS:-16}
for f in "$M/qwen2.5-coder-1.5b.gguf" "$M/qwen2.5-coder-0.5b.gguf" "$LLAMA_BIN/llama-server" "$B"; do
  [ -e "$f" ] || { echo "missing: $f"; exit 1; }
done
port=8931
for s in ${SERVERS:-specula llama specula-spec llama-spec}; do
  case $s in
    specula) cmd=("$B" serve -m qwen2.5-coder-1.5b -t 2 --port $port) ;;
    specula-spec) cmd=("$B" serve -m qwen2.5-coder-1.5b -t 2 --port $port --speculate) ;;
    llama) cmd=("$LLAMA_BIN/llama-server" -m "$M/qwen2.5-coder-1.5b.gguf" -t 2 -np 8 -c 16384 --port $port) ;;
    llama-spec) cmd=("$LLAMA_BIN/llama-server" -m "$M/qwen2.5-coder-1.5b.gguf" -t 2 -np 8 -c 16384 --port $port
                     -md "$M/qwen2.5-coder-0.5b.gguf" --spec-type draft-simple --spec-draft-n-max 3) ;;
    *) echo "unknown server $s"; exit 1 ;;
  esac
  "${cmd[@]}" > "/tmp/serve-peers-$s.log" 2>&1 & pid=$!
  for _ in $(seq 180); do curl -sf localhost:$port/health > /dev/null && break; sleep 1; done
  echo "== $s: ${cmd[*]}"
  "$B" bench-serve --url http://127.0.0.1:$port --prompts "$P" --limit 8 --requests "$N" --concurrency "$L" \
      -n 128 --ignore-eos --quiet 2>&1 | grep -vE '^\s*$'
  kill $pid; wait $pid 2> /dev/null
done
