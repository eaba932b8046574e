"""The step loop on real tiny models, driven step by step so arrival patterns are exact."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from predictor.engine.runners.cpu import ModelRunner
from predictor.engine.step import StepRow
from predictor.types import FinishReason, SamplingParams
from tests.engine.conftest import Collected, Tiny, drive, make_sequence, new_loop


def reference_greedy(tiny: Tiny, prompt: list[int], n: int) -> list[int]:
    """transformers' own generate, batch 1: what every row must reproduce."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = tiny.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
            do_sample=False, pad_token_id=tiny.pad_token_id,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def prompts(tiny: Tiny, count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = len(tiny.tokenizer)
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(1, 40))] for _ in range(count)]


NO_EOS: frozenset[int] = frozenset()


def test_greedy_rows_equal_generate_under_staggered_arrivals(tiny_dense: Tiny) -> None:
    ps = prompts(tiny_dense, 7)
    lengths = [12, 30, 5, 20, 1, 25, 16]
    loop = new_loop(tiny_dense.runner(), NO_EOS, max_batch_size=4)
    arrivals: dict[int, list[Any]] = {}
    sinks: list[Collected] = []
    for i, (p, n) in enumerate(zip(ps, lengths, strict=True)):
        seq, sink = make_sequence(tiny_dense.tokenizer, p, SamplingParams(max_tokens=n), f"r{i}")
        arrivals.setdefault([0, 0, 3, 4, 4, 9, 15][i], []).append(seq)
        sinks.append(sink)
    drive(loop, arrivals, sinks)
    for p, n, sink in zip(ps, lengths, sinks, strict=True):
        assert sink.finish_reason is FinishReason.LENGTH
        assert sink.token_ids == reference_greedy(tiny_dense, p, n)
        assert sink.events[-1].usage is not None
        assert sink.events[-1].usage.generated_tokens == n
        assert sink.events[-1].usage.prompt_tokens == len(p)
    assert len(loop.scheduler.running) == 0 and loop.scheduler.allocator.used == 0


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(tiny_dense: Tiny) -> None:
    ps = prompts(tiny_dense, 4, seed=5)
    params = SamplingParams(max_tokens=15, temperature=0.9, top_p=0.95, top_k=50, seed=42)

    alone_loop = new_loop(tiny_dense.runner(), NO_EOS)
    seq, alone = make_sequence(tiny_dense.tokenizer, ps[0], params)
    drive(alone_loop, {0: [seq]}, [alone])

    loop = new_loop(tiny_dense.runner(), NO_EOS)
    sinks, arrivals = [], {}
    for i, p in enumerate(ps):
        other = params if i == 0 else SamplingParams(max_tokens=9, temperature=1.0, seed=i)
        s, sink = make_sequence(tiny_dense.tokenizer, p, other, f"r{i}")
        arrivals.setdefault(0 if i < 2 else 2, []).append(s)
        sinks.append(sink)
    drive(loop, arrivals, sinks)
    assert sinks[0].token_ids == alone.token_ids
    assert sinks[0].text == alone.text


def test_gptq_output_is_well_formed_and_repeatable(tiny_gptq: Any) -> None:
    tiny = Tiny(tiny_gptq.model, tiny_gptq.tokenizer, tiny_gptq.eos_ids, tiny_gptq.pad_token_id)
    ps = prompts(tiny, 5, seed=9)

    def run() -> list[list[int]]:
        loop = new_loop(tiny.runner(), NO_EOS)
        sinks, arrivals = [], {}
        for i, p in enumerate(ps):
            s, sink = make_sequence(tiny.tokenizer, p, SamplingParams(max_tokens=8 + i), f"g{i}")
            arrivals.setdefault(i * 2, []).append(s)
            sinks.append(sink)
        drive(loop, arrivals, sinks)
        for i, sink in enumerate(sinks):
            assert sink.finish_reason is FinishReason.LENGTH
            assert len(sink.token_ids) == 8 + i
            assert "\ufffd" not in sink.text
        return [sink.token_ids for sink in sinks]

    assert run() == run()


