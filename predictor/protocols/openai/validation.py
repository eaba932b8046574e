"""pydantic's validation errors said as OpenAI does: the field to blame (`param`, as
messages[2].content), and where a union's alternatives all failed, the one meant."""

from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError


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
