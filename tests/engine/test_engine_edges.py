"""The engine's edges (issue 11): prompts as one unit, deadlines in the queue, cancellation that
really stops generating, tokenization off the event loop, liveness, admission faults."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from predictor.engine.async_engine import AsyncEngine
from predictor.engine.client import complete, complete_all
from predictor.engine.request import Request
from predictor.engine.scheduler import Scheduler
from predictor.errors import GenerationFailed, InvalidRequest, Overloaded
from predictor.types import FinishReason, GenerateRequest, SamplingParams, TokenEvent, Usage
from tests.engine.conftest import Tiny, make_sequence, new_loop
from tests.engine.test_async_engine import wait_for

LONG = 500  # far more tokens than any of these tests waits for


class RecordingScheduler(Scheduler):
    """The real scheduler, remembering every request it was given (to read its end state)."""

    def __init__(self, max_batch_size: int, max_waiting: int, allocator: Any) -> None:
        super().__init__(max_batch_size, max_waiting, allocator)
        self.seen: dict[str, Request] = {}

    def add_all(self, seqs: list[Request]) -> None:
        super().add_all(seqs)
        self.seen.update((s.request_id, s) for s in seqs)


@contextlib.contextmanager
def engine_on(
    tiny: Tiny,
    max_batch_size: int = 8,
    max_waiting: int = 64,
    runner: Any = None,
    tokenizer: Any = None,
    **options: Any,
) -> Iterator[tuple[AsyncEngine, RecordingScheduler]]:
    loop = new_loop(runner or tiny.runner(), frozenset(), max_batch_size=max_batch_size)
    loop.scheduler = scheduler = RecordingScheduler(
        max_batch_size, max_waiting, loop.scheduler.allocator
    )
    engine = AsyncEngine(
        loop, tokenizer or tiny.tokenizer, max_tokens_limit=LONG, max_prompt_tokens=100, **options
    )
    engine.start()
    try:
        yield engine, scheduler
    finally:
        engine.stop()


def req(rid: str, max_tokens: int = LONG, prompt: str = "Tell me a story", **kw: Any) -> Any:
    return GenerateRequest(rid, prompt, SamplingParams(max_tokens=max_tokens), **kw)


# -- point 1: N prompts are one unit ------------------------------------------------------------


async def test_prompts_past_the_queue_are_refused_whole(tiny_dense: Tiny) -> None:
    with engine_on(tiny_dense, max_batch_size=1, max_waiting=2) as (engine, scheduler):
        with pytest.raises(Overloaded):
            await engine.generate_all([req(f"p{i}") for i in range(3)])
        assert engine.waiting() == 0 and engine.running() == 0 and not scheduler.seen


async def test_one_bad_prompt_refuses_the_unit_before_anything_runs(tiny_dense: Tiny) -> None:
    with engine_on(tiny_dense) as (engine, scheduler):
        unit = [req("a"), req("b"), req("c", prompt="word " * 300)]
        with pytest.raises(InvalidRequest, match="limit is 100 tokens"):
            await engine.generate_all(unit)
        with pytest.raises(InvalidRequest, match="limit is 16"):
            await engine.generate_all([req(f"n{i}", 2) for i in range(17)])
        assert engine.waiting() == 0 and engine.running() == 0 and not scheduler.seen


async def test_a_failing_prompt_cancels_its_siblings_at_once(tiny_dense: Tiny) -> None:
    with engine_on(tiny_dense) as (engine, scheduler):
        streams = await engine.generate_all([req("ok1"), req("bad"), req("ok2")])
        failure = TokenEvent("bad", "", (), FinishReason.ERROR, Usage(1, 0), "forward pass failed")
        await wait_for(lambda: engine.running() == 3)
        streams[1]._queue.put_nowait(failure)  # what the step loop sends when its rows fail
        with pytest.raises(GenerationFailed):
            await complete_all(streams)
        await wait_for(lambda: engine.running() == 0)
        for rid in ("ok1", "ok2"):
            seq = scheduler.seen[rid]
            assert seq.finish_reason is FinishReason.CANCELLED
            assert len(seq.output_ids) < LONG // 5, "the sibling went on generating"


# -- point 6: deadlines while queued ------------------------------------------------------------


async def test_deadline_in_the_queue_answers_at_once_and_never_prefills(tiny_dense: Tiny) -> None:
    with engine_on(tiny_dense, max_batch_size=1) as (engine, scheduler):
        holder = engine.generate(req("holder"))
        await holder.__anext__()  # holds the only row
        started = time.monotonic()
        done = await complete(engine.generate(req("late", timeout=0.3)))
        assert done.finish_reason is FinishReason.TIMEOUT and done.usage.generated_tokens == 0
        assert time.monotonic() - started < 10  # not after the holder's 500 tokens
        assert scheduler.seen["late"].cached == 0  # its prompt never went through the model
        assert engine.running() == 1  # the holder is still generating
        await holder.aclose()  # type: ignore[attr-defined]
        await wait_for(lambda: engine.running() == 0)


# -- point 9: cancellation that can fail --------------------------------------------------------


async def test_closing_a_stream_cancels_it_far_before_max_tokens(tiny_dense: Tiny) -> None:
    with engine_on(tiny_dense) as (engine, scheduler):
        stream = engine.generate(req("x"))
        for _ in range(3):
            await stream.__anext__()
        await stream.aclose()  # type: ignore[attr-defined]
        await wait_for(lambda: scheduler.seen["x"].finish_reason is not None)
        seq = scheduler.seen["x"]
        assert seq.finish_reason is FinishReason.CANCELLED
        assert len(seq.output_ids) < LONG // 5


async def test_cancelled_tasks_cancel_their_requests(tiny_dense: Tiny) -> None:
    with engine_on(tiny_dense) as (engine, scheduler):
        seen = asyncio.Event()

        async def consume(i: int) -> None:
            async for _ in engine.generate(req(f"t{i}")):
                seen.set()

        tasks = [asyncio.create_task(consume(i)) for i in range(4)]
        await seen.wait()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await wait_for(lambda: all(s.finish_reason for s in scheduler.seen.values()))
        for seq in scheduler.seen.values():
            assert seq.finish_reason is FinishReason.CANCELLED
            assert len(seq.output_ids) < LONG // 5


async def test_abort_by_id_cancels(tiny_dense: Tiny) -> None:
    with engine_on(tiny_dense) as (engine, _):
        stream = engine.generate(req("z"))
        await stream.__anext__()
        await engine.abort("z")
        finals = [e async for e in stream if e.final]
        assert [e.finish_reason for e in finals] == [FinishReason.CANCELLED]
        assert finals[0].usage is not None and finals[0].usage.generated_tokens < LONG // 5


# -- point 4 / 8: tokenization off the event loop, counted as in flight -------------------------


class SlowTokenizer:
    """The real tokenizer, taking `delay` seconds per encode (in whatever thread calls it)."""

    def __init__(self, inner: Any, delay: float) -> None:
        self._inner = inner
        self.delay = delay

    def encode(self, text: str, **kw: Any) -> list[int]:
        time.sleep(self.delay)
        return list(self._inner.encode(text, **kw))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __len__(self) -> int:
        return len(self._inner)


async def test_tokenizing_runs_off_the_event_loop_and_counts_as_waiting(tiny_dense: Tiny) -> None:
    slow = SlowTokenizer(tiny_dense.tokenizer, 0.0)
    with engine_on(tiny_dense, tokenizer=slow) as (engine, _):
        slow.delay = 1.5
        work = asyncio.create_task(complete(engine.generate(req("s", 2))))
        gaps: list[float] = []
        last = time.monotonic()
        while not work.done():
            await asyncio.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last = now
            if len(gaps) == 20:  # 0.2 s into a 1.5 s tokenization
                assert engine.waiting() == 1  # in flight for drain while being tokenized
        assert (await work).usage.generated_tokens == 2
        assert max(gaps) < 0.75, f"the event loop stalled for {max(gaps):.2f} s"


class NoTemplateTokenizer(SlowTokenizer):
    def apply_chat_template(self, *args: Any, **kw: Any) -> str:
        raise AssertionError("an overlong conversation was rendered")


async def test_an_overlong_chat_is_refused_before_its_template_renders(tiny_dense: Tiny) -> None:
    tokenizer = NoTemplateTokenizer(tiny_dense.tokenizer, 0.0)
    with engine_on(tiny_dense, tokenizer=tokenizer) as (engine, scheduler):
        huge = "word " * 100_000  # far more characters than 100 tokens can hold
        with pytest.raises(InvalidRequest, match="characters"):
            await engine.generate_all([req("c", 2, prompt=huge, chat=True)])
        assert not scheduler.seen


# -- point 3: liveness --------------------------------------------------------------------------


class GatedRunner:
    """The real runner, whose forward pass waits while the gate is closed (a hung kernel)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.gate = threading.Event()
        self.gate.set()

    def forward(self, rows: Sequence[Any]) -> Any:
        self.gate.wait()
        return self._inner.forward(rows)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class SlowToPrepare(GatedRunner):
    """The real runner, whose bind_thread (compiling and tuning its kernels) waits on the gate."""

    def bind_thread(self) -> None:
        self.gate.wait()
        self._inner.bind_thread()


