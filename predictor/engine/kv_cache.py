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
    """Thread confinement: only the step loop thread calls the mutating methods.

    Placement: a row's blocks are kept adjacent where the pool allows, because attention reads
    a row block by block and adjacent blocks stream from memory (the native decode kernel, 16
    rows of 150 tokens, 30 layers: 5.8 ms adjacent, 7.7 ms interleaved row by row as rows grow
    one block at a time, 13.4 ms in random places as a long-running server's free list leaves
    them). A row's first allocation takes the start of a free run as long as its whole
    reservation (`claim`) and softly claims the rest; each later one (`after`, the row's last
    block) takes the next block when it is free. A claim only steers placement: when no run
    is free, or the next block is taken, any free block serves, so capacity is never lost.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("the KV cache needs at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._refs = [0] * num_blocks
        self._free = bytearray(b"\x01") * num_blocks  # 1: free
        self._open = bytearray(b"\x01") * num_blocks  # 1: free and claimed by no row
        self._free_count = num_blocks
        # candidates for any-block allocation, most recently freed last; an entry whose block
        # was taken since (by placement) is skipped when reached
        self._stack: list[int] = list(range(num_blocks - 1, -1, -1))  # block 0 first
        self._claims: dict[int, range] = {}  # a row's first block -> its claimed blocks
        self.reserved = 0  # blocks promised to admitted rows (allocated or not yet)

    @property
    def used(self) -> int:
        """Blocks holding at least one row's tokens now."""
        return self.num_blocks - self._free_count

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

    def allocate(self, count: int, after: int | None = None, claim: int = 0) -> list[int]:
        """`count` free blocks: after block `after` where free (a row growing), else at the
        start of a free run of `claim` blocks (a row's first blocks), else wherever."""
        if count > self._free_count:
            raise MemoryError(f"KV cache: {count} blocks asked for, {self._free_count} free")
        out: list[int] = []
        if after is not None:
            block = after + 1
            while len(out) < count and block < self.num_blocks and self._free[block]:
                out.append(self._take(block))
                block += 1
        elif count > 0:
            span = max(claim, count)
            start = self._open.find(b"\x01" * span)
            if start >= 0:
                out.extend(self._take(b) for b in range(start, start + count))
                claimed = range(start + count, start + span)
                for block in claimed:
                    self._open[block] = 0
                self._claims[start] = claimed
        while len(out) < count:
            block = self._stack.pop()
            if self._free[block]:
                out.append(self._take(block))
        return out

    def _take(self, block: int) -> int:
        self._free[block] = self._open[block] = 0
        self._refs[block] = 1
        self._free_count -= 1
        return block

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block; a row freeing its blocks also gives up its claim."""
        if blocks:
            for block in self._claims.pop(blocks[0], ()):
                if self._free[block]:
                    self._open[block] = 1
        for block in blocks:
            self._refs[block] -= 1
            assert self._refs[block] >= 0, f"KV block {block} freed twice"
            if self._refs[block] == 0:
                self._free[block] = self._open[block] = 1
                self._free_count += 1
                self._stack.append(block)
        if len(self._stack) > 2 * self.num_blocks:  # skipped entries piled up: rebuild
            self._stack = [b for b in range(self.num_blocks - 1, -1, -1) if self._free[b]]
