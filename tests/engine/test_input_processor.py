"""The input processor alone: from a GenerateRequest to an engine Request, every refusal early."""

from __future__ import annotations

import pytest

from predictor.engine.input_processor import InputProcessor, Limits
from predictor.errors import InvalidRequest
from predictor.types import GenerateRequest, SamplingParams, TokenEvent
from tests.engine.conftest import Tiny


def processor(tiny: Tiny, cache_blocks: int = 8, block_size: int = 16) -> InputProcessor:
    limits = Limits(max_tokens=64, max_prompt_tokens=40, max_prompts=2,
                    cache_blocks=cache_blocks, block_size=block_size)  # fmt: skip
    return InputProcessor(tiny.tokenizer, limits, tiny.eos_ids)


def ask(prompt: str, **params: object) -> GenerateRequest:
    return GenerateRequest("r", prompt, SamplingParams(**params))  # type: ignore[arg-type]


def test_checks_without_the_tokenizer_name_the_limit(tiny_dense: Tiny) -> None:
    inputs = processor(tiny_dense)
    inputs.check([ask("hi"), ask("there")])
    for requests, message in [
        ([], "at least one prompt"),
        ([ask("a")] * 3, "3 prompts in one request; the limit is 2"),
        ([ask("a", max_tokens=65)], "max_tokens must be between 0 and 64, got 65"),
    ]:
        with pytest.raises(InvalidRequest, match=message):
            inputs.check(requests)


def test_prepare_tokenizes_and_refuses_what_cannot_run(tiny_dense: Tiny) -> None:
    inputs = processor(tiny_dense, cache_blocks=2, block_size=16)  # a 32-token cache
    short = SamplingParams(max_tokens=8)
    ids, echo = inputs.prepare(GenerateRequest("r", "Hello there", short, echo=True))
    assert ids == tiny_dense.tokenizer.encode("Hello there") and echo == "Hello there"
    with pytest.raises(InvalidRequest, match="the limit is 40 tokens"):
        inputs.prepare(ask("word " * 200, max_tokens=8))
    with pytest.raises(InvalidRequest, match="exceed the KV cache \\(32 tokens\\)"):
        inputs.prepare(ask("Hello there", max_tokens=40))
    vocab = len(tiny_dense.tokenizer)
    with pytest.raises(InvalidRequest, match="logit_bias") as refused:
        inputs.prepare(ask("Hello", max_tokens=8, logit_bias=((vocab, 1.0),)))
    assert refused.value.param == "logit_bias"
    with pytest.raises(InvalidRequest, match="outside the vocabulary") as outside:
        inputs.prepare(GenerateRequest("r", "", short, prompt_ids=(1, vocab)))
    assert outside.value.param == "prompt"


def test_the_engine_request_carries_the_prompt_its_deadline_and_echo_only(
    tiny_dense: Tiny,
) -> None:
    inputs = processor(tiny_dense)
    events: list[TokenEvent] = []
    request = ask("Hello", max_tokens=0)
    ids, _ = inputs.prepare(request)
    made = inputs.request(request, ids, events.append, deadline=12.5)
    assert made.prompt_ids == ids and made.deadline == 12.5 and made.echo_only
    assert not inputs.request(ask("Hello"), ids, events.append, None).echo_only


def test_a_request_with_tools_keeps_its_formats_special_markers(tokenizer_dir: object) -> None:
    """The markers of the request's tool format that this tokenizer holds as special tokens are
    kept in its text (Phi-4-mini's <|tool_call|>, <|/tool_call|>); none for a format whose
    markers it lacks, and no request without tools keeps any."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|tool_call|>", "<|/tool_call|>"]})
    limits = Limits(max_tokens=64, max_prompt_tokens=40, max_prompts=2, cache_blocks=8,
                    block_size=16)  # fmt: skip
    inputs = InputProcessor(tokenizer, limits, frozenset([tokenizer.eos_token_id]))
    begin, end = tokenizer.convert_tokens_to_ids(["<|tool_call|>", "<|/tool_call|>"])
    assert inputs.kept_markers("phi4_mini_json") == {begin: "<|tool_call|>", end: "<|/tool_call|>"}
    assert inputs.kept_markers("hermes") == {} and inputs.kept_markers("mistral") == {}
    tools = ({"type": "function", "function": {"name": "f", "parameters": {}}},)
    asked = GenerateRequest("r", "hi", SamplingParams(max_tokens=4), tools=tools,
                            tool_format="phi4_mini_json")  # fmt: skip
    ids = tokenizer.encode("<|tool_call|>", add_special_tokens=False)
    made = inputs.request(asked, [1, 2], lambda event: None, None)
    assert (
        "".join(made.detokenizer.push(i) for i in ids) + made.detokenizer.flush() == "<|tool_call|>"
    )
    plain = inputs.request(ask("hi", max_tokens=4), [1, 2], lambda event: None, None)
    assert "".join(plain.detokenizer.push(i) for i in ids) + plain.detokenizer.flush() == ""
