"""tritonclient (grpc and http) in its own process: Triton's config, statistics and repository
index RPCs, Triton-vLLM-style requests, and refused inputs. Prints one JSON line.

usage: python -m tests.clients.triton_admin GRPC_TARGET HTTP_TARGET MODEL status|vllm|refusals
"""

from __future__ import annotations

import json
import queue
import sys
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException


def status(grpc_target: str, http_target: str, model: str) -> dict[str, Any]:
    g = grpcclient.InferenceServerClient(grpc_target)
    h = httpclient.InferenceServerClient(http_target)
    return {
        "grpc_config": g.get_model_config(model, as_json=True),
        "grpc_config_v1": g.get_model_config(model, "1", as_json=True),
        "http_config": h.get_model_config(model),
        "http_config_v1": h.get_model_config(model, "1"),
        "grpc_stats": g.get_inference_statistics(model, as_json=True),
        "grpc_all_stats": g.get_inference_statistics(as_json=True),
        "http_stats": h.get_inference_statistics(model),
        "http_all_stats": h.get_inference_statistics(),
        "grpc_index": g.get_model_repository_index(as_json=True),
        "http_index": h.get_model_repository_index(),
        "grpc_missing": error_of(lambda: g.get_model_config("no-such-model")),
        "http_missing": error_of(lambda: h.get_model_config("no-such-model")),
        "grpc_bad_version": error_of(lambda: g.get_model_config(model, "7")),
    }


def error_of(call: Any) -> str:
    try:
        call()
    except InferenceServerException as exc:
        return f"{exc.status()} {exc.message()}"
    return "no error"


def vllm_inputs(prompt: str, stream: bool, params: dict[str, Any]) -> list[Any]:
    inputs = []
    for name, datatype, value in [
        ("text_input", "BYTES", prompt.encode()),
        ("stream", "BOOL", stream),
        ("sampling_parameters", "BYTES", json.dumps(params).encode()),
        ("return_finish_reason", "BOOL", True),
        ("return_num_input_tokens", "BOOL", True),
        ("return_num_output_tokens", "BOOL", True),
    ]:
        tensor = grpcclient.InferInput(name, [1], datatype)
        dtype = np.object_ if datatype == "BYTES" else bool
        tensor.set_data_from_numpy(np.array([value], dtype=dtype))
        inputs.append(tensor)
    return inputs


def vllm(grpc_target: str, model: str) -> dict[str, Any]:
    """Two requests in the vLLM backend's shape on one stream: stream false and stream true."""
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(grpc_target)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    # the vLLM backend's sample client sends the values as strings, and as parameters too
    once = {"max_tokens": "7", "temperature": "0"}
    client.async_stream_infer(model, vllm_inputs("Hello", False, once), request_id="once",
                              parameters=once)  # fmt: skip
    client.async_stream_infer(model, vllm_inputs("Hello", True, {"max_tokens": 5, "top_k": 3,
                              "temperature": 0.7, "seed": 1}), request_id="streamed")  # fmt: skip
    out: dict[str, Any] = {r: {"texts": [], "tokens": [], "finish": [], "input_tokens": []}
                           for r in ("once", "streamed")}  # fmt: skip
    finals = 0
    while finals < 2:
        result, error = results.get(timeout=120)
        if error is not None:
            raise error
        response = result.get_response()
        entry = out[response.id]
        entry["texts"].append(result.as_numpy("text_output")[0].decode())
        entry["tokens"].append(int(result.as_numpy("num_output_tokens")[0]))
        entry["finish"].append(result.as_numpy("finish_reason")[0].decode())
        inputs = result.as_numpy("num_input_tokens")
        entry["input_tokens"].append(None if inputs is None else int(inputs[0]))
        finals += response.parameters["triton_final_response"].bool_param
    client.stop_stream()
    return out


def refusals(grpc_target: str, http_target: str, model: str) -> dict[str, Any]:
    g = grpcclient.InferenceServerClient(grpc_target)
    h = httpclient.InferenceServerClient(http_target)

    def inputs(module: Any) -> list[Any]:
        prompt = module.InferInput("text_input", [1], "BYTES")
        prompt.set_data_from_numpy(np.array([b"Hello"], dtype=np.object_))
        image = module.InferInput("image", [1], "BYTES")
        image.set_data_from_numpy(np.array([b"x"], dtype=np.object_))
        return [prompt, image]

    return {
        "grpc_unknown_input": error_of(lambda: g.infer(model, inputs(grpcclient))),
        "http_unknown_input": error_of(lambda: h.infer(model, inputs(httpclient))),
    }


def main() -> None:
    grpc_target, http_target, model, action = sys.argv[1:5]
    if action == "status":
        out = status(grpc_target, http_target, model)
    elif action == "vllm":
        out = vllm(grpc_target, model)
    else:
        out = refusals(grpc_target, http_target, model)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
