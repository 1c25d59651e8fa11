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
#
# PAIRED=1: every row's server is up at once (ports PORT, PORT+1, ...; an idle one waits on its
# queue), and the rows take turns level by level, their order rotated at each level (ROTATE
# shifts it), each level one `bench serve --first-level K` call. A machine whose speed drifts
# over the minutes one row takes then drifts on every row alike. Each row's levels are merged
# into one JSON report, as the sequential mode writes.
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
PAIRED=${PAIRED:-0}
ROTATE=${ROTATE:-0}
BIN=${LLAMA_BIN:-$HOME/.cache/dspark/llama.cpp/build/bin}
SLOTS=$(echo "$LEVELS" | tr ',' '\n' | sort -n | tail -n 1)
mkdir -p "$OUT"

label_of() {  # row -> the label of its reports
  case $1 in
    default) echo "dspark-default$TAG" ;;
    none) echo "dspark-none$TAG" ;;
    llama) echo "llama-server$TAG" ;;
    *) echo "unknown row $1" >&2; exit 2 ;;
  esac
}

start() {  # row, port: that row's server in the background, its pid in STARTED
  local label
  label=$(label_of "$1") || exit 2
  if curl -sf "localhost:$2/health" > /dev/null; then echo "port $2 already serves: stop that server" >&2; exit 1; fi
  case $1 in  # exec: the background pid is the server's own
    # shellcheck disable=SC2086  # EXTRA holds several flags
    default) exec "$HERE/.venv/bin/dspark" serve "${MODEL_ARGS[@]}" --port "$2" $EXTRA ;;
    # shellcheck disable=SC2086
    none) exec "$HERE/.venv/bin/dspark" serve "${MODEL_ARGS[@]}" --drafter none --port "$2" $EXTRA ;;
    llama) exec "$BIN/llama-server" -m "$FILE" --port "$2" -np "$SLOTS" -c $((SLOTS * 1024)) -t "$(nproc)" ;;
  esac > "$OUT/$label.server.log" 2>&1 &
  STARTED=$!
}

wait_up() {  # port
  for _ in $(seq 1 900); do curl -sf "localhost:$1/health" > /dev/null && return 0; sleep 1; done
  return 1
}

bench() {  # label, port, output stem, then more `dspark bench serve` flags
  local label=$1 port=$2 stem=$3; shift 3
  echo "== $stem $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >&2
  # shellcheck disable=SC2086  # BENCH_EXTRA holds several flags
  "$HERE/.venv/bin/dspark" bench serve --url "http://127.0.0.1:$port" --endpoint chat --prompts "$PROMPTS" \
    --num-prompts "$N" --max-tokens "$TOKENS" --label "$label" --output "$OUT/$stem.json" "$@" $BENCH_EXTRA \
    > /dev/null 2> "$OUT/$stem.table"
  grep -E "Output token throughput|Mean TTFT|P99 ITL" "$OUT/$stem.table" >&2
}

read -r -a rows <<< "$ROWS"
if [ "$PAIRED" != 1 ]; then
  for row in "${rows[@]}"; do
    label=$(label_of "$row") || exit 2
    start "$row" "$PORT"
    wait_up "$PORT"
    bench "$label" "$PORT" "$label" --concurrency "$LEVELS"
    kill "$STARTED"; wait "$STARTED" 2> /dev/null
  done
  exit 0
fi

pids=()
for i in "${!rows[@]}"; do  # one at a time: a start-up cost profile taken beside another is skewed
  start "${rows[$i]}" $((PORT + i)); pids+=("$STARTED")
  wait_up $((PORT + i)) || { echo "${rows[$i]} did not come up" >&2; kill "${pids[@]}"; exit 1; }
done
IFS=, read -r -a levels <<< "$LEVELS"
for k in "${!levels[@]}"; do
  for j in "${!rows[@]}"; do
    i=$(( (j + k + ROTATE) % ${#rows[@]} ))
    label=$(label_of "${rows[$i]}")
    warm=0; [ "$k" = 0 ] && warm=2  # as one call over every level warms up once
    bench "$label" $((PORT + i)) "$label.c${levels[$k]}" --concurrency "${levels[$k]}" --first-level "$k" \
      --warmup "$warm"
  done
done
kill "${pids[@]}"; wait 2> /dev/null
for row in "${rows[@]}"; do
  label=$(label_of "$row")
  parts=()
  for c in "${levels[@]}"; do parts+=("$OUT/$label.c$c.json"); done
  "$PY" - "$OUT/$label.json" "${parts[@]}" <<'EOF'
import json
import sys

reports = [json.load(open(p, encoding="utf-8")) for p in sys.argv[2:]]
merged = dict(reports[0], runs=[run for r in reports for run in r["runs"]], first_level=0, paired=True)
json.dump(merged, open(sys.argv[1], "w", encoding="utf-8"), indent=2)
EOF
done
