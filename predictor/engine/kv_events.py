"""KV-cache events for prefix-aware routers (llm-d's precise-prefix scorer, NVIDIA Dynamo's KV
router): what the prefix cache stored and evicted, in vLLM's events and with vLLM's block hashes.

The prefix cache keys its blocks with a fast 64-bit key of its own (kv_cache.py); a router
computes vLLM's hashes from the prompt's tokens, so the events carry those: each full block's
hash is `hash_fn((parent hash, the block's token ids, extra keys))`, the first block's parent
being NONE_HASH (`hash_fn(PYTHONHASHSEED)` where that is set, else 32 random bytes: vLLM's
`init_none_hash`), extra keys vLLM's: the LoRA adapter's name on every block, the cache salt on
the first (`generate_block_hash_extra_keys`), None where neither. A request's hashes are
computed once each (`BlockHasher`), and only when events or the disk cache are on.

The hash functions (--prefix-caching-hash-algo, vLLM's names):
- `sha256_cbor`: SHA-256 over canonical CBOR (RFC 8949, 4.2.1) of the tuple: portable, what
  llm-d and Dynamo compute; the CBOR of the few types a key holds is written here (`cbor`).
- `sha256`: SHA-256 over the tuple's pickle (protocol 5, vLLM's default): reproducible only
  by Python with the same pickle.
- `builtin`: Python's `hash()` of the tuple (vLLM up to 0.9): reproducible only by processes
  with the same PYTHONHASHSEED.
An event carries a hash as vLLM's do by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1): its
last 8 bytes as an unsigned 64-bit integer.

Events go out in batches, one per step that had any (`Recorder.flush`), to a `Publish` callable
(kv_publisher.py) that must never block.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

MEDIUM = "GPU"  # vLLM's name for the engine's own KV cache (its CPU backend's too)
MASK64 = (1 << 64) - 1

BlockHash = bytes | int  # a digest (the sha256 algorithms) or an integer (builtin)
HashFn = Callable[[Any], BlockHash]


# -- canonical CBOR of what a block key holds: None, bool, int, str, bytes, tuples and lists ---
def _head(major: int, value: int) -> bytes:
    """A data item's initial byte(s) with its argument in the shortest form (canonical)."""
    if value < 24:
        return bytes((major << 5 | value,))
    for extra, width in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if value < 1 << (8 * width):
            return bytes((major << 5 | extra,)) + value.to_bytes(width, "big")
    raise ValueError("a CBOR integer is at most 64 bits")


@functools.lru_cache(maxsize=1 << 18)
def _uint(value: int) -> bytes:
    """An unsigned integer's encoding, kept: a block's token ids repeat (a vocabulary's worth at
    most), and these bytes are most of a block's encoding."""
    return _head(0, value)


def cbor(value: Any) -> bytes:
    """`value` in canonical CBOR, as cbor2.dumps(value, canonical=True) writes it for these
    types (a tuple or list is an array)."""
    out = bytearray()
    _encode(value, out)
    return bytes(out)


def _encode(value: Any, out: bytearray) -> None:
    if value is None:
        out += b"\xf6"
    elif value is True or value is False:
        out += b"\xf5" if value else b"\xf4"
    elif isinstance(value, int):
        out += _uint(value) if value >= 0 else _head(1, -1 - value)
    elif isinstance(value, bytes):
        out += _head(2, len(value))
        out += value
    elif isinstance(value, str):
        data = value.encode("utf-8")
        out += _head(3, len(data))
        out += data
    elif isinstance(value, tuple | list):
        out += _head(4, len(value))
        if all(type(item) is int and item >= 0 for item in value):  # token ids: the hot path
            out += b"".join(map(_uint, value))
        else:
            for item in value:
                _encode(item, out)
    else:
        raise TypeError(f"no CBOR form here for {type(value).__name__}")


def sha256_cbor(value: Any) -> bytes:
    return hashlib.sha256(cbor(value)).digest()


