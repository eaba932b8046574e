"""BlockAllocator placement: rows keep adjacent blocks while growing together, and placement
never costs capacity."""

from __future__ import annotations

import random

import pytest

from predictor.engine.kv_cache import BlockAllocator


def test_rows_growing_together_keep_their_blocks_adjacent() -> None:
    cache = BlockAllocator(num_blocks=64, block_size=16)
    rows = [cache.allocate(2, claim=6) for _ in range(4)]  # prompts: 2 blocks, 6 reserved
    for _ in range(4):  # decoding: each row needs one more block, in turn
        for blocks in rows:
            blocks.extend(cache.allocate(1, after=blocks[-1], claim=6))
    for blocks in rows:
        assert blocks == list(range(blocks[0], blocks[0] + 6))
    assert len({b for blocks in rows for b in blocks}) == 24 and cache.used == 24


def test_a_freed_row_gives_up_its_claim() -> None:
    cache = BlockAllocator(num_blocks=8, block_size=16)
    a = cache.allocate(1, claim=4)  # block 0, claims 1-3
    b = cache.allocate(1, claim=4)  # block 4, claims 5-7
    assert (a, b) == ([0], [4])
    cache.free(a)
    assert cache.allocate(2, claim=4) == [0, 1]  # a's run is open again


def test_placement_never_costs_capacity() -> None:
    rng = random.Random(3)
    cache = BlockAllocator(num_blocks=50, block_size=16)
    rows: list[list[int]] = []
    for _ in range(3000):
        if rows and (rng.random() < 0.3 or cache.used == cache.num_blocks):
            cache.free(rows.pop(rng.randrange(len(rows))))
        elif rows and rng.random() < 0.5:  # a row grows; claims may be anywhere by now
            row = rng.choice(rows)
            free = cache.num_blocks - cache.used
            if free == 0:
                with pytest.raises(MemoryError):
                    cache.allocate(1, after=row[-1])
                continue
            row.extend(cache.allocate(min(free, rng.randint(1, 3)), after=row[-1]))
        else:
            free = cache.num_blocks - cache.used
            count = rng.randint(1, 6)
            if count > free:
                with pytest.raises(MemoryError):
                    cache.allocate(count, claim=count + 4)
                continue
            rows.append(cache.allocate(count, claim=count + rng.randint(0, 10)))
        held = [b for row in rows for b in row]
        assert len(held) == len(set(held)) == cache.used  # no block given twice
    for row in rows:
        cache.free(row)
    assert cache.used == 0 and cache.allocate(50) == list(range(50))


def test_under_pressure_rows_stay_adjacent_and_eviction_is_lru() -> None:
    """A cache full of cached blocks no row holds (a long-running server): a new row's first
    blocks are the least recently used ones in block order, and a growing row evicts its next
    block rather than another."""
    cache = BlockAllocator(num_blocks=12, block_size=4)
    old = [cache.allocate(4, claim=4) for _ in range(3)]  # blocks 0-3, 4-7, 8-11
    for r, blocks in enumerate(old):
        for i, block in enumerate(blocks):
            cache.register(block, (None, (r, i), None))
        cache.free(blocks)
    assert cache.used == 0 and cache.available == 12 and cache.cached == 12
    row = cache.allocate(3, claim=3)
    assert row == [1, 2, 3]  # the first row's tail first (its prefix outlives it)
    assert cache.match([(None, (0, 0), None)]) == [0]  # its first block is still cached
    row.extend(cache.allocate(1, after=row[-1]))
    assert row == [1, 2, 3, 4]  # the next block, evicted out of turn to stay adjacent
    assert cache.match([(None, (1, 0), None)]) == []
    cache.audit([row])
