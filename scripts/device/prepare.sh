#!/usr/bin/env bash
# Run HERE (the CPU machine) before a device session. A `run` call carries at most 64 MiB
# (working tree included), and what the GPU image lacks is more: FlashInfer (a 62 MB wheel, of
# which the kernels we JIT need ~12 MB once slimmed and xz'd), its small needs, the default
# model's GGUF (98 MB, 90 MB xz'd) and the shipped drafter (21 MB). So this script packs two
# loads, .carry/a and .carry/b (both ignored), one per call:
#   a: slimmed FlashInfer + wheels + the first part of the GGUF + the committed training data
#      (drafters/data, token ids, xz'd)                                       -> STAGE=setup
#   b: the rest of the GGUF + the drafter + dev and train prompts + checksum  -> STAGE=run or train
# FLASHINFER=0 leaves FlashInfer and its wheels out (a session that only trains drafters: its
# GPU tests then do not run), which leaves room for the data as it grows.
# The folders in ASIDE do not travel with the tree (drafters/ alone is 42 MB; the others are not
# used on the device): move them aside for both calls (scripts/device/gpu_checks.sh puts the
# drafter back in place on the device). The GGUF is split where both loads fit best; the script
# fails if one cannot fit.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
FLASHINFER=${FLASHINFER:-1}
ASIDE="drafters data/train_chat results"
rm -rf .carry/a .carry/b .whl /tmp/dspark-carry && mkdir -p .carry/a .carry/b .whl /tmp/dspark-carry
pip_dl() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "$@"
}
if [ "$FLASHINFER" = 1 ]; then
  # flashinfer imports without nccl4py, nccl-extensions and cudnn-frontend (then its decode
  # never picks cuDNN); the image has torch, triton, ninja, numpy, click, einops, requests,
  # tabulate, tqdm, nvidia-ml-py, packaging and cuda-bindings.
  # (versions pinned: the ones that ran on the H200 on 2026-11-26)
  pip_dl flashinfer-python==0.7.2.post1 apache-tvm-ffi==0.1.15.post2 cuda-tile==1.7.0 cuda-python==13.4.4 xgrammar==0.2.8
  FI_DIR=/tmp/dspark-carry/fi && mkdir -p "$FI_DIR"
  unzip -q -o .whl/flashinfer_python-0.7.2.post1-*.whl -d "$FI_DIR"
  # keep the python package, the headers and the top-level kernel sources the attention JIT
  # compiles (batch_prefill*, batch_decode*, tvm_ffi_utils.h: all small top-level files); drop the
  # sources of other kernel families (subfolders, multi-MB generated files) and the vendored
  # libraries' examples and tests
  (cd "$FI_DIR/flashinfer/data" && find csrc -mindepth 1 -maxdepth 1 -type d -exec rm -rf {} + \
    && find csrc -maxdepth 1 -type f -size +400k -delete \
    && rm -rf cutlass/examples cutlass/python cutlass/test cutlass/tools \
              cccl/benchmarks cccl/ci cccl/docs cccl/python)
  rm -rf "$FI_DIR"/flashinfer/experimental/*/csrc
  tar -C "$FI_DIR" -cf - flashinfer flashinfer_python-0.7.2.post1.dist-info | xz -T2 -6 > .carry/a/flashinfer-slim.tar.xz
  cp .whl/apache_tvm_ffi-*.whl .whl/cuda_tile-*.whl .whl/cuda_python-*.whl .carry/a/
fi
pip_dl gguf==0.19.0 && cp .whl/gguf-*.whl .carry/a/  # the GGUF reader: every stage
GGUF=$(.venv/bin/python -c "from dspark.models.loader import default_model_path; print(default_model_path())")
sha256sum "$GGUF" | cut -d' ' -f1 > .carry/b/gguf.sha256
xz -T2 -9e -c "$GGUF" > /tmp/dspark-carry/gguf.xz
tar -cf - drafters/smollm2-135m-dspark | xz -T2 -6 > .carry/b/drafter.tar.xz
if [ "$FLASHINFER" = 1 ]; then  # structured outputs (1.3 MB; its tvm-ffi comes with .carry/a)
  cp .whl/xgrammar-*.whl .carry/b/
fi
tar -cf - drafters/data | xz -T2 -6 > .carry/a/data.tar.xz
cp ../shared/data/dev_prompts.jsonl .carry/b/
xz -T2 -6 -c ../shared/data/train_prompts.jsonl > .carry/b/train_prompts.jsonl.xz
# what travels with each call besides its load: the files git carries, less the folders set aside
tree=$( (git ls-files; git ls-files --others --exclude-standard) | grep -v -E "^($(echo $ASIDE | tr ' ' '|'))/" \
  | tr '\n' '\0' | du -cb --files0-from=- | tail -1 | cut -f1)
limit=$((64 * 1048576)) gguf=$(stat -c %s /tmp/dspark-carry/gguf.xz)
a=$(du -sb .carry/a | cut -f1) b=$(du -sb .carry/b | cut -f1)
# the split leaves both loads the same room: a + part0 = b + (gguf - part0)
part0=$(( (gguf + b - a) / 2 ))
part0=$(( part0 < 0 ? 0 : part0 > gguf ? gguf : part0 ))
head -c "$part0" /tmp/dspark-carry/gguf.xz > .carry/a/gguf.xz.0
tail -c +$((part0 + 1)) /tmp/dspark-carry/gguf.xz > .carry/b/gguf.xz.1
for load in a b; do
  total=$(( $(du -sb .carry/$load | cut -f1) + tree ))
  echo ".carry/$load with the tree: $total bytes ($(( (limit - total) / 1024 )) KiB under 64 MiB)"
  [ "$total" -le "$limit" ] || { echo "too large for one call: try FLASHINFER=0, or move more aside"; exit 1; }
done
echo "then: for d in $ASIDE; do mkdir -p /tmp/aside/\$(dirname \$d); mv \$d /tmp/aside/\$d; done"
echo "(commit nothing until they are back); run STAGE=setup (carry .carry/a), STAGE=run or STAGE=train"
echo "(carry .carry/b); then move them back"
