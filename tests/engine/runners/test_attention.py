"""The runner's attention: the one chosen at start, and torch's soft-capped prompt attention and
sliding-window masks against straightforward references (the family tests hold the whole runner
to transformers; native/test_bindings.py the native against torch's)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from predictor.engine.runners import attention
from predictor.engine.runners.family import HeadSizes


def test_a_cap_too_high_to_bind_gives_sdpas_result() -> None:
    torch.manual_seed(0)
    query, keys, values = (
        torch.randn(1, 4, 5, 16),
        torch.randn(1, 2, 9, 16),
        torch.randn(1, 2, 9, 16),
    )
    ours = attention.prefill(query, keys, values, None, 0.25, cap=1e6)
    mask = torch.ones(5, 9, dtype=torch.bool).tril(4)
    theirs = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=0.25,
                                            enable_gqa=True)  # fmt: skip
    assert torch.allclose(ours, theirs, atol=1e-5)
    tight = attention.prefill(query, keys, values, None, 0.25, cap=0.1)
    assert not torch.allclose(tight, theirs, atol=1e-3)  # a binding cap changes the result


def test_window_masks_keep_each_querys_last_window_keys() -> None:
    mask = attention.window_mask(3, 6, 2, torch.device("cpu"))[0, 0]
    assert mask.tolist() == [
        [False, False, True, True, False, False],  # position 3 sees 2, 3
        [False, False, False, True, True, False],
        [False, False, False, False, True, True],
    ]
    bias = torch.zeros(2, 1, 5)
    bias[1, 0, 3:] = float("-inf")  # the second row has 3 keys
    windowed = attention.window_bias(bias, 2)
    assert torch.isinf(windowed[0, 0]).tolist() == [True, True, True, False, False]
    assert torch.isinf(windowed[1, 0]).tolist() == [True, False, False, True, True]


def test_torchs_attention_is_chosen_where_the_native_kernel_is_not() -> None:
    sizes, cpu = HeadSizes(4, 2, 16, 0.25), torch.device("cpu")
    none: list[int | None] = [None, None]

    def kernel(attention_flag: str, dtype: torch.dtype, cap: float | None = None) -> object:
        return attention.native_kernel(attention_flag, sizes, 16, cpu, dtype, cap, none, None)

    assert kernel("torch", torch.bfloat16) is None
    assert kernel("auto", torch.float32) is None  # the kernel reads bf16 pools only
    assert kernel("auto", torch.bfloat16, cap=50.0) is None  # it cannot cap scores
    with pytest.raises(ValueError, match="needs a bf16 model"):
        kernel("native", torch.float32)
    with pytest.raises(ValueError, match="GPU runner"):
        kernel("triton", torch.bfloat16)
    with pytest.raises(ValueError, match="attention must be one of"):
        kernel("fastest", torch.bfloat16)
    chosen = attention.choose(sizes, None, [None, None], None, none, cpu, None, None)
    assert type(chosen) is attention.TorchAttention and not chosen.native
