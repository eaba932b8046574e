import pytest

from predictor.engine.scheduler import Scheduler
from predictor.errors import Overloaded
from predictor.types import SamplingParams
from tests.engine.conftest import make_sequence


class NoDecoder:
    def decode(self, ids, skip_special_tokens=True):  # type: ignore[no-untyped-def]
        return ""


def seq(prompt_len: int, max_tokens: int, rid: str = "r"):  # type: ignore[no-untyped-def]
    return make_sequence(NoDecoder(), [1] * prompt_len, SamplingParams(max_tokens=max_tokens), rid)[
        0
    ]


def test_admits_in_order_within_rows_and_tokens() -> None:
    s = Scheduler(max_batch_size=3, max_cache_tokens=100, max_waiting=10)
    a, b, c, d = seq(10, 20), seq(10, 20), seq(50, 10), seq(1, 1)
    for x in (a, b, c, d):
        s.add(x)
    # a + b = 60 tokens; c would make 120 > 100: c waits, and d behind it waits too (FCFS)
    assert s.admit(running_rows=0, running_tokens=0) == [a, b]
    assert s.admit(running_rows=2, running_tokens=60) == []
    assert s.admit(running_rows=0, running_tokens=0) == [c, d]


def test_row_limit() -> None:
    s = Scheduler(max_batch_size=2, max_cache_tokens=1000, max_waiting=10)
    for _ in range(3):
        s.add(seq(1, 1))
    assert len(s.admit(running_rows=1, running_tokens=0)) == 1
    assert s.waiting() == 2


def test_oversized_request_runs_alone() -> None:
    s = Scheduler(max_batch_size=4, max_cache_tokens=10, max_waiting=10)
    big = seq(20, 20)
    s.add(big)
    assert s.admit(running_rows=0, running_tokens=0) == [big]


def test_bounded_waiting_queue() -> None:
    s = Scheduler(max_batch_size=1, max_cache_tokens=10, max_waiting=2)
    s.add(seq(1, 1))
    s.add(seq(1, 1))
    with pytest.raises(Overloaded):
        s.add(seq(1, 1))


def test_aborted_waiting_requests_are_dropped() -> None:
    s = Scheduler(max_batch_size=1, max_cache_tokens=10, max_waiting=5)
    a, b = seq(1, 1, "a"), seq(1, 1, "b")
    s.add(a)
    s.add(b)
    a.aborted = True
    assert s.drop_aborted() == [a]
    assert s.waiting() == 1
