"""The prefill section of `Scheduler.schedule`: a new short prompt is not held behind the chunks
of a long one (its first token comes in the next step), the longest-waiting prompt still gets a
quarter of the budget each step, and the budget holds."""

from __future__ import annotations

from predictor.engine.kv_cache import BlockAllocator
from predictor.engine.request import Request
from predictor.engine.scheduler import Schedule, Scheduler, prefill_chunks
from predictor.types import FinishReason, SamplingParams
from tests.engine.conftest import make_sequence


class NoDecoder:
    def decode(self, ids, skip_special_tokens=True):  # type: ignore[no-untyped-def]
        return ""


def seq(prompt_len: int, rid: str) -> Request:
    return make_sequence(NoDecoder(), [1] * prompt_len, SamplingParams(max_tokens=4), rid)[0]


def step(s: Scheduler) -> Schedule:
    """schedule, book the forward pass, and give each row that finished its prompt a token."""
    schedule = s.schedule()
    s.update(schedule)
    for request, row in schedule:
        if row.logits:
            request.output_ids.append(7)
    return schedule


def test_a_new_short_prompt_is_fed_whole_beside_a_long_one() -> None:
    s = Scheduler(8, 10, BlockAllocator(256, 16), max_step_tokens=64, prefix_caching=False)
    long, short = seq(400, "long"), seq(20, "short")
    s.add(long)
    first = step(s)
    assert [len(row.tokens) for row in first.rows] == [64]  # alone: the whole budget
    s.add(short)
    second = step(s)
    # the short prompt whole (its first token this step), the long one the rest of the budget
    fed = {r.request_id: len(row.tokens) for r, row in second}
    assert fed == {"short": 20, "long": 44}
    assert second.requests[0] is short and second.rows[0].logits  # it samples its first token
    assert not second.rows[1].logits
    assert sum(len(row.tokens) for row in second.rows) == 64


def test_the_longest_waiting_prompt_gets_a_quarter_under_a_stream_of_short_ones() -> None:
    s = Scheduler(32, 64, BlockAllocator(1024, 16), max_step_tokens=64, prefix_caching=False)
    long = seq(200, "long")
    s.add(long)
    steps = 0
    while long.prefilling:
        for i in range(3):  # three new 20-token prompts every step: 60 of the 64
            s.add(seq(20, f"short-{steps}-{i}"))
        schedule = step(s)
        fed = {r.request_id: len(row.tokens) for r, row in schedule}
        assert fed["long"] >= min(16, 200 - (long.cached - fed["long"]))
        assert sum(len(row.tokens) for row in schedule.rows) <= 64
        for request in list(s.running):
            if request is not long and not request.prefilling:
                request.finish_reason = request.finish_reason or FinishReason.LENGTH
        s.remove_finished()
        steps += 1
    assert steps <= 200 // 16 + 1  # 64 the first step, then at least 16 a step


def test_chunks_stay_within_the_budget_and_feed_shortest_first() -> None:
    rows = [seq(n, f"r{n}") for n in (100, 30, 10, 50)]
    granted = prefill_chunks(rows, 64)
    assert sum(n for _, n in granted) == 64
    # the oldest (100) keeps 16; then, fewest left first, 10 and 30 whole and 8 of the 50
    assert [(r.request_id, n) for r, n in granted] == [
        ("r10", 10), ("r30", 30), ("r50", 8), ("r100", 16),
    ]  # fmt: skip
    assert prefill_chunks(rows, 0) == []
    assert prefill_chunks(rows[:1], 64) == [(rows[0], 64)]
