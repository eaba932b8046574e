"""Structured-output requests -> the Grammar the engine enforces: vLLM's `structured_outputs`
(`json`, `regex`, `choice`, `grammar`, `json_object`) and OpenAI's `response_format` (`text`,
`json_object`, `json_schema`). The rows that carry them are in `protocols/parameters.py`; what
the grammar library cannot enforce is refused by `engine/grammar.py`, naming it."""

from __future__ import annotations

import json
from typing import Any

from predictor.errors import InvalidRequest
from predictor.protocols.limits import json_text
from predictor.types import Grammar

_STRUCTURED = ("json", "regex", "choice", "grammar", "json_object")


def grammar(key: str, value: Any, max_depth: int) -> Grammar | None:
    """structured_outputs (vLLM's) or response_format (OpenAI's) -> the Grammar it asks for."""
    if isinstance(value, str):  # gRPC maps and Triton's tensors carry no objects: JSON text
        value = json_text(value, max_depth, key)
    if not isinstance(value, dict):
        raise InvalidRequest(f"parameter '{key}' must be an object", param=key)
    if key == "response_format":
        return _response_format(value)
    unknown = sorted(set(value) - set(_STRUCTURED))
    if unknown:
        raise InvalidRequest(
            f"'{key}.{unknown[0]}' is not supported (one of {', '.join(_STRUCTURED)})",
            param=f"{key}.{unknown[0]}",
        )
    given = [k for k in _STRUCTURED if value.get(k) not in (None, False)]
    if len(given) != 1:
        raise InvalidRequest(
            f"parameter '{key}' needs exactly one of {', '.join(_STRUCTURED)}", param=key
        )
    kind, spec = given[0], value[given[0]]
    where = f"{key}.{kind}"
    if kind == "json":
        if isinstance(spec, str):  # a schema as JSON text: checked as an inline one is
            spec = json_text(spec, max_depth, where, "a JSON schema")
        if not isinstance(spec, dict | bool):
            raise InvalidRequest(f"'{where}' must be a JSON schema (an object)", param=where)
        return Grammar("json_schema", json.dumps(spec), key)
    if kind == "json_object":
        if spec is not True:
            raise InvalidRequest(f"'{where}' must be true", param=where)
        return Grammar("json_object", "", key)
    if kind == "choice":
        if not isinstance(spec, list) or not spec or not all(isinstance(c, str) for c in spec):
            raise InvalidRequest(f"'{where}' must be a non-empty list of strings", param=where)
        return Grammar("choice", json.dumps(spec), key)
    if not isinstance(spec, str) or not spec:
        raise InvalidRequest(f"'{where}' must be a non-empty string", param=where)
    return Grammar("regex" if kind == "regex" else "ebnf", spec, key)


def _response_format(value: dict[str, Any]) -> Grammar | None:
    key = "response_format"
    kind = value.get("type")
    allowed = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"}}
    if kind not in allowed:
        raise InvalidRequest(
            f"'{key}.type' must be one of text, json_object, json_schema, got {kind!r}",
            param=f"{key}.type",
        )
    extra = sorted(set(value) - allowed[kind])
    if extra:
        raise InvalidRequest(f"'{key}.{extra[0]}' is not supported", param=f"{key}.{extra[0]}")
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar("json_object", "", key)
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise InvalidRequest(
            f"'{key}.json_schema' must be an object with a name", param=f"{key}.json_schema"
        )
    return _schema_grammar(f"{key}.json_schema", spec, key)


def _schema_grammar(where: str, spec: dict[str, Any], param: str) -> Grammar:
    """A named JSON schema (`name`, `schema`, `strict`, `description`) -> its Grammar; `param`
    is the field its grammar's errors name."""
    extra = sorted(set(spec) - {"name", "schema", "strict", "description"})
    if extra:
        raise InvalidRequest(f"'{where}.{extra[0]}' is not supported", param=f"{where}.{extra[0]}")
    if spec.get("strict") not in (None, True, False):
        raise InvalidRequest(f"'{where}.strict' must be a boolean", param=f"{where}.strict")
    schema = spec.get("schema", {})  # strict or not, the schema is enforced
    if not isinstance(schema, dict):
        raise InvalidRequest(
            f"'{where}.schema' must be a JSON schema (an object)", param=f"{where}.schema"
        )
    return Grammar("json_schema", json.dumps(schema), param)


def text_format(value: Any) -> Grammar | None:
    """The Responses API's `text.format` (`{type: text}`, `{type: json_object}` or `{type:
    json_schema, name, schema, strict, description}`, flat where chat's response_format nests
    the schema) -> the Grammar it asks for, its errors naming `text.format`."""
    key = "text.format"
    if not isinstance(value, dict):
        raise InvalidRequest(f"'{key}' must be an object", param=key)
    kind = value.get("type")
    if kind not in ("text", "json_object", "json_schema"):
        raise InvalidRequest(
            f"'{key}.type' must be one of text, json_object, json_schema, got {kind!r}",
            param=f"{key}.type",
        )
    if kind != "json_schema":
        extra = sorted(set(value) - {"type"})
        if extra:
            raise InvalidRequest(f"'{key}.{extra[0]}' is not supported", param=f"{key}.{extra[0]}")
        return None if kind == "text" else Grammar("json_object", "", key)
    if not isinstance(value.get("name"), str):
        raise InvalidRequest(f"'{key}.name' must be a string", param=f"{key}.name")
    return _schema_grammar(key, {k: v for k, v in value.items() if k != "type"}, key)
