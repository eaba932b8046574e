"""V2 (Open Inference Protocol) tensors <-> text, for REST and gRPC alike.

Over REST, parameters arrive as a dict of JSON values; over gRPC as a protobuf map of
InferParameter. `plain_parameters` turns both into one dict before anything reads them. What a
request asks (its parameters, Triton's optional tensors, how to answer) is decoded by
`protocols/triton/requests.py`, on top of these.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any

import numpy as np
from google.protobuf.unknown_fields import UnknownFieldSet
from kserve import InferOutput, InferRequest, InferResponse

from predictor.errors import InvalidRequest
from predictor.protocols.limits import check_string
from predictor.types import Completion, FinishReason, Usage

TEXT_INPUT = "text_input"
TEXT_OUTPUT = "text_output"


def plain_parameters(raw: Mapping[str, Any] | None) -> dict[str, Any]:
    """A dict of plain Python values from REST JSON parameters or a gRPC InferParameter map."""
    if not raw:
        return {}
    out: dict[str, Any] = {}
    for key, value in raw.items():
        out[key] = _grpc_parameter(value) if hasattr(value, "WhichOneof") else value
    return out


# KServe's InferParameter has fields 1-3 only; Triton's adds double_param = 4 and
# uint64_param = 5, which tritonclient uses for floats and large ints. Those arrive here as
# unknown fields of KServe's message: read them rather than drop a client's temperature.
_DOUBLE_PARAM, _UINT64_PARAM = 4, 5


def _grpc_parameter(value: Any) -> Any:
    which = value.WhichOneof("parameter_choice")
    if which:
        return getattr(value, which)
    for field in UnknownFieldSet(value):
        if field.field_number == _DOUBLE_PARAM and field.wire_type == 1:  # fixed64
            return struct.unpack("<d", struct.pack("<Q", field.data))[0]
        if field.field_number == _UINT64_PARAM and field.wire_type == 0:  # varint
            return int(field.data)
    return None


def prompts(request: InferRequest) -> list[str]:
    """The prompts of the BYTES input `text_input`, one per element."""
    inputs = [inp for inp in request.inputs if inp.name == TEXT_INPUT]
    if not inputs:
        raise InvalidRequest(f"input '{TEXT_INPUT}' is missing")
    tensor = inputs[0]
    if tensor.datatype != "BYTES":
        raise InvalidRequest(
            f"input '{TEXT_INPUT}' must have datatype BYTES, got {tensor.datatype}"
        )
    try:
        values = tensor.as_numpy().reshape(-1).tolist()
    except InvalidRequest:
        raise
    except Exception as exc:
        raise InvalidRequest(f"input '{TEXT_INPUT}' cannot be read: {exc}") from exc
    if not values:
        raise InvalidRequest(f"input '{TEXT_INPUT}' is empty")
    texts = [text_of(v, TEXT_INPUT) for v in values]
    if any(not p for p in texts):
        raise InvalidRequest(f"input '{TEXT_INPUT}' must not contain empty strings")
    return texts


def text_of(value: Any, name: str) -> str:
    """One element of a BYTES tensor as text: UTF-8 bytes (gRPC) or a string (REST JSON)."""
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidRequest(f"input '{name}' is not valid UTF-8: {exc}") from exc
    if isinstance(value, str):
        check_string(value, f"input '{name}'")
        return value
    raise InvalidRequest(f"input '{name}' must hold strings")


def details(finish_reason: FinishReason, usage: Usage) -> dict[str, Any]:
    """The finish reason and token usage, as OIP's `details` and V2's response parameters."""
    return {
        "finish_reason": finish_reason.value,
        "prompt_tokens": usage.prompt_tokens,
        "generated_tokens": usage.generated_tokens,
        "cached_tokens": usage.cached_tokens,  # prompt tokens taken from the prefix cache
        # speculative decoding: draft tokens verified, and of them accepted
        "draft_tokens": usage.draft_tokens,
        "accepted_draft_tokens": usage.accepted_draft_tokens,
    }


def usage_parameters(completions: list[Completion]) -> dict[str, Any]:
    """Several prompts' usage summed, their finish reasons joined by commas."""
    return {
        "prompt_tokens": sum(c.usage.prompt_tokens for c in completions),
        "generated_tokens": sum(c.usage.generated_tokens for c in completions),
        "cached_tokens": sum(c.usage.cached_tokens for c in completions),
        "draft_tokens": sum(c.usage.draft_tokens for c in completions),
        "accepted_draft_tokens": sum(c.usage.accepted_draft_tokens for c in completions),
        "finish_reason": ",".join(c.finish_reason.value for c in completions),
    }


def text_response(
    request: InferRequest,
    model_name: str,
    fallback_id: str,
    texts: list[str],
    parameters: dict[str, Any] | None,
) -> InferResponse:
    """`text_output` BYTES [len(texts)]: JSON strings over REST, raw BYTES over gRPC
    (tritonclient with numpy 2 cannot read BYTES from `contents`)."""
    output = InferOutput(name=TEXT_OUTPUT, shape=[len(texts)], datatype="BYTES")
    if request.from_grpc:
        output.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=np.object_))
    else:
        output.data = texts
    return InferResponse(
        response_id=request.id or fallback_id,
        model_name=model_name,
        infer_outputs=[output],
        from_grpc=request.from_grpc,
        parameters=parameters,
        use_binary_outputs=request.from_grpc,
    )
