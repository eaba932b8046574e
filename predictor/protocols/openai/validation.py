"""An OpenAI body validated: its sampling keys read by the parameter table
(`protocols/parameters.py`), the fields OpenAI defines that this server cannot honour refused by
name unless they hold a harmless value, the rest checked by the route's strict pydantic model;
and pydantic's errors said as OpenAI does: the field to blame (`param`, as messages[2].content),
and where a union's alternatives all failed, the one meant. Every OpenAI route's body goes through
`validate_body` (completions, chat: requests.py; Responses: responses_api.py)."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from predictor.errors import InvalidRequest
from predictor.protocols import parameters

PROTOCOL = "openai"
Body = TypeVar("Body", bound=BaseModel)


def _empty(value: Any) -> bool:
    return value in ([], {})


# OpenAI fields we cannot honour: refused by name unless they hold a value that asks for nothing.
_HARMLESS: dict[str, Callable[[Any], bool]] = {
    "functions": _empty,  # deprecated by OpenAI for tools, which we take
    "function_call": lambda v: v == "none",
    "echo": lambda v: v is False,  # chat's; completions take it (CompletionBody)
    "suffix": lambda v: v == "",
    "modalities": lambda v: v == ["text"],
    "store": lambda v: v is False,
    "service_tier": lambda v: v in ("auto", "default"),
    "audio": lambda v: False,
    "prediction": lambda v: False,
    "reasoning_effort": lambda v: False,
    "web_search_options": lambda v: False,
    "metadata": lambda v: False,
}


def _without_refused(body: Any, taken: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The body without nulls and harmless defaults; `taken`: keys the route's body model
    has, which _HARMLESS does not judge there."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    kept: dict[str, Any] = {}
    for key, value in body.items():
        if value is None:  # JSON null: the default, for every optional field
            continue
        harmless = None if key in taken else _HARMLESS.get(key)
        if harmless is not None:
            if not harmless(value):
                raise InvalidRequest(f"'{key}' is not supported by this server", param=key)
            continue
        kept[key] = value
    return kept


def validate_body(
    model: type[Body],
    body: Any,
    default_max_tokens: int,
    field_names: frozenset[str],
    renames: Mapping[str, str] | None = None,
    table_keys: frozenset[str] | None = None,
) -> tuple[Body, parameters.Values]:
    """A body's own fields (as `model`), and its sampling keys read by the parameter table.
    `field_names` are the names errors may give as `param`; `renames` keys that are another name
    of a table key on this route; `table_keys` the table's keys this route takes (None: all of
    OpenAI's; the rest are the body model's, which refuses what it does not know)."""
    kept = _without_refused(body, frozenset(model.model_fields))
    table = set(parameters.names(PROTOCOL) if table_keys is None else table_keys)
    sampling_keys = {k: v for k, v in kept.items() if k in table}
    for key, name in (renames or {}).items():
        if key in kept:
            if name in sampling_keys and sampling_keys[name] != kept[key]:
                raise InvalidRequest(f"'{name}' and '{key}' disagree", param=name)
            sampling_keys[name] = kept[key]
    rest = {k: v for k, v in kept.items() if k not in table and k not in (renames or {})}
    values = _read_renamed(sampling_keys, default_max_tokens, renames or {}, kept)
    try:
        return model.model_validate(rest), values
    except ValidationError as exc:
        error = telling_error(exc, field_names)
        loc = error["loc"]
        if error["type"] == "extra_forbidden":  # the unknown key itself is the last part
            param = param_of(loc, field_names | {str(loc[-1])})
            raise InvalidRequest(f"'{param}' is not supported by this server", param=param) from exc
        param = param_of(loc, field_names)
        message = f"'{param}': {error['msg']}" if param else str(error["msg"])
        raise InvalidRequest(message, param=param or None) from exc


def _read_renamed(
    sampling_keys: dict[str, Any],
    default_max_tokens: int,
    renames: Mapping[str, str],
    given: Mapping[str, Any],
) -> parameters.Values:
    """The table's read, its errors naming the key the client gave (a renamed key by the name
    it was sent under: Responses' max_output_tokens, not max_tokens)."""
    try:
        return parameters.read(sampling_keys, PROTOCOL, default_max_tokens)
    except InvalidRequest as exc:
        sent = next((k for k, n in renames.items() if n == exc.param and k in given), None)
        if sent is None or exc.param is None:
            raise
        message = str(exc).replace(f"'{exc.param}'", f"'{sent}'")
        raise InvalidRequest(message, param=sent) from exc


def param_of(loc: tuple[int | str, ...], names: frozenset[str]) -> str:
    """A pydantic error location as OpenAI names a param: messages[2].content."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in names:  # skips pydantic's union-member tags ('str', 'list[str]', ...)
            out += f".{part}" if out else part
    return out


def telling_error(exc: ValidationError, names: frozenset[str]) -> Any:
    """The error to show. Where a union's alternatives all failed, pydantic lists one error per
    alternative, and the first is often one the input was never meant as (a list of content
    parts told "Input should be a valid string"). The alternative that got furthest into the
    input (the longest location) is the one meant; where several errors tie, the field they
    share is named, with what is wrong at each place inside it."""
    errors = exc.errors()
    deepest = max(len(e["loc"]) for e in errors)
    tied = [e for e in errors if len(e["loc"]) == deepest]
    places = [param_of(e["loc"], names | _unknown_key(e)) for e in tied]
    if len(tied) == 1 or tied[0]["type"] == "extra_forbidden":
        return tied[0]
    shared = places[0]
    for place in places[1:]:
        # (an empty `shared`: the places share no field, as two missing top-level keys)
        while shared and not (place == shared or place.startswith((f"{shared}.", f"{shared}["))):
            shared = shared[: max(shared.rfind("."), shared.rfind("["), 0)]
    said: list[str] = []
    for place, error in zip(places, tied, strict=True):
        inside = place[len(shared) :].lstrip(".")
        msg = str(error["msg"])
        line = f"{inside}: {msg[0].lower()}{msg[1:]}" if inside else msg
        if line not in said:
            said.append(line)
    return {"loc": tuple(loc_of(shared)), "type": "union", "msg": " or ".join(said)}


def _unknown_key(error: Any) -> set[str]:
    """The key an extra_forbidden error is about (the last of its location), to name it."""
    return {str(error["loc"][-1])} if error["type"] == "extra_forbidden" else set()


def loc_of(param: str) -> list[str | int]:
    """A param (messages[0].content) back as a location param_of reads the same."""
    loc: list[str | int] = []
    for name, index in re.findall(r"([A-Za-z_][A-Za-z0-9_]*)|\[(\d+)\]", param):
        loc.append(name if name else int(index))
    return loc
