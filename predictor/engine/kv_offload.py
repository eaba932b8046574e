"""The prefix cache on disk (--kv-offload-dir, --kv-offload-size): blocks evicted from the KV
cache are kept in files (kv_disk.py), read back on a later prompt that starts with them instead
of being computed, and found again after a restart of the same model and code.

- Key: the block's chained hash, the one the KV events carry (kv_events.BlockHasher: the
  parent's hash, the block's tokens, the LoRA adapter's name on every block and the cache
  salt on the first), so a block is only ever found by a prompt with the same tokens, adapter
  and salt before it. With the disk cache on, the first block's parent is PYTHONHASHSEED's
  hash, or a fixed one where that is unset (never random: a restart must compute the same).
- Identity: files live in a folder named by a digest of the model (its config files in full,
  each weight file's size and 64 evenly spaced samples of 64 KiB), the cache's layout (dtype,
  block size, layers, KV heads, head size), the code that computes keys and values (the
  runner's digest of its sources), the hash algorithm and its root, and this module's format;
  each file's header repeats the digest, so a file copied in from another model is refused.
- Out: the allocator tells `spilled(block, hash)` as it evicts (kv_cache.Spill); the blocks
  are copied out of the cache in one gather at the end of the step's scheduling (`flush`),
  before the forward pass can write them, and queued to the store's writer thread, which a
  full queue never waits for (dropped, counted). At shutdown every cached block not on disk
  yet is written (`save`), so a restarted server finds what the last one held.
- In: at admission, after the RAM prefix cache's hit, the blocks that follow it on disk are
  read into the request's new blocks (`load`), each file checked whole; the first that fails
  ends the read there (the rest is computed).

The step loop's thread calls everything but `save`, which runs after it stopped.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from predictor.engine.kv_disk import BlockStore, Counts, key_bytes
from predictor.engine.kv_events import BlockHash, BlockHasher, HashedRequest

log = logging.getLogger(__name__)

FORMAT = "gptq-predictor kv-offload 1"  # this module's layout of a block's payload
ROOT_SEED = "gptq-predictor"  # the first block's parent's seed where PYTHONHASHSEED is unset
QUEUE_BYTES = 128 << 20  # payloads waiting for the writer at most (then spills are dropped)
SAMPLES = 64  # of each weight file, for the model's digest
SAMPLE_BYTES = 64 << 10


class BlockCopies(Protocol):
    """The runner's side: blocks' keys and values out of and into the cache (runners/cpu.py)."""

    def kv_layout(self) -> dict[str, Any]:
        """What a block's payload depends on: dtype, layers, KV heads, head size, block size,
        and `code`, a digest of the sources that compute keys and values."""
        ...

    def kv_block_bytes(self) -> int: ...

    def read_blocks(self, blocks: Sequence[int]) -> memoryview:
        """The blocks' payloads, back to back."""
        ...

    def write_blocks(self, blocks: Sequence[int], data: memoryview) -> None:
        """Fill the blocks from their payloads, back to back."""
        ...


class LoadedRequest(HashedRequest, Protocol):
    blocks: list[int]


