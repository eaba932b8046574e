"""Hostile and unlucky grammars: what no text satisfies and what cannot be enforced is the
client's error (named, before any token), a dead end met while decoding too; compiles run on
their own pool, bounded in time and in number, abandoned when nobody waits, cached."""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

import pytest
import xgrammar as xgr

from predictor.engine.client import complete
from predictor.engine.grammar import Grammars, _mend_strings
from predictor.engine.grammar_check import empty_rule
from predictor.engine.tool_calls import structural_tag
from predictor.errors import InvalidRequest, Overloaded
from predictor.types import GenerateRequest, Grammar, SamplingParams
from tests.engine.conftest import Tiny
from tests.engine.test_grammar import SCHEMAS, running

# a regex xgrammar 0.2.9 takes ~1.5 s to compile on a 2-core machine (its broad class, bounded):
# `slow(i)` is one more, never cached (each its own text)
SLOW = "[^x]{{0,{}}}y"


def slow(i: int) -> Grammar:
    return Grammar("regex", SLOW.format(1000 + i), "structured_outputs")


NO_TEXT = [  # (kind, text): grammars no text satisfies
    ("regex", r"[^\s\S]"),
    ("ebnf", 'root ::= "a" root'),
    ("ebnf", 'root ::= "a" | "b" x\nx ::= x "c"'),  # a branch that cannot end
]
UNENFORCEABLE = [  # (schema, words the refusal says, where)
    ({"anyOf": []}, "'anyOf' is an empty list", "#"),
    ({"type": []}, "'type' is an empty list", "#"),
    ({"type": "object", "properties": {"a": {"enum": []}}, "required": ["a"]},
     "'enum' is an empty list", "#/properties/a"),
    ({"$ref": "https://example.com/s.json"}, "points outside the schema", "#"),
    ({"type": "object", "properties": {"a": {"$ref": "other.json#/a"}}},
     "points outside the schema", "#/properties/a"),
    ({"type": "string", "minLength": 5, "maxLength": 2}, "'minLength' 5 is greater", "#"),
    ({"type": "array", "items": {"type": "integer", "minimum": 3, "maximum": 1}},
     "'minimum' 3 is greater", "#/items"),
    ({"type": "number", "exclusiveMinimum": 2, "exclusiveMaximum": 2}, "exclusiveMinimum", "#"),
    ({"type": "object", "properties": {"a": False}, "required": ["a"]}, "schema false", "#"),
    ({"type": "object", "properties": {"a": {"type": ["string", "text"]}}},
     "'type' 'text' is not a JSON schema type", "#/properties/a"),
]  # fmt: skip


@pytest.mark.parametrize(("kind", "text"), NO_TEXT)
def test_a_grammar_no_text_satisfies_is_refused_at_compile(
    grammars: Grammars, kind: str, text: str
) -> None:
    with pytest.raises(InvalidRequest, match="no text satisfies 'structured_outputs'") as caught:
        grammars.compile(Grammar(kind, text, "structured_outputs"))
    assert caught.value.param == "structured_outputs"


@pytest.mark.parametrize(("schema", "words", "where"), UNENFORCEABLE)
def test_a_schema_that_cannot_be_honoured_is_refused_naming_where(
    grammars: Grammars, schema: Any, words: str, where: str
) -> None:
    with pytest.raises(InvalidRequest) as caught:
        grammars.compile(Grammar("json_schema", json.dumps(schema), "response_format"))
    message = str(caught.value)
    assert (
        words in message and f"at {where}," in message and caught.value.param == "response_format"
    )


def test_library_errors_come_without_its_internals(grammars: Grammars) -> None:
    for schema in ({"$ref": "#/$defs/missing"}, {"type": "string", "pattern": "(a"}):
        with pytest.raises(InvalidRequest) as caught:
            grammars.compile(Grammar("json_schema", json.dumps(schema), "response_format"))
        message = str(caught.value)
        assert not re.search(r"\.(cc|h|cpp):\d+|\[\d\d:\d\d:\d\d\]|/project/", message), message


