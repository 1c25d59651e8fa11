#!/usr/bin/env bash
# dspark plain decoding (dspark bench, ar) vs llama-bench tg32 on the widened files (scripts/widen.py --out /root/widened), one after another.
cd "$(dirname "$0")/.." && DIR=${WIDENED:-/root/widened}
BIN=$HOME/.cache/dspark/llama.cpp/build/bin
for f in Q4_0 Q4_K_M Q8_0; do
  m=$DIR/target-$f.gguf
  uptime
  $BIN/llama-bench -m $m -p 0 -n 32 -r 3 -t 2 -o json 2>/dev/null | .venv/bin/python -c "import json,sys; r=json.load(sys.stdin)[0]; print('$f llama.cpp tg32 t=2:', round(r['avg_ts'],2), '+-', round(r['stddev_ts'],2))"
  .venv/bin/dspark bench --model $m --methods ar --drafter none --prompts data/heldout_chat.jsonl --num-prompts 4 --max-tokens 64 --output /tmp/dspark_$f.json > /dev/null 2>/tmp/dspark_$f.err
  .venv/bin/python -c "import json; r=json.load(open('/tmp/dspark_$f.json')); a=r['methods']['ar']; print('$f dspark ar decode tok/s:', a['decode_tok_s'])"
done
