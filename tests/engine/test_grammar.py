"""Grammar-constrained decoding on the tiny dense model: every output matches its grammar."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import jsonschema
import pytest
import torch
import xgrammar as xgr

from predictor.engine import tool_calls
from predictor.engine.client import complete
from predictor.engine.grammar import Grammars
from predictor.engine.schema_check import check_schema
from predictor.errors import InvalidRequest
from predictor.types import FinishReason, GenerateRequest, Grammar, SamplingParams
from tests.engine.conftest import Tiny, new_loop

WORD = {"type": "string", "maxLength": 6}

# schemas a random-weight model can finish within the token budget: bounded strings and arrays
SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": WORD, "ok": {"type": "boolean"}},
     "required": ["name", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
     "size": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["color", "size"],
     "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2,
     "maxItems": 4},
    {"type": "object", "properties": {"outer": {"type": "object", "properties": {
        "inner": {"type": "object", "properties": {"v": {"type": "boolean"}}, "required": ["v"],
                  "additionalProperties": False}}, "required": ["inner"],
        "additionalProperties": False}}, "required": ["outer"], "additionalProperties": False},
    {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -5,
     "maximum": 5}, "y": {"type": "integer", "minimum": -5, "maximum": 5}}, "required": ["x", "y"],
     "additionalProperties": False}}, "type": "object", "properties": {"a": {"$ref": "#/$defs/point"},
     "b": {"$ref": "#/$defs/point"}}, "required": ["a", "b"], "additionalProperties": False},
    {"anyOf": [{"type": "boolean"}, {"enum": ["x", "y"]}, {"type": "integer", "minimum": 0,
     "maximum": 3}]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}},
     "required": ["code"], "additionalProperties": False},
    {"type": "object", "properties": {"maybe": {"type": ["string", "null"], "maxLength": 4},
     "also": {"anyOf": [{"type": "boolean"}, {"type": "null"}]}}, "required": ["maybe", "also"],
     "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
     "maxItems": 3}, "n": {"const": 7}}, "required": ["tags", "n"], "additionalProperties": False},
]  # fmt: skip


class running:
    def __init__(self, tiny: Tiny, max_step_tokens: int = 256) -> None:
        from predictor.engine.async_engine import AsyncEngine

        loop = new_loop(tiny.runner(), tiny.eos_ids, max_step_tokens=max_step_tokens)
        self.engine = AsyncEngine(loop, tiny.tokenizer, max_tokens_limit=256, max_prompt_tokens=400)

    def __enter__(self) -> Any:
        self.engine.start()
        return self.engine

    def __exit__(self, *exc: object) -> None:
        self.engine.stop()


def schema_params(schema: dict[str, Any], **kw: Any) -> SamplingParams:
    grammar = Grammar("json_schema", json.dumps(schema), "response_format")
    return SamplingParams(**{"max_tokens": 200, "temperature": 0.8, "grammar": grammar, **kw})


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
async def test_every_output_validates(tiny_dense: Tiny, index: int) -> None:
    schema = SCHEMAS[index]
    with running(tiny_dense) as engine:
        reqs = [
            GenerateRequest(f"s{index}-{k}", "Answer in JSON:", schema_params(schema, seed=k))
            for k in range(6)
        ]
        outs = await asyncio.gather(*(complete(engine.generate(r)) for r in reqs))
    for out in outs:
        assert out.finish_reason == FinishReason.EOS, out
        jsonschema.validate(json.loads(out.text), schema)


async def test_regex_choice_and_ebnf(tiny_dense: Tiny) -> None:
    cases = [
        (Grammar("regex", r"[a-c]{2,5}-[0-9]{1,3}"), re.compile(r"[a-c]{2,5}-[0-9]{1,3}")),
        (Grammar("choice", json.dumps(["yes", "no", "maybe \"so\""])),
         re.compile(r"yes|no|maybe \"so\"")),
        (Grammar("ebnf", 'root ::= "(" [0-9]+ ("," [0-9]+)? ")"'), re.compile(r"\(\d+(,\d+)?\)")),
    ]  # fmt: skip
    with running(tiny_dense) as engine:
        for grammar, pattern in cases:
            for seed in range(4):
                params = SamplingParams(max_tokens=40, temperature=0.8, seed=seed, grammar=grammar)
                out = await complete(engine.generate(GenerateRequest("g", "Say:", params)))
                if out.finish_reason == FinishReason.LENGTH:  # unbounded repeats may run out
                    assert grammar.kind == "ebnf"
                    continue
                assert out.finish_reason == FinishReason.EOS
                assert pattern.fullmatch(out.text), (grammar, out.text)


async def test_seeds_n_logprobs_stop_and_chunked_prefill(tiny_dense: Tiny) -> None:
    schema = SCHEMAS[1]
    long_prompt = " ".join(["word"] * 120)
    with running(tiny_dense, max_step_tokens=16) as engine:  # the prompt takes 8 chunks
        params = schema_params(schema, seed=5, logprobs=2)
        free = SamplingParams(max_tokens=12)
        reqs = [GenerateRequest("a", long_prompt, params), GenerateRequest("b", long_prompt, params),
                GenerateRequest("free", long_prompt, free)]  # fmt: skip
        a, b, plain = await asyncio.gather(*(complete(engine.generate(r)) for r in reqs))
        alone = await complete(engine.generate(GenerateRequest("free2", long_prompt, free)))
        stopped = await complete(
            engine.generate(
                GenerateRequest("s", "x", schema_params(schema, seed=1, stop=('"size"',)))
            )
        )
    assert a.text == b.text and a.finish_reason == FinishReason.EOS  # a seed is a seed
    jsonschema.validate(json.loads(a.text), schema)
    assert len(a.logprobs) == a.usage.generated_tokens and all(len(t.top) == 2 for t in a.logprobs)
    assert plain.text == alone.text  # a row without a grammar is untouched by its neighbours
    assert stopped.finish_reason == FinishReason.STOP and stopped.text.startswith('{"color": ')


async def test_grammars_are_cached_and_compiled_off_the_step_loop(tiny_dense: Tiny) -> None:
    with running(tiny_dense) as engine:
        params = schema_params(SCHEMAS[0], max_tokens=60)
        for k in range(3):
            await complete(engine.generate(GenerateRequest(f"c{k}", "x", params)))
        assert engine.inputs.grammars().compiled == 1


@pytest.mark.parametrize(
    ("grammar", "needle"),
    [
        (Grammar("json_schema", '{"type": "string", "format": "email"}'), "format"),
        (Grammar("json_schema", '{"oneOf": [{"type": "string"}]}'), "oneOf"),
        (Grammar("json_schema", '{"type": "array", "uniqueItems": true}'), "uniqueItems"),
        (Grammar("regex", "(?<=a)b"), "regex"),
        (Grammar("ebnf", "root ::= undefined_rule"), "cannot be enforced"),
    ],
)
async def test_what_cannot_be_enforced_is_refused(
    tiny_dense: Tiny, grammar: Grammar, needle: str
) -> None:
    with running(tiny_dense) as engine, pytest.raises(InvalidRequest) as caught:
        await complete(engine.generate(GenerateRequest("x", "x", SamplingParams(grammar=grammar))))
    assert caught.value.param == grammar.param
    assert needle in str(caught.value) or grammar.kind == "regex"


def test_schema_keywords_inside_data_are_not_keywords() -> None:
    check_schema(
        {"properties": {"format": {"type": "string"}, "e": {"enum": [{"format": 1}]}}}, "p"
    )
    with pytest.raises(InvalidRequest, match="'not'"):
        check_schema({"properties": {"a": {"not": {}}}}, "p")


async def test_a_cancelled_grammar_row_frees_its_place(tiny_dense: Tiny) -> None:
    with running(tiny_dense) as engine:
        params = schema_params({"type": "array", "items": WORD}, max_tokens=200)
        stream = engine.generate(GenerateRequest("c", "x", params))
        first = await stream.__anext__()
        assert first.text.startswith("[")
        await stream.aclose()
        for _ in range(200):
            if engine.running() == 0:
                break
            await asyncio.sleep(0.01)
        assert engine.running() == 0
        out = await complete(engine.generate(GenerateRequest("d", "x", schema_params(SCHEMAS[1]))))
        jsonschema.validate(json.loads(out.text), SCHEMAS[1])


# -- length-bounded strings: JSON characters only (xgrammar 0.2.9's own rule admits raw
# control characters and no escapes, mlc-ai/xgrammar#800) ------------------------------------

BOUNDED = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
           "required": ["city"], "additionalProperties": False}  # fmt: skip
CONTROL = re.compile("[\x00-\x1f]")


def allowed_after(grammars: Grammars, grammar: Grammar, text: str, tiny: Tiny) -> list[str]:
    """The texts of the tokens the grammar allows once `text` is written."""
    matcher = xgr.GrammarMatcher(grammars.compile(grammar))
    assert matcher.accept_string(text)
    bitmask = xgr.allocate_token_bitmask(1, grammars.vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    bits = (bitmask[0].unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1
    ids = bits.flatten()[: grammars.vocab_size].nonzero().flatten().tolist()
    return [tiny.tokenizer.decode([i]) for i in ids]


@pytest.mark.parametrize("path", ["json_schema", "structural_tag"])
def test_a_bounded_string_takes_json_characters_only(
    grammars: Grammars, tiny_dense: Tiny, path: str
) -> None:
    if path == "json_schema":
        grammar, head = Grammar(path, json.dumps(BOUNDED), "response_format"), '{"city": "Pa'
    else:
        tag = tool_calls.structural_tag([{"name": "w", "parameters": BOUNDED}], "required", False)
        grammar, head = Grammar(path, tag, "tools"), '<tool_call>\n{"name": "w", "arguments": '
        head += '{"city": "Pa'
    vocab = [tiny_dense.tokenizer.decode([i]) for i in range(grammars.vocab_size)]
    assert sum(bool(CONTROL.search(t)) for t in vocab) > 10  # the mask has them to refuse
    allowed = allowed_after(grammars, grammar, head, tiny_dense)
    assert "ris" in allowed or "r" in allowed
    assert not [t for t in allowed if CONTROL.search(t)]  # a raw tab would not parse
    assert "\\" in allowed  # escapes can be written, and count as one character each
    matcher = xgr.GrammarMatcher(grammars.compile(grammar))
    assert matcher.accept_string(head[: -len("Pa")] + 'a\\"b\\n\\u00e9\\\\12"}')  # 8 characters
    matcher = xgr.GrammarMatcher(grammars.compile(grammar))
    assert not matcher.accept_string(head[: -len("Pa")] + 'a\\"b\\n\\u00e9\\\\123"')  # 9


@pytest.mark.parametrize(
    ("schema", "needle"),
    [
        ({"type": "string", "enum": ["ab", "abc"], "maxLength": 2}, "'maxLength' beside 'enum'"),
        ({"anyOf": [{"type": "integer"}], "minimum": 3}, "'minimum' beside 'anyOf'"),
        ({"$ref": "#/$defs/a", "const": 1, "$defs": {"a": {}}}, "'const' beside '$ref'"),
        ({"type": "string", "pattern": "^a+$", "maxLength": 3}, "'pattern' with"),
        ({"type": "object", "required": ["a"]}, "required property 'a'"),
        ({"properties": {"b": {}}, "required": ["b", "a"]}, "required property 'a'"),
        ({"maxLength": 3}, "'maxLength' needs a 'type'"),
        ({"minimum": 0, "maximum": 9}, "'maximum' needs a 'type'"),
        ({"properties": {"p": {"maxItems": 1}}}, "at #/properties/p, 'maxItems' needs"),
    ],
)
def test_what_xgrammar_would_drop_is_refused(schema: dict[str, Any], needle: str) -> None:
    with pytest.raises(InvalidRequest, match=re.escape(needle)) as caught:
        check_schema(schema, "response_format")
    assert caught.value.param == "response_format"


@pytest.mark.parametrize(
    ("schema", "fits", "breaks"),
    [
        ({"type": ["string", "null"], "pattern": "^a$"}, "null", '"b"'),
        ({"type": ["integer", "string"], "maxLength": 2, "minimum": 5}, "7", '"abc"'),
        ({"items": {"type": "integer"}, "maxItems": 1}, "[1]", "[1, 2]"),  # an array by items
        ({"properties": {"a": {}}, "required": ["a"], "minimum": 3}, '{"a": 1}', "{}"),
        ({"type": "string", "enum": ["a", "b"], "description": "beside a branch"}, '"a"', '"c"'),
        ({"$defs": {"x": {"type": "integer"}}, "$ref": "#/$defs/x", "title": "t"}, "3", '"x"'),
    ],
)
def test_what_xgrammar_enforces_is_taken_and_enforced(
    grammars: Grammars, schema: dict[str, Any], fits: str, breaks: str
) -> None:
    check_schema(schema, "response_format")
    compiled = grammars.compile(Grammar("json_schema", json.dumps(schema), "response_format"))
    assert xgr.GrammarMatcher(compiled).accept_string(fits)
    assert not xgr.GrammarMatcher(compiled).accept_string(breaks)
