"""The OIP generate extension: `/generate` and `/generate_stream` bodies <-> our types.

`{"id", "text_input", "parameters": {...}}`, with Triton's conventions: the sampling keys at the
top level of the body as well as in `parameters` (a key in both is ambiguous: 400), `stream`,
TensorRT-LLM's `stop_words` (an alias of `stop`) and an empty `bad_words`. Any other top-level
key is refused, naming it; unknown keys inside `parameters` stay accepted (clients put their own
there). The answer is `{"id", "model_name", "model_version", "text_output", "details"}`; each
streamed event holds only the new text, the last adds `finish_reason` and `details`.
"""

from __future__ import annotations

import uuid
from typing import Any

from predictor.errors import InvalidRequest
from predictor.protocols import parameters
from predictor.protocols.limits import Limits, check_id
from predictor.protocols.v2 import TEXT_INPUT, details
from predictor.types import Completion, GenerateRequest, TokenEvent

PROTOCOL = "generate"
STREAM = "stream"
FIELDS = ("id", TEXT_INPUT, "parameters")


def top_level_keys() -> tuple[str, ...]:
    """The keys a body may hold beside FIELDS: every generate parameter, bad_words, stream."""
    return (*parameters.names(PROTOCOL), "bad_words", STREAM)


def decode_generate_request(
    body: Any, limits: Limits, streaming: bool
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
    allowed = top_level_keys()
    top = {k: v for k, v in body.items() if k not in FIELDS}
    for key in top:
        if key not in allowed:
            raise InvalidRequest(
                f"unknown key '{key}'; the body takes {', '.join(FIELDS)} and {', '.join(allowed)}"
            )
        if key in params:
            raise InvalidRequest(
                f"'{key}' is given both at the top level and in 'parameters': the request is "
                "ambiguous"
            )
    merged = {**params, **top}
    if merged.pop("bad_words", None) not in (None, "", []):
        raise InvalidRequest("'bad_words' is not supported (only an empty one is accepted)")
    stream = merged.pop(STREAM, None)
    if stream is not None and not isinstance(stream, bool):
        raise InvalidRequest(f"'stream' must be a boolean, got {stream!r}")
    if stream and not streaming:
        raise InvalidRequest("'stream': true needs generate_stream; /generate answers once")
    prompt = body.get(TEXT_INPUT)
    if not isinstance(prompt, str):
        raise InvalidRequest(f"'{TEXT_INPUT}' must be a string")
    if not prompt:
        raise InvalidRequest(f"'{TEXT_INPUT}' must not be empty")
    request_id = body.get("id")
    if request_id is not None and not isinstance(request_id, str | int):
        raise InvalidRequest("'id' must be a string")
    check_id(request_id)
    values = parameters.read(
        merged, PROTOCOL, limits.default_max_tokens, max_depth=limits.max_json_depth
    )
    rid = str(request_id) if request_id is not None else uuid.uuid4().hex
    request = GenerateRequest(
        rid, prompt, values.sampling, values.chat, values.timeout, cache_salt=values.cache_salt
    )
    return request, streaming if stream is None else stream


def generate_response(model_name: str, completion: Completion) -> dict[str, Any]:
    return {
        "id": completion.request_id,
        "model_name": model_name,
        "model_version": None,
        "text_output": completion.text,
        "details": details(completion.finish_reason, completion.usage),
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
        out["details"] = details(event.finish_reason, event.usage)
    return out
