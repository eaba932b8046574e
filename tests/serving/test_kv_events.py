"""KV-cache events through the real server (--kv-events-config, vLLM's): a ZeroMQ subscriber
decodes what it publishes with msgpack and checks the block hashes against vLLM's chained
sha256_cbor computed here (tests/engine/test_kv_events.py: vllm_chain), a LoRA request's
adapter name, evictions, a reset, the replay socket; a server without the flag opens no
socket of its own; a malformed config stops the start before the model loads."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest
import zmq

from load.local_server import free_port
from load.random_lora import write_adapter
from tests.engine.test_kv_events import vllm_chain
from tests.support import ServerProcess, run_predictor

SEED = "42"  # the server's PYTHONHASHSEED: vLLM's NONE_HASH seed, shared with the router
SIZE = 16  # --kv-block-size (the default)
TOPIC = "kv@10.0.0.7:8000@tiny"  # llm-d's kv@<pod-ip>:<port>@<model>


class Events:
    """A subscriber's frames: (topic, sequence number, decoded batch)."""

    def __init__(self, sub: zmq.Socket[bytes]) -> None:
        self.sub = sub
        self.frames: list[tuple[bytes, int, list[Any]]] = []
        self.seen = 0  # events already handed out by `until`

    def until(self, done: Callable[[list[list[Any]]], bool], timeout: float = 30.0) -> list[Any]:
        """Receive until `done(new events)`; the new events (tagged lists, vLLM's)."""
        deadline = time.monotonic() + timeout
        while True:
            new = [e for _, _, batch in self.frames for e in batch[1]][self.seen :]
            if done(new):
                self.seen += len(new)
                return new
            left = deadline - time.monotonic()
            assert left > 0, f"no such events came; got {new}"
            if self.sub.poll(int(left * 1000)):
                topic, seq, payload = self.sub.recv_multipart()
                assert len(seq) == 8
                self.frames.append((topic, int.from_bytes(seq, "big"), msgpack.unpackb(payload)))


def stored(events: list[list[Any]]) -> list[list[Any]]:
    return [e for e in events if e[0] == "BlockStored"]


def hashes(events: list[list[Any]]) -> list[int]:
    return [h for e in stored(events) for h in e[1]]


def vllm_hashes(tokens: list[int], lora: str | None = None) -> list[int]:
    extras = [None if lora is None else (lora,)] * (len(tokens) // SIZE)
    return [int.from_bytes(h[-8:], "big") for h in vllm_chain(tokens, SIZE, SEED, extras)]


def complete(server: ServerProcess, prompt: list[int], model: str = "tiny") -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": 1}
    r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text


def tokens(start: int, count: int) -> list[int]:
    return list(range(start, start + count))


@pytest.fixture(scope="module")
def published(
    tiny_gptq_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServerProcess, int, int]]:
    adapter = write_adapter(tmp_path_factory.mktemp("lora") / "sql", tiny_gptq_dir, 8, 1)
    port, replay = free_port(), free_port()
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}",
              "replay_endpoint": f"tcp://127.0.0.1:{replay}", "topic": TOPIC}  # fmt: skip
    extra = ["--kv-events-config", json.dumps(config), "--prefix-caching-hash-algo",
             "sha256_cbor", "--max-cache-tokens", "512", "--lora-modules", f"tiny-sql={adapter}",
             "--speculative", "off"]  # fmt: skip
    before = os.environ.get("PYTHONHASHSEED")
    os.environ["PYTHONHASHSEED"] = SEED  # the server's environment is this process's
    try:
        with ServerProcess.start(tiny_gptq_dir, "tiny", extra=extra) as proc:
            yield proc, port, replay
    finally:
        if before is None:
            del os.environ["PYTHONHASHSEED"]
        else:
            os.environ["PYTHONHASHSEED"] = before


@pytest.fixture(scope="module")
def events(published: tuple[ServerProcess, int, int]) -> Iterator[Events]:
    context = zmq.Context.instance()
    sub = context.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{published[1]}")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")  # llm-d's filter
    time.sleep(0.5)  # a subscription reaches the publisher after the connect
    yield Events(sub)
    sub.close(linger=0)


