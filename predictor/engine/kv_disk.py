"""KV-cache blocks on disk: one file per block, checksummed, under one model identity's folder,
least recently used removed first past a size bound (the disk cache's store; kv_offload.py
decides what goes in and comes out).

One file per block rather than an append log: a block is written whole or not at all (a
temporary file renamed), removing the least recently used is one unlink (a log would need
compaction), a damaged file loses one block, and the index is rebuilt at start from one
listing of the folder, by name, size and modification time, without reading a file.

A file: HEADER (magic, format, the identity's digest, the block's hash, the payload's length,
its CRC-32) then the payload, the block's keys and values as the cache holds them. Every read
checks all of it; a file that fails (corrupt, truncated, written for another identity or under
another name) is counted as rejected, removed and never served. CRC-32 finds damage (2.6 GB/s
here against SHA-256's 0.9 GB/s); it is no defence against someone who may write the folder,
who could as well write the model's.

Thread-safety: the step loop's thread reads and queues; one writer thread of its own writes,
and removes past the bound. The index is shared under a lock. A write never waits: past
`queue_blocks` queued the block is dropped and counted.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import struct
import threading
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

MAGIC = b"GPKVBLK1"
FORMAT = 1
# magic, format, identity digest (32 bytes), block key (32 bytes), payload bytes, CRC-32
HEADER = struct.Struct("<8sI32s32sQI")
SUFFIX = ".kv"


@dataclass
class Counts:
    """What the store did since it started: blocks written, read back, dropped (the writer's
    queue was full), rejected (a file failed its checks) and removed past the size bound."""

    stored: int = 0
    loaded: int = 0
    dropped: int = 0
    rejected: int = 0
    evicted: int = 0


def key_bytes(block_hash: bytes | int) -> bytes:
    """A block hash as 32 bytes: a digest as it is (right-aligned), an integer's two's
    complement (the builtin algorithm's)."""
    if isinstance(block_hash, int):
        return (block_hash & ((1 << 256) - 1)).to_bytes(32, "big")
    return block_hash[-32:].rjust(32, b"\0")


class BlockStore:
    """The blocks of one identity in `root / identity[:16]`, at most `limit` bytes of files."""

    def __init__(
        self, root: Path, identity: bytes, payload_bytes: int, limit: int, queue_blocks: int = 256
    ) -> None:
        self.folder = root / identity.hex()[:16]
        self.identity = identity
        self.payload_bytes = payload_bytes
        self.file_bytes = HEADER.size + payload_bytes
        self.limit = limit
        self.counts = Counts()
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, None] = OrderedDict()  # keys on disk, oldest first
        self._queued: set[bytes] = set()  # keys waiting for the writer
        # (key, payload) to write; None: stop
        self._queue: queue.Queue[tuple[bytes, bytes | memoryview] | None]
        self._queue = queue.Queue(queue_blocks)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._rebuild()
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
        self._writer.start()

    @property
    def used(self) -> int:
        """Bytes of block files on disk now."""
        return len(self._index) * self.file_bytes

    def __len__(self) -> int:
        return len(self._index)

    def _path(self, key: bytes) -> Path:
        return self.folder / (key.hex() + SUFFIX)

    def _rebuild(self) -> None:
        """The index from the folder: files of the right size, oldest modified first; a
        leftover temporary file or a file of another size is removed (rejected)."""
        found: list[tuple[int, bytes]] = []
        with os.scandir(self.folder) as entries:
            for entry in entries:
                name = entry.name
                if not name.endswith(SUFFIX):
                    if name.endswith(".tmp"):
                        self._remove(Path(entry.path))
                    continue
                try:
                    key = bytes.fromhex(name[: -len(SUFFIX)])
                    stat = entry.stat()
                except (ValueError, OSError):
                    continue
                if len(key) != 32 or stat.st_size != self.file_bytes:
                    self.counts.rejected += 1
                    self._remove(Path(entry.path))
                    continue
                found.append((stat.st_mtime_ns, key))
        for _, key in sorted(found):
            self._index[key] = None
        self._trim()
        if found:
            log.info(
                "KV disk cache: %d blocks (%.1f MiB) found in %s",
                len(self._index),
                self.used / 2**20,
                self.folder,
            )

    # -- the step loop's side ---------------------------------------------------------------
    def has(self, key: bytes) -> bool:
        return key in self._index

    def known(self, key: bytes) -> bool:
        """On disk or queued to be."""
        with self._lock:
            return key in self._index or key in self._queued

    def put(self, key: bytes, payload: bytes | memoryview) -> bool:
        """Queue a block to be written; False (counted as dropped) where the queue is full."""
        with self._lock:
            if key in self._queued:
                return True
            try:
                self._queue.put_nowait((key, payload))
            except queue.Full:
                self.counts.dropped += 1
                return False
            self._queued.add(key)
        return True

    def put_waiting(self, key: bytes, payload: bytes | memoryview, timeout: float) -> bool:
        """`put` that waits up to `timeout` seconds for room (at shutdown, no step waits)."""
        with self._lock:
            if key in self._queued or key in self._index:
                return True
            self._queued.add(key)
        try:
            self._queue.put((key, payload), timeout=max(timeout, 0.001))
        except queue.Full:
            with self._lock:
                self._queued.discard(key)
                self.counts.dropped += 1
            return False
        return True

    def read(self, key: bytes, into: memoryview) -> bool:
        """The block's payload into `into` (payload_bytes long) where its file passes every
        check; else False (a file that fails is rejected: counted, removed)."""
        path = self._path(key)
        try:
            with open(path, "rb") as file:
                header = file.read(HEADER.size)
                got = file.readinto(into) if len(header) == HEADER.size else 0
                extra = file.read(1)
        except FileNotFoundError:  # removed past the bound meanwhile
            with self._lock:
                self._index.pop(key, None)
            return False
        except OSError as error:
            log.warning("KV disk cache: %s unreadable: %s", path, error)
            return self._reject(key, path)
        if len(header) != HEADER.size or got != self.payload_bytes or extra:
            return self._reject(key, path)
        magic, fmt, identity, stored_key, length, crc = HEADER.unpack(header)
        if (magic, fmt, identity, stored_key, length) != (
            MAGIC,
            FORMAT,
            self.identity,
            key,
            self.payload_bytes,
        ) or zlib.crc32(into) != crc:
            return self._reject(key, path)
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
            self.counts.loaded += 1
        with contextlib.suppress(OSError):  # recently used, for the next start's order
            os.utime(path)
        return True

    def _reject(self, key: bytes, path: Path) -> bool:
        log.warning(
            "KV disk cache: %s failed its checks (corrupt, truncated or another "
            "model's): ignored and removed",
            path.name,
        )
        with self._lock:
            self._index.pop(key, None)
            self.counts.rejected += 1
        self._remove(path)
        return False

    # -- the writer's side --------------------------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            key, payload = item
            try:
                self._write(key, payload)
            except OSError as error:
                log.warning("KV disk cache: writing a block failed: %s", error)
                with self._lock:
                    self.counts.dropped += 1
            finally:
                with self._lock:
                    self._queued.discard(key)

    def _write(self, key: bytes, payload: bytes | memoryview) -> None:
        if self.file_bytes > self.limit:
            raise OSError(f"a block ({self.file_bytes} bytes) is larger than the size bound")
        header = HEADER.pack(MAGIC, FORMAT, self.identity, key, len(payload), zlib.crc32(payload))
        path = self._path(key)
        temporary = path.with_name(f"{path.name}.{threading.get_ident()}.tmp")
        with open(temporary, "wb") as file:
            file.write(header)
            file.write(payload)
        os.replace(temporary, path)
        with self._lock:
            self._index[key] = None
            self._index.move_to_end(key)
            self.counts.stored += 1
        self._trim()

    def _trim(self) -> None:
        """Remove the least recently used files while the folder is past its bound."""
        while True:
            with self._lock:
                if self.used <= self.limit or not self._index:
                    return
                key, _ = self._index.popitem(last=False)
                self.counts.evicted += 1
            self._remove(self._path(key))

    @staticmethod
    def _remove(path: Path) -> None:
        with contextlib.suppress(OSError):
            path.unlink()

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued (up to `timeout` seconds in all), then stop the writer; a
        write cut short leaves a temporary file the next start removes."""
        deadline = time.monotonic() + timeout
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=max(0.0, timeout))
        self._writer.join(max(0.0, deadline - time.monotonic()))
