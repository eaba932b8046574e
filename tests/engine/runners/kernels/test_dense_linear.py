"""Dense bf16 projections prepacked for oneDNN compute what torch's Linear computes."""

from __future__ import annotations

import pytest
import torch

from predictor.engine.runners.kernels.dense_linear import prepack
from predictor.engine.runners.kernels.int4_linear import prepack_available


@pytest.mark.skipif(
    not prepack_available(), reason="oneDNN prepacks bf16 with AVX-512 or AVX-NE-CONVERT only"
)
@pytest.mark.parametrize("bias", [False, True])
def test_prepacked_linear_equals_torch_linear(bias: bool) -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 40, bias=bias).to(torch.bfloat16)
    packed = prepack(linear)
    assert packed is not None
    for rows in (1, 3, 17):
        x = torch.randn(rows, 96).to(torch.bfloat16)
        with torch.inference_mode():
            expected, got = linear(x).float(), packed(x).float()
        assert torch.allclose(got, expected, atol=2e-2, rtol=2e-2)
    assert packed(torch.randn(2, 5, 96).to(torch.bfloat16)).shape == (2, 5, 40)


def test_only_plain_bf16_linears_are_prepacked() -> None:
    assert prepack(torch.nn.Linear(8, 8)) is None  # fp32: left to torch
    assert prepack(torch.nn.Identity()) is None
