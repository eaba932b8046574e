"""KV events' hashes and events in the engine (engine/kv_events.py, kv_cache.py, scheduler.py):
vLLM's chained block hashes against an implementation written here from RFC 8949 and vLLM's
`hash_block_tokens`, and against vLLM's own figures; the events of a step loop's cache stores,
evictions and reset; the publisher's queue that never blocks."""

from __future__ import annotations

import hashlib
import pickle
import struct
from typing import Any

import msgpack
import pytest

from predictor.engine.kv_cache import BlockAllocator
from predictor.engine.kv_events import (
    BlockHash,
    KVEventBatch,
    Recorder,
    cbor,
    chain_hashes,
    external,
    hash_function,
    none_hash,
)
from predictor.engine.kv_publisher import ZmqPublisher, binds
from predictor.engine.runners.null import NullRunner
from predictor.engine.scheduler import Scheduler
from predictor.engine.step_loop import StepLoop
from predictor.types import SamplingParams
from tests.engine.conftest import make_sequence


# -- an independent sha256_cbor chain: RFC 8949's encoding of what vLLM hashes ----------------
def rfc_cbor(item: Any) -> bytes:
    """Canonical CBOR, written from the RFC's table of initial bytes (not from ours)."""

    def head(major: int, n: int) -> bytes:
        if n <= 23:
            return struct.pack(">B", (major << 5) + n)
        for info, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
            if n < 256 ** struct.calcsize(fmt):
                return struct.pack(">B", (major << 5) + info) + struct.pack(fmt, n)
        raise OverflowError(n)

    if item is None:
        return bytes([0xF6])
    if isinstance(item, int):
        return head(0, item) if item >= 0 else head(1, ~item)
    if isinstance(item, bytes):
        return head(2, len(item)) + item
    if isinstance(item, str):
        return head(3, len(item.encode())) + item.encode()
    return head(4, len(item)) + b"".join(rfc_cbor(x) for x in item)


