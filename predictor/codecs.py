"""V2 (Open Inference Protocol) requests and responses <-> our types, for REST and gRPC alike.

Over REST, parameters arrive as a dict of JSON values; over gRPC as a protobuf map of
InferParameter. `plain_parameters` turns both into one dict before anything reads them.
"""

from __future__ import annotations

import json
import math
import struct
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
from google.protobuf.unknown_fields import UnknownFieldSet
from kserve import InferOutput, InferRequest, InferResponse

from predictor.errors import InvalidRequest
from predictor.types import (
    Completion,
    FinishReason,
    GenerateRequest,
    SamplingParams,
    TokenEvent,
    Usage,
)

TEXT_INPUT = "text_input"
TEXT_OUTPUT = "text_output"
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
MAX_ID_LENGTH = 256  # characters of a request id (REST, gRPC, ModelStreamInfer alike)
DEFAULT_MAX_JSON_DEPTH = 32


def check_plain(value: Any, max_depth: int = DEFAULT_MAX_JSON_DEPTH, where: str = "body") -> None:
    """Refuse what JSON parsers let through but nothing downstream can handle: non-finite
    numbers (NaN, Infinity, 1e999), lone surrogates (a "\\ud800" escape) in any string or key,
    and nesting deeper than `max_depth`. Iterative: a deep value cannot exhaust the stack."""
    for item in _containers(value, max_depth, where) if isinstance(value, dict | list) else ():
        for key in item if isinstance(item, dict) else ():
            _check_string(key, where)
        for inner in item.values() if isinstance(item, dict) else item:
            _check_scalar(inner, where)
    _check_scalar(value, where)


def check_depth(value: Any, max_depth: int = DEFAULT_MAX_JSON_DEPTH, where: str = "body") -> None:
    """`check_plain`'s nesting check alone, for values from a parser (orjson) that already
    refuses non-finite numbers and lone surrogates: the strings are not walked."""
    if isinstance(value, dict | list):
        for _ in _containers(value, max_depth, where):
            pass


