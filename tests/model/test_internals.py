"""Contract tests: one per item of predictor/model/internals.py (gptqmodel's private APIs)."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from predictor.model import internals


def test_every_item_has_a_contract_test() -> None:
    names = {n for n in globals() if n.startswith("test_item_")}
    assert {f"test_item_{i.lower()}" for i in internals.ITEMS} == names


def test_item_quantizer_find_params() -> None:
    quantizer = internals.quantizer_class()
    parameters = list(inspect.signature(quantizer.find_params).parameters)
    assert parameters[:3] == ["self", "x", "weight"], "QUANTIZER_FIND_PARAMS: signature changed"
    for name in ("requires_groupwise_processing", "_search_adjacent_zero_points"):
        assert callable(getattr(quantizer, name, None)), f"QUANTIZER_FIND_PARAMS: no {name}"
    # the search's results against gptqmodel's own loop: tests/model/test_scale_search.py


def test_item_subset_callback() -> None:
    from gptqmodel.looper import module_looper

    source = inspect.getsource(module_looper)
    assert 'getattr(self.gptq_model, "subset_callback", None)' in source, "SUBSET_CALLBACK"
    emit = inspect.getsource(module_looper.ModuleLooper._emit_subset_event)
    for word in ("subset_event", "stage=", "layer_idx=", "subset_total=", "module_names="):
        assert word in emit, f"SUBSET_CALLBACK: {word} no longer passed"


def test_item_hooked_linear_stop() -> None:
    from gptqmodel.nn_modules.hooked_linear import StopForward

    linear = internals.hooked_linear_class()
    source = inspect.getsource(linear.forward)
    for word in (
        "self.forward_hook(self, (input,), output)",
        "if self.forward_hook_last:",
        "raise STOP_FORWARD_EXCEPTION",
        "_w4a_stream_replay_mode",
        "online_full_had",
        "online_partial_had",
        "output = super().forward(input)",
    ):
        assert word in source, f"HOOKED_LINEAR_STOP: {word} is gone"
    assert isinstance(internals.stop_forward(), StopForward), "HOOKED_LINEAR_STOP"
    from gptqmodel.quantization.gptq import GPTQ

    add_batch = inspect.getsource(GPTQ.add_batch)
    assert "self.process_batch(inp)" in add_batch, "HOOKED_LINEAR_STOP: GPTQ's batch"
    assert "process_batch(inp, out" not in add_batch, "HOOKED_LINEAR_STOP: out is read now"
    from gptqmodel.looper import gptq_processor

    installs = inspect.getsource(gptq_processor)
    assert "module.weight.data = wq" in installs, "HOOKED_LINEAR_STOP: how wq is installed"


def test_item_progress_bar_draw() -> None:
    bar = internals.progress_bar_class()
    parameters = list(inspect.signature(bar.draw).parameters)
    assert parameters == ["self", "force"], "PROGRESS_BAR_DRAW: signature changed"


def test_item_gptq_fused_block() -> None:
    gptq, cuda = internals.gptq_class(), internals.gptq_cuda_module()
    source = inspect.getsource(inspect.unwrap(gptq.quantize))
    assert source.count(internals.FUSED_CONDITION) == 1, "GPTQ_FUSED_BLOCK: the condition moved"
    for word in (
        "from .gptq_cuda import block_update_available, gptq_block_update",
        "if block_update_available():",
        "fused_block_update = gptq_block_update",
        "if fused_block_update is not None and count == 128:",
        "Q1, Err1, Losses1, (1 << self.qcfg.bits) - 1,",
    ):
        assert word in source, f"GPTQ_FUSED_BLOCK: {word} is gone"
    parameters = list(inspect.signature(cuda.gptq_block_update).parameters)
    assert parameters == [
        "work", "hinv", "scale", "zero", "column_group", "quantized", "errors", "losses", "maxq",
    ], "GPTQ_FUSED_BLOCK: the block update's signature changed"  # fmt: skip
    assert callable(cuda.block_update_available), "GPTQ_FUSED_BLOCK"


def test_item_pack_extension_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from gptqmodel.nn_modules.qlinear import PackableQuantLinear
    from gptqmodel.nn_modules.qlinear.torch import TorchLinear

    source = inspect.getsource(PackableQuantLinear.pack_block)
    assert f'env_flag("{internals.PACK_EXTENSION_OFF}")' in source, "PACK_EXTENSION_OFF: renamed"
    # with the variable set, nothing is compiled and the module is packed all the same
    monkeypatch.setenv(internals.PACK_EXTENSION_OFF, "1")
    monkeypatch.setenv("GPTQMODEL_TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    rows, columns, group = 32, 64, 32  # out, in features
    codes = torch.randint(0, 16, (rows, columns), generator=torch.Generator().manual_seed(0))
    scales = torch.rand(rows, columns // group, generator=torch.Generator().manual_seed(1)) + 0.5
    zeros = torch.randint(0, 16, (rows, columns // group)).float()
    linear = torch.nn.Linear(columns, rows, bias=False)
    wide = {"repeats": group, "dim": 1}
    weight = (codes - zeros.repeat_interleave(**wide)) * scales.repeat_interleave(**wide)
    linear.weight.data = weight  # rounds back to `codes` exactly
    layer = TorchLinear(bits=4, group_size=group, sym=False, desc_act=False, in_features=columns,
                        out_features=rows, bias=False, pack_dtype=torch.int32, backend=None)  # fmt: skip
    layer.pack_block(linear, scales, zeros, torch.arange(columns, dtype=torch.int32) // group)
    assert not (tmp_path / "extensions").exists(), "PACK_EXTENSION_OFF: an extension was built"
    shifts = torch.arange(0, 32, 4, dtype=torch.int32).view(1, 8, 1)  # 8 codes a 32-bit word
    unpacked = (layer.qweight.unsqueeze(1) >> shifts) & 15  # [in / 8, 8, out]
    assert torch.equal(unpacked.reshape(columns, rows).T, codes.to(torch.int32))
