"""Schemas no test has seen before: each run draws new ones (the seed is printed with any
failure: PREDICTOR_TEST_SCHEMA_SEED=... runs it again) from every keyword the grammar enforces,
and every output that ends on its own validates against its schema."""

from __future__ import annotations

import asyncio
import json
import os
import random
import string
from typing import Any

import jsonschema

from predictor.engine.client import complete
from predictor.types import FinishReason, GenerateRequest
from tests.engine.conftest import Tiny
from tests.engine.test_grammar import running, schema_params

SCHEMAS_PER_RUN = 12
SAMPLES = 3


def _name(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(1, 6)))


def draw(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """A schema a random-weight model can finish in the token budget: strings, arrays and
    objects bounded, nesting at most two deep."""
    kinds = ["string", "integer", "number", "boolean", "enum", "const", "nullable", "pattern"]
    if depth < 2:
        kinds += ["object", "object", "array", "anyOf"]
    if depth == 0:  # "#/$defs/..." names the root's definitions
        kinds.append("ref")
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 6)}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 100)}
    if kind == "number":
        return {"type": "number", "exclusiveMinimum": -1, "exclusiveMaximum": 1}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": sorted({_name(rng) for _ in range(rng.randint(1, 4))})}
    if kind == "const":
        return {"const": rng.choice([_name(rng), rng.randint(0, 9), True, None])}
    if kind == "nullable":
        return {"type": [rng.choice(["string", "integer", "boolean"]), "null"], "maxLength": 4}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(["^[a-z]{2,4}$", "^[0-9]{3}-[A-Z]$"])}
    if kind == "array":
        low = rng.randint(0, 2)
        return {"type": "array", "items": draw(rng, depth + 1), "minItems": low,
                "maxItems": low + rng.randint(0, 2)}  # fmt: skip
    if kind == "anyOf":
        return {"anyOf": [draw(rng, depth + 1) for _ in range(rng.randint(2, 3))]}
    if kind == "ref":
        return {"$defs": {"d": draw(rng, depth + 1)},
                "type": "object", "properties": {"x": {"$ref": "#/$defs/d"}},
                "required": ["x"], "additionalProperties": False}  # fmt: skip
    names = sorted({_name(rng) for _ in range(rng.randint(1, 3))})
    properties = {n: draw(rng, depth + 1) for n in names}
    required = [n for n in names if rng.random() < 0.7]
    return {"type": "object", "properties": properties, "required": required,
            "additionalProperties": False}  # fmt: skip


async def test_fresh_schemas_validate(tiny_dense: Tiny) -> None:
    seed = int(
        os.environ.get("PREDICTOR_TEST_SCHEMA_SEED") or random.SystemRandom().getrandbits(32)
    )
    rng = random.Random(seed)
    schemas = [draw(rng) for _ in range(SCHEMAS_PER_RUN)]
    with running(tiny_dense) as engine:
        requests = [
            GenerateRequest(f"f{i}-{k}", "JSON:", schema_params(schema, seed=k))
            for i, schema in enumerate(schemas)
            for k in range(SAMPLES)
        ]
        outs = await asyncio.gather(*(complete(engine.generate(r)) for r in requests))
    finished = 0
    for request, out in zip(requests, outs, strict=True):
        schema = schemas[int(request.request_id[1:].split("-")[0])]
        where = f"PREDICTOR_TEST_SCHEMA_SEED={seed}, schema {json.dumps(schema)}: {out.text!r}"
        assert out.finish_reason in (FinishReason.EOS, FinishReason.LENGTH), where
        if out.finish_reason == FinishReason.EOS:  # ended on its own: the grammar is complete
            try:
                jsonschema.validate(json.loads(out.text), schema)
            except (ValueError, jsonschema.ValidationError) as exc:
                raise AssertionError(f"{where}: {exc}") from exc
            finished += 1
    assert finished >= len(requests) // 2, f"PREDICTOR_TEST_SCHEMA_SEED={seed}"
