"""V2 REST against the real server process on the tiny GPTQ model."""

from __future__ import annotations

import httpx
import pytest

from tests.support import ServerProcess


def infer_body(prompts: list[str], **parameters: object) -> dict:
    return {
        "inputs": [
            {"name": "text_input", "shape": [len(prompts)], "datatype": "BYTES", "data": prompts}
        ],
        "parameters": {"max_tokens": 4, **parameters},
    }


def test_health_and_metadata(server: ServerProcess) -> None:
    base = server.base_url
    assert httpx.get(f"{base}/v2/health/live").status_code == 200
    assert httpx.get(f"{base}/v2/health/ready").json() == {"ready": True}
    assert httpx.get(f"{base}/v2/models/tiny/ready").status_code == 200
    meta = httpx.get(f"{base}/v2/models/tiny").json()
    assert meta["inputs"] == [{"name": "text_input", "datatype": "BYTES", "shape": [-1]}]
    assert meta["outputs"] == [{"name": "text_output", "datatype": "BYTES", "shape": [-1]}]


def test_infer_n_prompts_in_n_texts_out(server: ServerProcess) -> None:
    r = httpx.post(
        f"{server.base_url}/v2/models/tiny/infer",
        json=infer_body(["Hello", "The capital of France is"], max_tokens=6, chat=True),
        timeout=60,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    (output,) = body["outputs"]
    assert output["name"] == "text_output" and output["datatype"] == "BYTES"
    assert output["shape"] == [2] and all(isinstance(t, str) for t in output["data"])
    assert body["parameters"]["generated_tokens"] == 12  # the tiny model never says eos
    assert body["parameters"]["prompt_tokens"] > 2


def test_untyped_body_like_curl_is_json(server: ServerProcess) -> None:
    import json

    r = httpx.post(
        f"{server.base_url}/v2/models/tiny/infer",
        content=json.dumps(infer_body(["Hi"])),
        headers={"content-type": "application/x-www-form-urlencoded"},
        timeout=60,
    )
    assert r.status_code == 200, r.text


def test_sampled_request_with_seed_is_repeatable(server: ServerProcess) -> None:
    body = infer_body(["Once"], max_tokens=8, temperature=1.0, top_p=0.9, top_k=20, seed=5)
    url = f"{server.base_url}/v2/models/tiny/infer"
    first = httpx.post(url, json=body, timeout=60).json()["outputs"][0]["data"]
    second = httpx.post(url, json=body, timeout=60).json()["outputs"][0]["data"]
    assert first == second


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"inputs": [{"name": "other", "shape": [1], "datatype": "BYTES", "data": ["x"]}]}, 400, "text_input"),
        ({"inputs": [{"name": "text_input", "shape": [1], "datatype": "INT32", "data": [1]}]}, 400, "BYTES"),
        (infer_body(["x"], max_tokens=0), 400, "max_tokens"),
        (infer_body(["x"], max_tokens=513), 400, "max_tokens"),
        (infer_body(["x"], temperature=-1), 400, "temperature"),
        (infer_body([""]), 400, "empty"),
    ],
)  # fmt: skip
def test_bad_requests_are_4xx_with_error(
    server: ServerProcess, body: dict, status: int, message: str
) -> None:
    r = httpx.post(f"{server.base_url}/v2/models/tiny/infer", json=body, timeout=30)
    assert r.status_code == status, r.text
    assert message in r.json()["error"]


def test_unknown_model_is_404(server: ServerProcess) -> None:
    r = httpx.post(f"{server.base_url}/v2/models/nope/infer", json=infer_body(["x"]), timeout=30)
    assert r.status_code == 404
    assert "nope" in r.json()["error"]


def test_tritonclient_http(server: ServerProcess) -> None:
    import numpy as np
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    assert client.is_server_ready()
    assert client.is_model_ready("tiny")
    meta = client.get_model_metadata("tiny")
    assert meta["inputs"][0]["name"] == "text_input"
    tensor = httpclient.InferInput("text_input", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([b"Hello"], dtype=np.object_), binary_data=False)
    result = client.infer("tiny", [tensor], parameters={"max_tokens": 3})
    (text,) = result.as_numpy("text_output").reshape(-1)
    assert isinstance(text, bytes | str)
    assert result.get_response()["parameters"]["generated_tokens"] == 3


@pytest.mark.parametrize("route", ["infer", "generate", "generate_stream", "infer_stream"])
@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '"text"', "", "\xff\xfe"])
def test_malformed_bodies_are_4xx(server: ServerProcess, route: str, content: str) -> None:
    r = httpx.post(
        f"{server.base_url}/v2/models/tiny/{route}",
        content=content.encode("latin-1"),
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    assert r.json()["error"]
