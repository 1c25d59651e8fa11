#!/usr/bin/env bash
# Run HERE (the CPU machine) before a device session. A `run` call carries at most 64 MiB
# (working tree included), and what the GPU image lacks is more: FlashInfer (a 62 MB wheel, of
# which the kernels we JIT need ~12 MB once slimmed and xz'd), its small needs, the default
# model's GGUF (98 MB, 90 MB xz'd) and the shipped drafter (21 MB). So this script packs two
# loads, .carry/a and .carry/b (both ignored), one per call:
#   a: slimmed FlashInfer + wheels + the first part of the GGUF + the committed training data
#      (drafters/data, 22 MB of token ids, 3 MB xz'd)                         -> STAGE=setup
#   b: the rest of the GGUF + the drafter + dev and train prompts + checksum  -> STAGE=run or train
# The tracked drafters/ folder (42 MB) must not travel with the tree: move it aside for both
# calls (scripts/device/gpu_checks.sh puts the drafter back in place on the device).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
# 42 MiB of the xz'd GGUF in .carry/a: with the committed data of 2026-11-27 (4.6 MB xz'd) each
# load plus the tree (~1.3 MB without drafters/) stays ~1-2 MiB under the 64 MiB limit
PART0_MB=${PART0_MB:-42}
rm -rf .carry/a .carry/b .whl /tmp/dspark-carry && mkdir -p .carry/a .carry/b .whl /tmp/dspark-carry
pip_dl() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "$@"
}
# flashinfer imports without nccl4py, nccl-extensions and cudnn-frontend (then its decode
# never picks cuDNN); the image has torch, triton, ninja, numpy, click, einops, requests,
# tabulate, tqdm, nvidia-ml-py, packaging and cuda-bindings.
# (versions pinned: the ones that ran on the H200 on 2026-11-26)
pip_dl flashinfer-python==0.7.2.post1 apache-tvm-ffi==0.1.15.post2 cuda-tile==1.7.0 cuda-python==13.4.4 gguf==0.19.0 \
  xgrammar==0.2.8
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
cp .whl/apache_tvm_ffi-*.whl .whl/cuda_tile-*.whl .whl/cuda_python-*.whl .whl/gguf-*.whl .carry/a/
GGUF=$(.venv/bin/python -c "from dspark.models.loader import default_model_path; print(default_model_path())")
sha256sum "$GGUF" | cut -d' ' -f1 > .carry/b/gguf.sha256
xz -T2 -9e -c "$GGUF" > /tmp/dspark-carry/gguf.xz
head -c "${PART0_MB}M" /tmp/dspark-carry/gguf.xz > .carry/a/gguf.xz.0
tail -c +$((PART0_MB * 1048576 + 1)) /tmp/dspark-carry/gguf.xz > .carry/b/gguf.xz.1
tar -cf - drafters/smollm2-135m-dspark | xz -T2 -6 > .carry/b/drafter.tar.xz
cp .whl/xgrammar-*.whl .carry/b/  # structured outputs (1.3 MB; its tvm-ffi comes with .carry/a)
tar -cf - drafters/data | xz -T2 -6 > .carry/a/data.tar.xz
cp ../shared/data/dev_prompts.jsonl .carry/b/
xz -T2 -6 -c ../shared/data/train_prompts.jsonl > .carry/b/train_prompts.jsonl.xz
du -sh .carry/a .carry/b
echo "then: mv drafters /tmp/drafters-aside (commit nothing until it is back); run STAGE=setup (carry .carry/a),"
echo "STAGE=run or STAGE=train (carry .carry/b); mv back"
