"""Engine fixtures: the tiny models loaded in process, and a hand-driven step loop."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from predictor.engine.detokenizer import IncrementalDetokenizer
from predictor.engine.grammar import Grammars
from predictor.engine.kv_cache import BlockAllocator
from predictor.engine.request import Request
from predictor.engine.runners.cpu import ModelRunner
from predictor.engine.scheduler import Scheduler
from predictor.engine.step import StepStats
from predictor.engine.step_loop import StepLoop
from predictor.model.loader import LoadedModel, load_checkpoint
from predictor.types import FinishReason, SamplingParams, TokenEvent
from tests.support import tune_cache, worker_cores


@dataclass
class Tiny:
    model: Any
    tokenizer: Any
    eos_ids: frozenset[int]
    pad_token_id: int

    def runner(self, num_blocks: int = 256, block_size: int = 16) -> ModelRunner:
        return ModelRunner(
            self.model, torch.device("cpu"), num_blocks, block_size, autotune_cache=tune_cache()
        )


@pytest.fixture(scope="session")
def tiny_dense(tiny_dense_dir: Path) -> Tiny:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(min(2, worker_cores()))
    model = AutoModelForCausalLM.from_pretrained(tiny_dense_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_dense_dir)
    return Tiny(model, tokenizer, frozenset({tokenizer.eos_token_id}), tokenizer.eos_token_id)


@pytest.fixture(scope="module")
def grammars(tiny_dense: Tiny) -> Grammars:
    return Grammars(tiny_dense.tokenizer, tiny_dense.eos_ids)


@pytest.fixture(scope="session")
def tiny_gptq(tiny_gptq_dir: Path) -> LoadedModel:
    return load_checkpoint(tiny_gptq_dir, device="cpu", threads=min(2, worker_cores()))


@dataclass
class Collected:
    """Events of one request, as a step loop sink receives them."""

    events: list[TokenEvent] = field(default_factory=list)

    def __call__(self, event: TokenEvent) -> None:
        self.events.append(event)

    @property
    def done(self) -> bool:
        return bool(self.events) and self.events[-1].final

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events)

    @property
    def token_ids(self) -> list[int]:
        return [t for e in self.events for t in e.token_ids]

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.events[-1].finish_reason if self.done else None


def make_sequence(
    tokenizer: Any, prompt_ids: list[int], params: SamplingParams, request_id: str = "r"
) -> tuple[Request, Collected]:
    sink = Collected()
    seq = Request(
        request_id=request_id,
        prompt_ids=prompt_ids,
        params=params,
        detokenizer=IncrementalDetokenizer(tokenizer, prompt_ids, params.stop),
        sink=sink,
        echo_only=params.max_tokens == 0,  # as the input processor makes it
    )
    return seq, sink


def drive(
    loop: StepLoop,
    arrivals: dict[int, list[Request]],
    sinks: list[Collected],
    max_steps: int = 500,
    each_step: Callable[[int], None] | None = None,
) -> int:
    """Run the step loop by hand: at step i, the sequences in arrivals[i] join the queue."""
    for step in range(max_steps):
        for seq in arrivals.get(step, []):
            loop.scheduler.add(seq)
        if each_step is not None:
            each_step(step)
        loop.step()
        if all(s.done for s in sinks) and step >= max(arrivals, default=0):
            return step
    raise AssertionError("requests did not finish")


def preemptions(loop: StepLoop) -> list[int]:
    """A list that gets a 1 for each preemption of the loop's later steps (as a step listener
    reads them from the stats `step` returns)."""
    seen: list[int] = []
    step = loop.step

    def counted() -> StepStats:
        stats = step()
        seen.extend([1] * stats.preemptions)
        return stats

    loop.step = counted  # type: ignore[method-assign]
    return seen


def new_loop(
    runner: Any,
    eos_ids: frozenset[int],
    max_batch_size: int = 8,
    max_step_tokens: int = 256,
    speculation: Any = None,
    vocab: int | None = None,
) -> StepLoop:
    """A step loop over the runner, with a block allocator the size of the runner's cache."""
    allocator = BlockAllocator(runner.num_blocks, runner.block_size)
    scheduler = Scheduler(max_batch_size, 64, allocator, max_step_tokens=max_step_tokens,
                          speculation=speculation)  # fmt: skip
    return StepLoop(runner, scheduler, eos_ids, vocab=vocab)
