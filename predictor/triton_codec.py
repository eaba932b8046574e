"""Triton's request conventions, on top of the V2 and generate codecs in `codecs`.

- `/generate`, `/generate_stream`: sampling keys at the top level of the body, as Triton's own
  examples write them, as well as in `parameters` (a key in both is ambiguous: 400); `stream`;
  TensorRT-LLM's `stop_words` (an alias of `stop`) and an empty `bad_words`.
- V2 infer, `infer_stream`, ModelStreamInfer: the vLLM backend's optional inputs
  (`sampling_parameters` JSON, `stream`, `exclude_input_in_output`, `return_finish_reason`,
  `return_num_input_tokens`, `return_num_output_tokens`) and outputs, and one-element input
  tensors named like sampling parameters, as the TensorRT-LLM backend takes them.
- Anything else is refused, naming it: an unknown input tensor, output or top-level key. Unknown
  keys inside `parameters` stay accepted (clients put their own there).

Semantics follow the vLLM backend (triton-inference-server/vllm_backend, src/utils/request.py):
`stream` false answers once with the whole text and, unless `exclude_input_in_output` is true,
with the prompt in front of it; `exclude_input_in_output` false while streaming is refused;
values in `sampling_parameters` may be strings ("0.1"), converted as the backend converts them.
Where `stream` is not sent, each route keeps its own way (infer answers once, infer_stream and
ModelStreamInfer stream) and the prompt is not repeated.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kserve import InferInput, InferRequest

from predictor import codecs
from predictor.errors import InvalidRequest
from predictor.types import GenerateRequest

# The keys codecs.sampling_from_parameters and codecs.request_options read.
_INTEGER_KEYS = ("max_tokens", "top_k", "seed", "min_tokens")
_NUMBER_KEYS = ("temperature", "top_p", "timeout")
_BOOLEAN_KEYS = ("ignore_eos", "chat")
PARAMETER_KEYS = (*_INTEGER_KEYS, *_NUMBER_KEYS, *_BOOLEAN_KEYS, "stop", "cache_salt")

# -- tensors: what the model configuration lists and the decoder takes --------------------------


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str  # V2 datatype
    dims: tuple[int, ...]
    optional: bool = True


SAMPLING_PARAMETERS = "sampling_parameters"
STREAM = "stream"
EXCLUDE_INPUT = "exclude_input_in_output"
FINISH_REASON, NUM_INPUT_TOKENS, NUM_OUTPUT_TOKENS = (
    "finish_reason",
    "num_input_tokens",
    "num_output_tokens",
)
_RETURN_FLAGS = {f"return_{name}": name for name in (FINISH_REASON, NUM_INPUT_TOKENS,
                                                       NUM_OUTPUT_TOKENS)}  # fmt: skip
# input tensor -> the parameter it sets (TensorRT-LLM's names map onto ours)
_PARAMETER_TENSORS = {
    "max_tokens": ("max_tokens", "INT32"),
    "temperature": ("temperature", "FP32"),
    "top_p": ("top_p", "FP32"),
    "top_k": ("top_k", "INT32"),
    "seed": ("seed", "UINT64"),
    "random_seed": ("seed", "UINT64"),
    "min_tokens": ("min_tokens", "INT32"),
    "min_length": ("min_tokens", "INT32"),
    "ignore_eos": ("ignore_eos", "BOOL"),
}
_STOP_TENSORS = ("stop", "stop_words")

INPUTS: tuple[TensorSpec, ...] = (
    TensorSpec(codecs.TEXT_INPUT, "BYTES", (-1,), optional=False),
    TensorSpec(STREAM, "BOOL", (1,)),
    TensorSpec(SAMPLING_PARAMETERS, "BYTES", (1,)),
    TensorSpec(EXCLUDE_INPUT, "BOOL", (1,)),
    *(TensorSpec(flag, "BOOL", (1,)) for flag in _RETURN_FLAGS),
    *(TensorSpec(name, datatype, (1,)) for name, (_, datatype) in _PARAMETER_TENSORS.items()),
    *(TensorSpec(name, "BYTES", (-1,)) for name in _STOP_TENSORS),
)
OUTPUTS: tuple[TensorSpec, ...] = (
    TensorSpec(codecs.TEXT_OUTPUT, "BYTES", (-1,), optional=False),
    TensorSpec(FINISH_REASON, "BYTES", (-1,)),
    TensorSpec(NUM_INPUT_TOKENS, "UINT32", (1,)),
    TensorSpec(NUM_OUTPUT_TOKENS, "UINT32", (-1,)),
)
_INPUT_NAMES = {spec.name for spec in INPUTS}
_OUTPUT_NAMES = {spec.name for spec in OUTPUTS}
_INTEGER_TYPES = {"INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32", "UINT64"}
_FLOAT_TYPES = {"FP16", "FP32", "FP64"}


# -- parameters from several places -------------------------------------------------------------


def _coerce(key: str, value: Any) -> Any:
    """A string value for a numeric or boolean key, as the vLLM backend converts it ("0.1")."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if key in _INTEGER_KEYS and re.fullmatch(r"[+-]?\d+", text):
        return int(text)
    if key in _NUMBER_KEYS:
        try:
            return float(text)
        except ValueError:
            return value
    if key in _BOOLEAN_KEYS and text.lower() in ("true", "false"):
        return text.lower() == "true"
    return value