def test_the_emptiness_check_passes_every_grammar_the_tests_serve() -> None:
    """No false alarm: the schemas the engine tests decode, JSON, regexes, tool calls."""
    grammars = [xgr.Grammar.builtin_json_grammar(), xgr.Grammar.from_regex("[a-f]{3}[0-9]{2}"),
                xgr.Grammar.from_ebnf('root ::= "(" root ")" | ""')]  # fmt: skip
    for schema in SCHEMAS:
        built = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
        grammars.append(_mend_strings(built))
    tools = [
        {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}
    ]
    for choice in ("auto", "required"):
        grammars.append(xgr.Grammar.from_structural_tag(structural_tag(tools, choice, True)))  # type: ignore[arg-type]
    for grammar in grammars:
        assert empty_rule(str(grammar)) is None, str(grammar)[:200]


async def test_a_dead_end_met_while_decoding_is_the_clients_error(tiny_dense: Tiny) -> None:
    """'a' then a class nothing matches: the first token is allowed, the second is not. The
    request fails as a 400 naming its parameter, not as a model fault."""
    grammar = Grammar("regex", r"a[^\s\S]", "structured_outputs")
    with running(tiny_dense) as engine:
        params = SamplingParams(max_tokens=8, grammar=grammar)
        with pytest.raises(InvalidRequest) as caught:
            await complete(engine.generate(GenerateRequest("d", "x", params)))
        assert caught.value.param == "structured_outputs"
        assert "allows no next token" in str(caught.value)
        plain = await complete(engine.generate(GenerateRequest("p", "x", SamplingParams(4))))
    assert plain.usage.generated_tokens == 4  # the engine goes on


def limited(tiny: Tiny, **limits: Any) -> Grammars:
    return Grammars(tiny.tokenizer, tiny.eos_ids, **limits)


async def test_a_compile_past_its_budget_is_too_complex_and_cached_after(tiny_dense: Tiny) -> None:
    grammars = limited(tiny_dense, timeout=0.2)
    try:
        started = time.monotonic()
        with pytest.raises(InvalidRequest, match="too complex") as caught:
            await grammars.compile_async(slow(0))
        assert time.monotonic() - started < 1.0 and caught.value.param == "structured_outputs"
        while grammars.in_flight:  # the compile runs on in its slot, then caches its grammar
            await asyncio.sleep(0.05)
        started = time.monotonic()
        assert await grammars.compile_async(slow(0)) is not None
        assert time.monotonic() - started < 0.1 and grammars.compiled == 1
    finally:
        grammars.close()


async def test_compiles_past_the_cap_are_overloaded_and_the_abandoned_free_their_slot(
    tiny_dense: Tiny,
) -> None:
    # one thread that a long compile keeps (no quantum passes): the second waits for it
    grammars = limited(tiny_dense, timeout=30.0, max_in_flight=2, threads=1, quantum=60.0)
    try:
        first = asyncio.create_task(grammars.compile_async(slow(1)))  # runs
        second = asyncio.create_task(grammars.compile_async(slow(2)))  # waits for the thread
        await asyncio.sleep(0.1)
        assert grammars.in_flight == 2
        with pytest.raises(Overloaded):
            await grammars.compile_async(slow(3))
        shared = asyncio.create_task(grammars.compile_async(slow(1)))  # the same text: shared
        await asyncio.sleep(0.05)
        assert grammars.in_flight == 2
        second.cancel()  # its client left before its compile began: dropped, slot free
        await asyncio.sleep(0.05)
        assert grammars.in_flight == 1
        assert (await first) is (await shared)
        assert grammars.compiled == 1  # the dropped one never ran
    finally:
        grammars.close()


async def test_compiles_never_hold_up_tokenizing(tiny_dense: Tiny) -> None:
    """Compiles have a pool of their own: the pool that tokenizes stays free."""
    # a budget none reaches: on a shared machine the demoted compiles (nice 19) wait for CPU
    grammars = limited(tiny_dense, timeout=120.0)
    try:
        compiles = [asyncio.create_task(grammars.compile_async(slow(10 + i))) for i in range(4)]
        await asyncio.sleep(0.1)
        started = time.monotonic()
        ids = await asyncio.to_thread(tiny_dense.tokenizer.encode, "a plain prompt")
        assert ids and time.monotonic() - started < 0.5
        await asyncio.gather(*compiles)
    finally:
        grammars.close()
