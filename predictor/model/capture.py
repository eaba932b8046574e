"""gptqmodel's calibration forwards for GPTQ, without the work whose result nobody reads.

Profiled in `make model` with torch held to AVX2 (Zen 5, 2 cores, py-spy; load/RESULTS.md), the
main thread spent 178 s in gptqmodel's layer loop: 70 s in the layers' forwards, 32 s in the
hooks that add each batch to the Hessians, 7 s drawing gptqmodel's own progress bar (its output
goes to quantize.log). Within `lean_capture()`:

1. **No output for the module the forward stops at.** With `true_sequential` each subset's
   forward runs the layer up to its last hooked module, which raises gptqmodel's StopForward
   right after its hook: its output was computed and thrown away (v_proj, o_proj, up_proj,
   down_proj: a fifth of the forwards' matmuls). Its hook now gets its input and an empty
   output (GPTQ reads only the input) and the forward stops without the product. The replay
   that makes the next layer's inputs runs every module in full, as before.
2. **gptqmodel's progress bar is not drawn**: quantize.py shows per-layer progress itself.

Neither changes a number: the checkpoint is gptqmodel's bit for bit (tests/model/
test_capture.py). Only the plain case is changed (a Linear on its weights' device, no W4A replay
or Hadamard rotation); anything else goes through gptqmodel's code. The private names used are
items of internals.py.

Tried and left out: one Hessian product a batch (gptqmodel adds X_s^T X_s text by text, "so
that batched calibration accumulates with the semantics of batch size 1"). The same sum in
another rounding order moves the checkpoint: with torch held to AVX2 the test ratio went from
1.056 to 1.070 (validation 1.055 to 1.064), as large as the spread between runs of one recipe
but no longer the checkpoint the recipe was chosen and reported on, for ~10 s.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from predictor.model import internals


@contextlib.contextmanager
def lean_capture() -> Iterator[None]:
    """Within the block, gptqmodel's GPTQ forwards skip the work described above."""
    linear = internals.hooked_linear_class()
    bar = internals.progress_bar_class()
    saved = (linear.forward, bar.draw)
    linear.forward = _stop_before_last_output(saved[0])
    bar.draw = _not_drawn
    try:
        yield
    finally:
        linear.forward, bar.draw = saved


def _stop_before_last_output(
    original: Callable[[Any, torch.Tensor], torch.Tensor],
) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    def forward(self: Any, input: torch.Tensor) -> torch.Tensor:
        if self.forward_hook is None or not self.forward_hook_last or not _plain(self, input):
            return original(self, input)
        with torch.inference_mode():
            self.forward_hook(self, (input,), input.new_empty(0))
        raise internals.stop_forward()

    return forward


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