def _containers(value: Any, max_depth: int, where: str) -> Iterator[Any]:
    """Every dict and list within `value` (itself one), refusing nesting past `max_depth`."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > max_depth:
            raise InvalidRequest(f"the {where} is nested deeper than {max_depth} levels")
        yield item
        inner = item.values() if isinstance(item, dict) else item
        stack.extend((x, depth + 1) for x in inner if isinstance(x, dict | list))


def _check_scalar(item: Any, where: str) -> None:
    if isinstance(item, str):
        _check_string(item, where)
    elif isinstance(item, float) and not math.isfinite(item):
        raise InvalidRequest(f"the {where} holds a non-finite number ({item})")


def _check_string(text: str, where: str) -> None:
    if text.isascii():  # O(1) in CPython (a flag of the string): no surrogate possible
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequest(f"the {where} holds a lone surrogate (invalid Unicode)") from exc


def check_id(request_id: Any) -> None:
    if isinstance(request_id, str) and len(request_id) > MAX_ID_LENGTH:
        raise InvalidRequest(f"'id' is {len(request_id)} characters; at most {MAX_ID_LENGTH}")


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


def _integer(params: Mapping[str, Any], name: str, default: int | None) -> int | None:
    value = params.get(name)
    if value is None:  # absent, or JSON null: the default
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or int(value) != value:
        raise InvalidRequest(f"parameter '{name}' must be an integer, got {value!r}")
    return int(value)


def _number(params: Mapping[str, Any], name: str, default: float) -> float:
    value = params.get(name)
    if value is None:  # absent, or JSON null: the default
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequest(f"parameter '{name}' must be a number, got {value!r}")
    if value != value or value in (float("inf"), float("-inf")):
        raise InvalidRequest(f"parameter '{name}' must be finite")
    return float(value)


def _stop(params: Mapping[str, Any]) -> tuple[str, ...]:
    value = params.get("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        # gRPC maps carry no lists: a JSON array in a string parameter is accepted too
        if value.startswith("["):
            try:
                value = json.loads(value)
            except (ValueError, RecursionError) as exc:
                raise InvalidRequest("parameter 'stop' is not a valid JSON array") from exc
        else:
            value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise InvalidRequest("parameter 'stop' must be a string or a list of strings")
    if len(value) > MAX_STOP_STRINGS:
        raise InvalidRequest(
            f"parameter 'stop' has {len(value)} strings; at most {MAX_STOP_STRINGS}"
        )
    if any(len(s) > MAX_STOP_LENGTH for s in value):
        raise InvalidRequest(f"each stop string must be at most {MAX_STOP_LENGTH} characters")
    if any(s == "" for s in value):
        raise InvalidRequest("stop strings must not be empty")
    return tuple(value)


def sampling_from_parameters(params: Mapping[str, Any], default_max_tokens: int) -> SamplingParams:
    """Check each sampling parameter's type and range (the token cap is the engine's check)."""
    max_tokens = _integer(params, "max_tokens", default_max_tokens)
    assert max_tokens is not None
    if max_tokens < 1:
        raise InvalidRequest(f"parameter 'max_tokens' must be at least 1, got {max_tokens}")
    temperature = _number(params, "temperature", 0.0)
    if not 0.0 <= temperature <= 100.0:
        raise InvalidRequest("parameter 'temperature' must be between 0 and 100")
    top_p = _number(params, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise InvalidRequest("parameter 'top_p' must be in (0, 1]")
    top_k = _integer(params, "top_k", 0)
    assert top_k is not None
    if top_k < 0:
        raise InvalidRequest("parameter 'top_k' must be 0 (off) or positive")
    seed = _integer(params, "seed", None)
    if seed is not None and not 0 <= seed < 2**63:
        raise InvalidRequest("parameter 'seed' must be a non-negative 64-bit integer")
    ignore_eos = _boolean(params, "ignore_eos", False)
    min_tokens = _integer(params, "min_tokens", 0)
    assert min_tokens is not None
    if not 0 <= min_tokens <= max_tokens:
        raise InvalidRequest(
            f"parameter 'min_tokens' must be between 0 and max_tokens ({max_tokens}), "
            f"got {min_tokens}"
        )
    return SamplingParams(
        max_tokens,
        temperature,
        top_p,
        top_k,
        seed,
        _stop(params),
        ignore_eos=ignore_eos,
        min_tokens=min_tokens,
    )


def _boolean(params: Mapping[str, Any], name: str, default: bool) -> bool:
    value = params.get(name)
    if value is None:  # absent, or JSON null: the default
        return default
    if not isinstance(value, bool):
        raise InvalidRequest(f"parameter '{name}' must be a boolean, got {value!r}")
    return value


def request_options(params: Mapping[str, Any]) -> tuple[bool, float | None]:
    """The non-sampling options: chat (apply the chat template) and timeout (seconds)."""
    chat = _boolean(params, "chat", False)
    timeout = params.get("timeout")
    if timeout is not None:
        timeout = _number(params, "timeout", 0.0)
        if timeout <= 0:
            raise InvalidRequest("parameter 'timeout' must be a positive number of seconds")
    return chat, timeout


def cache_salt(params: Mapping[str, Any]) -> str | None:
    """vLLM's cache_salt: requests share cached prompt blocks only with the same salt."""
    value = params.get("cache_salt")
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > MAX_ID_LENGTH:
        raise InvalidRequest(
            f"parameter 'cache_salt' must be a non-empty string of at most {MAX_ID_LENGTH} "
            "characters"
        )
    return value


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidRequest(f"{TEXT_INPUT} is not valid UTF-8: {exc}") from exc
    if isinstance(value, str):
        _check_string(value, TEXT_INPUT)
        return value
    raise InvalidRequest(f"{TEXT_INPUT} elements must be strings")


def decode_infer_request(
    request: InferRequest, default_max_tokens: int, params: Mapping[str, Any] | None = None
) -> list[GenerateRequest]:
    """One GenerateRequest per element of the BYTES input `text_input`.

    `params`: the parameters to read (default: the request's own). Other input tensors are not
    looked at here: the adapters decode with `triton_codec`, which reads or refuses each one.
    """
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
    prompts = [_text(v) for v in values]
    if any(not p for p in prompts):
        raise InvalidRequest(f"input '{TEXT_INPUT}' must not contain empty strings")
    if params is None:
        params = plain_parameters(request.parameters)
    check_id(request.id)
    check_plain(params, where="parameters")
    sampling = sampling_from_parameters(params, default_max_tokens)
    chat, timeout = request_options(params)
    base = request.id or uuid.uuid4().hex
    return [
        GenerateRequest(
            base if len(prompts) == 1 else f"{base}-{i}",
            p,
            sampling,
            chat,
            timeout,
            cache_salt=cache_salt(params),
        )
        for i, p in enumerate(prompts)
    ]


