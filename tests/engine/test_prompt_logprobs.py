"""Prompt logprobs (vLLM's prompt_logprobs, OpenAI's echo): the step loop scores every prompt
token chunk by chunk with the logits of the position before it, as the model's own forward over
the whole prompt does, with chunked prefill, beside other rows, past the prefix cache and a
preemption; max_tokens 0 returns the prompt only."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from predictor.engine.runners.cpu import ModelRunner
from predictor.types import FinishReason, PromptEcho, SamplingParams
from tests.engine.conftest import Tiny, drive, make_sequence, new_loop, preemptions
from tests.support import tune_cache

PROMPT = list(range(5, 75))  # 70 tokens: several chunks of 16


def reference(
    model: Any, ids: list[int], k: int, tol: float, rel: float
) -> list[tuple[float, range, list[int]]]:
    """(logprob, the ranks it may have within tol + rel * |logprob|, top-k ids) of ids[1:],
    from the model's own forward over all of ids."""
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0].float()  # [T, V]
    logp = torch.log_softmax(logits, dim=-1)
    out = []
    for t in range(len(ids) - 1):
        chosen = logp[t, ids[t + 1]]
        tol = tol + rel * abs(float(chosen))
        best = int((logp[t] > chosen + tol).sum()) + 1
        worst = int((logp[t] > chosen - tol).sum()) + 1
        out.append((float(chosen), range(best, worst + 1), torch.topk(logp[t], k).indices.tolist()))
    return out


def check(
    prompt: PromptEcho | None, ids: list[int], model: Any, k: int, tol: float, rel: float = 0.0
) -> None:
    assert prompt is not None and prompt.token_ids == tuple(ids)
    scores = prompt.logprobs
    assert len(scores) == len(ids) and [s.token_id for s in scores] == ids
    assert scores[0].logprob is None and scores[0].top == ()
    for score, (logprob, ranks, top) in zip(
        scores[1:], reference(model, ids, k, tol, rel), strict=True
    ):
        assert score.logprob == pytest.approx(logprob, abs=tol, rel=rel)
        assert score.rank in ranks
        assert len(score.top) == k
        if not rel:  # fp32: the same order
            assert [t.token_id for t in score.top] == top


def test_chunked_prompt_is_scored_like_one_forward(tiny_dense: Tiny) -> None:
    loop = new_loop(tiny_dense.runner(), tiny_dense.eos_ids, max_step_tokens=16)
    scored, sink = make_sequence(
        tiny_dense.tokenizer, PROMPT, SamplingParams(max_tokens=3, prompt_logprobs=4), "s"
    )
    # a row that asks for nothing, decoding beside it: its tokens are those it makes alone
    plain, plain_sink = make_sequence(
        tiny_dense.tokenizer, PROMPT[:9], SamplingParams(max_tokens=6)
    )
    alone, alone_sink = make_sequence(
        tiny_dense.tokenizer, PROMPT[:9], SamplingParams(max_tokens=6)
    )
    drive(new_loop(tiny_dense.runner(), tiny_dense.eos_ids), {0: [alone]}, [alone_sink])
    drive(loop, {0: [plain, scored]}, [sink, plain_sink])
    check(sink.events[0].prompt, PROMPT, tiny_dense.model, 4, 1e-4)
    assert all(e.prompt is None for e in sink.events[1:])
    assert plain_sink.events[0].prompt is None  # asked for nothing, gets nothing
    assert plain_sink.token_ids == alone_sink.token_ids
    assert len(sink.token_ids) == 3 and sink.finish_reason is FinishReason.LENGTH


def test_scored_prompt_takes_no_cached_prefix(tiny_dense: Tiny) -> None:
    loop = new_loop(tiny_dense.runner(), tiny_dense.eos_ids)
    first, first_sink = make_sequence(tiny_dense.tokenizer, PROMPT, SamplingParams(max_tokens=1))
    drive(loop, {0: [first]}, [first_sink])
    again, again_sink = make_sequence(tiny_dense.tokenizer, PROMPT, SamplingParams(max_tokens=1))
    drive(loop, {0: [again]}, [again_sink])
    assert again.cached_prompt_tokens == 64  # the cache holds the prompt's full blocks
    scored, sink = make_sequence(
        tiny_dense.tokenizer, PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=2)
    )
    drive(loop, {0: [scored]}, [sink])
    assert scored.cached_prompt_tokens == 0
    check(sink.events[0].prompt, PROMPT, tiny_dense.model, 2, 1e-4)
    assert sink.token_ids == first_sink.token_ids


