"""gptqmodel's calibration forwards for GPTQ, without the work whose result nobody reads or that
was done before: the layer loop's forwards, the hooks that add each batch to the Hessians and
gptqmodel's own progress bar were most of the GPTQ phase (load/RESULTS.md, "make model
profile", has the figures). Within `lean_capture()`:

1. **No output for the module the forward stops at.** With `true_sequential` each subset's
   forward runs the layer up to its last hooked module, which raises gptqmodel's StopForward
   right after its hook: its output was computed and thrown away (v_proj, o_proj, up_proj,
   down_proj: a fifth of the forwards' matmuls). Its hook now gets its input and an empty
   output (GPTQ reads only the input) and the forward stops without the product. The other
   hooked modules' hooks get an empty output too: gptqmodel's hook cuts a batch's output into
   its texts (a boolean-mask gather a text) only to pass each piece to GPTQ, which drops it.
2. **No product computed twice** (`_Products`). Each subset's forward starts the layer again
   on the same inputs, and so does the replay that makes the next layer's inputs: q/k/v,
   quantized after the first subset, are recomputed on the same input in the forwards for
   gate/up and down and in the replay, o in the last two, gate/up in the replay. Such a
   product is now reused: about half of the Linear work of a build (compared by memcmp, which
   is cheaper than torch.equal on bf16).
3. **gptqmodel's progress bar is not drawn**: quantize.py shows per-layer progress itself.

None changes a number: the checkpoint is gptqmodel's bit for bit (tests/model/
test_capture.py). Only the plain case is changed (a Linear on its weights' device, no W4A replay
or Hadamard rotation); anything else goes through gptqmodel's code. The private names used are
items of internals.py.

Left out on purpose: one Hessian product a batch (gptqmodel adds X_s^T X_s text by text, "so
that batched calibration accumulates with the semantics of batch size 1"). The same sum in
another rounding order moves the checkpoint away from the one the recipe was chosen and
reported on, for seconds saved.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from predictor.model import internals

# The Linear products kept for the forwards that repeat them (_Products): SmolLM2-135M's
# layer takes ~0.5 GB for its ~12k calibration tokens in fp32.
PRODUCTS_BUDGET = 2 << 30


@contextlib.contextmanager
def lean_capture() -> Iterator[_Products]:
    """Within the block, gptqmodel's GPTQ forwards skip the work described above. Yields the
    products kept: the caller clears them when a layer is done (`_Products.clear`), since no
    later layer repeats a product of an earlier one."""
    linear = internals.hooked_linear_class()
    bar = internals.progress_bar_class()
    saved = (linear.forward, bar.draw)
    products = _Products(PRODUCTS_BUDGET)
    linear.forward = _lean_forward(saved[0], products)
    bar.draw = _not_drawn
    try:
        yield products
    finally:
        linear.forward, bar.draw = saved


def _lean_forward(
    original: Callable[[Any, torch.Tensor], torch.Tensor], products: _Products
) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    def forward(self: Any, input: torch.Tensor) -> torch.Tensor:
        if not _plain(self, input):
            return original(self, input)
        with torch.inference_mode():
            if self.forward_hook is not None and self.forward_hook_last:
                self.forward_hook(self, (input,), input.new_empty(0))
                raise internals.stop_forward()
            output = products.get(self, input)
            if output is None:
                output = torch.nn.functional.linear(input, self.weight, self.bias)
                if self.forward_hook is None:  # a hooked module is quantized after this pass
                    products.put(self, input, output)
            if self.forward_hook is not None:  # GPTQ reads only the input (item 3)
                self.forward_hook(self, (input,), input.new_empty(0))
            return output

    return forward


@dataclass(eq=False)  # removed by identity
class _Product:
    input: torch.Tensor
    output: torch.Tensor


@dataclass
class _Weights:
    """What a Linear's products were computed with. Holding the storage keeps its address from
    being reused; gptqmodel installs a quantized weight as a new storage (`weight.data = wq`);
    an in-place write bumps the version (where torch keeps one); a sample of ~1k elements (a
    view into the storage, against a copy) also catches a write through an alias or into an
    inference tensor."""

    storages: list[Any]
    pointers: list[tuple[Any, ...]]  # where each tensor starts in its storage, shape, strides
    versions: list[int]
    views: list[torch.Tensor]
    samples: list[torch.Tensor]
    products: dict[tuple[Any, ...], list[_Product]] = field(default_factory=dict)

    @staticmethod
    def of(linear: Any) -> _Weights:
        tensors = _parameters(linear)
        views = [_sample(t) for t in tensors]
        return _Weights(
            storages=[t.untyped_storage() for t in tensors],
            pointers=[(t.data_ptr(), t.shape, t.stride()) for t in tensors],
            versions=[_version(t) for t in tensors],
            views=views,
            samples=[view.clone() for view in views],
        )

    def still(self, linear: Any) -> bool:
        tensors = _parameters(linear)
        return (
            len(tensors) == len(self.storages)
            and all(
                t.untyped_storage().data_ptr() == s.data_ptr()
                and (t.data_ptr(), t.shape, t.stride()) == pointer
                and _version(t) == v
                for t, s, pointer, v in zip(
                    tensors, self.storages, self.pointers, self.versions, strict=True
                )
            )
            and all(torch.equal(v, s) for v, s in zip(self.views, self.samples, strict=True))
        )


class _Products:
    """The Linear products of this block's forwards, for the forwards that repeat them.

    With `true_sequential` each subset's forward runs the layer from its start on the same
    inputs, and the replay for the next layer's inputs runs it once more: a module whose weights
    did not change since (q/k/v after their subset, o, gate/up) gets the input it had before
    and computes the product it computed before. Such a product is taken from here: the same
    weights (`_Weights`) and an input of the same bits give the same output, bit for bit.
    Copies go in and out, so a caller writing into its tensors changes nothing here (one copy
    serves the modules sharing an input: q/k/v, gate/up); the oldest products go first once
    `budget` bytes are kept. The forward keeps no product of a hooked module: its weights
    are quantized once the pass is over."""

    def __init__(self, budget: int) -> None:
        self._budget = budget
        self._bytes = 0
        self._weights: dict[int, tuple[Any, _Weights]] = {}
        self._order: collections.deque[tuple[_Weights, _Product]] = collections.deque()
        self._last_input: tuple[torch.Tensor, torch.Tensor] | None = None  # (caller's, copy)
        self.hits = 0
        self.misses = 0

    def get(self, linear: Any, input: torch.Tensor) -> torch.Tensor | None:
        entry = self._weights.get(id(linear))
        if entry is not None and entry[0] is linear and entry[1].still(linear):
            candidates = entry[1].products.get(_kind(input), [])
            for product in candidates:
                if _identical(product.input, input):
                    self.hits += 1
                    return product.output.clone()
        self.misses += 1
        return None

    def put(self, linear: Any, input: torch.Tensor, output: torch.Tensor) -> None:
        entry = self._weights.get(id(linear))
        if entry is None or entry[0] is not linear or not entry[1].still(linear):
            if entry is not None:
                self._drop(entry[1])
            entry = (linear, _Weights.of(linear))
            self._weights[id(linear)] = entry
        copy = self._copy(input)
        product = _Product(copy, output.clone())
        entry[1].products.setdefault(_kind(input), []).append(product)
        self._order.append((entry[1], product))
        self._bytes += _nbytes(product)
        while self._bytes > self._budget and self._order:
            weights, oldest = self._order.popleft()
            with contextlib.suppress(KeyError, ValueError):
                weights.products[_kind(oldest.input)].remove(oldest)
                self._bytes -= _nbytes(oldest)

    def clear(self) -> None:
        """Forget every product and every Linear seen (a finished layer's modules and their
        weights are then free to go: gptqmodel offloads them to disk)."""
        self._weights.clear()
        self._order.clear()
        self._last_input = None
        self._bytes = 0

    def _copy(self, input: torch.Tensor) -> torch.Tensor:
        """A copy of `input`: the last one again when the caller passes the same tensor."""
        last = self._last_input
        if last is not None and last[0] is input and _identical(last[1], input):
            return last[1]
        self._last_input = (input, input.clone())
        return self._last_input[1]

    def _drop(self, weights: _Weights) -> None:
        for products in weights.products.values():
            self._bytes -= sum(_nbytes(product) for product in products)
        weights.products.clear()


def _parameters(linear: Any) -> list[torch.Tensor]:
    return [t for t in (linear.weight, linear.bias) if t is not None]


def _version(tensor: torch.Tensor) -> int:
    """The in-place write count; -1 for an inference tensor, which keeps none (a weight made
    under inference mode, as gptqmodel makes the quantized ones)."""
    return -1 if tensor.is_inference() else tensor._version


def _sample(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach().reshape(-1)
    return flat[:: max(1, flat.numel() // 1024)]


def _identical(stored: torch.Tensor, input: torch.Tensor) -> bool:
    """The same bits (tensors of one _kind): memcmp where both are contiguous in CPU memory
    (torch.equal on bf16 reads ~2 GB/s, a seventh of memcmp's speed here), else torch.equal."""
    if stored.device.type == "cpu" and stored.is_contiguous() and input.is_contiguous():
        size = stored.numel() * stored.element_size()
        return _memcmp()(stored.data_ptr(), input.data_ptr(), size) == 0
    return torch.equal(stored, input)


@functools.cache
def _memcmp() -> Any:
    function = ctypes.CDLL(None).memcmp
    function.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    function.restype = ctypes.c_int
    return function


def _kind(input: torch.Tensor) -> tuple[Any, ...]:
    """What inputs must share to be compared at all."""
    return (tuple(input.shape), input.dtype, input.device)


def _nbytes(product: _Product) -> int:
    return sum(t.numel() * t.element_size() for t in (product.input, product.output))


def _plain(linear: Any, input: torch.Tensor) -> bool:
    """A Linear whose forward would be `F.linear(input, weight, bias)` with nothing around it."""
    weight = linear.weight
    return (
        not weight.is_meta
        and weight.device == input.device
        and getattr(linear, "_w4a_stream_replay_mode", None) is None
        and not getattr(linear, "online_full_had", False)
        and not getattr(linear, "online_partial_had", False)
    )


def _not_drawn(self: Any, force: bool = False) -> None:
    return None
