import pytest

from predictor.engine.kv_cache import BlockAllocator
from predictor.engine.scheduler import Scheduler
from predictor.errors import Overloaded
from predictor.types import FinishReason, SamplingParams
from tests.engine.conftest import make_sequence


class NoDecoder:
    def decode(self, ids, skip_special_tokens=True):  # type: ignore[no-untyped-def]
        return ""


def seq(prompt_len: int, max_tokens: int, rid: str = "r", deadline: float | None = None):  # type: ignore[no-untyped-def]
    s = make_sequence(NoDecoder(), [1] * prompt_len, SamplingParams(max_tokens=max_tokens), rid)[0]
    s.deadline = deadline
    return s


def test_admits_in_order_by_prompt_blocks_with_headroom() -> None:
    cache = BlockAllocator(num_blocks=10, block_size=10)  # 100 tokens, headroom 1 block
    s = Scheduler(max_batch_size=3, max_waiting=10, allocator=cache)
    a, b, c, d = seq(10, 90), seq(10, 90), seq(75, 10), seq(1, 1)
    for x in (a, b, c, d):
        s.add(x)
    # a and b take their prompt's block each (max_tokens reserves nothing); c needs 8 of the
    # 8 left plus the headroom: c waits, and d behind it (FCFS)
    assert s.schedule().admitted == [a, b]
    assert cache.used == 2 and len(a.blocks) == 1 and len(b.blocks) == 1
    assert s.schedule().admitted == []
    a.finish_reason = FinishReason.LENGTH
    s.remove_finished()
    assert s.schedule().admitted == [c]  # 8 + 1 of 9; d would leave no headroom
    assert cache.used == 9 and len(c.blocks) == 8
    s.running.clear()
    s.allocator = BlockAllocator(1, 10)
    assert s.schedule().admitted == [d]  # a lone request needs no headroom


def test_a_prefix_hit_takes_the_cached_blocks_and_never_the_last_token() -> None:
    cache = BlockAllocator(num_blocks=20, block_size=4)
    s = Scheduler(max_batch_size=4, max_waiting=10, allocator=cache)
    first = seq(12, 4, "first")
    s.add(first)
    assert s.admit() == [first]
    for i, key in enumerate(first.block_keys(3, 4)):  # as the step loop does once computed
        cache.register(first.blocks[i], key)
    cache.free(first.blocks)  # finished: its blocks stay cached
    assert cache.used == 0 and cache.available == 20 and cache.cached == 3
    same, longer = seq(12, 4, "same"), seq(14, 4, "longer")
    s.add(same)
    s.add(longer)
    assert s.admit() == [same, longer]
    assert same.blocks[:2] == first.blocks[:2] and same.blocks[2] != first.blocks[2]
    assert same.cached == 8  # 12 tokens: the last block is computed for the last token
    assert longer.blocks[:3] == first.blocks and longer.cached == 12
    assert same.cached_prompt_tokens == 8 and longer.cached_prompt_tokens == 12
    cache.audit([same.blocks, longer.blocks])


def test_row_limit() -> None:
    s = Scheduler(max_batch_size=2, max_waiting=10, allocator=BlockAllocator(100, 16))
    for _ in range(3):
        s.add(seq(1, 1))
    assert len(s.schedule().admitted) == 2
    s.add(seq(1, 1))
    assert s.schedule().admitted == []
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
    assert cache.available == 1


def test_a_schedule_feeds_decode_rows_first_then_prompt_chunks_within_the_budget() -> None:
    cache = BlockAllocator(num_blocks=64, block_size=4)
    s = Scheduler(4, 10, cache, max_step_tokens=8, prefix_caching=False)
    old, new = seq(6, 5, "old"), seq(20, 5, "new")
    s.add(old)
    first = s.schedule()
    assert first.admitted == [old] and first.decode_rows == 0
    assert [len(row.tokens) for row in first.rows] == [6] and first.rows[0].logits
    s.update(first)
    old.output_ids.append(7)  # as the step loop samples it
    s.add(new)
    second = s.schedule()
    # the decoding row's one token first, then 7 of the new prompt's 20 (budget 8)
    assert second.requests == [old, new] and second.decode_rows == 1
    assert [(row.start, len(row.tokens)) for row in second.rows] == [(6, 1), (0, 7)]
    assert not second.rows[1].logits  # a chunk short of the prompt's end samples nothing
    s.update(second)
    assert (old.cached, new.cached) == (7, 7)


