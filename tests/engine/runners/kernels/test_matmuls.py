"""engine/runners/kernels/matmuls.py on the tiny GPTQ model: every layer fused at start, a forced
kernel checked there, the kernels chosen once with the runner's hook between the choice and the
deferred copies, the step cost from the measured figures, and a head served from its int8 table
letting its bf16 weights go (a tied embedding's lookups read that table then)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from predictor.engine.runners.kernels import autotune
from predictor.engine.runners.kernels.autotune_cache import Choices
from predictor.engine.runners.kernels.matmuls import Matmuls
from predictor.engine.runners.native import bindings as native
from predictor.model.loader import load_checkpoint


def test_the_kernels_are_chosen_once_and_the_hook_runs_before_the_copies(
    tiny_gptq: Any, tmp_path: Path
) -> None:
    model = tiny_gptq.model
    matmuls = Matmuls(
        list(model.model.layers),
        model.lm_head,
        invariant=False,
        cache_dir=tmp_path,
        copies_after_ready=True,
    )
    assert matmuls.fused and all(f is not None for f in matmuls.fused)
    assert matmuls.head is None and matmuls.cost(1, 1) is None  # nothing chosen yet
    seen: list[bool] = []
    matmuls.choose(lambda: seen.append(matmuls.choices is not None))
    matmuls.choose(lambda: seen.append(False))  # chosen already: nothing runs again
    matmuls.join()
    assert seen == [True]
    assert matmuls.choices is not None and matmuls.choices.source.startswith("measured")
    few, many = matmuls.cost(4, 1), matmuls.cost(64, 64)
    assert few is not None and many is not None and 0 < few < many
    x = torch.randn((3, model.config.hidden_size)).to(model.lm_head.weight.dtype)
    assert matmuls.head is not None
    assert matmuls.head(x).shape == (3, model.config.vocab_size)


def test_a_forced_kernel_is_checked_at_start_and_has_no_step_cost(tiny_gptq: Any) -> None:
    model = tiny_gptq.model
    layers = list(model.model.layers)
    with pytest.raises(ValueError, match="kernel must be auto or one of"):
        Matmuls(layers, model.lm_head, forced="fastest_please")
    forced = Matmuls(layers, model.lm_head, forced="int4_op", invariant=False)
    forced.choose()
    assert forced.choices is not None and forced.choices.source == "forced"
    assert all(
        plan == [(1, "int4_op")]
        for key, plan in forced.choices.plans.items()
        if not key.startswith("lm_head")
    )
    assert forced.cost(1, 1) is None  # no figures for a kernel that was not measured


@pytest.mark.parametrize("tied", [True, False])
def test_a_head_served_in_int8_lets_its_bf16_weights_go(
    tiny_gptq_dir: Path, monkeypatch: pytest.MonkeyPatch, tied: bool
) -> None:
    """A server's Matmuls (the model's own weights released) whose autotune chose the int8
    head: the head's bf16 weight is emptied; tied, so is the embedding's, and its rows come from
    the int8 table (each within its 32-input block's rounding of the bf16 row); untied, the
    embedding stays as it was."""
    isas = native.usable_isas()
    if not isas:
        pytest.skip("this CPU has neither AVX2 + FMA nor AVX-512")
    model = load_checkpoint(tiny_gptq_dir, device="cpu", served=True).model  # emptied here
    vocab, width = model.lm_head.weight.shape
    embedding = torch.nn.Embedding(vocab, width).bfloat16()
    head = torch.nn.Linear(width, vocab, bias=False).bfloat16()
    if tied:
        head.weight = embedding.weight
    kept = embedding.weight.detach().clone()
    int8 = f"int8_f32_{isas[0]}"

    def measured(groups: dict[str, Any], heads: dict[str, Any], head_name: str, *_: Any) -> Any:
        plans = {key: [(1, "int4_op")] for key in groups} | {head_name: [(1, int8)]}
        return Choices(plans)

    monkeypatch.setattr(autotune, "_measure", measured)
    layers = list(model.model.layers)
    matmuls = Matmuls(layers, head, release_model_weights=True, embedding=embedding)
    matmuls.choose()
    assert head.weight.numel() == 0
    ids = torch.tensor([0, 17, vocab - 1])
    if not tied:
        assert matmuls.embed is embedding and torch.equal(embedding.weight, kept)
        return
    assert embedding.weight.numel() == 0 and matmuls.embed is not embedding
    rows = matmuls.embed(ids).float()
    blocks = kept[ids].float().reshape(len(ids), -1, 32)
    # Q8_0's rounding (test_int8_matmul.py): half a code in each block, then bf16's
    bound = blocks.abs().amax(-1, keepdim=True) / 127 * 0.51 + blocks.abs() / 256 + 1e-6
    off = (rows.reshape(blocks.shape) - blocks).abs()
    assert torch.all(off <= bound), (off - bound).max()
    x = (torch.randn((2, width)) * 0.5).bfloat16()  # the logits are the table's rows' products
    table = matmuls.embed(torch.arange(vocab)).float()
    exact = x.float() @ table.T  # the kernel's d q is exact, the rows' bf16-rounded
    assert float((matmuls.head(x) - exact).abs().max()) < 4e-3 * float(exact.abs().max())
