"""JSON schemas checked before xgrammar sees them: what it would not enforce, and what no value
satisfies, refused naming the keyword and where it stands (#/properties/a/...).

xgrammar 0.2.9 drops some keywords silently (a constraint beside a branch, `pattern` with a
length, a bound on a schema with no type) and serves some schemas no value satisfies as "" or
unconstrained text (an empty `anyOf` or `type` list, a `$ref` to another document). A schema
keyword outside `SCHEMA_KEYWORDS` is refused too: never unconstrained text.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, TypeGuard

from predictor.errors import InvalidRequest

# JSON schema keywords xgrammar 0.2.9 enforces (the rest are refused, not ignored)
SCHEMA_KEYWORDS = frozenset(
    "type properties required additionalProperties items prefixItems minItems maxItems enum"
    " const anyOf $ref $defs definitions pattern minLength maxLength minimum maximum"
    " exclusiveMinimum exclusiveMaximum title description default examples $schema $id"
    " $comment".split()
)
_DATA = frozenset({"enum", "const", "default", "examples"})  # values, not schemas
_NAMED = frozenset({"properties", "$defs", "definitions"})  # name -> schema maps
# A schema with one of these is that branch alone: xgrammar drops any constraint beside it.
_BRANCHES = ("$ref", "const", "enum", "anyOf")
# Constraints xgrammar enforces only on a schema with a `type`, or whose keywords make it an
# object or an array (`_SHAPES`); on any other it writes any JSON value and drops them.
_SCALAR = frozenset(
    "minLength maxLength pattern minimum maximum exclusiveMinimum exclusiveMaximum minItems"
    " maxItems".split()
)
_SHAPES = frozenset({"properties", "additionalProperties", "items", "prefixItems"})
_CONSTRAINTS = _SCALAR | _SHAPES | {"required"}


def _subschemas(schema: Any, path: str) -> Iterator[tuple[dict[str, Any], str]]:
    """(schema, where) for a JSON schema and every schema inside it."""
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            yield from _subschemas(item, f"{path}[{i}]")
        return
    if not isinstance(schema, dict):
        return
    yield schema, path
    for key, value in schema.items():
        if key in _DATA:
            continue
        if key in _NAMED and isinstance(value, dict):
            for name, sub in value.items():
                yield from _subschemas(sub, f"{path}/{key}/{name}")
        elif isinstance(value, dict | list):
            yield from _subschemas(value, f"{path}/{key}")


def _dropped(schema: dict[str, Any]) -> str | None:
    """Why xgrammar would not enforce one of this schema's own keywords, if it would not."""
    keys = set(schema)
    branches = [k for k in _BRANCHES if k in keys]
    beside = sorted(_CONSTRAINTS & keys)
    if branches and (len(branches) > 1 or beside):
        other = branches[1] if len(branches) > 1 else beside[0]
        return f"'{other}' beside '{branches[0]}' is not enforced (put it inside the branch)"
    if "pattern" in keys and {"minLength", "maxLength"} & keys:
        return "'pattern' with 'minLength'/'maxLength' is not enforced (fold the length into it)"
    required, properties = schema.get("required"), schema.get("properties")
    listed = properties if isinstance(properties, dict) else {}
    unlisted = [n for n in required if n not in listed] if isinstance(required, list) else []
    if unlisted:
        return f"required property '{unlisted[0]}' is not in 'properties', so is not enforced"
    untyped = sorted(_SCALAR & keys)
    if "type" not in keys and not branches and untyped and not _SHAPES & keys:
        return f"'{untyped[0]}' needs a 'type' beside it to be enforced"
    return None


JSON_TYPES = ("string", "number", "integer", "boolean", "object", "array", "null")
_BOUNDS = (("minLength", "maxLength"), ("minItems", "maxItems"), ("minimum", "maximum"))


def _number(value: Any) -> TypeGuard[float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _empty(schema: dict[str, Any]) -> str | None:
    """Why no value satisfies this schema on its own keywords, or what it points at that is
    not in the document, if so (xgrammar would serve such a schema unconstrained or as "")."""
    for key in ("anyOf", "enum", "type"):
        if schema.get(key) == []:
            return f"'{key}' is an empty list, so no value satisfies it"
    kinds = schema.get("type")
    for kind in kinds if isinstance(kinds, list) else [kinds] if kinds is not None else []:
        if kind not in JSON_TYPES:
            return f"'type' {kind!r} is not a JSON schema type ({', '.join(JSON_TYPES)})"
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        return (
            f"'$ref' {ref!r} points outside the schema (only references within it, "
            "'#/...', are followed)"
        )
    for low, high in _BOUNDS:
        a, b = schema.get(low), schema.get(high)
        if _number(a) and _number(b) and a > b:
            return f"'{low}' {a} is greater than '{high}' {b}, so no value satisfies both"
    a, b = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
    if _number(a) and _number(b) and a >= b:
        return f"'exclusiveMinimum' {a} is not below 'exclusiveMaximum' {b}: no value fits"
    required, properties = schema.get("required"), schema.get("properties")
    if isinstance(required, list) and isinstance(properties, dict):
        for name in required:
            if properties.get(name) is False:
                return f"required property '{name}' has the schema false: no value satisfies it"
    prefix = schema.get("prefixItems")
    least = schema.get("minItems")
    if schema.get("items") is False and _number(least):
        allowed = len(prefix) if isinstance(prefix, list) else 0
        if least > allowed:
            return f"'minItems' {least} but 'items' is false after {allowed} items"
    return None


def check_schema(schema: Any, param: str) -> None:
    """Refuse a JSON schema with a keyword the library would not enforce, or one no value
    satisfies, naming the keyword and where it stands (#/properties/a/...)."""
    if schema is False:
        raise InvalidRequest(f"'{param}': the schema false admits no value", param=param)
    if not isinstance(schema, dict | bool):
        raise InvalidRequest(f"'{param}': a JSON schema must be an object", param=param)
    for sub, where in _subschemas(schema, "#"):
        for key in sub:
            if key not in SCHEMA_KEYWORDS:
                raise InvalidRequest(
                    f"'{param}': JSON schema keyword '{key}' (at {where}) is not supported by "
                    "this server's constrained decoding",
                    param=param,
                )
        why = _dropped(sub) or _empty(sub)
        if why:
            raise InvalidRequest(f"'{param}': at {where}, {why}", param=param)
