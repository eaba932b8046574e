"""The KV cache's bookkeeping: fixed-size blocks handed to rows, no torch.

The runner holds one pool of `num_blocks * block_size` token slots per layer; a row's tokens
live in the blocks of its block table, in order (vLLM's paged layout). Admitting or removing a
row touches only that row's blocks, whatever the other rows hold.

Prefix caching (vLLM's automatic prefix caching): each full block a row has computed is keyed
by (its parent block's hash, its token ids, extras such as the request's cache salt), so a
key names a whole prefix. A later request whose prompt starts with the same blocks takes them
by reference instead of computing them again. Blocks are reference-counted; a block no row
holds any more stays cached (evictable) and is evicted least recently used first, only when a
row needs a block and none is free. A cached block is full and never written again: rows write
only past the tokens they hold, and an evicted block loses its key before it is reused.

Rows take blocks as they need them: the whole prompt's (minus the cached ones) at admission,
then one block at a time while decoding; the step loop preempts a row when none is left.

KV events (kv_events.py, for prefix-aware routers): with an `Evictions` listener the allocator
keeps each cached block's event hash (vLLM's, given by the scheduler when it registers the
block) and tells the listener when a cached block loses its key (evicted) or the whole cache is
reset; without one (the default) nothing of that is kept or called.

The disk cache (kv_offload.py): with a `Spill` listener, a cached block evicted (not reset) is
told to it with its event hash before the block turns free, while its keys and values are
still intact (the row that takes it writes them only in the next forward pass).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from collections.abc import Sequence as Blocks
from typing import Any, Protocol

# (parent block's hash or None, the block's token ids, extras such as the cache salt)
BlockKey = tuple[int | None, tuple[int, ...], Hashable]


class Evictions(Protocol):
    """Told of the prefix cache's losses (kv_events.Recorder)."""

    def removed(self, block_hash: Any) -> None: ...

    def cleared(self) -> None: ...


class Spill(Protocol):
    """Told of each cached block evicted, before it is reused (kv_offload.Offload)."""

    def spilled(self, block: int, block_hash: Any) -> None: ...


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def extend_keys(
    keys: list[BlockKey],
    tokens: Callable[[int, int], Blocks[int]],
    count: int,
    block_size: int,
    extras: Hashable,
) -> None:
    """Extend `keys` to the first `count` full blocks; `tokens(start, end)`: the token ids of
    positions [start, end). The dict holding a key compares the whole tuple, so a block's own
    tokens and extras are matched exactly; its parent by hash (64 bits)."""
    while len(keys) < count:
        start = len(keys) * block_size
        parent = hash(keys[-1]) if keys else None
        keys.append((parent, tuple(tokens(start, start + block_size)), extras))


