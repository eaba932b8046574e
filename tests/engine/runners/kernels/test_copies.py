"""engine/runners/kernels/copies.py: a copy of the weights only where it measures COPY_MARGIN
faster, what each copy costs in bytes, and the plans kept within the copies' budget (the
copies that save the least time per byte dropped first); with the tiny GPTQ model's real layers,
`autotune.tune` installs the budgeted plans."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from predictor.engine.runners.kernels import autotune, copies
from predictor.engine.runners.kernels.autotune_cache import Choices
from predictor.engine.runners.kernels.invariance import ROWWISE
from tests.engine.runners.kernels.test_autotune import layers

LEAN, COPY, HEAD_COPY = "native_i8_avx2", "prepacked_bf16", "int8_i8_avx2"


def figures(**per_kernel: float) -> dict[str, dict[str, float]]:
    """The same ms at every bucket (rows 1 and 16)."""
    return {rows: dict(per_kernel) for rows in ("1", "16")}


def test_a_copy_wins_only_by_the_margin() -> None:
    near = figures(**{LEAN: 1.1, COPY: 1.0})  # 10% faster: not worth its bytes
    far = figures(**{LEAN: 1.2, COPY: 1.0})  # 20%
    for single in (True, False):
        assert copies.pick(near, single) == [(1, LEAN)]
        assert copies.pick(far, single) == [(1, COPY)]
        assert copies.pick(far, single, lambda name: not copies.is_copy(name)) == [(1, LEAN)]


def test_per_bucket_a_copy_held_below_costs_nothing_more() -> None:
    timed = {"1": {LEAN: 1.2, COPY: 1.0}, "16": {LEAN: 1.05, COPY: 1.0}}
    assert copies.pick(timed, single=False) == [(1, COPY)]  # kept at 16 rows: already held
    timed = {"1": {LEAN: 1.0, COPY: 1.05}, "16": {LEAN: 1.2, COPY: 1.0}}
    assert copies.pick(timed, single=False) == [(1, LEAN), (16, COPY)]


def test_what_each_copy_keeps() -> None:
    assert copies.copy_bytes(COPY, 100, 64) == 2 * 100 * 64
    assert copies.copy_bytes(ROWWISE + COPY, 100, 64) == 2 * 100 * 64
    assert copies.copy_bytes("fp32", 100, 64) == 4 * 100 * 64
    assert copies.copy_bytes(HEAD_COPY, 100, 64) == 100 * 64 * 36 // 32
    assert copies.copy_bytes(LEAN, 100, 64) == copies.copy_bytes("module", 100, 64) == 0
    plan = [(1, HEAD_COPY), (16, "fp32"), (32, HEAD_COPY)]
    assert copies.plan_bytes(plan, 100, 64, 3) == 3 * (100 * 64 * 36 // 32 + 4 * 100 * 64)
    # a server's head served from its int8 table alone lets its bf16 weight go: no copy then
    assert copies.plan_bytes([(1, HEAD_COPY)], 100, 64, 1, replaces=True) == 0
    assert copies.plan_bytes(plan, 100, 64, 1, replaces=True) > 0


def budgeted(budget: int, replaced: tuple[str, ...] = ()) -> tuple[Choices, list[str]]:
    """Two matmuls holding copies: the head's saves 4x its time for 1.1 MB, the projections'
    1.3x for 6.4 MB; a forced one, no figures."""
    choices = Choices(
        plans={"qkv": [(1, COPY)], "lm_head": [(1, HEAD_COPY)], "o": [(1, COPY)]},
        figures={
            "qkv": figures(**{LEAN: 1.3, COPY: 1.0}),
            "lm_head": figures(module=4.0, **{HEAD_COPY: 1.0}),
        },
    )
    sizes = {"qkv": (1000, 800, 4), "lm_head": (1000, 1000, 1), "o": (800, 800, 4)}
    return choices, copies.within_budget(choices, sizes, budget, single=True, replaced=replaced)


def test_past_the_budget_the_copy_saving_least_per_byte_goes_first() -> None:
    everything = 2 * 1000 * 800 * 4 + 1000 * 1000 * 36 // 32 + 2 * 800 * 800 * 4
    choices, dropped = budgeted(everything)
    assert dropped == [] and choices.plans["qkv"] == [(1, COPY)]
    choices, dropped = budgeted(everything - 1)
    assert choices.plans["qkv"] == [(1, LEAN)] and choices.plans["lm_head"] == [(1, HEAD_COPY)]
    assert len(dropped) == 1 and dropped[0].startswith("qkv's prepacked_bf16 (6 MB")
    choices, dropped = budgeted(0)
    assert choices.plans["lm_head"] == [(1, "module")] and len(dropped) == 2
    assert choices.plans["o"] == [(1, COPY)]  # forced: no figures, not bound
    choices, dropped = budgeted(0, replaced=("lm_head",))  # the int8 table is the head's own
    assert choices.plans["lm_head"] == [(1, HEAD_COPY)] and len(dropped) == 1


def test_tune_serves_the_budgeted_plans(tiny_gptq: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Measured plans that take copies everywhere (prepacked bf16 projections, the head's fp32
    copy): with a budget of 0 every real layer and the head run kernels without one."""
    linears, names = layers(tiny_gptq)
    if COPY not in linears[0].candidates():
        pytest.skip("oneDNN's prepacked bf16 linear is unavailable on this CPU")

    def measured(groups: dict[str, Any], heads: dict[str, Any], head_name: str, *_: Any) -> Any:
        choices = Choices()
        for key in groups:
            choices.plans[key] = [(1, COPY)]
            choices.figures[key] = figures(**{COPY: 1.0, "int4_op": 2.0})
        choices.plans[head_name] = [(1, "fp32")]
        choices.figures[head_name] = figures(fp32=1.0, module=2.0)
        return choices

    monkeypatch.setattr(autotune, "_measure", measured)
    head_module = tiny_gptq.model.lm_head
    if head_module.weight.dtype != torch.bfloat16:
        head_module = torch.nn.Linear(*reversed(head_module.weight.shape), bias=False).bfloat16()
    choices, head, _ = autotune.tune(linears, names, head_module, 1, None, copy_budget=0)
    assert all(layer.plan == [(1, "int4_op")] for layer in linears)
    assert all(not copies.is_copy(name) for plan in choices.plans.values() for _, name in plan)
    x = torch.randn((2, head_module.weight.shape[1])).bfloat16()
    assert torch.equal(head(x), head_module(x))  # the module itself, not an fp32 copy
