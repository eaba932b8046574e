"""Speculative decoding: the proposers, the policy, and the step loop verifying drafts: the same
tokens as without drafts (greedy, seeded sampling, a grammar), through preemption and cancel."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from predictor.engine.drafting import Speculation
from predictor.engine.grammar import Grammars
from predictor.engine.request import Request
from predictor.engine.runners.cpu import ModelRunner
from predictor.engine.speculation import (
    ContextIndex,
    Policy,
    Proposer,
    SpeculationConfig,
)
from predictor.engine.step import StepStats
from predictor.model.loader import LoadedModel, load_checkpoint
from predictor.types import FinishReason, Grammar, SamplingParams
from tests.engine.conftest import Collected, Tiny, drive, make_sequence, new_loop, preemptions
from tests.support import tune_cache, worker_cores

NO_EOS: frozenset[int] = frozenset()


class Corrupting(Proposer):
    """A proposer whose drafts are partly wrong, on purpose, so that the rejection path runs at
    every position. Each call in turn: the drafts as found; the second one changed; every one
    changed."""

    calls = 0

    def propose(
        self, state: Any, tokens: Any, salt: str | None, limit: int, useful: Any = None
    ) -> list[int]:
        drafts = self.found(state, tokens, salt, limit)
        self.calls += 1
        turn = self.calls % 3
        if turn == 1 and len(drafts) > 1:
            drafts[1] += 1
        elif turn == 2:
            drafts = [t + 1 for t in drafts]
        return drafts

    def found(self, state: Any, tokens: Any, salt: str | None, limit: int) -> list[int]:
        # the tiny fp32 model repeats itself: where nothing is found, its last token again
        return super().propose(state, tokens, salt, limit) or [tokens[-1]] * limit


class Oracle(Corrupting):
    """Drafts the tokens a run without drafts produced (corrupted in turn, as above)."""

    def __init__(self, config: SpeculationConfig, runs: list[tuple[list[int], list[int]]]):
        super().__init__(config)
        self.runs = runs

    def found(self, state: Any, tokens: Any, salt: str | None, limit: int) -> list[int]:
        for prompt, out in self.runs:
            if list(tokens[: len(prompt)]) == prompt:
                done = len(tokens) - len(prompt)
                return out[done : done + limit]
        return []


class Always(Policy):
    """Grants every draft offered, whatever the steps cost."""

    def __init__(self) -> None:
        super().__init__(None)

    def choose(self, rows: int, offers: Any) -> list[int]:
        return [count for count, *_ in offers]


def free_drafts(mode: str = "ngram", k: int = 4) -> Speculation:
    """Drafts every step they are offered, some accepted, some rejected at the first position,
    some after it."""
    return Speculation(Corrupting(SpeculationConfig(mode, k)), Always())


# -- proposers and policy (no model) --------------------------------------------------------------


def test_ngram_drafts_what_followed_the_latest_earlier_occurrence() -> None:
    proposer = Proposer(SpeculationConfig("ngram", 4, min_n=2))
    state = proposer.state()
    text = [5, 6, 7, 8, 9, 1, 2, 5, 6]
    assert proposer.propose(state, text, None, 4) == [7, 8, 9, 1]
    assert proposer.propose(state, [*text, 7, 3, 5, 6], None, 4) == [7, 3, 5]  # the latest
    assert proposer.propose(proposer.state(), [1, 2, 3, 4], None, 4) == []  # nothing repeats
    assert proposer.propose(proposer.state(), [4, 1, 4], None, 4) == []  # shorter than min_n


def test_the_global_index_drafts_for_the_same_salt_only() -> None:
    proposer = Proposer(SpeculationConfig("suffix", 4, min_n=2))
    answer = [40, 41, 42, 43, 44, 45]
    proposer.finished([1, 2, 3, *answer], 3, "tenant-a")
    asking = [9, 9, 40, 41]
    assert proposer.propose(proposer.state(), asking, "tenant-a", 4) == [42, 43, 44, 45]
    assert proposer.propose(proposer.state(), asking, "tenant-b", 4) == []
    assert proposer.propose(proposer.state(), asking, None, 4) == []
    ngram = Proposer(SpeculationConfig("ngram", 4, min_n=2))
    ngram.finished([1, 2, 3, *answer], 3, "tenant-a")  # ngram keeps no global index
    assert ngram.propose(ngram.state(), asking, "tenant-a", 4) == []


def test_the_global_index_is_bounded() -> None:
    index = ContextIndex(max_n=2, max_entries=50)
    index.add(list(range(1000)))
    assert len(index) == 50
    assert index.propose([997, 998], 1, 1) == ([999], 2)  # the newest contexts stay


def test_many_salts_share_one_bound() -> None:
    """A client sending a new cache_salt with every request grows no index past the bound."""
    proposer = Proposer(SpeculationConfig("suffix", 4, min_n=2, global_entries=300))
    for tenant in range(200):
        proposer.finished([1, 2, 3, 40 + tenant, 41, 42, 43], 3, f"salt-{tenant}")
    assert len(proposer._global) == 300
    asking = [9, 9, 40 + 199, 41]  # the latest tenant's answer is still there, for it only
    assert proposer.propose(proposer.state(), asking, "salt-199", 2) == [42, 43]
    assert proposer.propose(proposer.state(), asking, "salt-198", 2) == []


def test_a_row_follows_a_recent_answer_in_order() -> None:
    """Answers of one shape (JSON fields: key, `": "`, a value, `", "`): after this row's own
    value, the field that came next in the last answer is drafted, where the index of answers
    offers the latest field seen after `", "`, whichever it was."""
    key, colon, comma = {"name": 31, "city": 32, "date": 33}, 7, 5
    prompt = [1, 2, 3]
    answer = [key["name"], colon, 100, comma, key["city"], colon, 101, comma, key["date"], 9]
    proposer = Proposer(SpeculationConfig("suffix", 4, min_n=1))
    proposer.finished(prompt + answer, len(prompt), "tenant")
    state = proposer.state()
    text = prompt + [key["name"]]
    assert proposer.propose(state, text, "tenant", 4) == [colon, 100, comma, key["city"]]
    text += [colon, 200]  # its own value: the answer followed up to the colon
    proposer.propose(state, text, "tenant", 4)
    text += [comma]
    assert proposer.propose(state, text, "tenant", 4) == [key["city"], colon, 101, comma]
    assert proposer._global.propose(text, 4, 1, ("tenant",))[0][0] == key["date"]  # the latest
    other = proposer.state()  # another tenant's row follows nothing of this one's
    assert proposer.propose(other, prompt + [key["name"]], "other", 4) == []


def test_policy_grants_drafts_while_they_add_tokens_faster_than_the_step() -> None:
    # the runner's matmul figures: 10 ms a step, 0.2 ms per token fed
    policy = Policy(lambda fed, rows: 0.010 + 0.0002 * fed, explore_every=1000)
    assert policy.choose(1, [(4, 0.9, 0.9)]) == [0]  # first a plain step, measured
    policy.observe(1, 0, 0.015)
    assert policy.choose(1, [(4, 0.9, 0.9)]) == [4]  # a draft costs 0.2 ms, as the figures say
    # measured: 4 drafts made the step 12 ms longer (3 ms each, a fifth of a step)
    policy.observe(1, 4, 0.027)
    assert policy.per_draft(1) == pytest.approx(0.003)
    assert policy.choose(1, [(4, 0.9, 0.9)]) == [4]  # 0.9 ** 4 = 0.66 of a token for 3 ms
    assert policy.choose(1, [(4, 0.3, 0.3)]) == [1]  # its second: 0.09 of a token, too dear
    assert policy.choose(1, [(4, 0.15, 0.15)]) == [0]  # free chat: nothing pays
    # two rows: the likelier drafts first, and they raise the bar: after them a draft of the
    # doubtful row (0.4 of a token) adds tokens slower than the step now makes them
    policy.observe(2, 0, 0.016)
    assert policy.choose(2, [(4, 0.4, 0.4), (4, 0.95, 0.95)]) == [0, 4]
    assert policy.choose(2, [(4, 0.4, 0.4), (0, 0.95, 0.95)]) == [1, 0]
    # 16 rows: a draft must make nearly a row's share of the step's tokens
    policy.observe(16, 0, 0.040)
    policy.observe(16, 16, 0.080)  # 2.5 ms each
    assert policy.choose(16, [(4, 0.9, 0.9)] * 16) == [0] * 16
    assert policy.choose(16, [(4, 0.9, 0.9)] * 16) == [0] * 16


def test_the_first_draft_of_a_step_costs_what_was_measured() -> None:
    """A step with any drafts costs more than its drafts' own share (the verification's fixed
    work): fitted from steps of different draft counts, it keeps a guess from a step where the
    eight drafts of a copy would pay."""
    policy = Policy(None)
    policy.observe(1, 0, 0.010)
    for _ in range(5):
        policy.observe(1, 1, 0.013)  # one draft: 3 ms more
        policy.observe(1, 8, 0.020)  # eight: 10 ms more
    assert policy.per_draft(1) == pytest.approx(0.001)
    assert policy.first_draft(1) == pytest.approx(0.002)
    assert policy.choose(1, [(1, 0.3, 0.3)]) == [0]  # 0.3 of a token for 3 ms: too dear
    assert policy.choose(1, [(8, 0.9, 0.95)]) == [8]


def test_policy_tries_a_declined_draft_again_now_and_then() -> None:
    policy = Policy(None, explore_every=3)
    policy.observe(1, 0, 0.010)
    policy.observe(1, 1, 0.030)  # measured in a noisy moment: 20 ms a draft
    assert [policy.choose(1, [(2, 0.8, 0.8)]) for _ in range(3)] == [[0], [0], [1]]
    policy.observe(1, 1, 0.011)  # measured again
    assert policy.per_draft(1) < 0.020
    # unmeasured, no figures: a draft costs a tenth of a plain step
    fresh = Policy(None)
    fresh.observe(4, 0, 0.020)
    assert fresh.per_draft(4) == pytest.approx(0.002)


def test_drafts_are_as_likely_as_their_kind_of_match_was_accepted() -> None:
    """What each kind of match (by source and matched length) was worth carries to the next
    rows: a long copied span is drafted on, a guess from one token of context stays doubtful."""
    proposer = Proposer(SpeculationConfig("ngram", 4, max_n=4))
    first = proposer.state()
    text = [5, 6, 7, 8, 9, 1, 2, 5, 6, 7, 8]
    assert proposer.propose(first, text, None, 4) == [9, 1, 2, 5]  # 4 tokens matched (max_n)
    for _ in range(20):
        first.observe(4, 4)  # every draft accepted
    assert min(first.chances) > 0.9
    guess = proposer.state()
    assert proposer.propose(guess, [3, 4, 1, 9, 4], None, 4) == [1, 9]  # 1 token matched
    assert guess.chances == pytest.approx((0.5, 0.5))  # nothing known of this kind yet
    for _ in range(20):
        guess.observe(2, 0)  # nothing accepted, again and again
    assert guess.chances[0] < 0.1
    later = proposer.state()  # the next row: a guess doubtful, a long match likely
    assert proposer.propose(later, [5, 3, 5], None, 4) == [3]
    assert later.chances[0] < 0.1
    assert proposer.propose(later, [*text, 9], None, 4) == [1, 2, 5, 6]
    assert min(later.chances) > 0.9


def test_rows_draft_no_further_than_the_policy_could_grant() -> None:
    """`Policy.useful` bounds what `choose` grants a row of such chances (so the proposer need
    not draft further: drafting is what a busy step's rows pay for, mostly in vain)."""
    policy = Policy(None)
    for rows, plain, per_draft in ((1, 0.010, 0.001), (16, 0.040, 0.004)):
        policy.observe(rows, 0, plain)
        for drafts in (2, 4, 8):
            policy.observe(rows, drafts, plain + drafts * per_draft)
    rng = random.Random(0)
    for _ in range(300):
        rows = rng.choice((1, 16))
        offers = [(8, rng.random(), rng.random()) for _ in range(rng.randint(1, rows))]
        granted = policy.choose(rows, offers)
        for (_, first, later), count in zip(offers, granted, strict=True):
            assert count <= max(1, policy.useful(rows, first, later))  # 1: an exploration
    assert policy.useful(1, 0.96, 0.98) > 8 and policy.useful(16, 0.3, 0.5) == 0
    proposer = Proposer(SpeculationConfig("ngram", 4))
    text = [1, 2, 3, 4, 9, 1, 2]
    assert proposer.propose(proposer.state(), text, None, 4) == [3, 4, 9, 1]
    assert proposer.propose(proposer.state(), text, None, 4, lambda first, later: 2) == [3, 4]
    assert proposer.propose(proposer.state(), text, None, 4, lambda first, later: 0) == [3]


def test_a_copy_once_started_goes_on() -> None:
    """The first draft of a kind may be a coin toss where the ones after it are near sure:
    both chances are learnt, and the policy grants the whole run or none of it."""
    proposer = Proposer(SpeculationConfig("ngram", 4))
    state = proposer.state()
    assert proposer.propose(state, [1, 2, 3, 4, 9, 1, 2], None, 4) == [3, 4, 9, 1]
    for turn in range(40):
        state.observe(4, 4 if turn % 2 else 0)  # every other first draft right, then all
    first, later = state.chances
    assert first == pytest.approx(0.5, abs=0.05)
    assert later > 0.9
    policy = Policy(None)
    policy.observe(1, 0, 0.010)
    policy.observe(1, 4, 0.014)  # 1 ms a draft
    assert policy.choose(1, [(4, first, later)]) == [4]
    for _ in range(10):
        policy.observe(1, 4, 0.034)  # drafts dear now: 6 ms each
    assert policy.choose(1, [(4, first, later)]) == [0]


def test_the_better_kind_of_match_of_own_text_and_recent_answers_drafts() -> None:
    proposer = Proposer(SpeculationConfig("suffix", 3, max_n=3))
    proposer.finished([1, 2, 3, 40, 41, 42, 43, 44], 3, None)  # an earlier answer
    state = proposer.state()
    asking = [42, 50, 41, 42]  # own text: 42 then 50 (1 token matched); answers: 41 42 43 44
    for _ in range(2):  # the answer followed in order, then the index of answers
        assert proposer.propose(state, asking, None, 3) == [43, 44]  # 2 matched beat 1
        for _ in range(10):
            state.observe(2, 0)  # this kind turns out wrong here
    assert proposer.propose(state, asking, None, 3) == [50, 41]  # the row's own now


# -- the step loop ------------------------------------------------------------------------------


def copying_prompts(tiny: Tiny, count: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a span of themselves (the shape of a copy-heavy request)."""
    rng = random.Random(seed)
    vocab = len(tiny.tokenizer)
    out = []
    for _ in range(count):
        span = [rng.randrange(100, vocab) for _ in range(rng.randint(6, 20))]
        out.append(span + [rng.randrange(100, vocab)] + span[: rng.randint(3, len(span))])
    return out


def run(
    tiny: Tiny,
    prompts: list[list[int]],
    params: list[SamplingParams],
    speculation: Speculation | None = None,
    num_blocks: int = 256,
    block_size: int = 16,
    matchers: list[Any] | None = None,
    **loop_args: Any,
) -> tuple[list[Collected], list[Request], list[StepStats]]:
    runner = tiny.runner(num_blocks=num_blocks, block_size=block_size)
    loop = new_loop(runner, NO_EOS, speculation=speculation, **loop_args)
    requests, sinks = [], []
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        request, sink = make_sequence(tiny.tokenizer, prompt, p, f"r{i}")
        if matchers is not None:
            request.matcher = matchers[i]
        requests.append(request)
        sinks.append(sink)
    stats: list[StepStats] = []
    step = loop.step

    def recorded() -> StepStats:
        stats.append(step())
        return stats[-1]

    loop.step = recorded  # type: ignore[method-assign]
    drive(loop, {0: requests[: len(requests) // 2 + 1], 3: requests[len(requests) // 2 + 1 :]},
          sinks)  # fmt: skip
    assert loop.scheduler.allocator.used == 0
    return sinks, requests, stats


def test_greedy_tokens_are_the_same_with_and_without_drafts(tiny_dense: Tiny) -> None:
    prompts = copying_prompts(tiny_dense, 5)
    params = [SamplingParams(max_tokens=n) for n in (30, 24, 40, 17, 33)]
    plain, _, _ = run(tiny_dense, prompts, params)
    drafted, requests, stats = run(tiny_dense, prompts, params, free_drafts())
    assert [s.token_ids for s in drafted] == [s.token_ids for s in plain]
    assert [s.text for s in drafted] == [s.text for s in plain]
    assert all(s.finish_reason is FinishReason.LENGTH for s in drafted)
    drafts = sum(s.draft_tokens for s in stats)
    assert drafts == sum(r.draft_tokens for r in requests) > 0
    accepted = sum(s.accepted_tokens for s in stats)
    assert 0 < accepted == sum(r.accepted_tokens for r in requests) < drafts  # some rejected
    positions = [p for s in stats for p in range(len(s.accepted_per_position))]
    assert 0 in positions and 1 in positions
    assert len(stats) < len(plain[0].events) + 40  # fewer steps than tokens: drafts were kept
    usage = drafted[0].events[-1].usage
    assert usage is not None and usage.accepted_draft_tokens == requests[0].accepted_tokens
    for s in stats:  # per position: no more rows kept a later draft than an earlier one
        assert list(s.accepted_per_position) == sorted(s.accepted_per_position, reverse=True)
        assert sum(s.accepted_per_position) == s.accepted_tokens


class Timed(Always):
    """Grants every draft and keeps what the step loop reports of each step."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[tuple[int, int, float]] = []

    def observe(self, rows: int, drafts: int, seconds: float) -> None:
        self.steps.append((rows, drafts, seconds))
        super().observe(rows, drafts, seconds)


def test_the_step_loop_times_each_decode_step_for_the_policy(tiny_dense: Tiny) -> None:
    prompts = copying_prompts(tiny_dense, 5, seed=4)
    params = [SamplingParams(max_tokens=12 + i, ignore_eos=True) for i in range(5)]
    policy = Timed()
    _, requests, stats = run(
        tiny_dense, prompts, params, Speculation(Corrupting(SpeculationConfig()), policy)
    )
    assert len(policy.steps) < len(stats)  # the steps with a prompt chunk are not timed
    assert all(rows >= 1 and seconds > 0 for rows, _, seconds in policy.steps)
    assert sum(d for _, d, _ in policy.steps) == sum(r.draft_tokens for r in requests) > 0
    assert any(d == 0 for _, d, _ in policy.steps)  # plain steps too (the steps' first)
    assert policy.plain(1) > 0 and policy.per_draft(1) >= 0


def test_seeded_sampling_gives_the_same_tokens_with_and_without_drafts(tiny_dense: Tiny) -> None:
    prompts = copying_prompts(tiny_dense, 4, seed=3)
    params = [
        SamplingParams(max_tokens=25, temperature=0.7, top_p=0.95, top_k=40, seed=11),
        SamplingParams(max_tokens=20, temperature=0.3, seed=12, repetition_penalty=1.1),
        SamplingParams(max_tokens=22, temperature=1.0, seed=13, logprobs=2),
        SamplingParams(max_tokens=18, min_tokens=5, presence_penalty=0.5),
    ]
    plain, _, _ = run(tiny_dense, prompts, params)
    drafted, requests, _ = run(tiny_dense, prompts, params, free_drafts("suffix"))
    assert [s.token_ids for s in drafted] == [s.token_ids for s in plain]
    logprobs = [lp.logprob for s in plain for e in s.events for lp in e.logprobs]
    again = [lp.logprob for s in drafted for e in s.events for lp in e.logprobs]
    assert len(logprobs) == 22 and again == pytest.approx(logprobs, abs=1e-5)
    assert sum(r.draft_tokens for r in requests) > 0


def test_stop_strings_and_opting_out_hold_with_drafts(tiny_dense: Tiny) -> None:
    prompts = copying_prompts(tiny_dense, 2, seed=7)
    plain, _, _ = run(tiny_dense, prompts, [SamplingParams(max_tokens=30)] * 2)
    stop = plain[0].text[5:8]  # a string the greedy text reaches
    params = [SamplingParams(max_tokens=30, stop=(stop,)), SamplingParams(max_tokens=30,
              speculative=False)]  # fmt: skip
    without, _, _ = run(tiny_dense, prompts, params)
    drafted, requests, _ = run(tiny_dense, prompts, params, free_drafts())
    assert drafted[0].finish_reason is FinishReason.STOP and drafted[0].text == without[0].text
    assert drafted[1].token_ids == without[1].token_ids
    assert requests[1].speculation is None and requests[1].draft_tokens == 0


def test_a_grammar_checks_the_drafts(tiny_dense: Tiny, grammars: Grammars) -> None:
    grammar = Grammar("regex", r"(ab|cd){3,12}")
    compiled = grammars.compile(grammar)
    prompts = copying_prompts(tiny_dense, 2, seed=9)
    params = [SamplingParams(max_tokens=24, grammar=grammar)] * 2

    def matchers() -> list[Any]:
        return [grammars.matcher(compiled) for _ in prompts]

    plain, _, _ = run(tiny_dense, prompts, params, matchers=matchers())
    drafted, requests, _ = run(tiny_dense, prompts, params, free_drafts(), matchers=matchers())
    assert [s.text for s in drafted] == [s.text for s in plain]
    import re

    assert all(re.fullmatch(r"(ab|cd){3,12}", s.text) for s in drafted)
    assert sum(r.draft_tokens for r in requests) > 0


def test_preemption_between_verifications_keeps_every_stream(tiny_dense: Tiny) -> None:
    """A cache too small for every row: rows that verified drafts are preempted, recomputed
    and resumed, and every stream is the one it is alone."""
    prompts = copying_prompts(tiny_dense, 6, seed=4)
    params = [SamplingParams(max_tokens=28)] * 6
    alone = [run(tiny_dense, [p], [params[0]])[0][0].token_ids for p in prompts]
    runner = tiny_dense.runner(num_blocks=16, block_size=4)
    loop = new_loop(runner, NO_EOS, max_batch_size=6, speculation=free_drafts())
    preempted = preemptions(loop)
    requests, sinks = [], []
    for i, p in enumerate(prompts):
        request, sink = make_sequence(tiny_dense.tokenizer, p, params[i], f"p{i}")
        requests.append(request)
        sinks.append(sink)

    def audit(step: int) -> None:
        loop.scheduler.allocator.audit(r.blocks for r in loop.scheduler.running)

    drive(loop, {0: requests}, sinks, each_step=audit)
    assert preempted and any(r.preemptions and r.draft_tokens for r in requests)
    assert [s.token_ids for s in sinks] == alone
    assert loop.scheduler.allocator.used == 0


def test_a_row_cancelled_after_verifying_frees_its_blocks(tiny_dense: Tiny) -> None:
    prompts = copying_prompts(tiny_dense, 2, seed=5)
    loop = new_loop(tiny_dense.runner(), NO_EOS, speculation=free_drafts())
    (a, sa), (b, sb) = (
        make_sequence(tiny_dense.tokenizer, p, SamplingParams(max_tokens=60), f"c{i}")
        for i, p in enumerate(prompts)
    )
    loop.scheduler.add(a)
    loop.scheduler.add(b)
    while not a.draft_tokens:
        loop.step()
    a.aborted = True
    loop.step()
    assert sa.finish_reason is FinishReason.CANCELLED and loop.scheduler.running == [b]
    assert loop.scheduler.allocator.used == len(b.blocks)
    while not sb.done:
        loop.step()
    alone, _, _ = run(tiny_dense, [prompts[1]], [SamplingParams(max_tokens=60)])
    assert sb.token_ids == alone[0].token_ids


def test_the_spec_decode_counters(tiny_dense: Tiny) -> None:
    from prometheus_client import CollectorRegistry

    from predictor.observability.metrics import Metrics

    registry = CollectorRegistry()
    metrics = Metrics(registry, "tiny", vllm_aliases=True)
    _, requests, stats = run(tiny_dense, copying_prompts(tiny_dense, 3, seed=8),
                             [SamplingParams(max_tokens=30)] * 3, free_drafts())  # fmt: skip
    for s in stats:
        metrics.observe_step(s)

    def value(name: str, **labels: str) -> float:
        got = registry.get_sample_value(name, {"model": "tiny", **labels})
        alias = name.replace("predictor_", "vllm:")
        theirs = registry.get_sample_value(alias, {"model_name": "tiny", **labels})
        assert got == theirs
        return got or 0.0

    drafts = value("predictor_spec_decode_num_drafts_total")
    tokens = value("predictor_spec_decode_num_draft_tokens_total")
    accepted = value("predictor_spec_decode_num_accepted_tokens_total")
    assert tokens == sum(r.draft_tokens for r in requests) and drafts <= tokens
    assert 0 < accepted == sum(r.accepted_tokens for r in requests)
    first = value("predictor_spec_decode_num_accepted_tokens_per_pos_total", position="0")
    assert 0 < first <= drafts
    per_position = [
        value("predictor_spec_decode_num_accepted_tokens_per_pos_total", position=str(p))
        for p in range(4)
    ]
    assert sum(per_position) == accepted
    assert json.dumps(per_position)  # plain numbers


@pytest.fixture(scope="module")
def bf16(tiny_bf16_dir: Path) -> LoadedModel:
    return load_checkpoint(tiny_bf16_dir, device="cpu", threads=min(2, worker_cores()))


def test_on_the_native_kernels_batch_invariant_drafts_change_no_token(bf16: LoadedModel) -> None:
    """A GPTQ bf16 model on the CPU's own kernels and attention, --batch-invariant: its
    random weights do not just repeat one token, so drafts are rejected at every position;
    greedy and seeded rows are the same with and without them."""
    tiny = Tiny(bf16.model, bf16.tokenizer, frozenset(), bf16.pad_token_id)
    prompts = copying_prompts(tiny, 4, seed=21)
    params = [
        SamplingParams(max_tokens=24, ignore_eos=True),
        SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.8, seed=5),
        SamplingParams(max_tokens=16, ignore_eos=True),
        SamplingParams(max_tokens=22, ignore_eos=True, temperature=1.0, top_k=20, seed=6),
    ]

    def serve(speculation: Speculation | None) -> tuple[list[list[int]], list[Request]]:
        runner = ModelRunner(
            bf16.model,
            torch.device("cpu"),
            128,
            16,
            autotune_cache=tune_cache(),
            batch_invariant=True,
        )
        loop = new_loop(runner, frozenset(), speculation=speculation)
        made = [
            make_sequence(bf16.tokenizer, p, q, f"b{i}")
            for i, (p, q) in enumerate(zip(prompts, params, strict=True))
        ]
        drive(
            loop, {0: [r for r, _ in made[:2]], 2: [r for r, _ in made[2:]]}, [s for _, s in made]
        )
        return [s.token_ids for _, s in made], [r for r, _ in made]

    plain, _ = serve(None)
    oracle = Oracle(SpeculationConfig("ngram", 4), list(zip(prompts, plain, strict=True)))
    drafted, requests = serve(Speculation(oracle, Always()))
    assert drafted == plain
    assert len({t for row in plain for t in row}) > 20  # not one token repeated
    assert 0 < sum(r.accepted_tokens for r in requests) < sum(r.draft_tokens for r in requests)
