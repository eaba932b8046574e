"""The prefix cache on disk (engine/kv_offload.py, kv_disk.py) on the real tiny fp32 model, step
by step: evicted blocks are written, read back instead of computed (the same greedy tokens as
computing them), found by a fresh runner over the same folder (a restart); a tampered, truncated
or foreign file is rejected, counted and never served; the size bound holds; another model's
blocks are in a folder of their own."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from predictor.engine.kv_cache import BlockAllocator
from predictor.engine.kv_disk import HEADER, BlockStore, key_bytes
from predictor.engine.kv_events import (
    BlockHasher,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    Recorder,
)
from predictor.engine.kv_offload import Offload
from predictor.engine.scheduler import Scheduler
from predictor.engine.step_loop import StepLoop
from predictor.types import SamplingParams
from tests.engine.conftest import Tiny, drive, make_sequence
from tests.engine.test_step_loop import NO_EOS, reference_greedy

SIZE = 4  # tokens a block
BLOCKS = 24  # the RAM cache: 96 tokens, so a second long prompt evicts the first's blocks
PROMPT = [(7 * i + 3) % 200 + 5 for i in range(41)]  # 10 full blocks before its last token
OTHER = [(11 * i + 1) % 200 + 5 for i in range(96)]  # every block of the cache: evicts all


def loop_over(tiny: Tiny, folder: Path, model_dir: Path, limit: int = 1 << 30) -> StepLoop:
    """A step loop whose cache spills to `folder` (a fresh runner: nothing in RAM)."""
    runner = tiny.runner(num_blocks=BLOCKS, block_size=SIZE)
    offload = Offload.open(folder, limit, model_dir, BlockHasher(SIZE, "sha256_cbor", "0"), runner)
    allocator = BlockAllocator(BLOCKS, SIZE, spill=offload)
    scheduler = Scheduler(4, 64, allocator, max_step_tokens=64, offload=offload)
    return StepLoop(runner, scheduler, NO_EOS)


def offload_of(loop: StepLoop) -> Offload:
    assert loop.scheduler.offload is not None
    return loop.scheduler.offload


def run(loop: StepLoop, tiny: Tiny, prompt: list[int], n: int = 6) -> tuple[list[int], int]:
    """Greedy tokens of `prompt` alone, and its prompt tokens found cached (RAM or disk)."""
    request, sink = make_sequence(tiny.tokenizer, prompt, SamplingParams(max_tokens=n))
    drive(loop, {0: [request]}, [sink])
    return sink.token_ids, request.cached_prompt_tokens


def written(loop: StepLoop, count: int) -> None:
    """Wait until the writer stored `count` blocks."""
    store = offload_of(loop).store
    deadline = time.monotonic() + 30
    while store.counts.stored < count:
        assert time.monotonic() < deadline, f"{store.counts} after 30 s"
        time.sleep(0.01)


def spilled(tiny: Tiny, folder: Path, model_dir: Path) -> tuple[StepLoop, list[int]]:
    """A loop that ran PROMPT (11 full blocks computed), then OTHER (evicting them to disk)."""
    loop = loop_over(tiny, folder, model_dir)
    tokens, _ = run(loop, tiny, PROMPT)
    run(loop, tiny, OTHER, 1)
    written(loop, 11)
    return loop, tokens


@pytest.fixture
def model_dir(tiny_dense_dir: Path) -> Path:
    return tiny_dense_dir


def test_evicted_blocks_are_read_back_instead_of_computed(
    tiny_dense: Tiny, model_dir: Path, tmp_path: Path
) -> None:
    loop, cold = spilled(tiny_dense, tmp_path, model_dir)
    assert cold == reference_greedy(tiny_dense, PROMPT, 6)
    offload = offload_of(loop)
    assert offload.store.counts.stored == 11 and offload.store.counts.dropped == 0
    again, cached = run(loop, tiny_dense, PROMPT)
    assert cached == 40  # all 10 full blocks: none in RAM any more, all from disk
    assert offload.counts.loaded == 10
    assert again == cold


def test_a_restart_finds_the_blocks(tiny_dense: Tiny, model_dir: Path, tmp_path: Path) -> None:
    first, cold = spilled(tiny_dense, tmp_path, model_dir)
    offload_of(first).store.close()
    restarted = loop_over(tiny_dense, tmp_path, model_dir)  # new pools: only the disk has them
    assert len(offload_of(restarted).store) == 11
    tokens, cached = run(restarted, tiny_dense, PROMPT)
    assert (tokens, cached) == (cold, 40)
    # a prompt that shares only the first 5 blocks finds those, then computes
    fork = PROMPT[:20] + [9] * 21
    _, cached = run(loop_over(tiny_dense, tmp_path, model_dir), tiny_dense, fork)
    assert cached == 20


def test_shutdown_saves_what_ram_holds(tiny_dense: Tiny, model_dir: Path, tmp_path: Path) -> None:
    loop = loop_over(tiny_dense, tmp_path, model_dir)
    cold, _ = run(loop, tiny_dense, PROMPT)
    offload = offload_of(loop)
    assert offload.counts.stored == 0  # nothing evicted yet
    assert offload.save(loop.scheduler.allocator.cached_blocks(), timeout=30) == 11
    assert offload.counts.stored == 11
    tokens, cached = run(loop_over(tiny_dense, tmp_path, model_dir), tiny_dense, PROMPT)
    assert (tokens, cached) == (cold, 40)


def block_files(loop: StepLoop, tiny: Tiny) -> list[Path]:
    """The block files in the order of PROMPT's blocks."""
    offload = offload_of(loop)
    request, _ = make_sequence(tiny.tokenizer, PROMPT, SamplingParams(max_tokens=1))
    keys = [key_bytes(h) for h in offload.hasher.hashes(request, 10)]
    return [offload.store.folder / f"{key.hex()}.kv" for key in keys]


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign"])
def test_a_bad_file_is_rejected_and_never_served(
    tiny_dense: Tiny, model_dir: Path, tmp_path: Path, damage: str
) -> None:
    loop, cold = spilled(tiny_dense, tmp_path, model_dir)
    offload_of(loop).store.close()
    victim = block_files(loop, tiny_dense)[4]
    data = bytearray(victim.read_bytes())
    if damage == "flip":
        data[HEADER.size + 100] ^= 0x40  # a bit of a key: only the checksum can tell
    elif damage == "truncate":
        del data[-7:]
    else:  # the header of another identity, checksum and all consistent
        data[12:44] = bytes(32)
    victim.write_bytes(bytes(data))
    restarted = loop_over(tiny_dense, tmp_path, model_dir)
    store = offload_of(restarted).store
    tokens, cached = run(restarted, tiny_dense, PROMPT)
    assert cached == 16  # blocks 0-3 from disk; block 4 rejected, so it and the rest computed
    assert store.counts.rejected == 1 and not victim.exists()
    assert tokens == cold