class Delegating:
    """A runner that forwards to a real one; fault injectors override forward."""

    def __init__(self, inner: ModelRunner) -> None:
        self.inner, self.device = inner, inner.device
        self.num_blocks, self.block_size = inner.num_blocks, inner.block_size

    def bind_thread(self) -> None:
        self.inner.bind_thread()

    def forward(self, rows: list[StepRow]) -> torch.Tensor:
        return self.inner.forward(rows)


class PoisonRows(Delegating):
    """A runner that turns the logits of chosen rows into NaN (a request gone bad)."""

    def __init__(self, inner: ModelRunner, poisoned: set[int]) -> None:
        super().__init__(inner)
        self.poisoned = poisoned
        self.loop: Any = None

    def _poison(self, logits: torch.Tensor, seqs: list[Any]) -> torch.Tensor:
        for row, seq in enumerate(seqs):
            if id(seq) in self.poisoned and len(seq.output_ids) >= 2:
                logits[row] = float("nan")
        return logits

    def forward(self, rows: list[StepRow]) -> torch.Tensor:
        # every row is decoding here: logits row i belongs to batch row i
        return self._poison(self.inner.forward(rows).clone(), self.loop.scheduler.running)


def test_poisoned_request_fails_alone(tiny_dense: Tiny) -> None:
    ps = prompts(tiny_dense, 3, seed=3)
    seqs_sinks = [
        make_sequence(tiny_dense.tokenizer, p, SamplingParams(max_tokens=12), f"p{i}")
        for i, p in enumerate(ps)
    ]
    bad = seqs_sinks[1][0]
    runner = PoisonRows(tiny_dense.runner(), {id(bad)})
    loop = new_loop(runner, NO_EOS)
    runner.loop = loop
    sinks = [s for _, s in seqs_sinks]
    drive(loop, {0: [s for s, _ in seqs_sinks]}, sinks)
    assert sinks[1].finish_reason is FinishReason.ERROR
    assert "non-finite" in (sinks[1].events[-1].error or "")
    for i in (0, 2):
        assert sinks[i].finish_reason is FinishReason.LENGTH
        assert sinks[i].token_ids == reference_greedy(tiny_dense, ps[i], 12)


class FailOnce(Delegating):
    """A runner whose next forward raises: the rows it fed fail, later requests are served."""

    def __init__(self, inner: ModelRunner) -> None:
        super().__init__(inner)
        self.armed = False

    def forward(self, rows: list[StepRow]) -> torch.Tensor:
        if self.armed:
            self.armed = False
            raise RuntimeError("device lost")
        return self.inner.forward(rows)


def test_failed_forward_fails_its_batch_and_the_engine_goes_on(
    tiny_dense: Tiny, caplog: pytest.LogCaptureFixture
) -> None:
    ps = prompts(tiny_dense, 3, seed=4)
    runner = FailOnce(tiny_dense.runner())
    loop = new_loop(runner, NO_EOS)
    first = [make_sequence(tiny_dense.tokenizer, p, SamplingParams(max_tokens=10)) for p in ps[:2]]
    for s, _ in first:
        loop.scheduler.add(s)
    loop.step()
    runner.armed = True
    loop.step()
    for _, sink in first:
        assert sink.finish_reason is FinishReason.ERROR
        # a short message for the client; the exception's text only in the log
        assert sink.events[-1].error == "forward pass failed"
    assert "device lost" in caplog.text
    assert len(loop.scheduler.running) == 0
    later, sink = make_sequence(tiny_dense.tokenizer, ps[2], SamplingParams(max_tokens=6))
    drive(loop, {0: [later]}, [sink])
    assert sink.token_ids == reference_greedy(tiny_dense, ps[2], 6)


