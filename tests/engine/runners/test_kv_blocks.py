"""Whole KV blocks out of and into the runner's pools (engine/runners/kv_blocks.py): a block's
payload is its keys and values of every layer, [layers, 2 * kv_heads, block_size, head_dim],
whatever runs of adjacent blocks the call's blocks form."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from predictor.engine.runners import kv_blocks

SIZE = 4


def pools(layers: int = 3, heads: int = 4, blocks: int = 16) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [
        torch.randn((heads, blocks * SIZE + 1, 8), generator=generator).to(torch.bfloat16)
        for _ in range(layers)
    ]


def test_a_payload_is_the_blocks_keys_and_values_layer_by_layer() -> None:
    cache = pools()
    blocks = [5, 6, 7, 2, 9, 10, 0]  # three runs, one of one block, one out of order
    data = kv_blocks.read_blocks(cache, blocks, SIZE)
    assert len(data) == len(blocks) * kv_blocks.block_bytes(cache, SIZE)
    payloads = torch.frombuffer(bytearray(data), dtype=torch.bfloat16).view(7, 3, 4, SIZE, 8)
    for i, block in enumerate(blocks):
        for layer, pool in enumerate(cache):
            assert torch.equal(payloads[i, layer], pool[:, block * SIZE : (block + 1) * SIZE])


def test_written_blocks_read_back_the_same_and_nothing_else_changes() -> None:
    cache = pools()
    data = kv_blocks.read_blocks(cache, [5, 6, 7, 2, 9, 10, 0], SIZE)
    before = [pool.clone() for pool in cache]
    targets = [12, 3, 4, 13, 14, 15, 1]
    kv_blocks.write_blocks(cache, targets, SIZE, memoryview(bytearray(data)))
    assert bytes(kv_blocks.read_blocks(cache, targets, SIZE)) == bytes(data)
    untouched = [b for b in range(16) if b not in targets]
    for pool, old in zip(cache, before, strict=True):
        for block in untouched:
            span = slice(block * SIZE, (block + 1) * SIZE)
            assert torch.equal(pool[:, span], old[:, span])
        assert torch.equal(pool[:, -1], old[:, -1])  # the padding slot


def test_the_code_digest_changes_with_a_source(tmp_path: Path) -> None:
    here = Path(kv_blocks.__file__).parent
    (tmp_path / "native").mkdir()
    for path in (here / "native").glob("*.[ch]"):
        shutil.copy(path, tmp_path / "native")
    shutil.copy(here / "cpu.py", tmp_path)
    digest = kv_blocks.code_digest(tmp_path)
    assert digest == kv_blocks.code_digest(tmp_path) and len(digest) == 24
    (tmp_path / "notes.txt").write_text("not a source")
    assert kv_blocks.code_digest(tmp_path) == digest
    with open(tmp_path / "cpu.py", "a") as file:
        file.write("# one more line\n")
    changed = kv_blocks.code_digest(tmp_path)
    assert changed != digest
    with open(tmp_path / "native" / "layer_ops.c", "a") as file:  # a room's source counts too
        file.write("/* one more line */\n")
    assert kv_blocks.code_digest(tmp_path) != changed
