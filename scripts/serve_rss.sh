#!/usr/bin/env bash
# Resident set of `dspark serve` (default model and drafter) after one request, with the fused
# CPU kernels and without them. Usage: bash scripts/serve_rss.sh [port]
set -u
PORT=${1:-8123}
for mode in 1 0; do
  DSPARK_CPU_OPS=$mode .venv/bin/dspark serve --port "$PORT" > /dev/null 2>&1 &
  pid=$!
  for _ in $(seq 1 180); do curl -sf "localhost:$PORT/health" > /dev/null && break; sleep 1; done
  curl -s "localhost:$PORT/v1/chat/completions" -H 'content-type: application/json' \
    -d '{"model":"x","messages":[{"role":"user","content":"Write a haiku about rain."}],"max_tokens":32}' > /dev/null
  echo "DSPARK_CPU_OPS=$mode $(grep VmRSS /proc/$pid/status)"
  kill "$pid"; wait "$pid" 2> /dev/null
done
