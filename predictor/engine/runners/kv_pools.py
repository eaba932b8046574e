"""The CPU runner's paged KV cache: one pool per layer, and whole blocks copied out of and into
them as bytes (the disk cache, engine/kv_offload.py).

A pool per layer holds [2 * kv_heads, slots + 1, head_dim]: keys then values of every token slot,
plus one zero slot that padding reads (masked keys must still be finite: 0 * NaN is NaN). One
write and one gather a layer serve both, and a gathered row's keys come out [kv_heads, tokens,
head_dim], the layout attention multiplies without a copy. A block's payload is [layers,
2 * kv_heads, block_size, head_dim] in the pool's dtype (bf16 as a served model holds it), C
order. Copies go one strided copy per layer and run of adjacent blocks, straight between the
pools and the bytes (250 adjacent blocks of SmolLM2-135M: 30 copies, not 7,500; an index_select
gather, a stack and a permute took 3x as long).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

_SOURCES = Path(__file__).parent


class KVPools:
    """The pools of every layer, allocated once for `num_blocks` blocks of `block_size` slots."""

    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.kv_heads, self.head_dim, self.block_size = kv_heads, head_dim, block_size
        slots = num_blocks * block_size
        self.pad_slot = slots  # the zero slot padding reads
        # empty, so pages are touched (and count in RSS) only as the cache fills
        self.layers = [
            torch.empty((2 * kv_heads, slots + 1, head_dim), dtype=dtype, device=device)
            for _ in range(layers)
        ]
        for pool in self.layers:
            pool[:, slots].zero_()

    def __getitem__(self, layer: int) -> torch.Tensor:
        return self.layers[layer]  # [2 * kv_heads, slots + 1, head_dim]

    def layout(self) -> dict[str, Any]:
        """What a block's payload depends on (the disk cache's identity)."""
        pool = self.layers[0]
        return {
            "dtype": str(pool.dtype),
            "layers": len(self.layers),
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "block_size": self.block_size,
            "code": code_digest(),
        }

    def block_bytes(self) -> int:
        return block_bytes(self.layers, self.block_size)

    def read(self, blocks: Sequence[int]) -> memoryview:
        return read_blocks(self.layers, blocks, self.block_size)

    def write(self, blocks: Sequence[int], data: memoryview) -> None:
        write_blocks(self.layers, blocks, self.block_size, data)

    def free(self) -> None:
        """Let the pools go (a runner put to sleep)."""
        self.layers = []


def code_digest(sources: Path = _SOURCES) -> str:
    """What a block's keys and values depend on besides the model: the runner's sources (this
    folder's: the runner, its kernels) and torch's version. Conservative: any change there
    makes new files."""
    digest = hashlib.sha256(torch.__version__.encode())
    for path in sorted(sources.rglob("*")):
        if path.suffix in (".py", ".c", ".h"):
            digest.update(str(path.relative_to(sources)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:24]


def _runs(blocks: Sequence[int]) -> list[tuple[int, int, int]]:
    """The blocks as runs of adjacent ones: (index of its first in `blocks`, first block,
    length). The allocator keeps a row's blocks adjacent where it can, so a prompt's blocks
    are mostly one run."""
    runs: list[tuple[int, int, int]] = []
    for i, block in enumerate(blocks):
        if runs and runs[-1][1] + runs[-1][2] == block:
            index, first, length = runs[-1]
            runs[-1] = (index, first, length + 1)
        else:
            runs.append((i, block, 1))
    return runs


def block_bytes(pools: Sequence[torch.Tensor], block_size: int) -> int:
    pool = pools[0]
    return len(pools) * pool.shape[0] * block_size * pool.shape[2] * pool.element_size()


def _payloads(
    pools: Sequence[torch.Tensor], count: int, block_size: int, data: memoryview
) -> torch.Tensor:
    """`data` seen as the payloads of `count` blocks: [count, layers, 2 * kv_heads, block_size,
    head_dim] in the pools' dtype (no copy)."""
    heads, dim = pools[0].shape[0], pools[0].shape[2]
    raw = torch.frombuffer(data, dtype=torch.uint8).view(pools[0].dtype)
    return raw.view(count, len(pools), heads, block_size, dim)


def _span(pool: torch.Tensor, first: int, length: int, block_size: int) -> torch.Tensor:
    """A run's slots of one layer as [length, 2 * kv_heads, block_size, head_dim] (a view)."""
    heads, dim = pool.shape[0], pool.shape[2]
    part = pool[:, first * block_size : (first + length) * block_size]
    return part.view(heads, length, block_size, dim).transpose(0, 1)


def read_blocks(
    pools: Sequence[torch.Tensor], blocks: Sequence[int], block_size: int
) -> memoryview:
    """The blocks' payloads, back to back: one strided copy per layer and run, straight into
    the bytes returned (not zeroed first: every byte is written; the view keeps them alive)."""
    size = len(blocks) * block_bytes(pools, block_size)
    data: memoryview = torch.empty(size, dtype=torch.uint8).numpy().data
    payloads = _payloads(pools, len(blocks), block_size, data)
    for index, first, length in _runs(blocks):
        for layer, pool in enumerate(pools):
            payloads[index : index + length, layer].copy_(_span(pool, first, length, block_size))
    return data


def write_blocks(
    pools: Sequence[torch.Tensor], blocks: Sequence[int], block_size: int, data: memoryview
) -> None:
    """Fill the blocks from their payloads, back to back (`data`: writable, as read)."""
    payloads = _payloads(pools, len(blocks), block_size, data)
    for index, first, length in _runs(blocks):
        for layer, pool in enumerate(pools):
            _span(pool, first, length, block_size).copy_(payloads[index : index + length, layer])
