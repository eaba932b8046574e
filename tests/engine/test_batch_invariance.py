"""--batch-invariant on a bf16 GPTQ model (native attention, the CPU's kernels): a request's
tokens, greedy and seeded, are the same alone and in any batch, with prefix-cache hits, in any
prefill chunking, and after a preemption."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from predictor.engine.runners.cpu import ModelRunner
from predictor.engine.runners.kernels.invariance import row_invariant
from predictor.model.loader import LoadedModel, load_checkpoint
from predictor.types import FinishReason, SamplingParams
from tests.engine.conftest import Collected, drive, make_sequence, new_loop, preemptions
from tests.support import tune_cache, worker_cores

NEW = 20


@pytest.fixture(scope="module")
def bf16(tiny_bf16_dir: Path) -> LoadedModel:
    return load_checkpoint(tiny_bf16_dir, device="cpu", threads=min(2, worker_cores()))


def runner(loaded: LoadedModel, num_blocks: int = 256, invariant: bool = True) -> ModelRunner:
    made = ModelRunner(loaded.model, torch.device("cpu"), num_blocks, 16,
                       autotune_cache=tune_cache(), batch_invariant=invariant)  # fmt: skip
    assert made._native is not None, "native attention: the bf16 CPU path"
    return made


def prompts(loaded: LoadedModel, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = len(loaded.tokenizer)
    shared = [rng.randrange(100, vocab) for _ in range(40)]  # a document several prompts share
    return [
        (shared if i % 2 else []) + [rng.randrange(100, vocab) for _ in range(rng.randint(3, 50))]
        for i in range(count)
    ]


def params(i: int, seeded: bool) -> SamplingParams:
    if seeded:
        return SamplingParams(max_tokens=NEW, ignore_eos=True, temperature=0.9, top_p=0.95,
                              seed=100 + i)  # fmt: skip
    return SamplingParams(max_tokens=NEW, ignore_eos=True)


def run(loop: Any, loaded: LoadedModel, batch: list[list[int]], seeded: bool,
        arrivals: dict[int, list[int]] | None = None) -> list[list[int]]:  # fmt: skip
    sinks: list[Collected] = []
    seqs = []
    for i, prompt in enumerate(batch):
        seq, sink = make_sequence(loaded.tokenizer, prompt, params(i, seeded), f"r{i}")
        seqs.append(seq)
        sinks.append(sink)
    schedule = arrivals or {0: list(range(len(batch)))}
    drive(loop, {step: [seqs[i] for i in ids] for step, ids in schedule.items()}, sinks)
    assert all(s.finish_reason is FinishReason.LENGTH for s in sinks)
    return [s.token_ids for s in sinks]


def alone(loaded: LoadedModel, batch: list[list[int]], seeded: bool) -> list[list[int]]:
    """Each request alone, on a fresh cache: no neighbour, no cached prefix, one chunk."""
    out = []
    for i, prompt in enumerate(batch):
        loop = new_loop(runner(loaded), frozenset(), max_batch_size=1, max_step_tokens=256)
        seq, sink = make_sequence(loaded.tokenizer, prompt, params(i, seeded), f"a{i}")
        drive(loop, {0: [seq]}, [sink])
        out.append(sink.token_ids)
    return out


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_tokens_are_the_same_alone_and_in_any_batch(bf16: LoadedModel, seeded: bool) -> None:
    batch = prompts(bf16, 12, seed=1)
    expected = alone(bf16, batch, seeded)
    # all at once, 24-token prefill chunks (another chunking), prefix hits on the document
    loop = new_loop(runner(bf16), frozenset(), max_batch_size=12, max_step_tokens=24)
    assert run(loop, bf16, batch, seeded) == expected
    # staggered arrivals, the document cached by the first: other batch sizes at every step
    loop = new_loop(runner(bf16), frozenset(), max_batch_size=5, max_step_tokens=64)
    staggered = {0: [0, 1], 3: [2, 3, 4], 7: [5, 6], 11: [7, 8, 9, 10, 11]}
    assert run(loop, bf16, batch, seeded, staggered) == expected


def test_a_preempted_stream_equals_its_uninterrupted_run(bf16: LoadedModel) -> None:
    batch = prompts(bf16, 6, seed=2)
    expected = alone(bf16, batch, seeded=True)
    loop = new_loop(runner(bf16, num_blocks=14), frozenset(), max_batch_size=6,
                    max_step_tokens=32)  # fmt: skip
    preempted = preemptions(loop)
    assert run(loop, bf16, batch, seeded=True) == expected
    assert preempted  # the cache was too small for all six: some were recomputed


def test_every_chosen_kernel_is_row_invariant(bf16: LoadedModel) -> None:
    made = runner(bf16)
    made.bind_thread()
    generator = torch.Generator().manual_seed(3)
    assert made.choices is not None
    for name, plan in made.choices.plans.items():
        assert len(plan) == 1, (name, plan)  # one kernel at every row count
    for fused in made._fused:
        assert fused is not None
        for linear in (fused.qkv, fused.o, fused.gate_up, fused.down):
            assert row_invariant(linear.forward, linear.in_features, generator)
    assert made.kernels.head is not None
    assert row_invariant(made.kernels.head, bf16.model.lm_head.weight.shape[1], generator)
