"""The runner's KV pools and whole KV blocks out of and into them (engine/runners/kv_pools.py): a block's
payload is its keys and values of every layer, [layers, 2 * kv_heads, block_size, head_dim],
whatever runs of adjacent blocks the call's blocks form."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from predictor.engine.runners import kv_pools

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
    data = kv_pools.read_blocks(cache, blocks, SIZE)
    assert len(data) == len(blocks) * kv_pools.block_bytes(cache, SIZE)
    payloads = torch.frombuffer(bytearray(data), dtype=torch.bfloat16).view(7, 3, 4, SIZE, 8)
    for i, block in enumerate(blocks):
        for layer, pool in enumerate(cache):
            assert torch.equal(payloads[i, layer], pool[:, block * SIZE : (block + 1) * SIZE])


def test_written_blocks_read_back_the_same_and_nothing_else_changes() -> None:
    cache = pools()
    data = kv_pools.read_blocks(cache, [5, 6, 7, 2, 9, 10, 0], SIZE)
    before = [pool.clone() for pool in cache]
    targets = [12, 3, 4, 13, 14, 15, 1]
    kv_pools.write_blocks(cache, targets, SIZE, memoryview(bytearray(data)))
    assert bytes(kv_pools.read_blocks(cache, targets, SIZE)) == bytes(data)
    untouched = [b for b in range(16) if b not in targets]
    for pool, old in zip(cache, before, strict=True):
        for block in untouched:
            span = slice(block * SIZE, (block + 1) * SIZE)
            assert torch.equal(pool[:, span], old[:, span])
        assert torch.equal(pool[:, -1], old[:, -1])  # the padding slot


def test_the_code_digest_changes_with_a_source(tmp_path: Path) -> None:
    here = Path(kv_pools.__file__).parent
    (tmp_path / "native").mkdir()
    for path in (here / "native").glob("*.[ch]"):
        shutil.copy(path, tmp_path / "native")
    shutil.copy(here / "cpu.py", tmp_path)
    digest = kv_pools.code_digest(tmp_path)
    assert digest == kv_pools.code_digest(tmp_path) and len(digest) == 24
    (tmp_path / "notes.txt").write_text("not a source")
    assert kv_pools.code_digest(tmp_path) == digest
    with open(tmp_path / "cpu.py", "a") as file:
        file.write("# one more line\n")
    changed = kv_pools.code_digest(tmp_path)
    assert changed != digest
    with open(tmp_path / "native" / "layer_ops.c", "a") as file:  # a room's source counts too
        file.write("/* one more line */\n")
    assert kv_pools.code_digest(tmp_path) != changed


def test_the_pools_pad_slot_is_zero_and_blocks_round_trip() -> None:
    cache = kv_pools.KVPools(2, 2, 8, 6, SIZE, torch.bfloat16, torch.device("cpu"))
    assert cache.pad_slot == 6 * SIZE and len(cache.layers) == 2
    assert all(bool((pool[:, cache.pad_slot] == 0).all()) for pool in cache.layers)
    generator = torch.Generator().manual_seed(2)
    for pool in cache.layers:
        pool[:, : cache.pad_slot] = torch.randn(
            pool[:, : cache.pad_slot].shape, generator=generator
        )
    data = cache.read([4, 1])
    assert len(data) == 2 * cache.block_bytes() == 2 * (2 * 4 * SIZE * 8 * 2)
    cache.write([0, 5], memoryview(bytearray(data)))
    assert bytes(cache.read([0, 5])) == bytes(data)
    layout = cache.layout()
    assert (
        layout["layers"] == 2
        and layout["kv_heads"] == 2
        and layout["code"] == kv_pools.code_digest()
    )
    cache.free()
    assert cache.layers == []
