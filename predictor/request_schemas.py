"""OpenAPI descriptions of the bodies our REST routes read (KServe's app serves /openapi.json,
which the schemathesis fuzzers read): the OIP generate body with Triton's top-level sampling
keys, and the V2 infer body of infer_stream."""

from __future__ import annotations

from typing import Any

from predictor import codecs
from predictor.triton_codec import PARAMETER_KEYS

_PARAMETERS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "max_tokens": {"type": "integer", "minimum": 1},
        "temperature": {"type": "number", "minimum": 0, "maximum": 100},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": 0},
        "seed": {"type": "integer", "minimum": 0},
        "stop": {
            "oneOf": [
                {"type": "string", "minLength": 1, "maxLength": codecs.MAX_STOP_LENGTH},
                {
                    "type": "array",
                    "items": {
                        "type": "string",
                        "minLength": 1,
                        "maxLength": codecs.MAX_STOP_LENGTH,
                    },
                    "maxItems": codecs.MAX_STOP_STRINGS,
                },
            ]
        },
        "ignore_eos": {"type": "boolean"},
        "min_tokens": {"type": "integer", "minimum": 0},
        "chat": {"type": "boolean"},
        "timeout": {"type": "number", "exclusiveMinimum": 0},
        "cache_salt": {"type": "string", "minLength": 1, "maxLength": codecs.MAX_ID_LENGTH},
        "details": {"type": "boolean"},
    },
}

_OIP_GENERATE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": [codecs.TEXT_INPUT],
    "properties": {
        "id": {"type": "string"},
        codecs.TEXT_INPUT: {"type": "string", "minLength": 1},
        "parameters": _PARAMETERS_SCHEMA,
    },
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
                    "name": {"type": "string", "enum": [codecs.TEXT_INPUT]},
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
    **_OIP_GENERATE_SCHEMA,
    "properties": {
        **_OIP_GENERATE_SCHEMA["properties"],
        **{k: v for k, v in _PARAMETERS_SCHEMA["properties"].items() if k in PARAMETER_KEYS},
        "stream": {"type": "boolean"},
    },
    "additionalProperties": False,
}
