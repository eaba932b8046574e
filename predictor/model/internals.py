"""The one place the model builder touches gptqmodel's (7.6.0) private or undocumented APIs.

Each item says what we use and why; each has a contract test in tests/model/test_internals.py
that fails naming the item when a gptqmodel upgrade changes what we rely on.

1. QUANTIZER_FIND_PARAMS: `gptqmodel.quantization.quantizer.Quantizer.find_params(self, x,
   weight)` is swapped for our vectorised MSE scale search while quantizing (scale_search.py);
   it reads `maxq`, `perchannel`, `qcfg.group_size`, `requires_groupwise_processing()` and
   `_search_adjacent_zero_points()`, and sets `scale` / `zero`. gptqmodel has no hook for it.
2. SUBSET_CALLBACK: the module looper reads the model's `subset_callback` attribute and calls its
   `subset_event(stage=..., layer_idx=..., subset_index=..., subset_total=..., module_names=...,
   processor=...)` (the only per-layer progress gptqmodel reports); quantize.py sets it.
3. HOOKED_LINEAR_STOP: `gptqmodel.nn_modules.hooked_linear.HookedLinear.forward` calls
   `self.forward_hook(self, (input,), output)` and, when `self.forward_hook_last`, raises
   `STOP_FORWARD_EXCEPTION` (a `StopForward`) right after; its W4A replay and Hadamard paths
   are keyed by `_w4a_stream_replay_mode`, `online_full_had`, `online_partial_had`, and
   without them its output is `super().forward(input)` (F.linear), which capture.py computes or
   reuses itself; GPTQ's hook reads only the input (`GPTQ.add_batch(inp, out)` of a Linear:
   `self.process_batch(inp)`); a quantized weight is installed as `weight.data = wq`.
4. PROGRESS_BAR_DRAW: `logbar.progress.ProgressBar.draw(self, force=False)` renders the bar
   and returns nothing; capture.py leaves it undrawn.
5. GPTQ_FUSED_BLOCK: `gptqmodel.quantization.gptq.GPTQ.quantize` takes its fused 128-column
   path when a condition holds that contains the line FUSED_CONDITION, and then calls
   `gptq_cuda.block_update_available()` and `gptq_cuda.gptq_block_update(work, hinv, scale,
   zero, column_group, quantized, errors, losses, maxq)` (imported from the module at each call);
   block_update.py compiles the method's source with that line widened to the CPU.
6. PACK_EXTENSION_OFF: `PackableQuantLinear.pack_block` (each quantized module's qweight and
   qzeros) JIT-compiles a C++ torch extension at its first call on a machine
   (`pack_block_cpu`, into ~/.cache/gptqmodel: tens of seconds of a core) unless the
   environment variable PACK_EXTENSION_OFF names is set to "1"; then it packs with torch
   (a little slower for a small model, the same bits). env.py sets it.
"""

from __future__ import annotations

from typing import Any

ITEMS = (
    "QUANTIZER_FIND_PARAMS",
    "SUBSET_CALLBACK",
    "HOOKED_LINEAR_STOP",
    "PROGRESS_BAR_DRAW",
    "GPTQ_FUSED_BLOCK",
    "PACK_EXTENSION_OFF",
)

# GPTQ_FUSED_BLOCK: the line of GPTQ.quantize's fused-path condition, and what it becomes.
FUSED_CONDITION = 'and W.device.type == "cuda"'
FUSED_CONDITION_CPU = 'and W.device.type in ("cuda", "cpu")'
# PACK_EXTENSION_OFF: the variable that keeps gptqmodel's packing in torch.
PACK_EXTENSION_OFF = "GPTQMODEL_DISABLE_PACK_EXT"


def quantizer_class() -> Any:
    """gptqmodel's Quantizer, whose `find_params` the scale search replaces (item 1)."""
    from gptqmodel.quantization.quantizer import Quantizer

    return Quantizer


def searches_adjacent_zero_points(quantizer: Any) -> bool:
    return bool(quantizer._search_adjacent_zero_points())


def set_subset_callback(model: Any, callback: Any) -> None:
    """Per-layer progress events from gptqmodel's looper (item 2)."""
    model.subset_callback = callback


def hooked_linear_class() -> Any:
    """The Linear gptqmodel hooks during the forwards (item 3)."""
    from gptqmodel.nn_modules.hooked_linear import HookedLinear

    return HookedLinear


def stop_forward() -> BaseException:
    from gptqmodel.nn_modules.hooked_linear import STOP_FORWARD_EXCEPTION

    return STOP_FORWARD_EXCEPTION.with_traceback(None)


def progress_bar_class() -> Any:
    """logbar's bar, drawn by gptqmodel's loop (item 4)."""
    from logbar.progress import ProgressBar

    return ProgressBar


def gptq_class() -> Any:
    """gptqmodel's GPTQ, whose `quantize` takes the fused block path (item 5)."""
    from gptqmodel.quantization.gptq import GPTQ

    return GPTQ


def gptq_cuda_module() -> Any:
    """gptqmodel's CUDA block update module, asked for the fused path's kernel (item 5)."""
    from gptqmodel.quantization import gptq_cuda

    return gptq_cuda
