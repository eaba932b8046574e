"""V2 infer requests (`/infer`, `infer_stream`, ModelStreamInfer) as Triton's clients send them.

Beside `text_input` and the request `parameters`, the vLLM backend's optional inputs
(`sampling_parameters` JSON, `stream`, `exclude_input_in_output`, `return_finish_reason`,
`return_num_input_tokens`, `return_num_output_tokens`) and one-element input tensors named like
parameters (TensorRT-LLM's). Anything else is refused, naming it: an unknown input tensor or
output, an unknown key in `sampling_parameters`. Unknown keys in `parameters` stay accepted
(clients put their own there).

Semantics follow the vLLM backend (triton-inference-server/vllm_backend, src/utils/request.py):
`stream` false answers once with the whole text and, unless `exclude_input_in_output` is true,
with the prompt in front of it; `exclude_input_in_output` false while streaming is refused;
values may be strings ("0.1"), converted as the backend converts them. Where `stream` is not
sent, each route keeps its own way (infer answers once, infer_stream and ModelStreamInfer
stream) and the prompt is not repeated.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kserve import InferInput, InferRequest

from predictor.errors import InvalidRequest
from predictor.protocols import parameters
from predictor.protocols.limits import Limits, check_id, check_plain
from predictor.protocols.triton.tensors import (
    EXCLUDE_INPUT,
    FLOAT_TYPES,
    INPUT_NAMES,
    INTEGER_TYPES,
    OUTPUT_NAMES,
    PARAMETER_TENSORS,
    RETURN_FLAGS,
    SAMPLING_PARAMETERS,
    STREAM,
)
from predictor.protocols.v2 import TEXT_OUTPUT, plain_parameters, prompts, text_of
from predictor.types import GenerateRequest

PROTOCOL = "v2"  # V2 parameters; sampling_parameters takes the "triton" rows


@dataclass(frozen=True)
class V2Request:
    """What a V2 request asks: one GenerateRequest per prompt, and how to answer."""

    requests: list[GenerateRequest]
    stream: bool
    include_prompt: bool  # the prompt leads the text (the vLLM backend's non-streamed default)
    outputs: tuple[str, ...]  # the output tensors to send, in order


def decode_infer_request(request: InferRequest, limits: Limits, streaming: bool) -> V2Request:
    """Every input tensor is read or refused. `streaming` is the route's way (see above)."""
    tensors: dict[str, InferInput] = {}
    for tensor in request.inputs:
        if tensor.name not in INPUT_NAMES:
            raise InvalidRequest(
                f"unexpected inference input '{tensor.name}'; the model takes "
                f"{', '.join(sorted(INPUT_NAMES))}"
            )
        if tensor.name in tensors:
            raise InvalidRequest(f"input '{tensor.name}' is given twice")
        tensors[tensor.name] = tensor
    flags = {
        name: _scalar(tensors[name], "BOOL")
        for name in (STREAM, EXCLUDE_INPUT, *RETURN_FLAGS)
        if name in tensors
    }
    texts = prompts(request)
    sources: list[tuple[str, Mapping[str, Any]]] = [
        ("parameters", plain_parameters(request.parameters))
    ]
    if SAMPLING_PARAMETERS in tensors:
        sampling = _sampling_parameters(tensors, limits.max_json_depth)
        sources.append((f"input '{SAMPLING_PARAMETERS}'", sampling))
    sources.extend(_parameter_tensors(tensors))
    params = merge_parameters(sources)
    stream = flags.get(STREAM)
    if stream and not streaming:
        raise InvalidRequest(
            "input 'stream' is true: infer answers once; use infer_stream or ModelStreamInfer"
        )
    streams = streaming if stream is None else bool(stream)
    exclude = flags.get(EXCLUDE_INPUT)
    include_prompt = stream is False if exclude is None else not exclude
    if include_prompt and streams:
        raise InvalidRequest(f"input '{EXCLUDE_INPUT}' false is not allowed when streaming")
    check_id(request.id)
    values = parameters.read(
        params, PROTOCOL, limits.default_max_tokens, coerce=True, max_depth=limits.max_json_depth
    )
    base = request.id or uuid.uuid4().hex
    requests = [
        GenerateRequest(
            base if len(texts) == 1 else f"{base}-{i}",
            text,
            values.sampling,
            values.chat,
            values.timeout,
            cache_salt=values.cache_salt,
        )
        for i, text in enumerate(texts)
    ]
    return V2Request(requests, streams, include_prompt, _outputs(request, flags))


