"""tritonclient.grpc streaming in its own process: two interleaved requests and a bad one on one
stream, then a cancelled stream. Prints one JSON line.

usage: python -m tests.clients.triton_stream TARGET MODEL
"""

from __future__ import annotations

import json
import queue
import sys
import time

import numpy as np
import tritonclient.grpc as grpcclient


def text_input(prompt: str) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput("text_input", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
    return tensor


def main() -> None:
    target, model = sys.argv[1:3]
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(target)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    client.async_stream_infer(
        model,
        [text_input("Hello")],
        request_id="a",
        # long enough that b, sent right after, joins the batch while a runs (6 tokens were
        # done before b arrived once the engine got faster)
        parameters={"max_tokens": 40, "ignore_eos": True},
        enable_empty_final_response=True,
    )
    client.async_stream_infer(
        model,
        [text_input("World")],
        request_id="bad",
        parameters={"max_tokens": 0},
        enable_empty_final_response=True,
    )
    client.async_stream_infer(model, [text_input("Again")], request_id="b",
                              parameters={"max_tokens": 4, "temperature": 0.5, "seed": 1},
                              enable_empty_final_response=True)  # fmt: skip
    out: dict = {"responses": {"a": [], "b": []}, "finals": {}, "errors": [], "order": []}
    deadline = time.monotonic() + 60
    while len(out["finals"]) < 2 and time.monotonic() < deadline:
        result, error = results.get(timeout=60)
        if error is not None:
            out["errors"].append(str(error))
            continue
        response = result.get_response()
        final = response.parameters["triton_final_response"].bool_param
        out["order"].append(response.id)
        if final:
            out["finals"][response.id] = len(response.outputs)
        else:
            text = result.as_numpy("text_output")
            out["responses"][response.id].append(text[0].decode() if text is not None else None)
            if "generated_tokens" in response.parameters:
                out.setdefault("usage", {})[response.id] = response.parameters[
                    "generated_tokens"
                ].int64_param
    client.stop_stream()

    # a long request on a new stream, then the call is cancelled
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    client.async_stream_infer(
        model,
        [text_input("Long")],
        request_id="c",
        parameters={"max_tokens": 60},
        enable_empty_final_response=True,
    )
    results.get(timeout=60)
    client.stop_stream(cancel_requests=True)
    out["cancelled"] = True
    print(json.dumps(out))


if __name__ == "__main__":
    main()
