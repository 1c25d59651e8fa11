#!/bin/bash
# Usage: bash scripts/prefix_cache_n.sh (from the repository root; starts and stops two servers on port 8130)
# n=4 choices of a chat with a 746-token system prompt, with and without --enable-prefix-caching
cd "$(git rev-parse --show-toplevel)"
for flag in "" "--enable-prefix-caching"; do
  .venv/bin/dspark serve --port 8130 --drafter none $flag > /tmp/serve_n.log 2>&1 &
  for i in $(seq 120); do curl -sf localhost:8130/v1/models > /dev/null && break; sleep 1; done
  .venv/bin/python - "$flag" <<'PY'
import sys, time, httpx
text = open("README.md").read()[:2400]
body = {"messages": [{"role": "system", "content": text}, {"role": "user", "content": "What is dspark?"}],
        "max_tokens": 8, "temperature": 0.8, "seed": 1, "n": 4}
httpx.post("http://127.0.0.1:8130/v1/chat/completions", json={**body, "n": 1, "max_tokens": 1}, timeout=300)  # warm-up
times = []
for _ in range(2):
    t = time.perf_counter()
    r = httpx.post("http://127.0.0.1:8130/v1/chat/completions", json={**body, "messages": body["messages"][:1] + [{"role": "user", "content": f"Q{_}: what is dspark?"}]}, timeout=300)
    times.append(round(time.perf_counter() - t, 2))
print(sys.argv[1] or "no caching", "n=4 wall s", times, "prompt tokens", r.json()["usage"]["prompt_tokens"])
PY
  pkill -f "dspark serve --port 8130"; sleep 2
done