def merge_parameters(sources: list[tuple[str, Mapping[str, Any]]]) -> dict[str, Any]:
    """One dict from several sources; a key given twice with different values is ambiguous."""
    merged: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for where, params in sources:
        for key, value in params.items():
            if key in merged and parameters.coerced(
                key, merged[key], PROTOCOL
            ) != parameters.coerced(key, value, PROTOCOL):
                raise InvalidRequest(
                    f"'{key}' is given in {origin[key]} and in {where} with different values: "
                    "the request is ambiguous"
                )
            if key not in merged:
                merged[key], origin[key] = value, where
    return merged


def _scalar(tensor: InferInput, *datatypes: str) -> Any:
    if tensor.datatype not in datatypes:
        raise InvalidRequest(
            f"input '{tensor.name}' must have datatype {' or '.join(sorted(datatypes))}, "
            f"got {tensor.datatype}"
        )
    values = _values(tensor)
    if len(values) != 1:
        raise InvalidRequest(f"input '{tensor.name}' must hold one value, got {len(values)}")
    return values[0]


def _values(tensor: InferInput) -> list[Any]:
    try:
        return list(tensor.as_numpy().reshape(-1).tolist())
    except Exception as exc:
        raise InvalidRequest(f"input '{tensor.name}' cannot be read: {exc}") from exc


def _sampling_parameters(tensors: Mapping[str, InferInput], max_depth: int) -> dict[str, Any]:
    raw = text_of(_scalar(tensors[SAMPLING_PARAMETERS], "BYTES"), SAMPLING_PARAMETERS)
    try:
        params = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise InvalidRequest(f"input '{SAMPLING_PARAMETERS}' is not valid JSON: {exc}") from exc
    if not isinstance(params, dict):
        raise InvalidRequest(f"input '{SAMPLING_PARAMETERS}' must hold a JSON object")
    check_plain(params, max_depth, where=f"input '{SAMPLING_PARAMETERS}'")
    known = parameters.names("triton")
    for key in params:
        if key not in known:
            raise InvalidRequest(
                f"'{key}' in input '{SAMPLING_PARAMETERS}' is not supported; it takes "
                f"{', '.join(known)}"
            )
    return {k: v for k, v in params.items() if v is not None}


def _parameter_tensors(tensors: Mapping[str, InferInput]) -> list[tuple[str, dict[str, Any]]]:
    """One source per tensor, so that two tensors setting one parameter are compared too."""
    out: list[tuple[str, dict[str, Any]]] = []
    for name, row in PARAMETER_TENSORS.items():
        if name not in tensors:
            continue
        tensor = tensors[name]
        value: Any
        if row.kind == "stop":
            if tensor.datatype != "BYTES":
                raise InvalidRequest(f"input '{name}' must have datatype BYTES")
            words = [text_of(v, name) for v in _values(tensor)]
            if name == "stop_words":  # TensorRT-LLM sends "" for none
                words = [w for w in words if w]
            if not words:
                continue
            value = words
        elif row.kind == "integer":
            value = _scalar(tensor, *INTEGER_TYPES)
        elif row.kind == "number":
            value = _scalar(tensor, *FLOAT_TYPES, *INTEGER_TYPES)
        else:
            value = bool(_scalar(tensor, "BOOL"))
        out.append((f"input '{name}'", {row.name: value}))
    return out


def _outputs(request: InferRequest, flags: Mapping[str, Any]) -> tuple[str, ...]:
    wanted = [out for flag, out in RETURN_FLAGS.items() if flags.get(flag)]
    requested = [o.name for o in request.request_outputs or []]
    for name in requested:
        if name not in OUTPUT_NAMES:
            raise InvalidRequest(
                f"unexpected inference output '{name}'; the model has "
                f"{', '.join(sorted(OUTPUT_NAMES))}"
            )
    if requested:  # asking for an optional output by name asks for it
        return tuple(requested)
    return (TEXT_OUTPUT, *wanted)
