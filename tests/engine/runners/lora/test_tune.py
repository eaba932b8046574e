"""engine/runners/lora/tune.py: lora_add's modes timed per row-count bucket on the tiny bf16
model, one mode at every bucket under --batch-invariant, the plan logged and installed."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from predictor.engine.runners.kernels import autotune
from predictor.engine.runners.lora import tune as lora_tune
from predictor.engine.step import StepRow


@pytest.mark.parametrize("invariant", [False, True])
def test_lora_modes_are_timed_per_bucket(
    tiny_bf16_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, invariant: bool
) -> None:
    """lora_tune.tune times lora_add's modes at every bucket and installs the fastest per bucket
    (one mode at every bucket under --batch-invariant); a resident adapter follows the plan."""
    from load.random_lora import write_adapter
    from predictor.engine.runners.cpu import ModelRunner
    from predictor.engine.runners.lora.weights import projection_shapes
    from predictor.model.loader import load_checkpoint
    from predictor.model.lora import load_adapter
    from tests.support import tune_cache

    loaded = load_checkpoint(tiny_bf16_dir, device="cpu", threads=1)
    runner = ModelRunner(loaded.model, torch.device("cpu"), 64, 16, autotune_cache=tune_cache(),
                         batch_invariant=invariant)  # fmt: skip
    if runner.lora.kernel is None:
        pytest.skip("no native layer ops here")
    layers = loaded.model.model.layers
    folder = write_adapter(tmp_path / "a", tiny_bf16_dir, 8, 1)
    adapter = load_adapter("a", folder, projection_shapes(layers[0]), len(layers), max_rank=64)
    runner.add_adapter(1, adapter.factors, adapter.scale)
    with caplog.at_level(logging.INFO, logger="predictor.engine.runners.lora.tune"):
        plan = lora_tune.tune(runner.lora, invariant)
    modes = {"bf16", "int8"} if runner.lora.kernel.lora_int8 else {"bf16"}
    timed = [r.getMessage() for r in caplog.records if "autotune lora" in r.getMessage()]
    assert len(timed) == len(autotune.BUCKETS) and all(
        all(f"{mode} " in line for mode in modes) for line in timed
    )
    assert plan == runner.lora.plan and plan[0][0] == 1 and {m for _, m in plan} <= modes
    assert [rows for rows, _ in plan] == sorted({rows for rows, _ in plan})
    if invariant:
        assert len(plan) == 1
    before = runner.forward([StepRow([0], 0, [5, 6, 7], True, adapter=1)])
    assert torch.isfinite(before).all()


def test_every_lora_mode_gives_a_row_the_same_bits_in_any_company(tiny_bf16_dir: Path) -> None:
    """lora_add's modes, as this machine's compiler built them: each row alone and beside 1 to 12
    others of its adapter gets the same bits (the int8 mode's instances for 3 and 4 rows fused
    its last multiply-add where the others did not: a repeated request with drafts then gave
    another text). The default's tune keeps only such modes (a warning names any other)."""
    from predictor.engine.runners.cpu import ModelRunner
    from predictor.model.loader import load_checkpoint
    from tests.support import tune_cache

    loaded = load_checkpoint(tiny_bf16_dir, device="cpu", threads=1)
    runner = ModelRunner(loaded.model, torch.device("cpu"), 64, 16, autotune_cache=tune_cache())
    if runner.lora.kernel is None:
        pytest.skip("no native layer ops here")
    modes = ["bf16", "int8"] if runner.lora.kernel.lora_int8 else ["bf16"]
    factors = {
        (layer, module): (torch.randn(16, features_in) * 0.05, torch.randn(features_out, 16) * 0.05)
        for layer in range(runner.lora.layers)
        for module, (features_in, features_out) in runner.lora.shapes.items()
    }  # fmt: skip
    runner.lora.add(1, factors, 1.0)
    generator = torch.Generator().manual_seed(1)
    for mode in modes:
        for _ in range(20):  # 20 draws of inputs: a fused rounding differs on some values only
            assert lora_tune._row_invariant(runner.lora, mode, generator), mode


def test_the_plan_is_read_back_so_two_servers_run_the_same_modes(
    tiny_bf16_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The modes' numerics differ: a plan is written to the autotune cache and a second tune of
    the same identity (another server on this machine) takes it as written, untimed; one made for
    other threads, or naming a mode not available here, is timed again."""
    import json

    from predictor.engine.runners.cpu import ModelRunner
    from predictor.model.loader import load_checkpoint

    loaded = load_checkpoint(tiny_bf16_dir, device="cpu", threads=1)
    runner = ModelRunner(loaded.model, torch.device("cpu"), 64, 16, autotune_cache=tmp_path)
    if runner.lora.kernel is None:
        pytest.skip("no native layer ops here")
    first = lora_tune.tune(runner.lora, False, 1, tmp_path)
    (written,) = tmp_path.glob("lora-*.json")
    data = json.loads(written.read_text())
    assert [tuple(part) for part in data["plan"]] == first
    other = [(1, "bf16"), (8, "bf16")] if first != [(1, "bf16"), (8, "bf16")] else [(1, "bf16")]
    written.write_text(json.dumps({**data, "plan": other}))  # a plan this tune would not time
    with caplog.at_level(logging.INFO, logger="predictor.engine.runners.lora.tune"):
        assert lora_tune.tune(runner.lora, False, 1, tmp_path) == other == runner.lora.plan
        assert not [r for r in caplog.records if "autotune lora" in r.getMessage()]
        caplog.clear()
        lora_tune.tune(runner.lora, False, 2, tmp_path)  # another identity: timed
        assert [r for r in caplog.records if "autotune lora" in r.getMessage()]
    written.write_text(json.dumps({**data, "plan": [[1, "fp64"]]}))
    assert lora_tune.tune(runner.lora, False, 1, tmp_path) != [(1, "fp64")]
