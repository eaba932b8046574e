"""engine/runners/kernels/matmuls.py on the tiny GPTQ model: every layer fused at start, a forced
kernel checked there, the kernels chosen once with the runner's hook between the choice and the
deferred copies, and the step cost from the measured figures."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from predictor.engine.runners.kernels.matmuls import Matmuls


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
