"""AsyncEngine with its real step-loop thread on the tiny dense model."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import pytest

from predictor.engine.async_engine import AsyncEngine
from predictor.engine.client import complete
from predictor.errors import EngineUnavailable, InvalidRequest, Overloaded
from predictor.types import FinishReason, GenerateRequest, SamplingParams
from tests.engine.conftest import Tiny, new_loop
from tests.engine.test_step_loop import reference_greedy


@contextlib.contextmanager
def running_engine(
    tiny: Tiny, max_batch_size: int = 8, max_waiting: int = 64
) -> Iterator[AsyncEngine]:
    loop = new_loop(tiny.runner(), frozenset(), max_batch_size=max_batch_size)
    loop.scheduler.queue.limit = max_waiting
    engine = AsyncEngine(loop, tiny.tokenizer, max_tokens_limit=64, max_prompt_tokens=100)
    engine.start()
    try:
        yield engine
    finally:
        engine.stop()


async def wait_for(condition, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def request(tiny: Tiny, ids: list[int], n: int, rid: str = "r") -> GenerateRequest:
    # decode/encode round trips are not exact for random ids: pass text that encodes to ids
    return GenerateRequest(rid, tiny.tokenizer.decode(ids), SamplingParams(max_tokens=n))


async def test_concurrent_requests_match_generate(tiny_dense: Tiny) -> None:
    texts = ["The quick brown fox", "Once upon a time", "1, 2, 3,", "Hello", "A B C D E F G"]
    with running_engine(tiny_dense, max_batch_size=3) as engine:

        async def one(i: int, text: str) -> tuple[list[int], list[int]]:
            await asyncio.sleep(0.05 * i)  # staggered arrivals
            ids: list[int] = []
            req = GenerateRequest(f"c{i}", text, SamplingParams(max_tokens=10 + i))
            async for event in engine.generate(req):
                ids.extend(event.token_ids)
            return engine.inputs.encode_prompt(req), ids

        results = await asyncio.gather(*(one(i, t) for i, t in enumerate(texts)))
    for i, (prompt_ids, ids) in enumerate(results):
        assert ids == reference_greedy(tiny_dense, prompt_ids, 10 + i)


# Cancellation (closing a stream, cancelling its task, abort by id) is tested with the finish
# reason and the engine's token count in tests/engine/test_engine_edges.py.


async def test_bad_requests_fail_before_the_first_event(tiny_dense: Tiny) -> None:
    with running_engine(tiny_dense) as engine:
        with pytest.raises(InvalidRequest, match="max_tokens"):
            await complete(
                engine.generate(GenerateRequest("a", "hi", SamplingParams(max_tokens=65)))
            )
        with pytest.raises(InvalidRequest, match="limit is 100 tokens"):
            await complete(engine.generate(GenerateRequest("b", "word " * 300, SamplingParams())))
        ok = await complete(
            engine.generate(GenerateRequest("c", "hi", SamplingParams(max_tokens=3)))
        )
        assert ok.usage.generated_tokens == 3 and ok.finish_reason is FinishReason.LENGTH


async def test_full_queue_is_refused_at_once(tiny_dense: Tiny) -> None:
    with running_engine(tiny_dense, max_batch_size=1, max_waiting=1) as engine:
        long = [engine.generate(GenerateRequest(f"l{i}", "Go on", SamplingParams(max_tokens=64)))
                for i in range(2)]  # fmt: skip
        await long[0].__anext__()  # holds the only row
        waiting = asyncio.create_task(long[1].__anext__())  # holds the only waiting place
        await wait_for(lambda: engine.waiting() == 1)
        with pytest.raises(Overloaded):
            await complete(
                engine.generate(GenerateRequest("o", "hi", SamplingParams(max_tokens=2)))
            )
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        for stream in long:
            await stream.aclose()  # type: ignore[attr-defined]
        await wait_for(lambda: engine.running() == 0 and engine.waiting() == 0)


async def test_stopped_engine_refuses(tiny_dense: Tiny) -> None:
    with running_engine(tiny_dense) as engine:
        pass
    with pytest.raises(EngineUnavailable):
        await complete(engine.generate(GenerateRequest("s", "hi", SamplingParams(max_tokens=2))))


async def test_server_default_timeout(tiny_dense: Tiny) -> None:
    loop = new_loop(tiny_dense.runner(), frozenset())
    engine = AsyncEngine(
        loop,
        tiny_dense.tokenizer,
        max_tokens_limit=512,
        max_prompt_tokens=100,
        default_timeout=0.05,
    )
    engine.start()
    try:
        done = await complete(
            engine.generate(GenerateRequest("t", "Go", SamplingParams(max_tokens=512)))
        )
        assert done.finish_reason is FinishReason.TIMEOUT and done.usage.generated_tokens < 512
        await wait_for(lambda: engine.running() == 0)
    finally:
        engine.stop()