def test_preempted_while_scoring_keeps_every_score_once(tiny_dense: Tiny) -> None:
    loop = new_loop(tiny_dense.runner(num_blocks=8), tiny_dense.eos_ids, max_step_tokens=16)
    scored, sink = make_sequence(
        tiny_dense.tokenizer, PROMPT[:40], SamplingParams(max_tokens=60, prompt_logprobs=1), "s"
    )
    other, other_sink = make_sequence(
        tiny_dense.tokenizer, PROMPT[:20], SamplingParams(max_tokens=60)
    )
    preempted = preemptions(loop)
    drive(loop, {0: [other, scored]}, [sink, other_sink])
    assert preempted  # 8 blocks of 16 hold 128 tokens: the two rows need 180
    check(sink.events[0].prompt, PROMPT[:40], tiny_dense.model, 1, 1e-4)


def test_max_tokens_zero_returns_the_prompt_only(tiny_dense: Tiny) -> None:
    loop = new_loop(tiny_dense.runner(), tiny_dense.eos_ids, max_step_tokens=16)
    scored, sink = make_sequence(
        tiny_dense.tokenizer, PROMPT, SamplingParams(max_tokens=0, prompt_logprobs=0), "s"
    )
    echoed, echo_sink = make_sequence(tiny_dense.tokenizer, PROMPT, SamplingParams(max_tokens=0))
    echoed.prompt_text = "the prompt"
    drive(loop, {0: [scored, echoed]}, [sink, echo_sink])
    for s in (sink, echo_sink):
        assert len(s.events) == 1 and s.finish_reason is FinishReason.LENGTH
        assert s.token_ids == [] and s.events[0].usage is not None
        assert s.events[0].usage.generated_tokens == 0
    check(sink.events[0].prompt, PROMPT, tiny_dense.model, 0, 1e-4)
    prompt = echo_sink.events[0].prompt
    assert prompt is not None and prompt.text == "the prompt" and prompt.logprobs == ()


@pytest.mark.parametrize(("attention", "kernel"), [("auto", "auto"), ("torch", "int4_op")])
def test_gptq_runner_scores_like_the_gptq_model(
    tiny_gptq: Any, attention: str, kernel: str
) -> None:
    """The native kernels (default flags) and the test servers' flags: both score the prompt as
    the GPTQ model's own forward does, within bf16 rounding (the random model's logits are
    large: bf16 steps by 0.5 at 64)."""
    runner = ModelRunner(
        tiny_gptq.model, torch.device("cpu"), 64, 16, attention=attention, kernel=kernel,
        autotune_cache=tune_cache(),
    )  # fmt: skip
    loop = new_loop(runner, tiny_gptq.eos_ids, max_step_tokens=16)
    seq, sink = make_sequence(
        tiny_gptq.tokenizer, PROMPT, SamplingParams(max_tokens=2, prompt_logprobs=3)
    )
    drive(loop, {0: [seq]}, [sink])
    check(sink.events[0].prompt, PROMPT, tiny_gptq.model, 3, 0.05, rel=0.02)


def test_null_runner_returns_every_position_of_a_scored_row(tiny_dense: Tiny) -> None:
    """The model-free runner (benchmarks of the engine) follows the same logits layout: a row
    scoring its prompt gets a row of logits per token fed, the others one or none."""
    from predictor.engine.runners.null import NullRunner
    from predictor.engine.step import StepRow

    runner = NullRunner(len(tiny_dense.tokenizer), 64)
    rows = [
        StepRow([0], 3, [7], logits=True),
        StepRow([1, 2], 0, list(range(20)), logits=False, all_logits=True),
        StepRow([3], 0, [1, 2, 3], logits=False),
    ]
    assert runner.forward(rows).shape[0] == 1 + 20
    loop = new_loop(runner, tiny_dense.eos_ids, max_step_tokens=16)
    seq, sink = make_sequence(
        tiny_dense.tokenizer, PROMPT, SamplingParams(max_tokens=2, prompt_logprobs=1)
    )
    drive(loop, {0: [seq]}, [sink])
    prompt = sink.events[0].prompt
    assert prompt is not None and len(prompt.logprobs) == len(PROMPT)
    assert all(p.logprob is not None and p.rank is not None for p in prompt.logprobs[1:])