def test_another_model_files_apart(
    tiny_dense: Tiny, model_dir: Path, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    loop, _ = spilled(tiny_dense, tmp_path / "cache", model_dir)
    offload_of(loop).store.close()
    other = tmp_path_factory.mktemp("other-model")
    shutil.copytree(model_dir, other, dirs_exist_ok=True)
    (other / "config.json").write_text((model_dir / "config.json").read_text() + " ")
    foreign = loop_over(tiny_dense, tmp_path / "cache", other)
    store = offload_of(foreign).store
    assert store.folder != offload_of(loop).store.folder and len(store) == 0
    _, cached = run(foreign, tiny_dense, PROMPT)
    assert cached == 0
    # its files copied into this model's folder: refused by their headers
    for path in block_files(loop, tiny_dense):
        shutil.copy(path, store.folder)
    again = loop_over(tiny_dense, tmp_path / "cache", other)
    _, cached = run(again, tiny_dense, PROMPT)
    assert cached == 0 and offload_of(again).counts.rejected == 1


def test_the_size_bound_holds(tiny_dense: Tiny, model_dir: Path, tmp_path: Path) -> None:
    probe = loop_over(tiny_dense, tmp_path, model_dir)
    file_bytes = offload_of(probe).store.file_bytes
    limit = 6 * file_bytes
    loop = loop_over(tiny_dense, tmp_path, model_dir, limit)
    store = offload_of(loop).store
    for seed in range(4):  # 40 distinct blocks evicted, six kept at most
        prompt = [(13 * i + seed * 31) % 200 + 5 for i in range(41)]
        run(loop, tiny_dense, prompt, 1)
        run(loop, tiny_dense, [(5 * i + seed) % 200 + 5 for i in range(96)], 1)
        assert store.used <= limit
    store.close()
    files = list(store.folder.glob("*.kv"))
    assert len(files) == 6 and store.counts.evicted >= 20
    assert sum(p.stat().st_size for p in files) <= limit
    # a restart with a smaller bound trims what it finds, oldest first
    smaller = loop_over(tiny_dense, tmp_path, model_dir, 2 * file_bytes)
    assert len(offload_of(smaller).store) == 2
    assert len(list(store.folder.glob("*.kv"))) == 2


def test_a_full_queue_drops_instead_of_waiting(tmp_path: Path) -> None:
    store = BlockStore(tmp_path, bytes(32), 1 << 20, 1 << 30, queue_blocks=1)
    payload = bytes(1 << 20)
    started = time.perf_counter()
    accepted = sum(store.put(i.to_bytes(32, "big"), payload) for i in range(200))
    assert time.perf_counter() - started < 1.0  # 200 MiB were not written meanwhile
    store.close()
    assert store.counts.stored == accepted and store.counts.dropped == 200 - accepted
    assert store.counts.dropped > 0


def test_files_are_named_by_the_events_hashes_and_salted_apart(
    tiny_dense: Tiny, model_dir: Path, tmp_path: Path
) -> None:
    batches: list[KVEventBatch] = []
    recorder = Recorder(batches.append, SIZE, "sha256_cbor", seed="0")
    runner = tiny_dense.runner(num_blocks=BLOCKS, block_size=SIZE)
    offload = Offload.open(tmp_path, 1 << 30, model_dir, recorder.hasher, runner)
    allocator = BlockAllocator(BLOCKS, SIZE, evictions=recorder, spill=offload)
    scheduler = Scheduler(4, 64, allocator, max_step_tokens=64, events=recorder, offload=offload)
    loop = StepLoop(runner, scheduler, NO_EOS)
    salted, sink = make_sequence(tiny_dense.tokenizer, PROMPT, SamplingParams(max_tokens=6))
    salted.cache_salt = "tenant-a"
    drive(loop, {0: [salted]}, [sink])
    run(loop, tiny_dense, OTHER, 1)
    written(loop, 11)
    stored = [h for b in batches for e in b.events if isinstance(e, BlockStored)
              for h in e.block_hashes]  # fmt: skip
    removed = [h for b in batches for e in b.events if isinstance(e, BlockRemoved)
               for h in e.block_hashes]  # fmt: skip
    names = {int(p.stem[-16:], 16) for p in offload.store.folder.glob("*.kv")}
    assert len(removed) == 11 and set(removed) <= set(stored)
    assert names == set(removed)  # each evicted block's file: the hash its events carried
    # the same tokens without the salt, or with another, find none of them
    _, cached = run(loop, tiny_dense, PROMPT)
    assert cached == 0
    again, sink = make_sequence(tiny_dense.tokenizer, PROMPT, SamplingParams(max_tokens=6))
    again.cache_salt = "tenant-a"
    drive(loop, {0: [again]}, [sink])
    assert again.cached_prompt_tokens == 40