def encode_infer_response(
    request: InferRequest, model_name: str, completions: list[Completion]
) -> InferResponse:
    """`text_output` BYTES [N]; usage and finish reasons in the response parameters.

    gRPC answers carry BYTES in raw_output_contents (tritonclient with numpy 2 cannot read
    BYTES from `contents`).
    """
    parameters = {
        "prompt_tokens": sum(c.usage.prompt_tokens for c in completions),
        "generated_tokens": sum(c.usage.generated_tokens for c in completions),
        "cached_tokens": sum(c.usage.cached_tokens for c in completions),
        "finish_reason": ",".join(c.finish_reason.value for c in completions),
    }
    texts = [c.text for c in completions]
    return _text_response(request, model_name, completions[0].request_id, texts, parameters)


def _text_response(
    request: InferRequest,
    model_name: str,
    fallback_id: str,
    texts: list[str],
    parameters: dict[str, Any] | None,
) -> InferResponse:
    """`text_output` BYTES [len(texts)]: JSON strings over REST, raw BYTES over gRPC."""
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


# -- OIP generate extension (JSON) ------------------------------------------------------------


def decode_generate_request(body: Any, default_max_tokens: int) -> GenerateRequest:
    """`{"id", "text_input", "parameters": {...}}` -> GenerateRequest."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    prompt = body.get(TEXT_INPUT)
    if not isinstance(prompt, str):
        raise InvalidRequest(f"'{TEXT_INPUT}' must be a string")
    if not prompt:
        raise InvalidRequest(f"'{TEXT_INPUT}' must not be empty")
    params = body.get("parameters") or {}
    if not isinstance(params, dict):
        raise InvalidRequest("'parameters' must be a JSON object")
    request_id = body.get("id")
    if request_id is not None and not isinstance(request_id, str | int):
        raise InvalidRequest("'id' must be a string")
    check_id(request_id)
    check_plain(body)
    sampling = sampling_from_parameters(params, default_max_tokens)
    chat, timeout = request_options(params)
    rid = str(request_id) if request_id is not None else uuid.uuid4().hex
    return GenerateRequest(rid, prompt, sampling, chat, timeout, cache_salt=cache_salt(params))


def _details(finish_reason: FinishReason, usage: Usage) -> dict[str, Any]:
    return {
        "finish_reason": finish_reason.value,
        "prompt_tokens": usage.prompt_tokens,
        "generated_tokens": usage.generated_tokens,
        "cached_tokens": usage.cached_tokens,  # prompt tokens taken from the prefix cache
    }


def generate_response(model_name: str, completion: Completion) -> dict[str, Any]:
    return {
        "id": completion.request_id,
        "model_name": model_name,
        "model_version": None,
        "text_output": completion.text,
        "details": _details(completion.finish_reason, completion.usage),
    }


def generate_stream_event(model_name: str, event: TokenEvent) -> dict[str, Any]:
    """One SSE event: the new text only; the last event adds finish_reason and usage."""
    out: dict[str, Any] = {
        "id": event.request_id,
        "model_name": model_name,
        "model_version": None,
        "text_output": event.text,
    }
    if event.final and event.finish_reason is not None and event.usage is not None:
        out["finish_reason"] = event.finish_reason.value
        out["details"] = _details(event.finish_reason, event.usage)
    return out


def infer_stream_response(
    request: InferRequest, model_name: str, event: TokenEvent
) -> InferResponse:
    """A V2 response carrying one text delta; the last one has finish_reason and usage."""
    parameters = None
    if event.final and event.finish_reason is not None and event.usage is not None:
        parameters = _details(event.finish_reason, event.usage)
    return _text_response(request, model_name, event.request_id, [event.text], parameters)
