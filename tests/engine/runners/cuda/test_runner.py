"""The GPU runner against transformers' generate on the same checkpoint on the same GPU: greedy
tokens over 32 steps for prompts of several lengths, with graphs, prefix-cache hits, chunked
prefill and preemption; every GPU kernel against the dense weights; a real server on the GPU."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from load.random_gptq import SHAPES, Layout, write_checkpoint
from predictor.engine.step import StepRow
from predictor.model.loader import LoadedModel, load_checkpoint
from predictor.types import FinishReason, SamplingParams
from tests.engine.conftest import Collected, drive, make_sequence, new_loop, preemptions
from tests.support import ServerProcess

pytestmark = pytest.mark.cuda

NEW_TOKENS = 32
LENGTHS = (1, 7, 33, 100)
# bf16: a greedy token may differ from the reference's only where the two top logits of the
# reference lie this close (a near-tie that rounding decides); after it the texts differ
BF16_TIE = 0.3
FP32_TIE = 1e-3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("gpu") / "tiny-g32-asym"
    return write_checkpoint(out, SHAPES["tiny"], Layout(4, 32, sym=False), tokenizer_dir, seed=7)


@pytest.fixture(scope="module")
def bf16(checkpoint: Path, gpu: torch.device) -> LoadedModel:
    return load_checkpoint(checkpoint, device="cuda")


@pytest.fixture(scope="module")
def fp32(checkpoint: Path, gpu: torch.device) -> LoadedModel:
    return load_checkpoint(checkpoint, device="cuda", dtype=torch.float32)


def runner(loaded: LoadedModel, num_blocks: int = 256, **options: Any) -> Any:
    from predictor.engine.runners.cuda.runner import CudaRunner

    options.setdefault("max_rows", 8)
    return CudaRunner(loaded.model, loaded.device, num_blocks, 16, **options)


def prompts(
    loaded: LoadedModel, lengths: tuple[int, ...] = LENGTHS, seed: int = 0
) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = len(loaded.tokenizer)
    return [[rng.randrange(100, vocab) for _ in range(n)] for n in lengths]


def reference(
    loaded: LoadedModel, prompt: list[int], n: int = NEW_TOKENS
) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' generate, batch 1, on the same model: its tokens and raw logits."""
    ids = torch.tensor([prompt], device=loaded.device)
    with torch.inference_mode():
        out = loaded.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
            do_sample=False, pad_token_id=loaded.pad_token_id, output_logits=True,
            return_dict_in_generate=True,
        )  # fmt: skip
    return out.sequences[0, len(prompt) :].tolist(), [x[0].float() for x in out.logits]


def agreeing(ours: list[int], logits: list[torch.Tensor], tie: float) -> int:
    """How many leading tokens equal the reference's; a first difference must be a near-tie of
    the reference's logits (then the rest is another text, not comparable)."""
    for t, (mine, row) in enumerate(zip(ours, logits, strict=False)):
        best = int(row.argmax())
        if mine != best:
            gap = float(row[best] - row[mine])
            assert gap <= tie, f"token {t}: {mine}, the reference {best}, {gap:.3f} apart"
            return t
    return len(ours)


def run_engine(
    loaded: LoadedModel, gpu_runner: Any, batch: list[list[int]], **loop_options: Any
) -> list[Collected]:
    loop = new_loop(gpu_runner, frozenset(), **loop_options)
    sinks, arrivals = [], {0: []}  # type: ignore[var-annotated]
    for i, prompt in enumerate(batch):
        seq, sink = make_sequence(
            loaded.tokenizer, prompt, SamplingParams(max_tokens=NEW_TOKENS), f"r{i}"
        )
        arrivals[0].append(seq)
        sinks.append(sink)
    drive(loop, arrivals, sinks)
    for sink in sinks:
        assert sink.finish_reason is FinishReason.LENGTH
    assert loop.scheduler.allocator.used == 0
    return sinks


def test_greedy_tokens_equal_generate_in_bf16(bf16: LoadedModel) -> None:
    batch = prompts(bf16)
    sinks = run_engine(bf16, runner(bf16), batch, max_batch_size=8)
    agreed = []
    for prompt, sink in zip(batch, sinks, strict=True):
        tokens, logits = reference(bf16, prompt)
        agreed.append(agreeing(sink.token_ids, logits, BF16_TIE))
    assert sum(agreed) >= NEW_TOKENS * len(batch) // 4, agreed  # not all at the first tokens


def test_greedy_tokens_equal_generate_exactly_in_fp32(fp32: LoadedModel) -> None:
    batch = prompts(fp32)
    gpu_runner = runner(fp32)
    sinks = run_engine(fp32, gpu_runner, batch, max_batch_size=8)
    for prompt, sink in zip(batch, sinks, strict=True):
        tokens, logits = reference(fp32, prompt)
        assert agreeing(sink.token_ids, logits, FP32_TIE) == NEW_TOKENS
    assert gpu_runner.choices is not None and gpu_runner.choices.plans  # measured and logged


