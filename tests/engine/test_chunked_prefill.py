"""Chunked prefill in real time: a long prompt joins while streams run, and they keep flowing."""

from __future__ import annotations

import random
import statistics
import threading
import time

import pytest

from predictor.engine.detokenizer import IncrementalDetokenizer
from predictor.engine.request import Request
from predictor.types import SamplingParams, TokenEvent
from tests.engine.conftest import Tiny, new_loop

pytestmark = pytest.mark.serial  # gaps against their median: a neighbour's work widens them


class Clocked:
    """A sink that records when each event arrived."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.done = threading.Event()

    def __call__(self, event: TokenEvent) -> None:
        if event.token_ids:
            self.times.append(time.perf_counter())
        if event.final:
            self.done.set()


def run_with_long_prompt(tiny: Tiny, max_step_tokens: int) -> tuple[float, float]:
    """Largest and median inter-token gap of 4 running streams while a 1,500-token prompt is
    prefilled, the step loop on its own thread as in the server."""
    rng = random.Random(0)
    vocab = len(tiny.tokenizer)
    runner = tiny.runner(num_blocks=512)
    runner.threads = 1  # one compute thread: no OpenMP spin-waits against the test's own thread
    loop = new_loop(runner, frozenset(), max_batch_size=8, max_step_tokens=max_step_tokens)

    def request(n: int, max_tokens: int, rid: str) -> tuple[Request, Clocked]:
        ids = [rng.randrange(100, vocab) for _ in range(n)]
        sink = Clocked()
        params = SamplingParams(max_tokens=max_tokens)
        detok = IncrementalDetokenizer(tiny.tokenizer, ids, ())
        return Request(rid, ids, params, detok, sink), sink

    streams = [request(8, 300, f"s{i}") for i in range(4)]
    loop.start()
    try:
        for seq, _ in streams:
            loop.scheduler.add(seq)
        loop.notify()
        while min(len(sink.times) for _, sink in streams) < 40:
            time.sleep(0.005)
        long_seq, long_sink = request(1500, 4, "long")
        admitted_at = time.perf_counter()
        loop.scheduler.add(long_seq)
        loop.notify()
        assert long_sink.done.wait(60)
        first_token_at = long_sink.times[0]
        for _, sink in streams:
            assert sink.done.wait(60)
    finally:
        loop.stop()
    # the gaps that end while the prompt is prefilled, up to the step that gives its first
    # token (the streams' tokens of that step come within a fraction of a millisecond of it);
    # not the one after it, a decode step in which the new row reads its 1,500 cached tokens
    gaps, during = [], []
    for _, sink in streams:
        for before, after in zip(sink.times, sink.times[1:], strict=False):
            gaps.append(after - before)
            if admitted_at <= after <= first_token_at + 0.001:
                during.append(after - before)
    assert during, "no stream produced a token while the long prompt was prefilled"
    return max(during), statistics.median(gaps)


# The largest gap against the median, below it with chunks and above it without. On a Zen 5 a
# 4-row decode step of the tiny fp32 model takes ~3 ms and a step with 60 prompt tokens 2-2.5x
# that (so chunks of 64 missed a 2x bar in half the runs). On a 2-core Xeon (2026-12-02) the
# 32-token steps late in the prompt, whose rows read up to 1,500 cached tokens, left the largest
# gap at 1.7-1.95x the median in most tries (2.0-6x in a few), and all three tries of a fresh
# clone's suite at 2.2-2.3x; one step of all 1,500 tokens made it 14-16x.
BAR = 2.5


def test_running_streams_keep_flowing_while_a_long_prompt_is_prefilled(tiny_dense: Tiny) -> None:
    # a shared machine can pause any thread for a while: three tries, one must hold the bar.
    # Chunks of 32 tokens (4 decode rows + 28 prompt tokens a step)
    seen = []
    for _ in range(3):
        largest, median = run_with_long_prompt(tiny_dense, max_step_tokens=32)
        seen.append(f"largest gap {largest * 1000:.1f} ms, median {median * 1000:.1f} ms")
        if largest < BAR * median:
            return
    raise AssertionError("; ".join(seen))


def test_without_chunks_the_long_prompt_stalls_the_streams(tiny_dense: Tiny) -> None:
    """The gap test above can fail: one step that prefills all 1,500 tokens stalls the streams."""
    largest, median = run_with_long_prompt(tiny_dense, max_step_tokens=4096)
    assert largest > BAR * median