async def test_not_ready_until_the_runner_is_prepared_on_its_thread(tiny_dense: Tiny) -> None:
    runner = SlowToPrepare(tiny_dense.runner())
    runner.gate.clear()
    with engine_on(tiny_dense, runner=runner) as (engine, _):
        await asyncio.sleep(0.3)
        assert engine.live() and engine.health()  # tuning is not a stall
        assert not engine.ready()
        early = engine.generate(req("early", max_tokens=3))  # queued: served once prepared
        runner.gate.set()
        await wait_for(engine.ready)
        events = [event async for event in early]  # type: ignore[attr-defined]
        assert events[-1].finish_reason == FinishReason.LENGTH


async def test_liveness_fails_while_a_step_hangs_and_when_the_thread_dies(
    tiny_dense: Tiny,
) -> None:
    runner = GatedRunner(tiny_dense.runner())
    with engine_on(tiny_dense, runner=runner, stall_seconds=0.5) as (engine, _):
        assert engine.live() and engine.health()
        stream = engine.generate(req("h"))
        await stream.__anext__()
        runner.gate.clear()
        await wait_for(lambda: not engine.live())
        assert not engine.health()  # not ready either
        runner.gate.set()
        await wait_for(engine.live)
        await stream.aclose()  # type: ignore[attr-defined]
        await wait_for(lambda: engine.running() == 0)
        engine._loop.stop()  # the thread ends without the engine being stopped: it died
        assert not engine.live()
    assert engine.live()  # stopped on purpose (drain, unload): readiness says so, not liveness


