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
"""

from __future__ import annotations

from typing import Any

ITEMS = ("QUANTIZER_FIND_PARAMS", "SUBSET_CALLBACK")


def quantizer_class() -> Any:
    """gptqmodel's Quantizer, whose `find_params` the scale search replaces (item 1)."""
    from gptqmodel.quantization.quantizer import Quantizer

    return Quantizer


def searches_adjacent_zero_points(quantizer: Any) -> bool:
    return bool(quantizer._search_adjacent_zero_points())


def set_subset_callback(model: Any, callback: Any) -> None:
    """Per-layer progress events from gptqmodel's looper (item 2)."""
    model.subset_callback = callback
