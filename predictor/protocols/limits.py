"""Checks of JSON values that no parser makes, with the limits passed in by the caller.

REST bodies are checked once, at the edge (`serving/rest/body.py`, with `--max-json-depth`);
the decoders check only what arrives by other ways: JSON inside a string (Triton's
`sampling_parameters`, a stop list over gRPC) and request ids.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from predictor.errors import InvalidRequest

MAX_ID_LENGTH = 256  # characters of a request id (REST, gRPC, ModelStreamInfer alike)


def check_plain(value: Any, max_depth: int, where: str = "body") -> None:
    """Refuse what JSON parsers let through but nothing downstream can handle: non-finite
    numbers (NaN, Infinity, 1e999), lone surrogates (a "\\ud800" escape) in any string or key,
    and nesting deeper than `max_depth`. Iterative: a deep value cannot exhaust the stack."""
    for item in _containers(value, max_depth, where) if isinstance(value, dict | list) else ():
        for key in item if isinstance(item, dict) else ():
            check_string(key, where)
        for inner in item.values() if isinstance(item, dict) else item:
            _check_scalar(inner, where)
    _check_scalar(value, where)


def check_depth(value: Any, max_depth: int, where: str = "body") -> None:
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
        check_string(item, where)
    elif isinstance(item, float) and not math.isfinite(item):
        raise InvalidRequest(f"the {where} holds a non-finite number ({item})")


def check_string(text: str, where: str) -> None:
    if text.isascii():  # O(1) in CPython (a flag of the string): no surrogate possible
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequest(f"the {where} holds a lone surrogate (invalid Unicode)") from exc


def json_text(text: str, max_depth: int, key: str, what: str = "a valid JSON object") -> Any:
    """A parameter given as JSON in a string (gRPC maps and Triton tensors carry no objects or
    lists), parsed and checked as the edge checks bodies."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise InvalidRequest(f"parameter '{key}' is not {what}", param=key) from exc
    try:
        check_plain(value, max_depth, where=f"parameter '{key}'")
    except InvalidRequest as exc:  # the parameter named, as OpenAI's `param`
        raise InvalidRequest(str(exc), param=key) from None
    return value


def check_id(request_id: Any) -> None:
    if isinstance(request_id, str) and len(request_id) > MAX_ID_LENGTH:
        raise InvalidRequest(f"'id' is {len(request_id)} characters; at most {MAX_ID_LENGTH}")


@dataclass(frozen=True)
class Limits:
    """What the decoders need of the server's configuration (from `config.Settings`)."""

    default_max_tokens: int  # a request's max_tokens when it names none
    max_json_depth: int  # nesting of JSON the decoders parse themselves
    tool_format: str = "hermes"  # the model's tool-call format (engine/tool_formats/ names)
    thinks: bool = False  # whether the model has a reasoning parser (engine/reasoning.py)


def check_thinking(asked: str | None, limits: Limits) -> None:
    """A field that asks the model to think (`asked`: its name, None where none does) is a 400
    naming it when the model does not think: it cannot be honoured. Fields that ask for no
    thinking pass on any model (the decoders do not name them)."""
    if asked is not None and not limits.thinks:
        raise InvalidRequest(
            f"'{asked}' asks the model to think, and this model does not (it has no reasoning "
            "parser: --reasoning-parser)",
            param=asked,
        )
