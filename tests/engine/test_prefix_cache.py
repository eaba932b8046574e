"""Prefix caching, KV on demand and preemption on the real tiny fp32 model, step by step.

Every test audits the allocator's books against the rows' block tables after every step, and
checks that no step writes a block another row reads or the prefix cache holds.
"""

from __future__ import annotations

import random
from collections.abc import Sequence as Rows
from typing import Any

import torch

from predictor.engine.request import Request
from predictor.engine.runners.null import NullRunner
from predictor.engine.step import StepRow
from predictor.engine.step_loop import StepLoop
from predictor.types import FinishReason, SamplingParams
from tests.engine.conftest import Collected, Tiny, drive, make_sequence, new_loop, preemptions
from tests.engine.test_step_loop import NO_EOS, reference_greedy
from tests.support import tune_cache


class Watched:
    """A runner that checks each step's writes against the cache: a token is written only
    into a block its own row holds alone and the prefix cache does not hold (so a hit never
    reads a block being overwritten)."""

    def __init__(self, inner: Any, loop: list[StepLoop]) -> None:
        self.inner, self.loop = inner, loop
        self.device, self.num_blocks = inner.device, inner.num_blocks
        self.block_size = inner.block_size
        self.writes = 0

    def bind_thread(self) -> None:
        self.inner.bind_thread()

    def forward(self, rows: Rows[StepRow]) -> torch.Tensor:
        allocator = self.loop[0].scheduler.allocator
        for index, row in enumerate(rows):
            end = row.start + len(row.tokens)
            written = {row.blocks[p // self.block_size] for p in range(row.start, end)}
            others = {b for j, other in enumerate(rows) if j != index for b in other.blocks}
            assert not written & others, "a step writes a block another row reads"
            assert all(allocator._key_of[b] is None for b in written), "writes a cached block"
            self.writes += len(written)
        return self.inner.forward(rows)


def watched_loop(tiny: Tiny, num_blocks: int, block_size: int, **kwargs: Any) -> StepLoop:
    holder: list[StepLoop] = []
    runner = Watched(tiny.runner(num_blocks=num_blocks, block_size=block_size), holder)
    loop = new_loop(runner, NO_EOS, **kwargs)
    holder.append(loop)
    return loop


def audited(loop: StepLoop, arrivals: dict[int, list[Request]], sinks: list[Collected]) -> int:
    """drive(), auditing the books before each step (so after the previous one)."""

    def audit(_: int) -> None:
        loop.scheduler.allocator.audit(seq.blocks for seq in loop.scheduler.running)

    steps = drive(loop, arrivals, sinks, max_steps=2000, each_step=audit)
    loop.scheduler.allocator.audit(seq.blocks for seq in loop.scheduler.running)
    assert loop.scheduler.allocator.used == 0
    return steps


def ids(tiny: Tiny, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, len(tiny.tokenizer)) for _ in range(n)]


def request(
    tiny: Tiny, prompt: list[int], n: int, rid: str, salt: str | None = None
) -> tuple[Request, Collected]:
    seq, sink = make_sequence(tiny.tokenizer, prompt, SamplingParams(max_tokens=n), rid)
    seq.cache_salt = salt
    return seq, sink


def test_a_cache_hit_gives_the_cold_runs_greedy_tokens_with_partial_blocks(
    tiny_dense: Tiny,
) -> None:
    """Prompts sharing a 21-token document (5 blocks of 4 and one token more), each shorter,
    longer or equal to another, and one exactly on a block boundary; output as generate's."""
    doc = ids(tiny_dense, 21, 1)
    first = doc + ids(tiny_dense, 3, 2)
    prompts = [first, first + ids(tiny_dense, 7, 3), doc[:20], doc[:20], first, doc[:9],
               doc + ids(tiny_dense, 5, 4)]  # fmt: skip
    loop = watched_loop(tiny_dense, 64, 4, max_batch_size=4, max_step_tokens=16)
    sinks: list[Collected] = []
    seqs: list[Request] = []
    arrivals: dict[int, list[Request]] = {}
    for i, p in enumerate(prompts):
        seq, sink = request(tiny_dense, p, 6, f"p{i}")
        arrivals.setdefault(0 if i == 0 else 12 + i, []).append(seq)
        sinks.append(sink)
        seqs.append(seq)
    audited(loop, arrivals, sinks)
    for p, sink in zip(prompts, sinks, strict=True):
        assert sink.token_ids == reference_greedy(tiny_dense, p, 6)
    cached = [s.cached_prompt_tokens for s in seqs]
    # the first is cold; later ones take whole blocks of the document, never the last token
    assert cached[0] == 0
    assert cached[1] == 24  # the first prompt, 6 blocks, continued (not by its output)
    assert cached[2] == 16 and cached[3] == 16  # 20 tokens: the fifth block holds the last one
    assert cached[4] == 20  # the same 24-token prompt again: its last block is computed
    assert cached[5] == 8
    assert cached[6] == 20  # the document's 5 whole blocks; its 21st token is in the 6th
    for sink, seq in zip(sinks, seqs, strict=True):
        assert sink.events[-1].usage is not None
        assert sink.events[-1].usage.cached_tokens == seq.cached_prompt_tokens


def test_caching_off_shares_nothing(tiny_dense: Tiny) -> None:
    loop = watched_loop(tiny_dense, 64, 4)
    loop.scheduler.prefix_caching = False
    doc = ids(tiny_dense, 30, 4)
    a, sa = request(tiny_dense, doc, 3, "a")
    b, sb = request(tiny_dense, doc, 3, "b")
    audited(loop, {0: [a], 8: [b]}, [sa, sb])
    assert a.cached_prompt_tokens == b.cached_prompt_tokens == 0
    assert loop.scheduler.allocator.cached == 0 and sb.token_ids == sa.token_ids


def test_salts_never_share(tiny_dense: Tiny) -> None:
    loop = watched_loop(tiny_dense, 64, 4)
    doc = ids(tiny_dense, 30, 5)
    runs = [("a", "tenant-1"), ("b", "tenant-2"), ("c", None), ("d", "tenant-1"), ("e", None)]
    seqs, sinks, arrivals = [], [], {}
    for step, (rid, salt) in enumerate(runs):
        seq, sink = request(tiny_dense, doc, 3, rid, salt)
        arrivals[step * 10] = [seq]
        seqs.append(seq)
        sinks.append(sink)
    audited(loop, arrivals, sinks)
    assert [s.cached_prompt_tokens for s in seqs] == [0, 0, 0, 28, 28]
    assert all(sink.token_ids == sinks[0].token_ids for sink in sinks)
    blocks: dict[str | None, set[int]] = {salt: set() for _, salt in runs}
    for seq in seqs:
        for key in seq.keys:
            block = loop.scheduler.allocator._by_key.get(key)
            if block is not None:
                blocks[seq.cache_salt].add(block)
    assert not (blocks["tenant-1"] & blocks["tenant-2"]) and not (blocks["tenant-1"] & blocks[None])


def test_eviction_under_pressure_is_least_recently_used(tiny_dense: Tiny) -> None:
    """A 24-block cache: two 32-token prompts (8 blocks each, cached after they end), the
    first used again after the second; then a 48-token one needs 13 blocks of the 8 free and
    must evict the second's (least recently used), so the first still hits and the second no
    longer fully."""
    loop = watched_loop(tiny_dense, 24, 4, max_batch_size=1)
    first, second, third = ids(tiny_dense, 32, 6), ids(tiny_dense, 32, 7), ids(tiny_dense, 48, 8)
    order = [first, second, first, third, first, second]
    seqs, sinks, arrivals = [], [], {}
    for i, p in enumerate(order):
        seq, sink = request(tiny_dense, p, 2, f"e{i}")
        arrivals[i * 12] = [seq]
        seqs.append(seq)
        sinks.append(sink)
    audited(loop, arrivals, sinks)
    hits = [s.cached_prompt_tokens for s in seqs]
    assert hits[:3] == [0, 0, 28]
    assert hits[3] == 0 and hits[4] == 28  # third evicted second's blocks, not first's
    assert hits[5] < 28  # second's prefix was evicted
    for p, sink in zip(order, sinks, strict=True):
        assert sink.token_ids == reference_greedy(tiny_dense, p, 2)


def test_preemption_never_repeats_loses_or_reorders_a_token(tiny_dense: Tiny) -> None:
    """Six rows growing in a 30-block cache (4 tokens a block) cannot all fit: the newest are
    preempted, recomputed and resumed; every stream equals generate's, token for token."""
    loop = watched_loop(tiny_dense, 30, 4, max_batch_size=6, max_step_tokens=64)
    preempted = preemptions(loop)
    prompts = [ids(tiny_dense, n, 20 + n) for n in (5, 9, 3, 12, 7, 6)]
    seqs, sinks = [], []
    for i, p in enumerate(prompts):
        seq, sink = request(tiny_dense, p, 22, f"g{i}")
        seqs.append(seq)
        sinks.append(sink)
    audited(loop, {0: seqs}, sinks)
    assert len(preempted) >= 2
    assert any(s.preemptions for s in seqs)
    for p, sink in zip(prompts, sinks, strict=True):
        assert sink.finish_reason is FinishReason.LENGTH
        assert sink.token_ids == reference_greedy(tiny_dense, p, 22)
        assert sum(1 for e in sink.events if e.final) == 1
        assert "".join(e.text for e in sink.events) == tiny_dense.tokenizer.decode(sink.token_ids)


def test_cancelling_a_row_with_shared_blocks_frees_only_its_references(tiny_dense: Tiny) -> None:
    loop = watched_loop(tiny_dense, 64, 4)
    doc = ids(tiny_dense, 26, 9)
    a, sa = request(tiny_dense, doc + [101, 102], 30, "a")
    b, sb = request(tiny_dense, doc + [103], 30, "b")
    for step in range(12):
        if step == 0:
            loop.scheduler.add(a)
        if step == 8:
            loop.scheduler.add(b)
        loop.step()
        loop.scheduler.allocator.audit(seq.blocks for seq in loop.scheduler.running)
    shared = set(a.blocks) & set(b.blocks)
    assert len(shared) == 6 and b.cached_prompt_tokens == 24
    b.aborted = True
    loop.step()
    loop.scheduler.allocator.audit(seq.blocks for seq in loop.scheduler.running)
    assert sb.finish_reason is FinishReason.CANCELLED and loop.scheduler.running == [a]
    assert all(loop.scheduler.allocator._refs[block] == 1 for block in shared)
    assert loop.scheduler.allocator.used == len(a.blocks)
    audited(loop, {}, [sa])
    assert sa.token_ids == reference_greedy(tiny_dense, doc + [101, 102], 30)


def test_max_tokens_4096_does_not_hold_the_cache() -> None:
    """32 requests asking for 4096 tokens each all run at once in the default 32k-token cache
    (each holds its prompt's blocks and grows by what it generates)."""
    from predictor.engine.kv_cache import BlockAllocator
    from predictor.engine.scheduler import Scheduler

    allocator = BlockAllocator(32768 // 16, 16)
    runner = NullRunner(1000, allocator.num_blocks)
    loop = StepLoop(runner, Scheduler(32, 64, allocator, max_step_tokens=2048), frozenset())

    class Silent:
        def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
            return ""

    seqs = [
        make_sequence(Silent(), [i + 1] * 60, SamplingParams(max_tokens=4096), f"m{i}")[0]
        for i in range(32)
    ]
    for seq in seqs:
        loop.scheduler.add(seq)
    for _ in range(50):
        loop.step()
        allocator.audit(seq.blocks for seq in loop.scheduler.running)
    assert len(loop.scheduler.running) == 32 and loop.scheduler.waiting() == 0
    assert all(len(seq.output_ids) == 50 for seq in seqs)
    assert allocator.used == 32 * 7  # 110 tokens each: 7 blocks, of 2048


def test_hits_on_the_native_path_give_the_cold_tokens(tiny_gptq: Any) -> None:
    """The bf16 GPTQ model with the native attention kernel, layer ops and the native 4-bit
    matmul (what a CPU server runs): shared-prefix prompts with caching on give the tokens of the
    same prompts with caching off."""
    from predictor.engine.runners.cpu import ModelRunner

    tokenizer = tiny_gptq.tokenizer
    rng = random.Random(9)
    doc = [rng.randrange(100, len(tokenizer)) for _ in range(37)]
    prompts = [doc + [rng.randrange(100, len(tokenizer)) for _ in range(k)] for k in (3, 9, 1)]

    def run(caching: bool) -> tuple[list[list[int]], list[int]]:
        runner = ModelRunner(
            tiny_gptq.model, torch.device("cpu"), 64, 4, threads=1, attention="native",
            kernel="native_f32", autotune_cache=tune_cache(),
        )  # fmt: skip
        assert runner._native is not None
        loop = new_loop(runner, NO_EOS, max_batch_size=4, max_step_tokens=16)
        loop.scheduler.prefix_caching = caching
        sinks, seqs, arrivals = [], [], {}
        for i, p in enumerate(prompts):
            seq, sink = make_sequence(tokenizer, p, SamplingParams(max_tokens=6), f"n{i}")
            arrivals[i * 12] = [seq]
            sinks.append(sink)
            seqs.append(seq)
        audited(loop, arrivals, sinks)
        return [s.token_ids for s in sinks], [s.cached_prompt_tokens for s in seqs]

    cold, none = run(caching=False)
    warm, cached = run(caching=True)
    assert none == [0, 0, 0] and cached[0] == 0 and min(cached[1:]) >= 36
    assert warm == cold