def test_stored_blocks_carry_vllms_hashes_chained(
    published: tuple[ServerProcess, int, int], events: Events
) -> None:
    server = published[0]
    prompt = tokens(1000, 4 * SIZE)
    complete(server, prompt)
    first = events.until(lambda new: len(hashes(new)) >= 4)
    assert hashes(first) == vllm_hashes(prompt)
    assert stored(first)[0][2] is None  # the first block: no parent
    assert all(e[4] == SIZE and e[5] is None and e[6] == "GPU" and e[7] is None
               for e in stored(first))  # fmt: skip
    assert [t for e in stored(first) for t in e[3]] == prompt
    topic, seq, batch = events.frames[0]
    assert topic == TOPIC.encode() and batch[2] == 0 and isinstance(batch[0], float)
    assert [f[1] for f in events.frames] == list(range(seq, seq + len(events.frames)))

    # 3 blocks shared: only the new block is stored, its parent the third's hash
    prompt2 = prompt[: 3 * SIZE] + tokens(5000, SIZE + 3)
    complete(server, prompt2)
    second = stored(events.until(lambda new: len(hashes(new)) >= 1))
    assert second[0][2] == vllm_hashes(prompt)[2]
    assert hashes(second) == vllm_hashes(prompt2)[3:4] and second[0][3] == prompt2[48:64]


def test_an_adapters_blocks_carry_its_name(
    published: tuple[ServerProcess, int, int], events: Events
) -> None:
    prompt = tokens(2000, 2 * SIZE)
    complete(published[0], prompt, model="tiny-sql")
    new = stored(events.until(lambda new: len(hashes(new)) >= 2))
    assert hashes(new) == vllm_hashes(prompt, lora="tiny-sql")
    assert all(e[7] == "tiny-sql" and isinstance(e[5], int) for e in new)


def test_evictions_are_block_removed(
    published: tuple[ServerProcess, int, int], events: Events
) -> None:
    """512 tokens of cache (32 blocks): prompts of 7 blocks evict the oldest cached ones."""
    known = set(hashes([e for _, _, b in events.frames for e in b[1]]))
    for i in range(6):
        prompt = tokens(10_000 + 1000 * i, 7 * SIZE)
        complete(published[0], prompt)
    new = events.until(lambda new: any(e[0] == "BlockRemoved" for e in new) and
                       len(hashes(new)) >= 42)  # fmt: skip
    known |= set(hashes(new))
    removed = [e for e in new if e[0] == "BlockRemoved"]
    assert all(len(e[1]) == 1 and e[2] == "GPU" for e in removed)
    assert {e[1][0] for e in removed} <= known  # only what was stored is removed


def test_a_reset_is_all_blocks_cleared_and_replay_resends(
    published: tuple[ServerProcess, int, int], events: Events
) -> None:
    server, _, replay_port = published
    r = httpx.post(f"{server.base_url}/reset_prefix_cache", timeout=30)
    assert r.status_code == 200, r.text
    assert events.until(lambda new: bool(new)) == [["AllBlocksCleared"]]

    # replay (vLLM's ROUTER): every kept batch from a sequence number on, then -1
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{replay_port}")
    first = events.frames[0][1]
    dealer.send_multipart([b"", first.to_bytes(8, "big")])
    replayed: dict[int, bytes] = {}
    while True:
        assert dealer.poll(10_000), "the replay did not answer"
        empty, seq, payload = dealer.recv_multipart()
        assert empty == b""
        if seq == (-1).to_bytes(8, "big", signed=True):
            assert payload == b""
            break
        replayed[int.from_bytes(seq, "big")] = payload
    dealer.close(linger=0)
    assert sorted(replayed) == list(range(first, first + len(replayed)))
    for _, seq, batch in events.frames:
        assert msgpack.unpackb(replayed[seq]) == batch
    metrics = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    assert "predictor_kv_events_dropped_total 0.0" in metrics


def listening_ports(pid: int) -> set[int]:
    """The TCP ports a process listens on (its socket inodes in /proc/net/tcp{,6})."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


def test_without_the_flag_no_socket_is_opened(
    server: ServerProcess, published: tuple[ServerProcess, int, int]
) -> None:
    assert listening_ports(server.process.pid) == {server.http_port, server.grpc_port}
    events_server, port, replay = published
    assert {port, replay} <= listening_ports(events_server.process.pid)


@pytest.mark.parametrize(
    ("config", "named"),
    [('{"enable_kv_cache_events": true, "topics": "x"}', "topics"),
     ('{"enable_kv_cache_events": tru', "not JSON"),
     ('{"publisher": "kafka"}', "kafka")],
)  # fmt: skip
def test_a_bad_config_stops_the_start_naming_it(
    tiny_gptq_dir: Path, config: str, named: str
) -> None:
    code, output = run_predictor(["--model-dir", str(tiny_gptq_dir), "--kv-events-config", config])
    assert code == 2 and named in output and "--kv-events-config" in output
    assert "serving" not in output and "Traceback" not in output  # before the model loads
