"""The real default model (built by `make model`), served by the real server."""

from __future__ import annotations

import httpx
import pytest

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