def model_digest(model_dir: Path) -> str:
    """The checkpoint's digest: its JSON files in full, each weight file's name, size and
    SAMPLES evenly spaced samples (a rebuild of the same shapes differs almost everywhere;
    reading all of an 8B model's weights would cost seconds at each start)."""
    digest = hashlib.sha256()
    for path in sorted(model_dir.iterdir()):
        if path.suffix == ".json" and path.is_file():
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
        elif path.suffix in (".safetensors", ".bin") and path.is_file():
            size = path.stat().st_size
            digest.update(f"{path.name}\0{size}".encode())
            with open(path, "rb") as file:
                for i in range(SAMPLES):
                    file.seek(max(0, size - SAMPLE_BYTES) * i // max(1, SAMPLES - 1))
                    digest.update(file.read(SAMPLE_BYTES))
    return digest.hexdigest()


def identity(
    model_dir: Path, layout: dict[str, Any], hasher: BlockHasher
) -> tuple[bytes, dict[str, Any]]:
    """The identity blocks are filed under: its digest and what it names."""
    root = hasher.root
    described = {
        "format": FORMAT,
        "model": model_digest(model_dir),
        **layout,
        "hash": hasher.algo,
        "root": root.hex() if isinstance(root, bytes) else str(root),
    }
    text = json.dumps(described, sort_keys=True).encode()
    return hashlib.sha256(text).digest(), described


class Offload:
    """The disk cache of one server: its store, the hasher its keys come from, the runner."""

    def __init__(self, store: BlockStore, hasher: BlockHasher, copies: BlockCopies) -> None:
        self.store = store
        self.hasher = hasher
        self.copies = copies
        self._payload = store.payload_bytes
        self._pending: list[tuple[int, bytes]] = []  # (block, key) evicted, not yet copied

    @classmethod
    def open(
        cls,
        folder: Path,
        limit_bytes: int,
        model_dir: Path,
        hasher: BlockHasher,
        copies: BlockCopies,
    ) -> Offload:
        """The disk cache in `folder` (the identity's own folder under it, made where new)."""
        digest, described = identity(model_dir, copies.kv_layout(), hasher)
        payload = copies.kv_block_bytes()
        store = BlockStore(folder, digest, payload, limit_bytes, max(8, QUEUE_BYTES // payload))
        about = store.folder / "identity.json"
        if not about.exists():
            temporary = about.with_suffix(f".{os.getpid()}.json.part")
            temporary.write_text(json.dumps(described, indent=1, sort_keys=True))
            os.replace(temporary, about)
        log.info(
            "KV disk cache in %s: %d blocks found, at most %.2f GiB",
            store.folder,
            len(store),
            limit_bytes / 2**30,
        )
        return cls(store, hasher, copies)

    @property
    def counts(self) -> Counts:
        return self.store.counts

    # -- out ------------------------------------------------------------------------------------
    def spilled(self, block: int, block_hash: BlockHash) -> None:
        """A cached block is being evicted (kv_cache.Spill): copied at the next `flush`."""
        key = key_bytes(block_hash)
        if not self.store.known(key):
            self._pending.append((block, key))

    def flush(self) -> None:
        """Copy the evicted blocks out (one gather) and queue them for the writer: before the
        forward pass or a load writes into them."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        data = self.copies.read_blocks([block for block, _ in pending])
        size = self._payload
        for i, (_, key) in enumerate(pending):
            self.store.put(key, data[i * size : (i + 1) * size])

    def save(self, cached: Sequence[tuple[int, BlockHash]], timeout: float) -> int:
        """At shutdown (no step runs): write every cached block not on disk yet (least
        recently used first, the disk's order), waiting for the writer up to `timeout` seconds
        in all (what is left then is dropped); how many were queued."""
        deadline = time.monotonic() + timeout
        todo = [(b, key_bytes(h)) for b, h in cached]
        todo = [(b, k) for b, k in todo if not self.store.known(k)]
        size, queued = self._payload, 0
        for start in range(0, len(todo), 64):
            chunk = todo[start : start + 64]
            data = self.copies.read_blocks([b for b, _ in chunk])
            for i, (_, key) in enumerate(chunk):
                left = deadline - time.monotonic()
                queued += self.store.put_waiting(key, data[i * size : (i + 1) * size], left)
        self.store.close(max(0.0, deadline - time.monotonic()))
        return queued

    # -- in -------------------------------------------------------------------------------------
    def load(self, request: LoadedRequest, start: int, wanted: int) -> int:
        """Read the request's blocks `start` .. `wanted` that are on disk, in order, into its
        blocks (`request.blocks`, allocated); how many were read (the first missing or failing
        one ends it)."""
        keys = [key_bytes(h) for h in self.hasher.hashes(request, wanted)[start:]]
        count = 0
        while count < len(keys) and self.store.has(keys[count]):
            count += 1
        if not count:
            return 0
        self.flush()  # blocks this admission evicted may be among the request's new ones
        size = self._payload
        buffer = memoryview(bytearray(count * size))
        read = 0
        while read < count and self.store.read(keys[read], buffer[read * size : (read + 1) * size]):
            read += 1
        if read:
            self.copies.write_blocks(request.blocks[start : start + read], buffer[: read * size])
        return read
