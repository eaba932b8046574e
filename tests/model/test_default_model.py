"""The real default model (built by `make model`), served by the real server."""

from __future__ import annotations

import math

import httpx
import pytest
import torch

from predictor.model.loader import load_checkpoint
from predictor.model.perplexity import TEXTS, text_ids
from tests.conftest import DEFAULT_MODEL
from tests.support import ServerProcess

pytestmark = pytest.mark.model


@pytest.mark.skipif(not DEFAULT_MODEL.is_dir(), reason="run `make model` first (make test does)")
def test_default_model_knows_paris() -> None:
    with ServerProcess.start(
        DEFAULT_MODEL, "smollm2-135m-instruct-gptq", extra=["--threads", "2"]
    ) as srv:
        body = {
            "inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES",
                        "data": ["What is the capital of France?"]}],
            "parameters": {"max_tokens": 16, "chat": True},
        }  # fmt: skip
        r = httpx.post(
            f"{srv.base_url}/v2/models/smollm2-135m-instruct-gptq/infer", json=body, timeout=120
        )
    assert r.status_code == 200, r.text
    assert "Paris" in r.json()["outputs"][0]["data"][0]


@pytest.mark.skipif(not DEFAULT_MODEL.is_dir(), reason="run `make model` first (make test does)")
def test_served_perplexity_is_the_in_process_gptq_one() -> None:
    """The test text's perplexity through the server with no flags (the autotune's kernels,
    native attention; prompt logprobs of completions' echo) within 2% of the same checkpoint's
    in process (dequantized exactly, fp32): what `make model` gated is what is served."""
    loaded = load_checkpoint(DEFAULT_MODEL, device="cpu", threads=2, kernel="dequantized",
                             dtype=torch.float32)  # fmt: skip
    ids = text_ids(loaded.tokenizer, TEXTS["test"], max_tokens=1024)
    with torch.inference_mode():
        logits = loaded.model(torch.tensor([ids])).logits[0, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]))
    in_process = math.exp(float(nll))
    with ServerProcess.start(DEFAULT_MODEL, "smollm2-135m-instruct-gptq") as srv:  # defaults
        r = httpx.post(
            f"{srv.base_url}/v1/completions",
            json={"model": "smollm2-135m-instruct-gptq", "prompt": ids, "max_tokens": 0,
                  "echo": True, "logprobs": 0, "temperature": 0},
            timeout=300,
        )  # fmt: skip
    assert r.status_code == 200, r.text
    logprobs = r.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert len(logprobs) == len(ids) and logprobs[0] is None
    served = math.exp(-sum(logprobs[1:]) / (len(ids) - 1))
    assert served == pytest.approx(in_process, rel=0.02), (served, in_process)
