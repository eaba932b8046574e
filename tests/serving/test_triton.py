"""A drop-in for Triton clients, against the real server: tritonclient (in a subprocess) reads
the model config, statistics and repository index; vLLM-backend and generate conventions."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import grpc
import httpx
import pytest

from predictor.pb import triton_model_pb2 as tpb
from tests.serving.test_grpc_stream import call_stream, stream_request, wait_idle
from tests.support import REPO, ServerProcess


def run_client(server: ServerProcess, action: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "tests.clients.triton_admin", server.grpc_target,
         f"127.0.0.1:{server.http_port}", server.model_name, action],
        cwd=REPO, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_tritonclient_reads_config_statistics_and_index(server: ServerProcess) -> None:
    out = run_client(server, "status")
    for config in (out["grpc_config"]["config"], out["http_config"]):
        assert config["name"] == "tiny" and config["backend"] == "gptq-predictor"
        assert config["model_transaction_policy"] == {"decoupled": True}
        inputs = {i["name"]: i for i in config["input"]}
        assert inputs["text_input"]["data_type"] == "TYPE_STRING"
        assert inputs["sampling_parameters"]["optional"] is True
        assert inputs["stream"]["data_type"] == "TYPE_BOOL"
        assert inputs["max_tokens"]["data_type"] == "TYPE_INT32"
        outputs = {o["name"]: o["data_type"] for o in config["output"]}
        assert outputs == {
            "text_output": "TYPE_STRING",
            "finish_reason": "TYPE_STRING",
            "num_input_tokens": "TYPE_UINT32",
            "num_output_tokens": "TYPE_UINT32",
        }
    assert out["http_config"]["input"][0]["dims"] == [-1]  # numbers, as Triton's REST writes them
    assert (
        out["grpc_config_v1"] == out["grpc_config"] and out["http_config_v1"] == out["http_config"]
    )
    for stats in (
        out["grpc_stats"],
        out["grpc_all_stats"],
        out["http_stats"],
        out["http_all_stats"],
    ):
        (model,) = stats["model_stats"]
        assert model["name"] == "tiny" and model["version"] == "1"
        assert set(model["inference_stats"]) >= {
            "success",
            "fail",
            "queue",
            "compute_input",
            "compute_infer",
            "compute_output",
        }
    assert out["grpc_index"] == {"models": [{"name": "tiny", "version": "1", "state": "READY"}]}
    assert out["http_index"] == [{"name": "tiny", "version": "1", "state": "READY"}]
    assert out["grpc_missing"].startswith("StatusCode.NOT_FOUND")
    assert out["http_missing"].startswith("404") or "not found" in out["http_missing"]
    assert out["grpc_bad_version"].startswith("StatusCode.NOT_FOUND")


def test_vllm_style_stream_gets_the_requested_tokens(server: ServerProcess) -> None:
    out = run_client(server, "vllm")
    once, streamed = out["once"], out["streamed"]
    # stream false: one response with the whole text, the prompt in front (the vLLM default)
    assert len(once["texts"]) == 1 and once["texts"][0].startswith("Hello")
    assert once["tokens"] == [7] and once["finish"] == ["length"]
    assert once["input_tokens"][0] is not None and once["input_tokens"][0] > 0
    # stream true: token by token, counts adding up to max_tokens, the reason on the last one
    assert len(streamed["texts"]) >= 2 and sum(streamed["tokens"]) == 5
    assert streamed["finish"][-1] == "length" and set(streamed["finish"][:-1]) == {"None"}
    assert streamed["input_tokens"][-1] == once["input_tokens"][0]
    wait_idle(server)


def test_unknown_inputs_are_refused_by_name(server: ServerProcess) -> None:
    out = run_client(server, "refusals")
    assert out["grpc_unknown_input"].startswith("StatusCode.INVALID_ARGUMENT")
    assert "'image'" in out["grpc_unknown_input"] and "'image'" in out["http_unknown_input"]
    assert out["http_unknown_input"].startswith("400")


def test_unknown_input_on_model_stream_infer(server: ServerProcess) -> None:
    bad = stream_request("bad", b"Hi", 2, empty_final=False)
    bad.inputs.add(name="image", datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"x")
    (response,) = call_stream(server, [bad])
    assert "unexpected inference input 'image'" in response.error_message


def generate(
    server: ServerProcess, body: dict[str, Any], route: str = "generate"
) -> httpx.Response:
    url = f"{server.base_url}/v2/models/tiny/{route}"
    return httpx.post(url, json=body, timeout=60)


def test_generate_honours_top_level_max_tokens(server: ServerProcess) -> None:
    response = generate(server, {"text_input": "Hello", "max_tokens": 3})
    assert response.status_code == 200, response.text
    assert response.json()["details"]["generated_tokens"] == 3
    ambiguous = generate(
        server, {"text_input": "Hi", "max_tokens": 3, "parameters": {"max_tokens": 4}}
    )
    assert ambiguous.status_code == 400 and "ambiguous" in ambiguous.json()["error"]
    unknown = generate(server, {"text_input": "Hi", "max_tokenz": 3})
    assert unknown.status_code == 400 and "'max_tokenz'" in unknown.json()["error"]


def test_generate_stream_with_stream_false_sends_one_event(server: ServerProcess) -> None:
    response = generate(server, {"text_input": "Hi", "max_tokens": 4, "stream": False},
                        "generate_stream")  # fmt: skip
    events = [
        json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ")
    ]
    assert len(events) == 1 and events[0]["details"]["generated_tokens"] == 4


def test_infer_stream_vllm_tensors(server: ServerProcess) -> None:
    body = {
        "inputs": [
            {"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["Hi"]},
            {"name": "sampling_parameters", "shape": [1], "datatype": "BYTES",
             "data": [json.dumps({"max_tokens": 3})]},
            {"name": "return_num_output_tokens", "shape": [1], "datatype": "BOOL", "data": [True]},
        ]
    }  # fmt: skip
    response = httpx.post(f"{server.base_url}/v2/models/tiny/infer_stream", json=body, timeout=60)
    events = [
        json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ")
    ]
    counts = [e["outputs"][1]["data"][0] for e in events]
    assert sum(counts) == 3


# -- statistics: a known mix, counted exactly ----------------------------------------------------


def stats(server: ServerProcess) -> dict[str, Any]:
    response = httpx.get(f"{server.base_url}/v2/models/tiny/stats", timeout=10)
    (model,) = response.json()["model_stats"]
    return model


def grpc_stats(server: ServerProcess) -> tpb.ModelStatistics:
    with grpc.insecure_channel(server.grpc_target) as channel:
        rpc = channel.unary_unary(
            "/inference.GRPCInferenceService/ModelStatistics",
            request_serializer=tpb.ModelStatisticsRequest.SerializeToString,
            response_deserializer=tpb.ModelStatisticsResponse.FromString,
        )
        (model,) = rpc(tpb.ModelStatisticsRequest(name="tiny"), timeout=10).model_stats
    return model


def infer(server: ServerProcess, max_tokens: int) -> httpx.Response:
    body = {"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["Hi"]}],
            "parameters": {"max_tokens": max_tokens}}  # fmt: skip
    return httpx.post(f"{server.base_url}/v2/models/tiny/infer", json=body, timeout=60)


def accepted_drafts(server: ServerProcess) -> float:
    """Draft tokens the server's speculation has had accepted (its counter on /metrics)."""
    for line in httpx.get(f"{server.base_url}/metrics", timeout=10).text.splitlines():
        if line.startswith("predictor_spec_decode_num_accepted_tokens_total{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_statistics_count_a_known_mix_exactly(server: ServerProcess) -> None:
    wait_idle(server)
    before, drafted = stats(server), accepted_drafts(server)
    # four successes, one after the other, on four routes: 3 + 2 + 4 + 2 tokens
    assert generate(server, {"text_input": "a", "max_tokens": 3}).status_code == 200
    assert (
        generate(server, {"text_input": "b", "max_tokens": 2}, "generate_stream").status_code == 200
    )
    assert infer(server, 4).status_code == 200
    (last,) = call_stream(server, [stream_request("s", b"c", 2, empty_final=False)])[-1:]
    assert last.infer_response.parameters["generated_tokens"].int64_param == 2
    # one refused by the engine (over --max-tokens-limit): a failure
    assert generate(server, {"text_input": "d", "max_tokens": 1000}).status_code == 400
    # refused while parsing: never reaches the engine, not counted
    assert generate(server, {"text_input": "e", "max_tokens": 0}).status_code == 400
    assert infer(server, 0).status_code == 400
    after = stats(server)

    def delta(*path: str) -> int:
        a: Any = after
        b: Any = before
        for key in path:
            a, b = a[key], b[key]
        return int(a) - int(b)

    assert delta("inference_count") == 4
    assert delta("inference_stats", "success", "count") == 4
    assert delta("inference_stats", "fail", "count") == 1
    assert delta("inference_stats", "queue", "count") == 4
    for part in ("compute_input", "compute_infer", "compute_output"):
        assert delta("inference_stats", part, "count") == 4
    # one model execution (forward pass) per generated token, the first being the prefill's
    # pass (these prompts fit one chunk): 3 + 2 + 4 + 2, less the drafts accepted (a pass
    # that keeps drafts makes their tokens too)
    assert delta("execution_count") == 11 - (accepted_drafts(server) - drafted)
    assert (
        delta("inference_stats", "success", "ns")
        > delta("inference_stats", "compute_infer", "ns")
        > 0
    )
    assert after["last_inference"] >= before["last_inference"] > 0
    # the gRPC answer is the same figures
    message = grpc_stats(server)
    assert message.inference_count == after["inference_count"]
    assert message.inference_stats.fail.count == after["inference_stats"]["fail"]["count"]


@pytest.mark.parametrize("path", ["/v2/models/nope/config", "/v2/models/nope/stats",
                                  "/v2/models/tiny/versions/2/config"])  # fmt: skip
def test_unknown_model_or_version_is_404(server: ServerProcess, path: str) -> None:
    response = httpx.get(f"{server.base_url}{path}", timeout=10)
    assert response.status_code == 404 and "error" in response.json()


def test_repository_index_ready_filter(server: ServerProcess) -> None:
    url = f"{server.base_url}/v2/repository/index"
    assert httpx.post(url, json={"ready": True}, timeout=10).json()[0]["state"] == "READY"
    assert httpx.post(url, json=["x"], timeout=10).status_code == 400
    with grpc.insecure_channel(server.grpc_target) as channel:
        rpc = channel.unary_unary(
            "/inference.GRPCInferenceService/RepositoryIndex",
            request_serializer=tpb.RepositoryIndexRequest.SerializeToString,
            response_deserializer=tpb.RepositoryIndexResponse.FromString,
        )
        (entry,) = rpc(tpb.RepositoryIndexRequest(ready=True), timeout=10).models
    assert (entry.name, entry.state) == ("tiny", "READY")
