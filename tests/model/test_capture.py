"""predictor.model.capture: gptqmodel's GPTQ forwards without the unread work, on the tiny model.

Both runs quantize the same fp checkpoint on the same texts, one with gptqmodel's own forwards
and one within lean_capture(): the skipped products must be skipped, GPTQ must see the same
batches, and the checkpoints must be equal bit for bit."""

from __future__ import annotations

from collections import defaultdict
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from predictor.model import capture, internals
from predictor.model.quantize import Recipe, calibration_texts, quantize_checkpoint


@dataclass
class Record:
    tokens: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    names: dict[int, str] = field(default_factory=dict)
    linear_products: int = 0
    stops_without_output: int = 0


def _quantize(
    source: Path, out: Path, monkeypatch: pytest.MonkeyPatch, lean: bool
) -> tuple[Record, dict[str, torch.Tensor]]:
    from gptqmodel.quantization.gptq import GPTQ
    from safetensors.torch import load_file

    record = Record()
    add_batch, linear_forward = GPTQ.add_batch, torch.nn.Linear.forward
    stop_forward = internals.stop_forward

    def counted_add_batch(self: Any, inp: torch.Tensor, out: torch.Tensor, **kw: Any) -> Any:
        # one task a module and layer, in the order they start: "0:self_attn.q_proj", ...
        name = record.names.setdefault(id(self), f"{len(record.names)}:{self.name}")
        record.tokens[name] += inp.reshape(-1, inp.shape[-1]).shape[0]
        return add_batch(self, inp, out, **kw)

    def counted_linear(self: Any, input: torch.Tensor) -> torch.Tensor:
        record.linear_products += 1
        return linear_forward(self, input)

    def counted_stop() -> BaseException:
        record.stops_without_output += 1
        return stop_forward()

    monkeypatch.setattr(GPTQ, "add_batch", counted_add_batch)
    monkeypatch.setattr(torch.nn.Linear, "forward", counted_linear)
    monkeypatch.setattr(internals, "stop_forward", counted_stop)
    if not lean:
        monkeypatch.setattr(capture, "lean_capture", nullcontext)
    texts = calibration_texts()[:24]  # 3 batches of 8
    quantize_checkpoint(source, out, texts, recipe=Recipe(group_size=64), dtype="float32")
    monkeypatch.undo()
    return record, load_file(out / "model.safetensors")


def test_lean_forwards_skip_the_unread_products_and_make_gptqmodels_checkpoint(
    tiny_dense_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    theirs, their_tensors = _quantize(tiny_dense_dir, tmp_path / "theirs", monkeypatch, False)
    ours, our_tensors = _quantize(tiny_dense_dir, tmp_path / "ours", monkeypatch, True)

    # 2 layers x 4 subsets (q/k/v, o, gate/up, down) x 3 batches stop without their product
    assert (theirs.stops_without_output, ours.stops_without_output) == (0, 2 * 4 * 3)
    assert theirs.linear_products - ours.linear_products == ours.stops_without_output
    assert len(ours.tokens) == 2 * 4  # each subset's leader collects its Hessian...
    assert ours.tokens == theirs.tokens  # ...from the same tokens
    assert our_tensors.keys() == their_tensors.keys()
    assert _differing(our_tensors, their_tensors) == []


def _differing(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> list[str]:
    return [name for name in theirs if not torch.equal(ours[name], theirs[name])]


def test_gptqmodels_own_code_is_back_after_the_block() -> None:
    patched = (
        (internals.hooked_linear_class(), "forward"),
        (internals.progress_bar_class(), "draw"),
    )
    before = [getattr(owner, name) for owner, name in patched]
    with capture.lean_capture():
        assert all(getattr(o, n) is not b for (o, n), b in zip(patched, before, strict=True))
    assert [getattr(owner, name) for owner, name in patched] == before