def vllm_chain(tokens: list[int], size: int, seed: str, extras: list[Any]) -> list[bytes]:
    """vLLM's request block hasher: parent_0 = sha256(cbor(PYTHONHASHSEED)), then
    sha256(cbor((parent, tuple(block tokens), extra keys))) per full block."""
    parent = hashlib.sha256(rfc_cbor(seed)).digest()
    out = []
    for i in range(len(tokens) // size):
        parent = hashlib.sha256(rfc_cbor((parent, tuple(tokens[i * size:(i + 1) * size]),
                                          extras[i]))).digest()  # fmt: skip
        out.append(parent)
    return out


# vLLM's own events (llm-d-kv-cache-manager, tests/integration/testdata/kv_event_base.json and
# kv_event_lora.json: Qwen3-0.6B's tokens of one prompt, block size 16, PYTHONHASHSEED=42,
# --prefix-caching-hash-algo sha256_cbor): the first 3 blocks' tokens and BlockStored hashes
VLLM_TOKENS = [
    2082, 1113, 2142, 374, 264, 4948, 19128, 323, 7203, 429, 374, 66351, 938, 315, 11198, 323,
    59415, 678, 90505, 11, 54263, 533, 7586, 315, 28922, 13, 1527, 1113, 2142, 6738, 369, 279,
    75345, 315, 279, 1584, 11, 892, 432, 9982, 311, 387, 25165, 11, 76244, 11, 323, 27756,
]  # fmt: skip
VLLM_HASHES = [17705339885301241772, 13360521540053240825, 1652464311825922890]
VLLM_LORA_HASHES = [9643097150530800701, 11170191873018355659, 6527130464540768062]  # "Alice"


def test_the_cbor_is_canonical_cbor() -> None:
    cases: list[Any] = [None, 0, 23, 24, 255, 256, 65535, 65536, 2**32, 2**64 - 1, -1, -25,
                        "", "é", b"", b"\x00" * 32, (), (1, [2, "x"]), ("a" * 300,),
                        (0, 23, 24, 255, 256, 65535, 65536, 2**32, 2**64 - 1), (5, -5)]  # fmt: skip
    for case in cases:
        assert cbor(case) == rfc_cbor(case), case
    assert cbor(True) == b"\xf5" and cbor(False) == b"\xf4" and cbor((True, 1)) == b"\x82\xf5\x01"
    with pytest.raises(ValueError):
        cbor(2**64)


def test_sha256_cbor_hashes_are_vllms() -> None:
    sha = hash_function("sha256_cbor")
    root = none_hash(sha, "42")
    ours = chain_hashes(sha, root, VLLM_TOKENS, 16)
    assert [external(h) for h in ours] == VLLM_HASHES
    assert ours == vllm_chain(VLLM_TOKENS, 16, "42", [None] * 3)
    lora = chain_hashes(sha, root, VLLM_TOKENS, 16, lora_name="Alice")
    assert [external(h) for h in lora] == VLLM_LORA_HASHES
    # a cache salt is an extra key of the first block only; the chain carries it on
    salted = chain_hashes(sha, root, VLLM_TOKENS, 16, lora_name="Alice", cache_salt="s")
    assert salted == vllm_chain(VLLM_TOKENS, 16, "42", [("Alice", "s"), ("Alice",), ("Alice",)])
    assert salted[0] != lora[0]
    # a chain continued from its middle is the same chain
    tail = chain_hashes(sha, root, VLLM_TOKENS[16:], 16, "Alice", "s", salted[0], first_block=1)
    assert tail == salted[1:]
    # partial blocks are not hashed; another block size is another chain
    assert len(chain_hashes(sha, root, VLLM_TOKENS[:40], 16)) == 2
    assert chain_hashes(sha, root, VLLM_TOKENS, 8)[1] != ours[0]


def test_sha256_is_over_the_pickle_and_builtin_is_hash() -> None:
    sha = hash_function("sha256")
    root = none_hash(sha, "7")
    assert root == hashlib.sha256(pickle.dumps("7", protocol=pickle.HIGHEST_PROTOCOL)).digest()
    first = chain_hashes(sha, root, VLLM_TOKENS, 16)[0]
    block = (root, tuple(VLLM_TOKENS[:16]), None)
    assert first == hashlib.sha256(pickle.dumps(block, protocol=5)).digest()
    builtin = hash_function("builtin")
    assert chain_hashes(builtin, 5, VLLM_TOKENS, 16)[0] == hash((5, tuple(VLLM_TOKENS[:16]), None))
    assert external(-1) == 2**64 - 1


def test_without_pythonhashseed_the_root_is_random() -> None:
    sha = hash_function("sha256_cbor")
    assert none_hash(sha, None) != none_hash(sha, None)
    assert none_hash(sha, "42") == none_hash(sha, "42")


# -- the events of a step loop ------------------------------------------------------------------
class Silent:
    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        return ""


def loop_with_events(
    num_blocks: int, block_size: int = 4, algo: str = "sha256_cbor"
) -> tuple[StepLoop, list[KVEventBatch]]:
    batches: list[KVEventBatch] = []
    recorder = Recorder(batches.append, block_size, algo, seed="0", clock=lambda: 1.5)
    allocator = BlockAllocator(num_blocks, block_size, evictions=recorder)
    runner = NullRunner(100, num_blocks, block_size)
    scheduler = Scheduler(4, 16, allocator, max_step_tokens=64, speculation=None, events=recorder)
    return StepLoop(runner, scheduler, frozenset()), batches


def run(loop: StepLoop, prompt: list[int], max_tokens: int = 2, **fields: Any) -> Any:
    request = make_sequence(Silent(), prompt, SamplingParams(max_tokens=max_tokens))[0]
    for name, value in fields.items():
        setattr(request, name, value)
    loop.scheduler.add(request)
    while request.finish_reason is None:
        loop.step()
        loop.scheduler.allocator.audit(r.blocks for r in loop.scheduler.running)
    return request


def events(batches: list[KVEventBatch]) -> list[Any]:
    return [event for batch in batches for event in batch.events]


def expected(prompt: list[int], size: int, **kwargs: Any) -> list[int]:
    sha = hash_function("sha256_cbor")
    return [external(h) for h in chain_hashes(sha, none_hash(sha, "0"), prompt, size, **kwargs)]


def test_stored_blocks_chain_and_a_shared_prefix_is_stored_once() -> None:
    loop, batches = loop_with_events(64)
    shared = list(range(1, 13))  # 3 blocks of 4
    run(loop, [*shared, 50, 51, 52, 53, 54])  # 17 tokens + 2 generated: 4 full blocks
    stored = events(batches)
    assert all(e.__class__.__name__ == "BlockStored" for e in stored)
    hashes = [h for e in stored for h in e.block_hashes]
    assert hashes[:4] == expected([*shared, 50, 51, 52, 53], 4)
    assert stored[0].parent_block_hash is None and stored[0].medium == "GPU"
    for before, after in zip(stored, stored[1:], strict=False):  # each continues the chain
        assert after.parent_block_hash == before.block_hashes[-1]
    assert [t for e in stored for t in e.token_ids][:16] == [*shared, 50, 51, 52, 53]
    assert all(e.block_size == 4 and e.lora_name is None and e.lora_id is None for e in stored)
    assert all(b.ts == 1.5 and b.data_parallel_rank == 0 for b in batches)

    batches.clear()
    run(loop, [*shared, 60, 61, 62, 63, 64])  # the 3 shared blocks are hits: not stored again
    again = events(batches)
    assert again[0].parent_block_hash == hashes[2]
    assert again[0].block_hashes[0] == expected([*shared, 60, 61, 62, 63], 4)[3]


def test_an_adapters_blocks_carry_its_name_and_a_salt_changes_the_hashes() -> None:
    loop, batches = loop_with_events(64)
    prompt = list(range(1, 10))
    run(loop, prompt, 1, adapter=3, lora_name="sql")
    run(loop, prompt, 1, cache_salt="tenant")
    lora, salted = events(batches)
    assert (lora.lora_name, lora.lora_id) == ("sql", 3)
    assert lora.block_hashes == expected(prompt, 4, lora_name="sql")
    assert salted.block_hashes == expected(prompt, 4, cache_salt="tenant")
    assert salted.lora_name is None and salted.block_hashes != lora.block_hashes


def test_evictions_are_block_removed_and_a_reset_all_blocks_cleared() -> None:
    loop, batches = loop_with_events(6)  # 6 blocks of 4 tokens
    first = run(loop, list(range(1, 17)), 1)  # 4 blocks stored (the prompt's)
    stored = [h for e in events(batches) for h in e.block_hashes]
    batches.clear()
    run(loop, list(range(100, 116)), 1)  # needs 5 blocks: 3 of the first's evicted, LRU
    removed = [e for e in events(batches) if e.__class__.__name__ == "BlockRemoved"]
    assert removed and all(len(e.block_hashes) == 1 and e.medium == "GPU" for e in removed)
    assert {e.block_hashes[0] for e in removed} <= set(stored)
    assert first.event_hashes  # computed once, kept with the request
    batches.clear()
    assert loop.reset_prefix_cache()
    assert [e.wire() for e in events(batches)] == [["AllBlocksCleared"]]
    assert loop.scheduler.allocator.cached == 0


def test_a_reset_is_refused_while_a_row_holds_blocks() -> None:
    loop, batches = loop_with_events(16)
    request = make_sequence(Silent(), list(range(1, 9)), SamplingParams(max_tokens=50))[0]
    loop.scheduler.add(request)
    loop.step()
    batches.clear()
    assert not loop.reset_prefix_cache()
    assert events(batches) == [] and loop.scheduler.allocator.cached > 0


def test_without_events_nothing_is_hashed() -> None:
    allocator = BlockAllocator(16, 4)
    loop = StepLoop(NullRunner(100, 16, 4), Scheduler(4, 16, allocator, 64), frozenset())
    request = run(loop, list(range(1, 13)), 2)
    assert request.event_hashes == [] and allocator.cached == 3
    assert loop.reset_prefix_cache() and allocator.cached == 0


def test_the_wire_form_is_vllms_array_like_tagged_structs() -> None:
    loop, batches = loop_with_events(8)
    run(loop, list(range(1, 9)), 1, adapter=2, lora_name="a")
    payload = msgpack.unpackb(msgpack.packb(batches[0].wire()))
    ts, (event,), rank = payload
    assert ts == 1.5 and rank == 0
    tag, hashes, parent, tokens, size, lora_id, medium, lora_name = event
    assert (tag, parent, tokens, size, lora_id, medium, lora_name) == (
        "BlockStored",
        None,
        list(range(1, 9)),
        4,
        2,
        "GPU",
        "a",
    )
    assert hashes == expected(list(range(1, 9)), 4, lora_name="a")


# -- the publisher ------------------------------------------------------------------------------
def test_a_full_queue_drops_and_counts_never_waits() -> None:
    dropped: list[int] = []
    publisher = ZmqPublisher(max_queue_size=2, on_drop=lambda: dropped.append(1))
    batch = KVEventBatch(0.0, [])
    for _ in range(5):  # no thread drains it (not started)
        publisher.publish(batch)
    assert len(dropped) == 3


def test_endpoints_bind_or_connect_as_vllms() -> None:
    assert binds("tcp://*:5557") and binds("ipc:///tmp/x") and binds("tcp://[::]:1")
    assert not binds("tcp://indexer:5557")


def test_hashes_are_bytes_or_ints() -> None:
    value: BlockHash = b"\x00" * 24 + (7).to_bytes(8, "big")
    assert external(value) == 7
