#!/usr/bin/env bash
# Peak and steady resident set of `dspark serve --model FILE` beside llama.cpp's `llama-server` on
# the same file: peak (VmHWM) and steady (VmRSS) after one chat request of 32 tokens, both servers
# with a KV cache of KV tokens and plain decoding.
#
#   bash scripts/serve_rss.sh [FILE] [KV]      # FILE: a .gguf (default: the embedded model), KV: 4096
#
# llama-server comes from scripts/build_llamacpp.sh (skipped when it is not built). A first load of
# a GGUF also converts its index into the cache (the peak then includes that).
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODEL=${1:-}
KV=${2:-4096}
PORT=${PORT:-8123}
LLAMA_SERVER=${LLAMA_SERVER:-$HOME/.cache/dspark/llama.cpp/build/bin/llama-server}
MESSAGES='"messages":[{"role":"user","content":"Write a haiku about rain."}],"max_tokens":32,"temperature":0'

measure() {  # name, then the server command; prints one line
  local name=$1; shift
  "$@" > /dev/null 2>&1 &
  local pid=$!
  for _ in $(seq 1 600); do curl -sf "localhost:$PORT/health" > /dev/null && break; sleep 1; done
  # the server's own model name (dspark answers an unknown one with 404, and the request must run)
  local model
  model=$(curl -s "localhost:$PORT/v1/models" | python3 -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])')
  curl -s "localhost:$PORT/v1/chat/completions" -H 'content-type: application/json' \
    -d "{\"model\":\"$model\",$MESSAGES}" | grep -q '"choices"' || echo "$name: the request failed" >&2
  local hwm rss
  hwm=$(awk '/VmHWM/ {print $2}' "/proc/$pid/status")
  rss=$(awk '/VmRSS/ {print $2}' "/proc/$pid/status")
  printf '%-14s peak %6.2f GB  steady %6.2f GB\n' "$name" "$(echo "$hwm/1048576" | bc -l)" "$(echo "$rss/1048576" | bc -l)"
  kill "$pid"; wait "$pid" 2> /dev/null
}

ARGS=(--port "$PORT" --drafter none --kv-cache-tokens "$KV")
[ -n "$MODEL" ] && ARGS+=(--model "$MODEL")
[ -n "$MODEL" ] && ls -l "$MODEL" | awk '{printf "file           %6.2f GB\n", $5 / 1073741824}'
measure "dspark" "$HERE/.venv/bin/dspark" serve "${ARGS[@]}"
if [ -x "$LLAMA_SERVER" ] && [ -n "$MODEL" ]; then
  measure "llama-server" "$LLAMA_SERVER" -m "$MODEL" --port "$PORT" -c "$KV" -np 1 -t "$(nproc)"
fi
