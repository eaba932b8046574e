"""predictor.model.capture: gptqmodel's GPTQ forwards without the unread or repeated work, on the
tiny model.

Both runs quantize the same fp checkpoint on the same texts, one with gptqmodel's own forwards
and one within lean_capture(): the skipped products must be skipped, the repeated ones reused,
GPTQ must see the same batches, and the checkpoints must be equal bit for bit."""

from __future__ import annotations

from collections import defaultdict
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from predictor.model import capture, internals
from predictor.model.recipe import Recipe, calibration_texts, quantize_checkpoint


@dataclass
class Record:
    tokens: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    # every task seen, held: a freed task's id() could name the next one (7 tasks, not 8, once)
    tasks: list[Any] = field(default_factory=list)
    linear_products: int = 0
    stops_without_output: int = 0
    reused: int = 0


def _quantize(
    source: Path, out: Path, monkeypatch: pytest.MonkeyPatch, lean: bool
) -> tuple[Record, dict[str, torch.Tensor]]:
    from gptqmodel.quantization.gptq import GPTQ
    from safetensors.torch import load_file

    record = Record()
    add_batch, linear = GPTQ.add_batch, torch.nn.functional.linear
    stop_forward = internals.stop_forward

    def counted_add_batch(self: Any, inp: torch.Tensor, out: torch.Tensor, **kw: Any) -> Any:
        # one task a module and layer, in the order they start: "0:self_attn.q_proj", ...
        index = next((i for i, task in enumerate(record.tasks) if task is self), None)
        if index is None:
            index = len(record.tasks)
            record.tasks.append(self)
        name = f"{index}:{self.name}"
        record.tokens[name] += inp.reshape(-1, inp.shape[-1]).shape[0]
        return add_batch(self, inp, out, **kw)

    def counted_linear(*args: Any, **kwargs: Any) -> torch.Tensor:
        record.linear_products += 1
        return linear(*args, **kwargs)

    def counted_stop() -> BaseException:
        record.stops_without_output += 1
        return stop_forward()

    get = capture._Products.get

    def counted_get(self: Any, linear: Any, input: torch.Tensor) -> torch.Tensor | None:
        found = get(self, linear, input)
        record.reused += found is not None
        return found

    monkeypatch.setattr(capture._Products, "get", counted_get)
    monkeypatch.setattr(GPTQ, "add_batch", counted_add_batch)
    monkeypatch.setattr(torch.nn.functional, "linear", counted_linear)
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
    # per batch, layer 0: the forward for o recomputes q/k/v (quantized since), the one for
    # gate/up reuses q/k/v, the one for down q/k/v/o, the replay making layer 1's inputs all
    # but down: 0 + 3 + 4 + 6; layer 1 (no replay): 0 + 3 + 4
    assert (theirs.reused, ours.reused) == (0, 3 * (13 + 7))
    skipped = ours.stops_without_output + ours.reused
    assert theirs.linear_products - ours.linear_products == skipped
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


def _linear(seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(16, 8)


def test_a_product_is_reused_for_the_same_weights_and_an_equal_input() -> None:
    products, linear, x = capture._Products(1 << 20), _linear(), torch.randn(3, 16)
    assert products.get(linear, x) is None
    products.put(linear, x, linear(x))
    found = products.get(linear, x.clone())
    assert found is not None and torch.equal(found, linear(x))
    found.zero_()  # the caller's copy: what is kept stays as it was
    again = products.get(linear, x)
    assert again is not None and torch.equal(again, linear(x))
    x[0, 0] += 1.0  # the caller's input changed after the product was kept
    assert products.get(linear, x) is None
    assert products.get(_linear(), x) is None  # another module with equal weights


@pytest.mark.parametrize(
    "change", ["new data", "in place", "inference tensor in place", "same storage, reshaped"]
)
def test_a_weight_change_is_never_served_an_old_product(change: str) -> None:
    products, linear, x = capture._Products(1 << 20), _linear(), torch.randn(3, 16)
    if change == "inference tensor in place":
        with torch.inference_mode():  # as gptqmodel installs a quantized weight
            linear.weight.data = linear.weight.detach().clone()
    products.put(linear, x, linear(x))
    with torch.no_grad():
        if change == "new data":
            linear.weight.data = linear.weight.detach() * 0.5
        elif change == "in place":
            linear.weight.mul_(0.5)
        elif change == "same storage, reshaped":  # [8, 16] read as the transpose of [16, 8]
            linear.weight.data = linear.weight.detach().reshape(16, 8).t()
    if change == "inference tensor in place":
        with torch.inference_mode():  # no version counter: the sample sees it
            linear.weight.mul_(0.5)
    assert products.get(linear, x) is None
    products.put(linear, x, linear(x))
    found = products.get(linear, x)
    assert found is not None and torch.equal(found, linear(x))


def test_the_oldest_products_go_once_the_budget_is_spent() -> None:
    linear, first, second = _linear(), torch.randn(3, 16), torch.randn(3, 16)
    one = 3 * (16 + 8) * 4  # bytes of one product: its input and output, fp32
    products = capture._Products(one)
    products.put(linear, first, linear(first))
    products.put(linear, second, linear(second))
    assert products.get(linear, first) is None
    assert products.get(linear, second) is not None