def test_prefix_hits_chunked_prefill_and_preemption_keep_the_tokens(bf16: LoadedModel) -> None:
    """A shared 40-token document (prefix-cache hits), prompts fed 16 tokens a step (chunked
    prefill) and a cache too small for every row (preemption, recompute): each stream still
    equals generate's up to a near-tie."""
    document = prompts(bf16, (40,), seed=3)[0]
    batch = [document + p for p in prompts(bf16, (3, 9, 20, 5, 12, 2), seed=4)]
    gpu_runner = runner(bf16, num_blocks=20, max_step_tokens=16)
    loop = new_loop(gpu_runner, frozenset(), max_batch_size=6, max_step_tokens=16)
    preempted = preemptions(loop)
    sinks, seqs = [], []
    for i, prompt in enumerate(batch):
        seq, sink = make_sequence(
            bf16.tokenizer, prompt, SamplingParams(max_tokens=NEW_TOKENS), f"p{i}"
        )
        seqs.append(seq)
        sinks.append(sink)
    drive(loop, {0: seqs[:1], 6: seqs[1:]}, sinks)
    assert preempted and any(s.preemptions for s in seqs)
    assert any(s.cached_prompt_tokens >= 32 for s in seqs[1:])  # the document's blocks reused
    for prompt, sink in zip(batch, sinks, strict=True):
        assert sink.finish_reason is FinishReason.LENGTH
        tokens, logits = reference(bf16, prompt)
        agreeing(sink.token_ids, logits, BF16_TIE)


def test_graph_replay_equals_the_eager_step(bf16: LoadedModel) -> None:
    graphs, eager = runner(bf16), runner(bf16, graphs=False)
    batch = prompts(bf16, (5, 17, 30))
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(len(batch))]
    for r in (graphs, eager):
        r.forward([StepRow(t, 0, p, True) for t, p in zip(tables, batch, strict=True)])
    last = [p[-1] for p in batch]
    rows = [StepRow(t, len(p), [tok], True) for t, p, tok in zip(tables, batch, last, strict=True)]
    assert graphs._graphs and not eager._graphs
    a, b = graphs.forward(rows).clone(), eager.forward(rows)
    for mine, theirs in zip(a, b, strict=True):  # each runner measured its own kernels
        assert agreeing([int(mine.argmax())], [theirs], BF16_TIE) <= 1
    assert torch.allclose(a, b, atol=0.05 * float(b.std()))


@pytest.mark.parametrize(
    "layout",
    [
        Layout(4, 32, sym=False),
        Layout(4, 128, sym=True, desc_act=True, checkpoint_format="gptq_v2"),
        Layout(8, 64, sym=False),
        Layout(4, -1, sym=True),
    ],
    ids=["4bit-g32", "4bit-g128-act-order", "8bit-g64", "4bit-per-channel"],
)
def test_every_kernel_agrees_with_the_dense_weights(
    layout: Layout, tmp_path: Path, tokenizer_dir: Path, gpu: torch.device
) -> None:
    from predictor.engine.runners.cuda.linear import DENSE, CudaLinear

    shape = dataclasses.replace(SHAPES["smollm2-135m"], num_hidden_layers=1)
    path = write_checkpoint(tmp_path / "m", shape, layout, tokenizer_dir, device=gpu)
    loaded = load_checkpoint(path, device="cuda")
    mlp = loaded.model.model.layers[0].mlp
    linear = CudaLinear([mlp.gate_proj, mlp.up_proj], torch.bfloat16)
    for rows in (1, 16, 100):
        x = torch.randn((rows, linear.in_features), device=gpu).to(torch.bfloat16)
        expected = linear.kernel(DENSE)(
            x.index_select(1, linear.perm) if linear.perm is not None else x
        ).float()
        for name in linear.candidates(rows):
            got = linear.kernel(name)(
                x.index_select(1, linear.perm) if linear.perm is not None else x
            ).float()
            error = float((got - expected).norm() / expected.norm())
            assert error < 2e-2, (name, rows, error)
        reference = torch.cat((mlp.gate_proj(x), mlp.up_proj(x)), -1).float()
        linear.use([(1, linear.candidates(rows)[0])])
        assert float((linear(x).float() - reference).norm() / reference.norm()) < 2e-2


def test_the_server_serves_on_the_gpu(checkpoint: Path, gpu: torch.device) -> None:
    with ServerProcess.start(
        checkpoint,
        "tiny-gpu",
        extra=["--device", "cuda", "--kernel", "auto", "--attention", "auto"],
    ) as server:
        body = {"text_input": "The capital of France is", "parameters": {"max_tokens": 8}}
        reply = httpx.post(f"{server.base_url}/v2/models/tiny-gpu/generate", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["details"]["generated_tokens"] == 8
        chat = {"model": "tiny-gpu", "max_tokens": 6, "temperature": 0.8, "seed": 1,
                "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
        reply = httpx.post(f"{server.base_url}/v1/chat/completions", json=chat, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 6
    log = server.log()
    assert "GPU kernels for qkv" in log and "decode graphs" in log