def test_abort_frees_the_row_at_the_next_step(tiny_dense: Tiny) -> None:
    loop = new_loop(tiny_dense.runner(), NO_EOS)
    pairs = [make_sequence(tiny_dense.tokenizer, p, SamplingParams(max_tokens=50))
             for p in prompts(tiny_dense, 2, seed=8)]  # fmt: skip
    for s, _ in pairs:
        loop.scheduler.add(s)
    loop.step()
    loop.step()
    assert len(loop.scheduler.running) == 2
    pairs[0][0].aborted = True
    loop.step()
    assert len(loop.scheduler.running) == 1
    assert loop.scheduler.allocator.used == len(pairs[1][0].blocks)
    assert pairs[0][1].finish_reason is FinishReason.CANCELLED
    pairs[1][0].aborted = True
    loop.step()
    assert len(loop.scheduler.running) == 0 and loop.scheduler.allocator.used == 0


def test_eos_and_stop_strings(tiny_dense: Tiny) -> None:
    p = prompts(tiny_dense, 1, seed=11)[0]
    ref = reference_greedy(tiny_dense, p, 12)
    # make the 4th generated token an end-of-sequence token
    loop = new_loop(tiny_dense.runner(), frozenset({ref[3]}) - set(ref[:3]))
    seq, sink = make_sequence(tiny_dense.tokenizer, p, SamplingParams(max_tokens=12))
    drive(loop, {0: [seq]}, [sink])
    if ref[3] not in ref[:3]:
        assert sink.finish_reason is FinishReason.EOS
        assert sink.token_ids == ref[:4]
    # a stop string taken from the middle of the greedy text
    full = tiny_dense.tokenizer.decode(ref)
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    loop = new_loop(tiny_dense.runner(), NO_EOS)
    seq, sink = make_sequence(tiny_dense.tokenizer, p, SamplingParams(max_tokens=12, stop=(stop,)))
    drive(loop, {0: [seq]}, [sink])
    assert sink.finish_reason is FinishReason.STOP
    assert sink.text == full[: full.find(stop)]
    assert stop not in sink.text


def test_chunked_prefill_output_equals_generate(tiny_dense: Tiny) -> None:
    """Prompts longer than a step's token budget are prefilled over several steps."""
    rng = random.Random(21)
    vocab = len(tiny_dense.tokenizer)
    ps = [[rng.randrange(100, vocab) for _ in range(n)] for n in (70, 33, 5, 120)]
    loop = new_loop(tiny_dense.runner(), NO_EOS, max_batch_size=4, max_step_tokens=24)
    sinks, arrivals = [], {}
    for i, p in enumerate(ps):
        seq, sink = make_sequence(tiny_dense.tokenizer, p, SamplingParams(max_tokens=10), f"c{i}")
        arrivals.setdefault(i * 3, []).append(seq)
        sinks.append(sink)
    fed: list[int] = []
    drive(loop, arrivals, sinks, each_step=lambda _: fed.append(0))
    for p, sink in zip(ps, sinks, strict=True):
        assert sink.token_ids == reference_greedy(tiny_dense, p, 10)