def sha256_pickle(value: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def builtin_hash(value: Any) -> int:
    return hash(value)


def hash_function(algo: str) -> HashFn:
    """vLLM's hash function of that --prefix-caching-hash-algo name."""
    functions: dict[str, HashFn] = {
        "sha256_cbor": sha256_cbor,
        "sha256": sha256_pickle,
        "builtin": builtin_hash,
    }
    return functions[algo]


def none_hash(hash_fn: HashFn, seed: str | None) -> BlockHash:
    """The first block's parent: `hash_fn(seed)` where PYTHONHASHSEED is set (`seed`), else
    random, so no other process computes the same hashes (vLLM's init_none_hash)."""
    if seed is None:
        return os.urandom(32) if hash_fn is not builtin_hash else int.from_bytes(os.urandom(8))
    return hash_fn(seed)


def external(block_hash: BlockHash) -> int:
    """A hash as events carry it: the digest's last 8 bytes, big-endian (vLLM's
    maybe_convert_block_hash), or an integer's low 64 bits."""
    if isinstance(block_hash, bytes):
        return int.from_bytes(block_hash[-8:], "big")
    return block_hash & MASK64


def extra_keys(
    lora_name: str | None, cache_salt: str | None, first: bool
) -> tuple[Any, ...] | None:
    """vLLM's extra keys of a block: the adapter's name, then the salt on the first block."""
    keys: list[Any] = [] if lora_name is None else [lora_name]
    if first and cache_salt:
        keys.append(cache_salt)
    return tuple(keys) if keys else None


def chain_hashes(
    hash_fn: HashFn,
    root: BlockHash,
    tokens: Sequence[int],
    block_size: int,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    parent: BlockHash | None = None,
    first_block: int = 0,
) -> list[BlockHash]:
    """The hashes of the full blocks of `tokens`, which start at block `first_block` of the
    sequence, after the block hashed `parent` (None: the first block, after `root`)."""
    out: list[BlockHash] = []
    for i in range(len(tokens) // block_size):
        extras = extra_keys(lora_name, cache_salt, first_block + i == 0)
        block = tuple(tokens[i * block_size : (i + 1) * block_size])
        parent = hash_fn((root if parent is None else parent, block, extras))
        out.append(parent)
    return out


# -- the events (vLLM's msgspec structs, array_like and tagged: a list, its tag first) ---------
@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None

    def wire(self) -> list[Any]:
        return [
            "BlockStored",
            self.block_hashes,
            self.parent_block_hash,
            self.token_ids,
            self.block_size,
            self.lora_id,
            self.medium,
            self.lora_name,
        ]


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str | None

    def wire(self) -> list[Any]:
        return ["BlockRemoved", self.block_hashes, self.medium]


@dataclass(frozen=True)
class AllBlocksCleared:
    def wire(self) -> list[Any]:
        return ["AllBlocksCleared"]


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class KVEventBatch:
    ts: float
    events: list[KVCacheEvent]
    data_parallel_rank: int = 0

    def wire(self) -> list[Any]:
        """vLLM's KVEventBatch as msgpack sees it: [ts, events, data_parallel_rank]."""
        return [self.ts, [event.wire() for event in self.events], self.data_parallel_rank]


Publish = Callable[[KVEventBatch], None]  # never blocks (kv_publisher.py)


class HashedRequest(Protocol):
    """What the recorder reads of a request (engine/request.py's Request)."""

    lora_name: str | None
    cache_salt: str | None
    event_hashes: list[BlockHash]

    def tokens(self, start: int, end: int) -> list[int]: ...


class BlockHasher:
    """A request's chained block hashes, each computed once (kept on the request): what the
    events carry, and what the disk cache (kv_offload.py) files a block under."""

    def __init__(self, block_size: int, algo: str = "sha256_cbor", seed: str | None = None) -> None:
        self.block_size = block_size
        self.algo = algo
        self._hash = hash_function(algo)
        self.root = none_hash(self._hash, seed)

    def hashes(self, request: HashedRequest, count: int) -> list[BlockHash]:
        """The hashes of the request's first `count` full blocks (each computed once)."""
        have = request.event_hashes
        if len(have) < count:
            size = self.block_size
            start = len(have) * size
            have += chain_hashes(
                self._hash,
                self.root,
                request.tokens(start, count * size),
                size,
                request.lora_name,
                request.cache_salt,
                have[-1] if have else None,
                len(have),
            )
        return have[:count]


class Recorder:
    """The prefix cache's changes as events. Thread confinement: the step loop's thread (the
    scheduler and the allocator call it; the loop flushes once a step)."""

    def __init__(
        self,
        publish: Publish,
        block_size: int,
        algo: str = "sha256_cbor",
        seed: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._publish = publish
        self.block_size = block_size
        self.hasher = BlockHasher(block_size, algo, seed)
        self._clock = clock
        self._pending: list[KVCacheEvent] = []

    def hashes(self, request: HashedRequest, count: int) -> list[BlockHash]:
        return self.hasher.hashes(request, count)

    def stored(
        self,
        request: HashedRequest,
        first: int,
        count: int,
        lora_id: int | None,
    ) -> list[BlockHash]:
        """Blocks `first` .. `first + count` of the request entered the cache: one BlockStored
        (parent: the block before, if any); returns their hashes, for their removal."""
        hashes = self.hashes(request, first + count)
        size = self.block_size
        self._pending.append(
            BlockStored(
                block_hashes=[external(h) for h in hashes[first:]],
                parent_block_hash=external(hashes[first - 1]) if first else None,
                token_ids=request.tokens(first * size, (first + count) * size),
                block_size=size,
                lora_id=lora_id,
                medium=MEDIUM,
                lora_name=request.lora_name,
            )
        )
        return hashes[first:]

    def removed(self, block_hash: BlockHash) -> None:
        self._pending.append(BlockRemoved([external(block_hash)], MEDIUM))

    def cleared(self) -> None:
        self._pending.append(AllBlocksCleared())

    def flush(self) -> None:
        """The events since the last flush, as one batch (none: nothing is sent)."""
        if self._pending:
            events, self._pending = self._pending, []
            self._publish(KVEventBatch(self._clock(), events))
