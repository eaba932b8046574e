"""Sleep in the step loop (engine/sleep.py): the runner dropped with the prefix cache and built
again; a row preempted by a sleep resumes with the tokens it would have had; an idle loop falls
asleep on its own thread and a request wakes it."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from predictor.engine.kv_cache import BlockAllocator
from predictor.engine.runners.cpu import ModelRunner
from predictor.engine.runners.null import NullRunner
from predictor.engine.scheduler import Scheduler
from predictor.engine.sleep import ASKED, IDLE, Sleep
from predictor.engine.step import Runner, StepStats
from predictor.engine.step_loop import StepLoop
from predictor.types import FinishReason, SamplingParams
from tests.engine.conftest import Tiny, make_sequence
from tests.engine.test_step_loop import NO_EOS, prompts, reference_greedy
from tests.support import tune_cache


class Cleared:
    """The allocator's eviction listener (kv_events.Recorder's face): resets heard."""

    def __init__(self) -> None:
        self.cleared_count = 0

    def removed(self, block_hash: Any) -> None:
        pass

    def cleared(self) -> None:
        self.cleared_count += 1


class Reloads:
    """A Sleep's hooks, counted: each reload reads the dense checkpoint again into a new
    runner, as a server's wake reads its checkpoint."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self.reloads = 0
        self.freed: list[Runner] = []
        self.released = 0

    def reload(self) -> Runner:
        from transformers import AutoModelForCausalLM

        self.reloads += 1
        model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32).eval()
        return ModelRunner(model, torch.device("cpu"), 64, 16, autotune_cache=tune_cache())

    def free(self, runner: Runner) -> None:
        self.freed.append(runner)
        assert isinstance(runner, ModelRunner)
        runner.free()

    def release(self) -> None:
        self.released += 1

    def sleep(self, idle_seconds: float = 0.0) -> Sleep:
        return Sleep(self.reload, self.free, self.release, idle_seconds)


def test_a_sleep_mid_request_frees_everything_and_the_row_resumes_the_same(
    tiny_dense: Tiny, tiny_dense_dir: Path
) -> None:
    hooks = Reloads(tiny_dense_dir)
    first = hooks.reload()  # the loop's own (a sleep empties its tensors: not the fixture's)
    listener = Cleared()
    allocator = BlockAllocator(64, 16, evictions=listener)
    loop = StepLoop(first, Scheduler(4, 8, allocator), NO_EOS, sleep=hooks.sleep())
    told: list[StepStats] = []
    loop._listener = told.append
    ps = prompts(tiny_dense, 2, seed=3)
    sinks = []
    for i, p in enumerate(ps):
        seq, sink = make_sequence(tiny_dense.tokenizer, p, SamplingParams(max_tokens=12), f"r{i}")
        loop.scheduler.add(seq)
        sinks.append(sink)
    for _ in range(4):
        loop.step()
    assert loop.scheduler.running and not any(s.done for s in sinks)
    assert allocator.cached > 0  # the prompts' full blocks are in the prefix cache

    assert loop.sleep()  # not running: the chore runs at once
    assert loop.sleeping() and loop.runner is None
    assert hooks.freed == [first] and hooks.released == 1
    assert first.model.model.embed_tokens.weight.numel() == 0  # its tensors emptied
    assert not loop.scheduler.running and loop.scheduler.waiting() == 2
    assert allocator.used == 0 and allocator.cached == 0 and listener.cleared_count == 1
    assert told[-1].slept == ASKED and told[-1].preemptions == 2

    assert loop.wake_up() and not loop.sleeping() and hooks.reloads == 2
    assert told[-1].woke > 0
    while not all(s.done for s in sinks):
        loop.step()
    for p, sink in zip(ps, sinks, strict=True):
        assert sink.finish_reason is FinishReason.LENGTH
        assert sink.token_ids == reference_greedy(tiny_dense, p, 12)


def test_a_loop_that_cannot_sleep_says_so() -> None:
    runner = NullRunner(100, 16)
    loop = StepLoop(runner, Scheduler(4, 8, BlockAllocator(16, 16)), NO_EOS)
    assert not loop.can_sleep and not loop.sleep() and loop.runner is runner


def test_an_idle_loop_sleeps_on_its_thread_and_a_request_wakes_it(tiny_dense: Tiny) -> None:
    made: list[NullRunner] = []

    def reload() -> Runner:
        made.append(NullRunner(len(tiny_dense.tokenizer), 16))
        return made[-1]

    loop = StepLoop(
        reload(),
        Scheduler(4, 8, BlockAllocator(16, 16)),
        NO_EOS,
        sleep=Sleep(reload, idle_seconds=0.3),
    )
    told: list[StepStats] = []
    woke = threading.Event()

    def listen(stats: StepStats) -> None:
        told.append(stats)
        if stats.woke:
            woke.set()

    loop.start(listen)
    try:
        deadline = time.monotonic() + 10
        while not loop.sleeping():
            assert time.monotonic() < deadline, "the idle loop did not fall asleep"
            time.sleep(0.05)
        assert [s.slept for s in told if s.slept] == [IDLE] and len(made) == 1
        seq, sink = make_sequence(tiny_dense.tokenizer, [5, 6, 7], SamplingParams(max_tokens=3))
        loop.scheduler.add(seq)
        loop.notify()
        assert woke.wait(10), "a request did not wake the loop"
        deadline = time.monotonic() + 10
        while not sink.done:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert sink.finish_reason is FinishReason.LENGTH and len(made) == 2
        assert loop.runner is made[1]
    finally:
        loop.stop()


@pytest.mark.parametrize("idle", [0.0, -1.0])
def test_no_idle_sleep_without_a_positive_delay(idle: float) -> None:
    sleep = Sleep(lambda: NullRunner(10, 4), idle_seconds=idle)
    assert not sleep.due(1e9)
    assert Sleep(lambda: NullRunner(10, 4), idle_seconds=2).due(2.0)
