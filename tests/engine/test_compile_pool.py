"""The compile pool: its slots' threads at the pool's niceness, a job past its quantum while
another waits demoted to the lowest and its slot given to a fresh thread, queued jobs dropped
on cancel; its default size every usable CPU (affinity, cgroup quota) but one."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from predictor.cpus import container_cpus
from predictor.engine.compile_pool import (
    DEMOTED_NICENESS,
    CompilePool,
    Job,
    default_threads,
)

NICENESS = 10


def niceness() -> int:
    """This thread's nice value (Linux: per thread)."""
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


class Held:
    """A job that reports its thread and niceness, then runs until released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.thread_id = 0
        self.niceness = -100

    def __call__(self) -> int:
        self.thread_id, self.niceness = threading.get_native_id(), niceness()
        self.release.wait(30)
        return self.niceness


@pytest.fixture
def pools() -> Iterator[Callable[..., CompilePool]]:
    made: list[CompilePool] = []

    def make(threads: int, quantum: float) -> CompilePool:
        made.append(CompilePool(threads, quantum, NICENESS, "test-pool"))
        return made[-1]

    yield make
    for pool in made:
        pool.close()


def started(job: Job[int], within: float = 2.0) -> bool:
    try:
        job.started.result(within)
    except TimeoutError:
        return False
    return True


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="per-thread niceness: Linux")
def test_a_long_job_gives_its_slot_to_a_waiting_one_and_runs_on_demoted(
    pools: Callable[..., CompilePool],
) -> None:
    pool = pools(1, 0.1)
    long, short = Held(), Held()
    try:
        first = pool.submit(long)
        assert started(first)
        time.sleep(0.3)  # past its quantum, but nobody waits: it keeps its slot
        assert pool.demotions == 0 and os.getpriority(os.PRIO_PROCESS, long.thread_id) == NICENESS
        submitted = time.monotonic()
        second = pool.submit(short)
        assert started(second)
        assert time.monotonic() - submitted < 0.5  # at once: `long` is past its quantum
        assert pool.demotions == 1 and short.thread_id != long.thread_id
        assert os.getpriority(os.PRIO_PROCESS, long.thread_id) == DEMOTED_NICENESS
        assert short.niceness == NICENESS and long.niceness == NICENESS
        short.release.set()
        assert second.done.result(5) == NICENESS
        third = pool.submit(lambda: niceness())  # the slot's thread goes on at the pool's
        assert third.done.result(5) == NICENESS
    finally:
        long.release.set()
    assert first.done.result(5) == NICENESS


def test_a_job_within_its_quantum_keeps_its_slot(pools: Callable[..., CompilePool]) -> None:
    pool = pools(2, 1.0)
    holders = [Held() for _ in range(3)]
    try:
        jobs = [pool.submit(h) for h in holders]
        assert started(jobs[0]) and started(jobs[1])
        assert not started(jobs[2], within=0.3)  # two slots, both within their quantum
        assert started(jobs[2], within=3.0)  # the oldest past it gives its slot up
        assert pool.demotions == 1
    finally:
        for holder in holders:
            holder.release.set()
    assert all(job.done.result(5) == NICENESS for job in jobs)


def test_a_queued_job_cancelled_never_runs(pools: Callable[..., CompilePool]) -> None:
    pool = pools(1, 60.0)
    holder, ran = Held(), threading.Event()
    try:
        running = pool.submit(holder)
        assert started(running)
        queued = pool.submit(ran.set)
        assert pool.cancel(queued) and queued.done.cancelled() and queued.started.cancelled()
        assert not pool.cancel(running)  # a running job cannot be stopped
    finally:
        holder.release.set()
    running.done.result(5)
    assert pool.submit(lambda: 1).done.result(5) == 1
    assert not ran.is_set()


def test_the_errors_of_a_job_are_its_callers(pools: Callable[..., CompilePool]) -> None:
    job = pools(1, 60.0).submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        job.done.result(5)


def test_compiles_leave_one_usable_cpu_to_decoding() -> None:
    assert default_threads() == max(1, container_cpus() - 1)