def merge_parameters(sources: list[tuple[str, Mapping[str, Any]]]) -> dict[str, Any]:
    """One dict from several sources; a key given twice with different values is ambiguous."""
    merged: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for where, params in sources:
        for key, value in params.items():
            if key in merged and _coerce(key, merged[key]) != _coerce(key, value):
                raise InvalidRequest(
                    f"'{key}' is given in {origin[key]} and in {where} with different values: "
                    "the request is ambiguous"
                )
            if key not in merged:
                merged[key], origin[key] = value, where
    return merged


# -- OIP generate: top-level keys -----------------------------------------------------------------

_GENERATE_FIELDS = ("id", codecs.TEXT_INPUT, "parameters")
GENERATE_KEYS = (*PARAMETER_KEYS, "stop_words", "bad_words", STREAM)


def decode_generate_request(
    body: Any, default_max_tokens: int, streaming: bool
) -> tuple[GenerateRequest, bool]:
    """The request, and whether to stream it (`stream`, else the route's way).

    `streaming` is the route's way: False for /generate (which cannot stream: `stream` true is
    refused), True for /generate_stream (where `stream` false sends one event).
    """
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    params = body.get("parameters") or {}
    if not isinstance(params, dict):
        raise InvalidRequest("'parameters' must be a JSON object")
    top = {k: v for k, v in body.items() if k not in _GENERATE_FIELDS}
    for key in top:
        if key not in GENERATE_KEYS:
            raise InvalidRequest(
                f"unknown key '{key}'; the body takes {', '.join(_GENERATE_FIELDS)} and "
                f"{', '.join(GENERATE_KEYS)}"
            )
        if key in params:
            raise InvalidRequest(
                f"'{key}' is given both at the top level and in 'parameters': the request is "
                "ambiguous"
            )
    merged = {**params, **top}
    _alias_stop_words(merged)
    if merged.pop("bad_words", None) not in (None, "", []):
        raise InvalidRequest("'bad_words' is not supported (only an empty one is accepted)")
    stream = merged.pop(STREAM, None)
    if stream is not None and not isinstance(stream, bool):
        raise InvalidRequest(f"'stream' must be a boolean, got {stream!r}")
    if stream and not streaming:
        raise InvalidRequest("'stream': true needs generate_stream; /generate answers once")
    plain = {k: body[k] for k in ("id", codecs.TEXT_INPUT) if k in body}
    request = codecs.decode_generate_request({**plain, "parameters": merged}, default_max_tokens)
    return request, streaming if stream is None else stream


def _alias_stop_words(params: dict[str, Any]) -> None:
    """TensorRT-LLM's `stop_words` is our `stop`; an empty one means none."""
    if "stop_words" not in params:
        return
    words = params.pop("stop_words")
    if isinstance(words, list):
        words = [w for w in words if w != ""]
    if words in (None, "", []):
        return
    if "stop" in params:
        raise InvalidRequest("'stop' and 'stop_words' are both given: the request is ambiguous")
    params["stop"] = words


# -- V2 infer: optional tensors -----------------------------------------------------------------


@dataclass(frozen=True)
class V2Request:
    """What a V2 request asks: one GenerateRequest per prompt, and how to answer."""

    requests: list[GenerateRequest]
    stream: bool
    include_prompt: bool  # the prompt leads the text (the vLLM backend's non-streamed default)
    outputs: tuple[str, ...]  # the output tensors to send, in order


