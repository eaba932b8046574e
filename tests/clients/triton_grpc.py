"""tritonclient.grpc in its own process (it cannot share one with kserve): prints JSON results.

usage: python -m tests.clients.triton_grpc TARGET MODEL infer|bad_utf8|unknown_model
"""

from __future__ import annotations

import json
import sys

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException


def infer(client: grpcclient.InferenceServerClient, model: str, prompts: list[bytes]) -> dict:
    tensor = grpcclient.InferInput("text_input", [len(prompts)], "BYTES")
    tensor.set_data_from_numpy(np.array(prompts, dtype=np.object_))
    result = client.infer(
        model, [tensor], parameters={"max_tokens": 5, "temperature": 0.7, "seed": 3, "chat": True}
    )
    texts = [t.decode() for t in result.as_numpy("text_output").reshape(-1)]
    params = result.get_response().parameters
    return {"texts": texts, "generated_tokens": params["generated_tokens"].int64_param}


def main() -> None:
    target, model, action = sys.argv[1:4]
    client = grpcclient.InferenceServerClient(target)
    out: dict = {"ready": client.is_server_ready(), "model_ready": client.is_model_ready(model)}
    try:
        if action == "infer":
            out.update(infer(client, model, [b"Hello there", "Grüße".encode()]))
        elif action == "bad_utf8":
            out.update(infer(client, model, [b"\xff\xfe"]))
        elif action == "unknown_model":
            out.update(infer(client, "no-such-model", [b"hi"]))
    except InferenceServerException as exc:
        out["error_status"] = exc.status()
        out["error_message"] = exc.message()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