def test_an_echo_only_request_is_admitted_and_released_with_nothing_to_run() -> None:
    cache = BlockAllocator(num_blocks=16, block_size=4)
    s = Scheduler(max_batch_size=4, max_waiting=10, allocator=cache)
    echo = seq(9, 0, "echo")
    echo.echo_only = True
    s.add(echo)
    schedule = s.schedule()
    assert schedule.echoed == [echo] and not schedule.rows and not s.running
    assert cache.used == 0


def prioritized(prompt_len: int, priority: int, rid: str):  # type: ignore[no-untyped-def]
    params = SamplingParams(max_tokens=40, priority=priority)
    return make_sequence(NoDecoder(), [1] * prompt_len, params, rid)[0]


def test_the_queue_admits_by_priority_then_arrival() -> None:
    s = Scheduler(max_batch_size=1, max_waiting=10, allocator=BlockAllocator(64, 4))
    late, urgent, later, urgent_too = (prioritized(4, p, r) for p, r in
                                       [(0, "late"), (-5, "urgent"), (0, "later"), (-5, "too")])  # fmt: skip
    for request in (late, urgent, later, urgent_too):
        s.add(request)
    admitted = []
    for _ in range(4):
        admitted += s.schedule().admitted
        s.running[0].finish_reason = FinishReason.LENGTH
        s.remove_finished()
    assert admitted == [urgent, urgent_too, late, later]


def test_a_waiting_request_preempts_running_rows_of_a_lower_priority() -> None:
    s = Scheduler(max_batch_size=2, max_waiting=10, allocator=BlockAllocator(64, 4))
    batch, equal = prioritized(4, 3, "batch"), prioritized(4, 0, "equal")
    s.add(batch)
    s.add(equal)
    assert s.schedule().admitted == [equal, batch]
    same = prioritized(4, 3, "same")
    s.add(same)  # the batch is full: a request no more urgent than any running row waits
    assert s.schedule().preempted == [] and s.waiting() == 1
    urgent = prioritized(4, -1, "urgent")
    s.add(urgent)  # it goes first, and takes the row of the lowest priority
    schedule = s.schedule()
    assert schedule.preempted == [batch] and schedule.admitted == [urgent]
    assert s.running == [equal, urgent] and batch.blocks == [] and batch.preemptions == 1
    assert s.waiting() == 2 and list(s.queue) == [batch, same]  # priority 3, by arrival
    s.allocator.audit([equal.blocks, urgent.blocks])


def test_a_dry_cache_preempts_the_lowest_priority_row_first() -> None:
    cache = BlockAllocator(num_blocks=7, block_size=4)
    s = Scheduler(max_batch_size=3, max_waiting=10, allocator=cache, prefix_caching=False)
    background, normal, urgent = (prioritized(8, p, r) for p, r in
                                  [(5, "background"), (0, "normal"), (-1, "urgent")])  # fmt: skip
    s.add(background)  # alone: the oldest row, and the least urgent
    first = s.schedule()
    s.update(first)
    background.output_ids.append(7)
    s.add(normal)
    s.add(urgent)
    second = s.schedule()  # both admitted, and the background row takes the last block
    assert second.admitted == [urgent, normal] and cache.available == 0
    s.update(second)
    for request in (normal, urgent):
        request.output_ids.append(7)
    # the newer rows need a block each: the background row goes, not the newest
    third = s.schedule()
    assert third.preempted == [background]
    assert s.running == [urgent, normal] and [len(r.blocks) for r in s.running] == [3, 3]
    assert list(s.queue) == [background]


def test_max_loras_bounds_the_distinct_adapters_of_a_step() -> None:
    s = Scheduler(max_batch_size=8, max_waiting=10, allocator=BlockAllocator(64, 4), max_loras=1)
    first, same, other, base = (prioritized(4, 0, r) for r in ("first", "same", "other", "base"))
    first.adapter, same.adapter, other.adapter = 1, 1, 2
    for request in (first, same, other, base):
        s.add(request)
    # adapter 1's rows run; adapter 2's waits for them, and (in order) the base row behind it
    assert s.schedule().admitted == [first, same]
    for request in (first, same):
        request.finish_reason = FinishReason.LENGTH
    s.remove_finished()
    assert s.schedule().admitted == [other, base]
