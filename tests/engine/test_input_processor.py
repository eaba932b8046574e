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