def test_cache_holds_exactly_what_the_rows_hold_after_every_step(tiny_dense: Tiny) -> None:
    rng = random.Random(5)
    vocab = len(tiny_dense.tokenizer)
    loop = new_loop(tiny_dense.runner(), NO_EOS, max_batch_size=4, max_step_tokens=32)
    block = loop.scheduler.allocator.block_size
    lengths = [(300, 6), (4, 30), (9, 25), (17, 12)]  # one long prompt among short ones
    pairs = [
        make_sequence(
            tiny_dense.tokenizer,
            [rng.randrange(100, vocab) for _ in range(n)],
            SamplingParams(max_tokens=m),
            f"k{i}",
        )
        for i, (n, m) in enumerate(lengths)
    ]
    for seq, _ in pairs:
        loop.scheduler.add(seq)
    seen_long_prefill = False
    for _ in range(200):
        loop.step()
        rows = loop.scheduler.running
        # a row holds its prompt's blocks from admission, then one more per block_size tokens
        held = sum(
            -(-(seq.total_tokens if seq.prefilling else seq.cached) // block) for seq in rows
        )
        assert loop.scheduler.allocator.used == held
        assert all(len(seq.blocks) * block >= seq.cached for seq in rows)
        assert loop.scheduler.allocator.usage() == held / loop.scheduler.allocator.num_blocks
        loop.scheduler.allocator.audit(seq.blocks for seq in rows)
        seen_long_prefill |= any(seq.prefilling for seq in rows)
        if all(sink.done for _, sink in pairs):
            break
    assert seen_long_prefill
    assert all(sink.finish_reason is FinishReason.LENGTH for _, sink in pairs)
    assert loop.scheduler.allocator.used == 0


def test_ignore_eos_and_min_tokens(tiny_dense: Tiny) -> None:
    p = prompts(tiny_dense, 1, seed=11)[0]
    ref = reference_greedy(tiny_dense, p, 12)
    eos = ref[3]
    if eos in ref[:3]:
        return  # the greedy text repeats itself early: nothing to learn from this prompt
    eos_ids = frozenset({eos})
    # ignore_eos: the end-of-sequence token is generated and the request goes on
    loop = new_loop(tiny_dense.runner(), eos_ids)
    seq, sink = make_sequence(
        tiny_dense.tokenizer, p, SamplingParams(max_tokens=12, ignore_eos=True)
    )
    drive(loop, {0: [seq]}, [sink])
    assert sink.finish_reason is FinishReason.LENGTH and sink.token_ids == ref
    # min_tokens: the end-of-sequence token cannot be drawn before 6 tokens exist
    loop = new_loop(tiny_dense.runner(), eos_ids)
    seq, sink = make_sequence(tiny_dense.tokenizer, p, SamplingParams(max_tokens=12, min_tokens=6))
    drive(loop, {0: [seq]}, [sink])
    assert sink.token_ids[:3] == ref[:3] and sink.token_ids[3] != eos
    assert eos not in sink.token_ids[:6] and len(sink.token_ids) >= 6


def test_logprobs_equal_log_softmax_of_a_direct_forward_pass(tiny_dense: Tiny) -> None:
    p = prompts(tiny_dense, 1, seed=13)[0]
    loop = new_loop(tiny_dense.runner(), NO_EOS)
    seq, sink = make_sequence(tiny_dense.tokenizer, p, SamplingParams(max_tokens=4, logprobs=2))
    drive(loop, {0: [seq]}, [sink])
    ids = torch.tensor([p + sink.token_ids])
    with torch.inference_mode():
        logits = tiny_dense.model(ids).logits[0].float()
    want = torch.log_softmax(logits, dim=-1)
    got = [lp for event in sink.events for lp in event.logprobs]
    assert [lp.token_id for lp in got] == sink.token_ids
    for i, lp in enumerate(got):
        row = want[len(p) - 1 + i]
        assert abs(lp.logprob - float(row[lp.token_id])) < 1e-4
        assert [t.token_id for t in lp.top] == torch.topk(row, 2).indices.tolist()
        assert lp.token == tiny_dense.tokenizer.decode([lp.token_id])


def test_chores_run_a_slice_between_two_steps_on_the_loop_thread(tiny_dense: Tiny) -> None:
    """StepLoop.run_chore: before the loop runs, at once on the caller's thread; while it runs,
    each slice on the loop's thread with a step between two slices while a request runs, the
    chore's result returned to the caller and its exception raised there."""
    import threading

    loop = new_loop(tiny_dense.runner(num_blocks=64, block_size=4), frozenset())
    steps: list[int] = []
    seen: list[tuple[str, int]] = []

    def chore(slices: int, fail: bool = False) -> Any:
        for _ in range(slices):
            seen.append((threading.current_thread().name, len(steps)))
            yield
        if fail:
            raise ValueError("this adapter is bad")
        return "done"

    assert loop.run_chore(chore(2)) == "done"
    assert [name for name, _ in seen] == [threading.current_thread().name] * 2
    seen.clear()
    loop.start(lambda stats: steps.append(stats.fed))
    try:
        params = SamplingParams(max_tokens=200, ignore_eos=True)
        request, sink = make_sequence(tiny_dense.tokenizer, [5, 6, 7], params)
        loop.scheduler.add(request)
        loop.notify()
        while not sink.events:
            threading.Event().wait(0.01)
        assert loop.run_chore(chore(5)) == "done"
        assert {name for name, _ in seen} == {"engine-step-loop"}
        counts = [count for _, count in seen]
        assert all(b > a for a, b in zip(counts, counts[1:], strict=False)), counts
        with pytest.raises(ValueError, match="this adapter is bad"):
            loop.run_chore(chore(1, fail=True))
        assert loop.alive()  # a failed chore leaves the loop serving
    finally:
        loop.stop()


class PaddedHead:
    """A runner whose head has 64 rows past the tokenizer's (as Qwen3's), scoring above all."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.device, self.num_blocks, self.block_size = (
            inner.device,
            inner.num_blocks,
            inner.block_size,
        )

    def bind_thread(self) -> None:
        self.inner.bind_thread()

    def forward(self, rows: Any) -> torch.Tensor:
        logits = self.inner.forward(rows)
        return torch.cat([logits, torch.full((logits.shape[0], 64), 1e4)], dim=1)


def test_the_heads_padding_rows_are_never_sampled(tiny_dense: Tiny) -> None:
    """Rows past the tokenizer's tokens spell no text (the detokenizer had none to give, and the
    step failed): greedy and sampled rows pick among the tokenizer's tokens only."""
    vocab = len(tiny_dense.tokenizer)
    (p,) = prompts(tiny_dense, 1, seed=3)
    loop = new_loop(PaddedHead(tiny_dense.runner()), NO_EOS, vocab=vocab)
    greedy, greedy_sink = make_sequence(tiny_dense.tokenizer, p, SamplingParams(max_tokens=8))
    hot = SamplingParams(max_tokens=8, temperature=1.0, seed=7)
    sampled, sampled_sink = make_sequence(tiny_dense.tokenizer, p, hot, "hot")
    drive(loop, {0: [greedy, sampled]}, [greedy_sink, sampled_sink])
    assert greedy_sink.token_ids == reference_greedy(tiny_dense, p, 8)
    assert sampled_sink.finish_reason is FinishReason.LENGTH
    assert all(t < vocab for t in sampled_sink.token_ids) and len(sampled_sink.token_ids) == 8


