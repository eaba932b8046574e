"""The KV cache's bookkeeping: fixed-size blocks handed to rows, no torch.

The runner holds one pool of `num_blocks * block_size` token slots per layer; a row's tokens
live in the blocks of its block table, in order (vLLM's paged layout). Admitting or removing a
row touches only that row's blocks, whatever the other rows hold, and a block can later be
shared between rows whose prompts start alike (prefix caching) by counting its references.

A request reserves the blocks it may need at most (prompt + max_tokens) when it is admitted and
allocates them as its tokens arrive, so a running row can never find the pool empty and no row
is ever preempted. `used` counts what the cache really holds; `reserved` is the admission bound.
"""

from __future__ import annotations

from collections.abc import Sequence


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class BlockAllocator:
    """Thread confinement: only the step loop thread calls the mutating methods."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("the KV cache needs at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives block 0 first
        self._refs = [0] * num_blocks
        self.reserved = 0  # blocks promised to admitted rows (allocated or not yet)

    @property
    def used(self) -> int:
        """Blocks holding at least one row's tokens now."""
        return self.num_blocks - len(self._free)

    def usage(self) -> float:
        """Share of the cache's blocks in use (0-1): what KV-cache utilization gauges report."""
        return self.used / self.num_blocks

    def can_reserve(self, blocks: int) -> bool:
        return self.reserved + blocks <= self.num_blocks

    def reserve(self, blocks: int) -> None:
        if not self.can_reserve(blocks):
            raise MemoryError(f"KV cache: {blocks} blocks asked for, {self.free_reservations} left")
        self.reserved += blocks

    def release(self, blocks: int) -> None:
        self.reserved -= blocks
        assert self.reserved >= 0, "released more KV blocks than were reserved"

    @property
    def free_reservations(self) -> int:
        return self.num_blocks - self.reserved

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise MemoryError(f"KV cache: {count} blocks asked for, {len(self._free)} free")
        out = [self._free.pop() for _ in range(count)]
        for block in out:
            self._refs[block] = 1
        return out

    def free(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            self._refs[block] -= 1
            assert self._refs[block] >= 0, f"KV block {block} freed twice"
            if self._refs[block] == 0:
                self._free.append(block)