def decode_infer_request(
    request: InferRequest, default_max_tokens: int, streaming: bool
) -> V2Request:
    """Every input tensor is read or refused. `streaming` is the route's way (see above)."""
    tensors: dict[str, InferInput] = {}
    for tensor in request.inputs:
        if tensor.name not in _INPUT_NAMES:
            raise InvalidRequest(
                f"unexpected inference input '{tensor.name}'; the model takes "
                f"{', '.join(sorted(_INPUT_NAMES))}"
            )
        if tensor.name in tensors:
            raise InvalidRequest(f"input '{tensor.name}' is given twice")
        tensors[tensor.name] = tensor
    flags = {name: _scalar(tensors[name], "BOOL") for name in (STREAM, EXCLUDE_INPUT,
             *_RETURN_FLAGS) if name in tensors}  # fmt: skip
    sources: list[tuple[str, Mapping[str, Any]]] = [
        ("parameters", codecs.plain_parameters(request.parameters))
    ]
    if SAMPLING_PARAMETERS in tensors:
        sources.append((f"input '{SAMPLING_PARAMETERS}'", _sampling_parameters(tensors)))
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
    requests = codecs.decode_infer_request(
        request, default_max_tokens, {k: _coerce(k, v) for k, v in params.items()}
    )
    return V2Request(requests, streams, include_prompt, _outputs(request, flags))


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


def _text(value: Any, name: str) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidRequest(f"input '{name}' is not valid UTF-8") from exc
    if isinstance(value, str):
        return value
    raise InvalidRequest(f"input '{name}' must hold strings")


def _sampling_parameters(tensors: Mapping[str, InferInput]) -> dict[str, Any]:
    raw = _text(_scalar(tensors[SAMPLING_PARAMETERS], "BYTES"), SAMPLING_PARAMETERS)
    try:
        params = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise InvalidRequest(f"input '{SAMPLING_PARAMETERS}' is not valid JSON: {exc}") from exc
    if not isinstance(params, dict):
        raise InvalidRequest(f"input '{SAMPLING_PARAMETERS}' must hold a JSON object")
    codecs.check_plain(params, where=f"input '{SAMPLING_PARAMETERS}'")
    for key in params:
        if key not in PARAMETER_KEYS:
            raise InvalidRequest(
                f"'{key}' in input '{SAMPLING_PARAMETERS}' is not supported; it takes "
                f"{', '.join(PARAMETER_KEYS)}"
            )
    return {k: _coerce(k, v) for k, v in params.items() if v is not None}


def _parameter_tensors(tensors: Mapping[str, InferInput]) -> list[tuple[str, dict[str, Any]]]:
    """One source per tensor, so that two tensors setting one parameter are compared too."""
    out: list[tuple[str, dict[str, Any]]] = []
    for name, (key, _) in _PARAMETER_TENSORS.items():
        if name not in tensors:
            continue
        if key in _INTEGER_KEYS:
            value = _scalar(tensors[name], *_INTEGER_TYPES)
        elif key in _NUMBER_KEYS:
            value = _scalar(tensors[name], *_FLOAT_TYPES, *_INTEGER_TYPES)
        else:
            value = bool(_scalar(tensors[name], "BOOL"))
        out.append((f"input '{name}'", {key: value}))
    for name in _STOP_TENSORS:
        if name in tensors:
            if tensors[name].datatype != "BYTES":
                raise InvalidRequest(f"input '{name}' must have datatype BYTES")
            words = [_text(v, name) for v in _values(tensors[name])]
            if name == "stop_words":  # TensorRT-LLM sends "" for none
                words = [w for w in words if w]
            if words:
                out.append((f"input '{name}'", {"stop": words}))
    return out


def _outputs(request: InferRequest, flags: Mapping[str, Any]) -> tuple[str, ...]:
    wanted = [out for flag, out in _RETURN_FLAGS.items() if flags.get(flag)]
    requested = [o.name for o in request.request_outputs or []]
    for name in requested:
        if name not in _OUTPUT_NAMES:
            raise InvalidRequest(
                f"unexpected inference output '{name}'; the model has "
                f"{', '.join(sorted(_OUTPUT_NAMES))}"
            )
    if requested:  # asking for an optional output by name asks for it
        return tuple(requested)
    return (codecs.TEXT_OUTPUT, *wanted)
