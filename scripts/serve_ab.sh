#!/usr/bin/env bash
# Two dspark servers side by side under load, measured in alternation: both run at once on their
# own ports (an idle server costs nothing), started afresh every round with the first start
# alternating, and at every concurrency level each round benchmarks one then the other with the
# same prompts (the order flipping every round, each round the next slice of the prompt file), so
# the machine's drift and the start order land on both rows alike. Prints, per level, each row's
# median output tok/s and the median of the rounds' ratios A / B.
#
#   bash scripts/serve_ab.sh [FILE] [OUT]   # FILE default: the embedded SmolLM2-135M GGUF
#
# Env: A, B (the two rows' extra `dspark serve` flags; default A="" (the defaults), B="--drafter
# none"), ROUNDS (default 3), LEVELS (default 1,4,8,16,32), N (requests per level and round,
# default 32), TOKENS (default 64), PROMPTS (default data/heldout_chat.jsonl), TAG.
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$HERE/.venv/bin/python"
MODEL_ARGS=()  # the embedded model goes without --model, so that dspark takes its shipped drafter
[ -n "${1:-}" ] && MODEL_ARGS=(--model "$1")
OUT=${2:-$HERE/results/bench/serve_ab}
A=${A-}
B=${B---drafter none}
ROUNDS=${ROUNDS:-3}
LEVELS=${LEVELS:-1,4,8,16,32}
N=${N:-32}
TOKENS=${TOKENS:-64}
PROMPTS=${PROMPTS:-$HERE/data/heldout_chat.jsonl}
TAG=${TAG:-}
PORT_A=${PORT_A:-8131}
PORT_B=${PORT_B:-8132}
mkdir -p "$OUT"

start() {  # port, then extra flags (one string), then the round; prints the pid
  # shellcheck disable=SC2086  # the flags are several words
  "$HERE/.venv/bin/dspark" serve "${MODEL_ARGS[@]}" --port "$1" $2 > "$OUT/server-$1-r$3$TAG.log" 2>&1 &
  echo $!
}
ready() { for _ in $(seq 1 900); do curl -sf "localhost:$1/health" > /dev/null && return; sleep 1; done; }
PID_A="" PID_B=""
trap 'kill $PID_A $PID_B 2> /dev/null' EXIT

slice() {  # round -> a file of that round's N prompts (wrapping around the file)
  "$PY" - "$PROMPTS" "$1" "$N" "$OUT/prompts-$1.jsonl" <<'EOF'
import sys
rows = [r for r in open(sys.argv[1], encoding="utf-8") if r.strip()]
r, n = int(sys.argv[2]), int(sys.argv[3])
with open(sys.argv[4], "w", encoding="utf-8") as f:
    f.writelines(rows[(r * n + i) % len(rows)] for i in range(n))
EOF
  echo "$OUT/prompts-$1.jsonl"
}

bench() {  # row label, port, level, round, prompts
  "$HERE/.venv/bin/dspark" bench serve --url "http://127.0.0.1:$2" --endpoint chat --prompts "$5" \
    --num-prompts "$N" --same-prompts --max-tokens "$TOKENS" --concurrency "$3" --label "$1" \
    --output "$OUT/$1-c$3-r$4$TAG.json" > /dev/null 2>&1
}

for round in $(seq 1 "$ROUNDS"); do
  prompts=$(slice "$round")
  # both servers start afresh every round, each first in turn, one after the other (a first start
  # may measure the machine's step costs, which the other's start-up would disturb): of two
  # servers with the same flags, the one started first measured up to ~8% slower at c=4 in two of
  # three rounds, which a fixed start order puts on one row
  if [ $((round % 2)) -eq 1 ]; then
    PID_A=$(start "$PORT_A" "$A" "$round"); ready "$PORT_A"; PID_B=$(start "$PORT_B" "$B" "$round"); ready "$PORT_B"
  else
    PID_B=$(start "$PORT_B" "$B" "$round"); ready "$PORT_B"; PID_A=$(start "$PORT_A" "$A" "$round"); ready "$PORT_A"
  fi
  for level in ${LEVELS//,/ }; do
    echo "== c=$level round $round $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >&2
    if [ $((round % 2)) -eq 1 ]; then
      bench A "$PORT_A" "$level" "$round" "$prompts"; bench B "$PORT_B" "$level" "$round" "$prompts"
    else
      bench B "$PORT_B" "$level" "$round" "$prompts"; bench A "$PORT_A" "$level" "$round" "$prompts"
    fi
  done
  kill $PID_A $PID_B 2> /dev/null
  wait $PID_A $PID_B 2> /dev/null
done

"$PY" - "$OUT" "$LEVELS" "$ROUNDS" "$TAG" "$A" "$B" <<'EOF'
import json, statistics, sys
out, levels, rounds, tag, a, b = sys.argv[1:7]
def run(row, level, r):
    with open(f"{out}/{row}-c{level}-r{r}{tag}.json") as f:
        return json.load(f)["runs"][0]
print(f"A: dspark serve {a or '(defaults)'}   B: dspark serve {b}")
print("| c | A tok/s (median) | B tok/s (median) | A / B, round by round | median A / B | A tau |")
print("| ---: | ---: | ---: | --- | ---: | ---: |")
for level in levels.split(","):
    ra = [run("A", level, r) for r in range(1, int(rounds) + 1)]
    rb = [run("B", level, r) for r in range(1, int(rounds) + 1)]
    ratios = [x["output_throughput"] / y["output_throughput"] for x, y in zip(ra, rb)]
    taus = [x.get("tau") for x in ra if x.get("tau")]
    print(f"| {level} | {statistics.median(x['output_throughput'] for x in ra):.1f} "
          f"| {statistics.median(y['output_throughput'] for y in rb):.1f} "
          f"| {', '.join(f'{q:.2f}' for q in ratios)} | {statistics.median(ratios):.2f}x "
          f"| {statistics.median(taus) if taus else '-'} |")
EOF
