"""OpenAPI descriptions of the bodies our REST routes read (KServe's app serves /openapi.json,
which the schemathesis fuzzers read), generated from the parameter table: the OIP generate body
with Triton's top-level keys, the V2 infer body of infer_stream, OpenAI's and Anthropic's bodies."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from predictor.protocols import generate, parameters
from predictor.protocols.anthropic import bodies as anthropic_bodies
from predictor.protocols.openai import requests as openai_requests
from predictor.protocols.openai import responses_bodies
from predictor.protocols.parameters import MAX_STOP_LENGTH, MAX_STOP_STRINGS, Parameter
from predictor.protocols.v2 import TEXT_INPUT


def parameter_schema(row: Parameter) -> dict[str, Any]:
    """One row as a JSON schema."""
    if row.kind == "boolean":
        return {"type": "boolean"}
    if row.kind == "string":
        return {"type": "string", "minLength": row.low, "maxLength": row.high}
    if row.kind == "stop":
        text = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_LENGTH}
        return {"oneOf": [text, {"type": "array", "items": text, "maxItems": MAX_STOP_STRINGS}]}
    if row.kind == "bias":
        bias = {"type": "number", "minimum": row.low, "maximum": row.high}
        return {"oneOf": [{"type": "object", "additionalProperties": bias}, {"type": "string"}]}
    if row.kind == "grammar":
        return {"oneOf": [{"type": "object"}, {"type": "string"}]}
    schema: dict[str, Any] = {"type": row.kind}
    if row.low is not None:
        schema["exclusiveMinimum" if row.low_open else "minimum"] = row.low
    if row.high is not None:
        schema["exclusiveMaximum" if row.high_open else "maximum"] = row.high
    return schema


def parameters_properties(protocol: str) -> dict[str, Any]:
    """Every key of a protocol (the row's name; aliases are accepted but not advertised)."""
    return {row.name: parameter_schema(row) for row in parameters.rows(protocol)}


_PARAMETERS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {**parameters_properties("v2"), "details": {"type": "boolean"}},
}

INFER_REQUEST_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["inputs"],
    "properties": {
        "id": {"type": "string"},
        "parameters": _PARAMETERS_SCHEMA,
        "inputs": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name", "shape", "datatype", "data"],
                "properties": {
                    "name": {"type": "string", "enum": [TEXT_INPUT]},
                    "shape": {"type": "array", "items": {"type": "integer"}},
                    "datatype": {"type": "string", "enum": ["BYTES"]},
                    "data": {"type": "array", "items": {"type": "string"}},
                },
            },
        },
    },
}

# generate and generate_stream also take the sampling keys at the top level, as Triton does
GENERATE_REQUEST_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": [TEXT_INPUT],
    "properties": {
        "id": {"type": "string"},
        TEXT_INPUT: {"type": "string", "minLength": 1},
        "parameters": _PARAMETERS_SCHEMA,
        **parameters_properties(generate.PROTOCOL),
        generate.STREAM: {"type": "boolean"},
    },
    "additionalProperties": False,
}


def _inline_refs(schema: Any, defs: dict[str, Any]) -> Any:
    """A JSON schema with its $refs replaced by their definitions (the OpenAPI document has
    no place for pydantic's $defs)."""
    if isinstance(schema, dict):
        if "$ref" in schema:
            return _inline_refs(defs[schema["$ref"].rsplit("/", 1)[1]], defs)
        return {k: _inline_refs(v, defs) for k, v in schema.items() if k != "$defs"}
    if isinstance(schema, list):
        return [_inline_refs(v, defs) for v in schema]
    return schema


def openai_schema(
    model: type[BaseModel],
    protocol: str = "openai",
    keys: frozenset[str] | None = None,
    renames: dict[str, str] | None = None,
) -> dict[str, Any]:
    """An OpenAI (or Anthropic) body: its pydantic model's fields and the table's keys of
    `protocol` (`keys`: those the route takes, None: all; `renames`: a route's name for a row,
    as max_output_tokens)."""
    schema = model.model_json_schema()
    body = dict(_inline_refs(schema, schema.get("$defs", {})))
    table = parameters_properties(protocol)
    taken = {k: v for k, v in table.items() if keys is None or k in keys}
    taken |= {new: table[old] for new, old in (renames or {}).items()}
    body["properties"] = {**body.get("properties", {}), **taken}
    return body


COMPLETION_SCHEMA = openai_schema(openai_requests.CompletionBody)
CHAT_SCHEMA = openai_schema(openai_requests.ChatBody)
COUNT_TOKENS_SCHEMA = openai_schema(anthropic_bodies.MessagesBody, "anthropic")
MESSAGES_SCHEMA = {
    **COUNT_TOKENS_SCHEMA,
    "required": [*COUNT_TOKENS_SCHEMA.get("required", []), "max_tokens"],
}
RESPONSES_SCHEMA = openai_schema(
    responses_bodies.ResponsesBody,
    keys=responses_bodies.TABLE_KEYS,
    renames=responses_bodies.RENAMES,
)