def test_the_status_is_published_by_the_step_and_counts_requests_handed_since(
    tiny_dense: Tiny,
) -> None:
    loop = new_loop(tiny_dense.runner(), NO_EOS, max_batch_size=1)
    first, first_sink = make_sequence(tiny_dense.tokenizer, [5, 6, 7], SamplingParams(max_tokens=3))
    second, _ = make_sequence(tiny_dense.tokenizer, [8, 9], SamplingParams(max_tokens=3), "b")
    second.adapter = 4  # a LoRA slot, as the input processor gives it (the tiny runner has none)
    loop.add_all([first, second])
    # nothing published yet: the queue's count comes from the requests handed since
    assert loop.status().waiting == 0 and loop.status().running == 0 and loop.waiting() == 2
    loop.step()
    status = loop.status()
    assert (status.running, status.waiting, loop.waiting()) == (1, 1, 1)
    assert status.running_adapters == (0,) and status.waiting_adapters == (4,)
    assert status.kv_usage == loop.scheduler.allocator.usage() > 0
    assert loop.adapters_in_use() == {0, 4}
    while not first_sink.done:
        loop.step()
    loop.scheduler.drain()
    loop.step()  # the finished row gone and the queue empty: published as such
    assert loop.status().running == 0 and loop.waiting() == 0
    assert loop.status().kv_usage == 0.0