# -- point 8: a failure while admitting leaves the running rows intact ---------------------------


def test_admission_failure_fails_that_request_only(
    tiny_dense: Tiny, monkeypatch: pytest.MonkeyPatch
) -> None:
    from predictor.engine import step_loop

    def make_generator(seed: int | None, device: Any) -> Any:
        if admitting[0] == "bad":
            raise RuntimeError("no generator for this device")
        return real(seed, device)

    real = step_loop.make_generator
    monkeypatch.setattr(step_loop, "make_generator", make_generator)
    loop = new_loop(tiny_dense.runner(), frozenset(), max_batch_size=4)
    admitting = [""]
    good, good_sink = make_sequence(tiny_dense.tokenizer, [5, 6, 7], SamplingParams(max_tokens=8))
    loop.scheduler.add(good)
    loop.step()
    loop.step()
    bad, bad_sink = make_sequence(tiny_dense.tokenizer, [8, 9], SamplingParams(max_tokens=8), "b")
    loop.scheduler.add(bad)
    admitting[0] = "bad"
    loop.step()
    admitting[0] = ""
    assert bad_sink.finish_reason is FinishReason.ERROR
    assert bad_sink.events[-1].error == "the request could not be admitted"  # no exception text
    assert loop.scheduler.running == [good]
    assert loop.scheduler.allocator.used == len(good.blocks)
    while not good_sink.done:
        loop.step()
    assert good_sink.finish_reason is FinishReason.LENGTH and len(good.output_ids) == 8
    assert loop.scheduler.allocator.used == 0


async def test_a_request_being_prefilled_counts_as_in_flight(tiny_dense: Tiny) -> None:
    runner = GatedRunner(tiny_dense.runner())
    runner.gate.clear()  # the first forward pass (its prefill) cannot end yet
    with engine_on(tiny_dense, runner=runner) as (engine, scheduler):
        work = asyncio.create_task(complete(engine.generate(req("p", 2))))
        await wait_for(lambda: "p" in scheduler.seen and engine.running() == 1)
        assert scheduler.seen["p"].prefilling and engine.waiting() == 0
        # what Drain waits for: running() + waiting() stays 1 until the request ends
        runner.gate.set()
        assert (await work).usage.generated_tokens == 2
        assert engine.running() + engine.waiting() == 0
