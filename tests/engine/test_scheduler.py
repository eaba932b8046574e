import pytest

from predictor.engine.kv_cache import BlockAllocator
from predictor.engine.scheduler import Scheduler
from predictor.errors import Overloaded
from predictor.types import SamplingParams
from tests.engine.conftest import make_sequence


class NoDecoder:
    def decode(self, ids, skip_special_tokens=True):  # type: ignore[no-untyped-def]
        return ""


def seq(prompt_len: int, max_tokens: int, rid: str = "r", deadline: float | None = None):  # type: ignore[no-untyped-def]
    s = make_sequence(NoDecoder(), [1] * prompt_len, SamplingParams(max_tokens=max_tokens), rid)[0]
    s.deadline = deadline
    return s


def test_admits_in_order_within_rows_and_blocks() -> None:
    s = Scheduler(max_batch_size=3, max_waiting=10)
    cache = BlockAllocator(num_blocks=10, block_size=10)  # 100 tokens
    a, b, c, d = seq(10, 20), seq(10, 20), seq(50, 10), seq(1, 1)
    for x in (a, b, c, d):
        s.add(x)
    # a + b reserve 3 + 3 blocks; c needs 6 more of the 4 left: c waits, and d behind it (FCFS)
    assert s.admit(0, cache) == [a, b]
    assert cache.reserved == 6 and a.reserved_blocks == 3
    assert s.admit(2, cache) == []
    cache.release(6)
    assert s.admit(0, cache) == [c, d]
    assert cache.reserved == 7


def test_row_limit() -> None:
    s = Scheduler(max_batch_size=2, max_waiting=10)
    for _ in range(3):
        s.add(seq(1, 1))
    assert len(s.admit(1, BlockAllocator(100, 16))) == 1
    assert s.waiting() == 2


def test_bounded_waiting_queue() -> None:
    s = Scheduler(max_batch_size=1, max_waiting=2)
    s.add(seq(1, 1))
    s.add(seq(1, 1))
    with pytest.raises(Overloaded):
        s.add(seq(1, 1))


def test_aborted_waiting_requests_are_dropped() -> None:
    s = Scheduler(max_batch_size=1, max_waiting=5)
    a, b = seq(1, 1, "a"), seq(1, 1, "b")
    s.add(a)
    s.add(b)
    a.aborted = True
    assert s.drop_aborted() == [a]
    assert s.waiting() == 1


def test_expired_waiting_requests_are_dropped() -> None:
    s = Scheduler(max_batch_size=1, max_waiting=5)
    a, b, c = seq(1, 1, "a", deadline=5.0), seq(1, 1, "b", deadline=50.0), seq(1, 1, "c")
    for x in (a, b, c):
        s.add(x)
    assert s.drop_expired(10.0) == [a]
    assert s.waiting() == 2


def test_allocator_counts_blocks_and_reuses_freed_ones() -> None:
    cache = BlockAllocator(num_blocks=4, block_size=2)
    first = cache.allocate(3)
    assert cache.used == 3 and cache.usage() == 0.75
    cache.free(first[1:2])
    assert cache.used == 2
    assert cache.allocate(1) == first[1:2]  # the block just freed, still warm
    with pytest.raises(MemoryError):
        cache.allocate(2)
    assert cache.can_reserve(4) and not cache.can_reserve(5)
