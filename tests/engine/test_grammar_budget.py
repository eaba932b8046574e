"""The compile budget counts a grammar's own compile: waiting behind other clients' compiles is
not this client's error (a wait past the budget is the server's 429, retry later), a compile that
runs past it is (400, too complex); a cheap grammar passes slow ones on one compile thread."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from predictor.engine.grammar import Grammars
from predictor.errors import InvalidRequest, Overloaded, status_of
from predictor.serving.errors import headers_of, openai_body
from predictor.types import Grammar
from tests.engine.conftest import Tiny


class Slept:
    """What a 'sleep' grammar compiles to."""

    memory_size_bytes = 0


class Paced(Grammars):
    """The real pool, budget, sharing and cache; a grammar of kind 'sleep' compiles by sleeping
    its text's seconds: a compile of a known length on any machine (xgrammar's own are timed
    in test_grammar_limits.py and tests/serving/test_grammar_busy.py)."""

    def _compile(self, grammar: Grammar) -> Any:
        if grammar.kind != "sleep":
            return super()._compile(grammar)
        time.sleep(float(grammar.text.split()[0]))
        return Slept()


def sleep(seconds: float, name: str) -> Grammar:
    return Grammar("sleep", f"{seconds} {name}", "response_format")


@pytest.fixture
def paced(tiny_dense: Tiny) -> Iterator[Callable[..., Paced]]:
    made: list[Paced] = []

    def make(**limits: Any) -> Paced:
        made.append(Paced(tiny_dense.tokenizer, tiny_dense.eos_ids, **limits))
        return made[-1]

    yield make
    for grammars in made:
        grammars.close()


# one thread and a quantum no compile reaches: a plain queue, one compile after another
QUEUE = {"threads": 1, "quantum": 60.0}


async def test_waiting_behind_other_compiles_does_not_count(paced: Callable[..., Paced]) -> None:
    grammars = paced(timeout=2.0, **QUEUE)
    ahead = asyncio.create_task(grammars.compile_async(sleep(1.2, "ahead")))
    await asyncio.sleep(0.05)
    started = time.monotonic()
    assert isinstance(await grammars.compile_async(sleep(1.2, "behind")), Slept)
    # ~1.15 s queued, then 1.2 s compiling: past the 2 s budget in all, within it alone
    assert time.monotonic() - started > grammars.timeout
    assert isinstance(await ahead, Slept)


async def test_the_budget_starts_when_the_compile_starts(paced: Callable[..., Paced]) -> None:
    """A queued compile that runs past the budget is too complex at its start + the budget."""
    grammars = paced(timeout=1.0, **QUEUE)
    ahead = asyncio.create_task(grammars.compile_async(sleep(0.6, "ahead")))
    await asyncio.sleep(0.05)
    started = time.monotonic()
    with pytest.raises(InvalidRequest, match="too complex") as caught:
        await grammars.compile_async(sleep(3.0, "behind"))
    assert 1.4 < time.monotonic() - started < 2.5  # ~0.55 s queued + the 1 s budget
    assert caught.value.param == "response_format"
    assert isinstance(await ahead, Slept)


async def test_a_compile_slower_than_the_budget_is_too_complex(
    paced: Callable[..., Paced],
) -> None:
    grammars = paced(timeout=0.3, **QUEUE)
    started = time.monotonic()
    with pytest.raises(InvalidRequest, match="too complex") as caught:
        await grammars.compile_async(sleep(1.0, "alone"))
    assert 0.3 <= time.monotonic() - started < 0.9 and caught.value.param == "response_format"


async def test_a_wait_past_the_budget_is_the_servers_busy_not_a_bad_request(
    paced: Callable[..., Paced],
) -> None:
    grammars = paced(timeout=0.3, **QUEUE)
    ahead = asyncio.create_task(grammars.compile_async(sleep(1.5, "ahead")))
    await asyncio.sleep(0.05)
    started = time.monotonic()
    with pytest.raises(Overloaded, match="busy") as caught:
        await grammars.compile_async(sleep(0.01, "behind"))
    assert 0.3 <= time.monotonic() - started < 1.2  # at the budget, not when `ahead` ends
    busy = caught.value
    assert not isinstance(busy, InvalidRequest)
    status = status_of(busy)
    assert (status.http, status.grpc) == (429, "RESOURCE_EXHAUSTED")  # as a full waiting queue
    assert headers_of(busy) == {"Retry-After": "1"}
    assert openai_body(busy)["error"]["code"] == "rate_limit_exceeded"
    with pytest.raises(InvalidRequest, match="too complex"):  # `ahead` itself ran past it
        await ahead
    while grammars.in_flight:
        await asyncio.sleep(0.05)
    assert grammars.compiled == 1  # the refused one was dropped before it began


async def test_a_cheap_compile_passes_slow_ones_on_one_thread(
    paced: Callable[..., Paced],
) -> None:
    """Four compiles that each run 3 s hold the one thread a quantum each, not their runs."""
    grammars = paced(timeout=10.0, threads=1, quantum=0.1)
    slow = [asyncio.create_task(grammars.compile_async(sleep(3.0, f"slow{i}"))) for i in range(4)]
    await asyncio.sleep(0.6)  # all four are running by now, the last one on the pool's thread
    started = time.monotonic()
    assert isinstance(await grammars.compile_async(sleep(0.05, "cheap")), Slept)
    assert time.monotonic() - started < 0.6  # a quantum, then its own 0.05 s (a queue: ~12 s)
    assert grammars.pool.demotions == 4 and not any(task.done() for task in slow)
    for task in slow:
        assert isinstance(await task, Slept)
