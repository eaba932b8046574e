"""The runner's torch attention: soft-capped prompt attention and sliding-window masks against
straightforward references (the family tests hold the whole runner to transformers)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from predictor.engine.runners import torch_attention


def test_a_cap_too_high_to_bind_gives_sdpas_result() -> None:
    torch.manual_seed(0)
    query, keys, values = (
        torch.randn(1, 4, 5, 16),
        torch.randn(1, 2, 9, 16),
        torch.randn(1, 2, 9, 16),
    )
    ours = torch_attention.prefill(query, keys, values, None, 0.25, cap=1e6)
    mask = torch.ones(5, 9, dtype=torch.bool).tril(4)
    theirs = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=0.25,
                                            enable_gqa=True)  # fmt: skip
    assert torch.allclose(ours, theirs, atol=1e-5)
    tight = torch_attention.prefill(query, keys, values, None, 0.25, cap=0.1)
    assert not torch.allclose(tight, theirs, atol=1e-3)  # a binding cap changes the result


def test_window_masks_keep_each_querys_last_window_keys() -> None:
    mask = torch_attention.window_mask(3, 6, 2, torch.device("cpu"))[0, 0]
    assert mask.tolist() == [
        [False, False, True, True, False, False],  # position 3 sees 2, 3
        [False, False, False, True, True, False],
        [False, False, False, False, True, True],
    ]
    bias = torch.zeros(2, 1, 5)
    bias[1, 0, 3:] = float("-inf")  # the second row has 3 keys
    windowed = torch_attention.window_bias(bias, 2)
    assert torch.isinf(windowed[0, 0]).tolist() == [True, True, True, False, False]
    assert torch.isinf(windowed[1, 0]).tolist() == [True, False, False, True, True]
