#!/usr/bin/env bash
# Serving under load, side by side in one run: `dspark serve` (defaults: the drafter, load-aware),
# `dspark serve --drafter none` and llama.cpp's `llama-server` (one slot per request of the highest
# concurrency) on the same GGUF, each benchmarked by `dspark bench serve` over the same prompts at
# every concurrency level, one server at a time.
#
#   bash scripts/serve_vs_llamaserver.sh [FILE] [OUT]   # FILE default: the embedded SmolLM2-135M GGUF
#
# Env: PROMPTS (default data/heldout_chat.jsonl), N (requests per level, default 32), TOKENS
# (default 64), LEVELS (default 1,4,8,16,32), ROWS (default "default none llama"), EXTRA (more
# `dspark serve` flags for both dspark rows, e.g. "--max-decode-stall-ms 60"), BENCH_EXTRA (more
# `dspark bench serve` flags, e.g. "--same-prompts": every level replays the same prompts, which
# both servers' prompt caches then answer), TAG (a suffix of the output names). Each level sends
# its own prompts by default. llama-server comes from scripts/build_llamacpp.sh.
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$HERE/.venv/bin/python"
FILE=${1:-$("$PY" -c 'from dspark.models.loader import default_model_path; print(default_model_path())')}
MODEL_ARGS=()  # the embedded model goes without --model, so that dspark takes its shipped drafter
[ -n "${1:-}" ] && MODEL_ARGS=(--model "$FILE")
OUT=${2:-$HERE/results/bench/serve_load}
PROMPTS=${PROMPTS:-$HERE/data/heldout_chat.jsonl}
N=${N:-32}
TOKENS=${TOKENS:-64}
LEVELS=${LEVELS:-1,4,8,16,32}
ROWS=${ROWS:-"default none llama"}
EXTRA=${EXTRA:-}
BENCH_EXTRA=${BENCH_EXTRA:-}
TAG=${TAG:-}
PORT=${PORT:-8125}
BIN=${LLAMA_BIN:-$HOME/.cache/dspark/llama.cpp/build/bin}
SLOTS=$(echo "$LEVELS" | tr ',' '\n' | sort -n | tail -n 1)
mkdir -p "$OUT"

run() {  # label, then the server command
  local label=$1$TAG; shift
  "$@" > "$OUT/$label.server.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 900); do curl -sf "localhost:$PORT/health" > /dev/null && break; sleep 1; done
  echo "== $label $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >&2
  # shellcheck disable=SC2086  # BENCH_EXTRA holds several flags
  "$HERE/.venv/bin/dspark" bench serve --url "http://127.0.0.1:$PORT" --endpoint chat --prompts "$PROMPTS" \
    --num-prompts "$N" --max-tokens "$TOKENS" --concurrency "$LEVELS" --label "$label" \
    --output "$OUT/$label.json" $BENCH_EXTRA > /dev/null 2> "$OUT/$label.table"
  grep -E "Output token throughput|Mean TTFT|P99 ITL" "$OUT/$label.table" >&2
  kill "$pid"; wait "$pid" 2> /dev/null
}

for row in $ROWS; do
  case $row in
    # shellcheck disable=SC2086  # EXTRA holds several flags
    default) run dspark-default "$HERE/.venv/bin/dspark" serve "${MODEL_ARGS[@]}" --port "$PORT" $EXTRA ;;
    # shellcheck disable=SC2086
    none) run dspark-none "$HERE/.venv/bin/dspark" serve "${MODEL_ARGS[@]}" --drafter none --port "$PORT" $EXTRA ;;
    llama) run llama-server "$BIN/llama-server" -m "$FILE" --port "$PORT" -np "$SLOTS" -c $((SLOTS * 1024)) \
             -t "$(nproc)" ;;
    *) echo "unknown row $row" >&2; exit 2 ;;
  esac
done