class BlockAllocator:
    """Thread confinement: only the step loop thread calls the mutating methods.

    Placement: a row's blocks are kept adjacent where the pool allows, because attention reads
    a row block by block and adjacent blocks stream from memory (the native decode kernel reads
    a row's adjacent blocks faster than blocks interleaved row by row as rows grow one block at
    a time, and those faster than blocks in random places as a long-running server's free list
    leaves them). A row's first allocation takes the start of a free run as long as `claim`
    (what it may grow to) and softly claims the rest; each later one (`after`, the row's last
    block) takes the next block when it is free. A claim only steers placement: when no run is
    free, or the next block is taken, any free block serves, so capacity is never lost. A claim
    ends when its first block is no longer held.

    Three kinds of block: held (by one row or more: refs > 0), cached (no row holds it, its key
    is kept: evictable, LRU order), free. `available` = free + cached: what rows may take.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        evictions: Evictions | None = None,
        spill: Spill | None = None,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("the KV cache needs at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._refs = [0] * num_blocks
        self._free = bytearray(b"\x01") * num_blocks  # 1: free (neither held nor cached)
        self._open = bytearray(b"\x01") * num_blocks  # 1: free and claimed by no row
        self._free_count = num_blocks
        # candidates for any-block allocation, most recently freed last; an entry whose block
        # was taken since (by placement) is skipped when reached
        self._stack: list[int] = list(range(num_blocks - 1, -1, -1))  # block 0 first
        self._claims: dict[int, range] = {}  # a row's first block -> its claimed blocks
        self._key_of: list[BlockKey | None] = [None] * num_blocks
        self._by_key: dict[BlockKey, int] = {}  # the cached prefixes: key -> block
        self._evictable: OrderedDict[int, None] = OrderedDict()  # refs 0, keyed; oldest first
        self.evictions = evictions  # KV events: told of evictions and resets (None: off)
        self.spill = spill  # the disk cache: told of evictions (None: off)
        # a cached block's event hash (events or the disk cache on only)
        self._event_hash: dict[int, Any] = {}

    @property
    def used(self) -> int:
        """Blocks held by at least one row now."""
        return self.num_blocks - self._free_count - len(self._evictable)

    @property
    def available(self) -> int:
        """Blocks a row may take now: free ones and cached ones no row holds (evicted)."""
        return self._free_count + len(self._evictable)

    @property
    def cached(self) -> int:
        """Blocks holding a cached prefix (held or not)."""
        return len(self._by_key)

    def usage(self) -> float:
        """Share of the cache's blocks held by rows (0-1): what KV-cache utilization gauges
        report (vLLM's kv_cache_usage_perc: cached blocks no row holds count as free)."""
        return self.used / self.num_blocks

    # -- prefix cache -------------------------------------------------------------------------
    def match(self, keys: Iterable[BlockKey]) -> list[int]:
        """The cached blocks of the longest prefix of `keys` (not yet taken: see `share`)."""
        out: list[int] = []
        for key in keys:
            block = self._by_key.get(key)
            if block is None:
                break
            out.append(block)
        return out

    def unheld(self, blocks: Iterable[int]) -> int:
        """How many of `blocks` no row holds (taking them uses up that many available ones)."""
        return sum(1 for block in blocks if self._refs[block] == 0)

    def share(self, blocks: Iterable[int]) -> None:
        """Take one reference to each of these cached blocks (from `match`)."""
        for block in blocks:
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1

    def register(self, block: int, key: BlockKey) -> bool:
        """Key a held block that is full and computed, so later prompts can share it; whether
        it was. A key already cached (two rows computed the same prefix at once) stays with its
        block."""
        if key not in self._by_key and self._key_of[block] is None:
            self._by_key[key] = block
            self._key_of[block] = key
            return True
        return False

    def hashed(self, block: int, event_hash: Any) -> None:
        """The event hash of a block just registered (told when it is evicted)."""
        self._event_hash[block] = event_hash

    def cached_blocks(self) -> list[tuple[int, Any]]:
        """Every cached block with its event hash, least recently used first (the disk cache
        saves them at shutdown)."""
        held = [b for b in self._by_key.values() if b not in self._evictable]
        blocks = [*self._evictable, *held]
        return [(b, self._event_hash[b]) for b in blocks if b in self._event_hash]

    def reset(self) -> bool:
        """Forget every cached prefix (vLLM's reset_prefix_cache): only while no row holds a
        block (False: refused, nothing done), as a row's later blocks chain on its earlier
        ones' keys. The listener hears one `cleared`, not each block."""
        if self.used:
            return False
        for block in list(self._evictable):
            self._forget(block, quiet=True)
        self._event_hash.clear()
        if self.evictions is not None:
            self.evictions.cleared()
        return True

    def _evict(self, count: int) -> None:
        """Forget the `count` least recently used cached blocks no row holds; they turn free."""
        for _ in range(count):
            self._forget(next(iter(self._evictable)))

    def _forget(self, block: int, quiet: bool = False) -> None:
        """A cached block no row holds loses its key and turns free (the listener told,
        unless `quiet`)."""
        del self._evictable[block]
        event_hash = None if quiet else self._event_hash.pop(block, None)
        if event_hash is not None:
            if self.evictions is not None:
                self.evictions.removed(event_hash)
            if self.spill is not None:
                self.spill.spilled(block, event_hash)
        key = self._key_of[block]
        assert key is not None
        del self._by_key[key]
        self._key_of[block] = None
        self._free[block] = self._open[block] = 1
        self._free_count += 1
        self._stack.append(block)

    # -- taking and giving back ---------------------------------------------------------------
    def allocate(self, count: int, after: int | None = None, claim: int = 0) -> list[int]:
        """`count` new blocks: after block `after` where free (a row growing), else at the
        start of a free run of `claim` blocks (a row's first blocks; else of `count`), else
        wherever. Cached blocks are evicted only when too few are free: least recently used
        first, except that a growing row's next block is evicted rather than another one, so
        the row stays adjacent (a long-running server's cache is all cached blocks)."""
        if count > self.available:
            raise MemoryError(f"KV cache: {count} blocks asked for, {self.available} available")
        out: list[int] = []
        if after is not None:
            block = after + 1
            while len(out) < count and block < self.num_blocks:
                if not self._free[block]:
                    short = self._free_count < count - len(out)  # must evict anyway
                    if not (short and block in self._evictable):
                        break
                    self._forget(block)
                out.append(self._take(block))
                block += 1
        need = count - len(out)
        if need > self._free_count and after is None:
            # under pressure, a row's first blocks: the free ones would not do, so the oldest
            # cached ones first, as many as are missing, in block order (mostly a run of one
            # finished row), then the free ones
            victims = sorted(itertools.islice(self._evictable, need - self._free_count))
            for block in victims:
                self._forget(block)
            out.extend(self._take(block) for block in victims)
            need = count - len(out)
        if need > self._free_count:
            self._evict(need - self._free_count)
        if need and after is None:
            span = max(claim, need)
            start = self._open.find(b"\x01" * span)
            if start < 0 and span > need:
                span = need
                start = self._open.find(b"\x01" * span)
            if start >= 0:
                out.extend(self._take(b) for b in range(start, start + need))
                claimed = range(start + need, start + span)
                for block in claimed:
                    self._open[block] = 0
                if claimed:
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

    def free(self, blocks: Blocks[int]) -> None:
        """Drop one reference to each block of a row's table. A block no row holds any more
        stays cached if it has a key (the row's last blocks first in line for eviction, so a
        prefix outlives its tails), else it is free."""
        for block in reversed(blocks):
            self._refs[block] -= 1
            assert self._refs[block] >= 0, f"KV block {block} freed twice"
            if self._refs[block]:
                continue
            for claimed in self._claims.pop(block, ()):
                if self._free[claimed]:
                    self._open[claimed] = 1
            if self._key_of[block] is not None:
                self._evictable[block] = None
            else:
                self._free[block] = self._open[block] = 1
                self._free_count += 1
                self._stack.append(block)
        if len(self._stack) > 2 * self.num_blocks:  # skipped entries piled up: rebuild
            self._stack = [b for b in range(self.num_blocks - 1, -1, -1) if self._free[b]]

    def audit(self, tables: Iterable[Blocks[int]]) -> None:
        """Check the books against the rows' block tables (tests call it after every step):
        each block's references equal the tables naming it, held + cached + free = all."""
        refs = [0] * self.num_blocks
        for table in tables:
            for block in table:
                refs[block] += 1
        assert refs == self._refs, "reference counts differ from the rows' block tables"
        free = [b for b in range(self.num_blocks) if self._free[b]]
        assert len(free) == self._free_count and all(refs[b] == 0 for b in free)
        assert all(self._key_of[b] is None for b in free), "a free block kept its key"
        assert all(refs[b] == 0 and self._key_of[b] is not None for b in self._evictable)
        unheld = {b for b in range(self.num_blocks) if refs[b] == 0}
        assert unheld == set(free) | set(self._evictable), "an unheld block is lost"
        assert all(self._key_of[b] == k for k, b in self._by_key.items())
        assert sum(k is not None for k in self._key_of) == len(self._by_key)
        assert self.used == sum(1 for r in refs if r), "used differs from the held blocks"
