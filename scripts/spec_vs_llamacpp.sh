#!/usr/bin/env bash
# Speculative decoding on the widened 2B-shaped target (scripts/widen.py --out DIR), dspark beside
# llama.cpp's llama-server, one server at a time on the same file, the same prompts, in one run:
#
#   dspark --drafter none          plain decoding
#   dspark (defaults)              the widened DSpark drafter DIR/drafter with the n-gram assist
#   dspark --draft-model ORIG      the original 135M model drafting (ORIG: its GGUF)
#   llama-server                   plain decoding
#   llama-server -md ORIG          llama.cpp's speculative decoding with the same draft model
#
# The 135M draft computes almost the same function as the widened target, so its acceptance is an
# upper bound: those two rows compare the engines' speculation overhead, not drafters.
#
#   bash scripts/spec_vs_llamacpp.sh [FILE] [OUT]   # FILE default DIR/target-Q4_K_M.gguf, OUT a folder
#
# Env: WIDENED (DIR, default /root/widened), ORIG (default DIR/control/orig-Q8_0.gguf), PROMPTS
# (default data/heldout_chat.jsonl), N (requests, default 10), TOKENS (default 128), CATEGORY,
# ROWS (which rows to run, default all: "plain default draft llama llama-spec"), BLOCK (draft
# tokens per step for the draft model, both engines, default 8), EXTRA (more `dspark serve` flags
# for the dspark rows, e.g. "--draft-p-min 0").
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR=${WIDENED:-/root/widened}
FILE=${1:-$DIR/target-Q4_K_M.gguf}
OUT=${2:-$HERE/results/bench/widen/spec}
ORIG=${ORIG:-$DIR/control/orig-Q8_0.gguf}
PROMPTS=${PROMPTS:-$HERE/data/heldout_chat.jsonl}
N=${N:-10}
TOKENS=${TOKENS:-128}
BLOCK=${BLOCK:-8}
ROWS=${ROWS:-"plain default draft llama llama-spec"}
EXTRA=${EXTRA:-}
PORT=${PORT:-8124}
BIN=${LLAMA_BIN:-$HOME/.cache/dspark/llama.cpp/build/bin}
DSPARK="$HERE/.venv/bin/dspark"
mkdir -p "$OUT"
CAT_ARGS=()
[ -n "${CATEGORY:-}" ] && CAT_ARGS=(--category "$CATEGORY")

run() {  # label, then the server command
  local label=$1; shift
  "$@" > "$OUT/$label.server.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 900); do curl -sf "localhost:$PORT/health" > /dev/null && break; sleep 1; done
  echo "== $label $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >&2
  "$DSPARK" bench serve --url "http://127.0.0.1:$PORT" --endpoint chat --prompts "$PROMPTS" "${CAT_ARGS[@]}" \
    --num-prompts "$N" --max-tokens "$TOKENS" --concurrency 1 --warmup 1 --label "$label" \
    --output "$OUT/$label.json" > /dev/null 2> "$OUT/$label.table"
  tail -n 3 "$OUT/$label.table" >&2
  kill "$pid"; wait "$pid" 2> /dev/null
}

for row in $ROWS; do
  case $row in
    # shellcheck disable=SC2086  # EXTRA holds several flags
    plain) run dspark-plain "$DSPARK" serve --model "$FILE" --drafter none --port "$PORT" $EXTRA ;;
    # shellcheck disable=SC2086
    default) run dspark-default "$DSPARK" serve --model "$FILE" --drafter "$DIR/drafter" --port "$PORT" $EXTRA ;;
    # shellcheck disable=SC2086
    draft) run dspark-draft-model "$DSPARK" serve --model "$FILE" --draft-model "$ORIG" --block-size "$BLOCK" \
             --port "$PORT" $EXTRA ;;
    llama) run llama-server "$BIN/llama-server" -m "$FILE" --port "$PORT" -c 4096 -np 1 -t "$(nproc)" ;;
    llama-spec) run llama-server-spec "$BIN/llama-server" -m "$FILE" -md "$ORIG" --spec-draft-n-max "$BLOCK" \
                  --spec-draft-n-min 1 --port "$PORT" -c 4096 -np 1 -t "$(nproc)" ;;
    *) echo "unknown row $row" >&2; exit 2 ;;
  esac
done
