"""The native kernels' weight layouts kept on disk, beside the autotune's choices: a restart maps
each layer's layout (int4_matmul.c's, the head's int8 copy) from a file instead of unpacking
GPTQ's words and repacking them (most of a restart's kernel set-up at 1.7B shapes).

A file is named by everything its bytes depend on: the weights as loaded (`fingerprint`: a
checksum of every 16 KB of their words, so the same checkpoint copied anew, as KServe's storage
initializer does at each pod start, finds its layouts and any other weights do not), the shape,
the kernel's layout (instruction set) and the C source. It is written whole or not at all (two
servers may start at once), mapped copy-on-write (the kernels only read it; its pages are the
page cache's, shared by every server of the model on the node), and a file of the wrong size is
not used. The folder is kept under MAX_BYTES, the least recently used files going first.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

FOLDER = "layouts"  # under --autotune-cache
MAX_BYTES = 16 << 30  # the folder's bound: a few models' 4-bit layouts
BLOCK_WORDS = 4096  # a checksum per 16 KB of words


def fingerprint(tensors: Sequence[torch.Tensor | None], *facts: object) -> str:
    """A digest of the tensors' bytes (a 64-bit sum per block of BLOCK_WORDS 32-bit words, the
    sums hashed: one read of the weights) and of `facts` (shapes, kernel, source)."""
    digest = hashlib.blake2b(repr(facts).encode(), digest_size=16)
    for tensor in tensors:
        if tensor is None:
            digest.update(b"none")
            continue
        flat = tensor.detach().contiguous().view(-1).view(torch.uint8)
        digest.update(f"{tensor.dtype} {tuple(tensor.shape)}".encode())
        whole = flat.numel() // (4 * BLOCK_WORDS) * 4 * BLOCK_WORDS
        if whole:
            words = flat[:whole].view(torch.int32).view(-1, BLOCK_WORDS)
            digest.update(words.sum(dim=1, dtype=torch.int64).numpy().tobytes())
        digest.update(flat[whole:].numpy().tobytes())
    return digest.hexdigest()


class LayoutStore:
    """Layouts by key in `folder`/layouts: `read` or None, `write` after building one."""

    def __init__(self, folder: Path, max_bytes: int = MAX_BYTES) -> None:
        self.folder = folder / FOLDER
        self.max_bytes = max_bytes
        self.read_bytes = self.written_bytes = 0  # for the start's log

    def _path(self, key: str) -> Path:
        return self.folder / f"{key}.bin"

    def read(self, key: str, size: int) -> torch.Tensor | None:
        """The layout of `size` bytes stored under `key`, mapped (uint8), or None."""
        path = self._path(key)
        try:
            if path.stat().st_size != size:
                return None
            mapped = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)
            os.utime(path)  # recently used: the last to be pruned
        except (OSError, RuntimeError):
            return None
        self.read_bytes += size
        return mapped

    def write(self, key: str, layout: torch.Tensor) -> None:
        """`layout` kept under `key` (a failure to write is logged, never raised)."""
        path = self._path(key)
        data = layout.contiguous().view(torch.uint8).numpy()
        temporary: Path | None = None
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.folder, delete=False, suffix=".tmp") as f:
                temporary = Path(f.name)
                f.write(data.data)
            os.replace(temporary, path)  # whole or not at all
        except OSError as error:
            logger.warning("layout %s not kept on disk: %s", path, error)
            if temporary is not None:
                temporary.unlink(missing_ok=True)
            return
        self.written_bytes += data.nbytes
        self._prune()

    def _prune(self) -> None:
        """The least recently used files go while the folder is past its bound."""
        try:
            files = [(p.stat().st_mtime, p.stat().st_size, p) for p in self.folder.glob("*.bin")]
        except OSError:
            return
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files):
            if total <= self.max_bytes:
                break
            path.unlink(missing_ok=True)
            total -= size
