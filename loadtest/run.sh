#!/usr/bin/env bash
# `make loadtest`: start a local dspark server, wait for /health, run Locust headless against it for a
# bounded time, write CSVs under loadtest/results/, then stop the server. Exits non-zero when any
# request failed (Locust's exit code) or the server did not come up.
# Settings (environment): PORT (8011), USERS (4), SPAWN_RATE (2), RUN_TIME (60s), DRAFTER (ngram),
# VENV (.venv), SERVER_ARGS (extra `dspark serve` flags).
set -euo pipefail
cd "$(dirname "$0")/.."

PORT=${PORT:-8011}
USERS=${USERS:-4}
SPAWN_RATE=${SPAWN_RATE:-2}
RUN_TIME=${RUN_TIME:-60s}
DRAFTER=${DRAFTER:-ngram}
VENV=${VENV:-.venv}
RESULTS=loadtest/results
URL="http://127.0.0.1:${PORT}"
mkdir -p "$RESULTS"

# shellcheck disable=SC2086  # SERVER_ARGS is a list of flags
nice -n 10 "$VENV/bin/dspark" serve --host 127.0.0.1 --port "$PORT" --drafter "$DRAFTER" \
    --log-level warning ${SERVER_ARGS:-} >"$RESULTS/server.log" 2>&1 &
server=$!
stop_server() {
    kill -TERM "$server" 2>/dev/null || true
    wait "$server" 2>/dev/null || true
}
trap stop_server EXIT

echo "[loadtest] waiting for $URL/health (server log: $RESULTS/server.log) ..."
for _ in $(seq 1 300); do
    if "$VENV/bin/python" -c "import urllib.request as u; u.urlopen('$URL/health', timeout=2)" 2>/dev/null; then
        break
    fi
    if ! kill -0 "$server" 2>/dev/null; then
        echo "[loadtest] the server exited:" >&2
        cat "$RESULTS/server.log" >&2
        exit 1
    fi
    sleep 1
done
"$VENV/bin/python" -c "import urllib.request as u; u.urlopen('$URL/health', timeout=2)"

echo "[loadtest] locust: $USERS users for $RUN_TIME against $URL; CSVs in $RESULTS/"
nice -n 10 "$VENV/bin/locust" -f loadtest/locustfile.py --headless --host "$URL" \
    --users "$USERS" --spawn-rate "$SPAWN_RATE" --run-time "$RUN_TIME" --stop-timeout 120 \
    --csv "$RESULTS/dspark" --only-summary --loglevel WARNING
