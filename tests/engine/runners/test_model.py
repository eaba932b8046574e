"""The runner on the tiny GPTQ model: fused int4 projections, paged attention, vs transformers."""

from __future__ import annotations

import random
from typing import Any

import torch

from predictor.engine.runners.model import ModelRunner
from predictor.engine.step import StepRow


def step_logits(runner: ModelRunner, prompts: list[list[int]], steps: int) -> list[torch.Tensor]:
    """Prefill every prompt in one step, then decode greedily; logits of every step."""
    block = runner.block_size
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(len(prompts))]
    out = [runner.forward([StepRow(t, 0, p, True) for t, p in zip(tables, prompts, strict=True)])]
    lengths = [len(p) for p in prompts]
    for _ in range(steps):
        last = out[-1].argmax(dim=-1).tolist()
        rows = [StepRow(t, n, [tok], True) for t, n, tok in zip(tables, lengths, last, strict=True)]
        assert all(n + 1 <= len(t) * block for t, n in zip(tables, lengths, strict=True))
        out.append(runner.forward(rows))
        lengths = [n + 1 for n in lengths]
    return out


def test_fused_int4_projections_give_the_same_tokens(tiny_gptq: Any) -> None:
    model = tiny_gptq.model
    fused = ModelRunner(model, torch.device("cpu"), 64, 16)
    assert all(layer is not None for layer in fused._fused)  # every layer fused on this CPU
    plain = ModelRunner(model, torch.device("cpu"), 64, 16)
    plain._fused = [None] * len(plain._fused)  # the model's own gptqmodel modules
    rng = random.Random(4)
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in (5, 17, 30)]
    a, b = step_logits(fused, prompts, 6), step_logits(plain, prompts, 6)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.argmax(dim=-1), y.argmax(dim=-1))
        assert torch.allclose(x, y, atol=0.05 * float(y.std()))


def test_paged_attention_matches_transformers_forward(tiny_gptq: Any) -> None:
    model = tiny_gptq.model
    runner = ModelRunner(model, torch.device("cpu"), 64, 16)
    prompt = [random.Random(5).randrange(100, 40000) for _ in range(23)]
    ours = step_logits(runner, [prompt], 4)
    ids = prompt + [int(x.argmax()) for x in ours[:-1]]
    with torch.inference_mode():
        theirs = model(torch.tensor([ids])).logits[0, len(prompt) - 1 :].float()
    for i, x in enumerate(ours):
        assert int(x[0].argmax()) == int(theirs[i].argmax())
        assert torch.allclose(x[0], theirs[i], atol=0.05 * float(theirs[i].std()))
