"""Whole KV-cache blocks copied out of and into the runner's pools, as bytes (the disk cache,
engine/kv_offload.py).

A pool per layer holds [2 * kv_heads, slots + 1, head_dim] (keys then values, model.py); a
block's payload is [layers, 2 * kv_heads, block_size, head_dim] in the pool's dtype (bf16 as a
served model holds it), C order. Copies go one gather or scatter per layer for all the blocks
of a call, not one per block (250 blocks of SmolLM2-135M: 30 index operations, not 7,500).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

import torch

_SOURCES = Path(__file__).parent


def code_digest() -> str:
    """What a block's keys and values depend on besides the model: this folder's sources (the
    runner, its kernels) and torch's version. Conservative: any change there makes new files."""
    digest = hashlib.sha256(torch.__version__.encode())
    for path in sorted(_SOURCES.glob("*")):
        if path.suffix in (".py", ".c", ".h"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:24]


def _slots(blocks: Sequence[int], block_size: int) -> torch.Tensor:
    # slots: [len(blocks) * block_size], each block's in order
    starts = torch.tensor(list(blocks), dtype=torch.long) * block_size
    return (starts[:, None] + torch.arange(block_size)).reshape(-1)


def block_bytes(pools: Sequence[torch.Tensor], block_size: int) -> int:
    pool = pools[0]
    return len(pools) * pool.shape[0] * block_size * pool.shape[2] * pool.element_size()


def read_blocks(pools: Sequence[torch.Tensor], blocks: Sequence[int], block_size: int) -> bytes:
    """The blocks' payloads, back to back."""
    slots = _slots(blocks, block_size)
    heads, dim = pools[0].shape[0], pools[0].shape[2]
    # gathered: [layers, 2 * kv_heads, n * block_size, head_dim]
    gathered = torch.stack([pool.index_select(1, slots) for pool in pools])
    per_block = gathered.view(len(pools), heads, len(blocks), block_size, dim)
    # [n, layers, 2 * kv_heads, block_size, head_dim], as bytes
    return per_block.permute(2, 0, 1, 3, 4).contiguous().view(torch.uint8).numpy().tobytes()


def write_blocks(
    pools: Sequence[torch.Tensor], blocks: Sequence[int], block_size: int, data: memoryview
) -> None:
    """Fill the blocks from their payloads, back to back (`data`: writable, as read)."""
    slots = _slots(blocks, block_size)
    heads, dim = pools[0].shape[0], pools[0].shape[2]
    raw = torch.frombuffer(data, dtype=torch.uint8).view(pools[0].dtype)
    # payloads: [n, layers, 2 * kv_heads, block_size, head_dim]
    payloads = raw.view(len(blocks), len(pools), heads, block_size, dim)
    for layer, pool in enumerate(pools):
        # this layer's: [2 * kv_heads, n * block_size, head_dim]
        values = payloads[:, layer].permute(1, 0, 2, 3).reshape(heads, -1, dim)
        pool.index_copy_(1, slots, values)
