"""The prefix cache on disk through the real server (--kv-offload-dir): a server stopped with
SIGTERM saves its cached blocks; the next one over the same folder answers a long shared prompt
with the same greedy text, its prompt tokens reported cached (usage.prompt_tokens_details) and
read back (predictor_kv_offload_blocks_total{event="loaded"}); a tampered block file is
rejected and counted, never served; another model's server keeps a folder of its own; a
server started with a smaller bound trims the folder to it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx

from tests.support import ServerProcess

PROMPT = [(37 * i + 11) % 900 + 50 for i in range(330)]  # 20 full blocks of 16 before its last
CACHED = (len(PROMPT) - 1) // 16 * 16


def complete(server: ServerProcess, model: str = "tiny") -> dict[str, Any]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return dict(r.json())


def cached(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


def offload_metric(server: ServerProcess, event: str) -> float:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    found = re.search(rf'^predictor_kv_offload_blocks_total\{{[^}}]*event="{event}"[^}}]*\}} (\S+)$',
                      text, re.M)  # fmt: skip
    assert found, f"no {event} count in /metrics"
    return float(found[1])


def start(model_dir: Path, folder: Path, size: str = "1") -> Any:
    return ServerProcess.start(model_dir, "tiny", extra=[
        "--kv-offload-dir", str(folder), "--kv-offload-size", size, "--speculative", "off",
    ])  # fmt: skip


def test_a_restart_finds_its_disk_cache_and_refuses_a_tampered_file(
    tiny_gptq_dir: Path, tiny_bf16_dir: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "kv"
    with start(tiny_gptq_dir, folder) as first:
        cold = complete(first)
        assert cached(cold) == 0
        assert offload_metric(first, "stored") == 0  # nothing evicted yet: saved at shutdown
    (model_folder,) = [p for p in folder.iterdir() if p.is_dir()]
    files = sorted(model_folder.glob("*.kv"), key=lambda p: p.stat().st_mtime_ns)
    assert len(files) >= CACHED // 16

    with start(tiny_gptq_dir, folder) as second:
        warm = complete(second)
        assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
        assert cached(warm) == CACHED
        assert offload_metric(second, "loaded") == CACHED // 16
        assert offload_metric(second, "rejected") == 0

    for path in model_folder.glob("*.kv"):  # one byte of every block's keys changed
        data = bytearray(path.read_bytes())
        data[-5] ^= 0x01
        path.write_bytes(bytes(data))
    with start(tiny_gptq_dir, folder) as third:
        tampered = complete(third)
        assert tampered["choices"][0]["text"] == cold["choices"][0]["text"]
        assert cached(tampered) == 0  # the first block refused, so everything computed
        assert offload_metric(third, "rejected") == 1
        assert offload_metric(third, "loaded") == 0

    # another model over the same folder: a folder of its own, nothing of this one's served
    with start(tiny_bf16_dir, folder) as other:
        assert cached(complete(other)) == 0
        assert offload_metric(other, "loaded") == 0
    assert len([p for p in folder.iterdir() if p.is_dir()]) == 2


def test_a_smaller_bound_trims_the_folder(tiny_gptq_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "kv"
    with start(tiny_gptq_dir, folder):
        pass
    with start(tiny_gptq_dir, folder) as server:
        complete(server)
    (model_folder,) = [p for p in folder.iterdir() if p.is_dir()]
    files = list(model_folder.glob("*.kv"))
    one = files[0].stat().st_size
    size = 5 * one / 2**30  # GiB: five files' worth
    with start(tiny_gptq_dir, folder, f"{size:.12f}") as server:
        text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
        used = re.search(r"^predictor_kv_offload_bytes\{[^}]*\} (\S+)$", text, re.M)
        assert used and float(used[1]) <= 5 * one
        assert offload_metric(server, "evicted") == len(files) - 5
    assert len(list(model_folder.glob("*.kv"))) == 5


def test_a_wake_from_sleep_finds_the_prefix_cache_on_disk(
    tiny_gptq_dir: Path, tmp_path: Path
) -> None:
    """With --enable-sleep-mode, a sleep saves the cached blocks before it empties the cache,
    and the woken runner reads them back: the long prompt's tokens are cached after the wake."""
    extra = ["--kv-offload-dir", str(tmp_path / "kv"), "--speculative", "off",
             "--enable-sleep-mode"]  # fmt: skip
    with ServerProcess.start(tiny_gptq_dir, "tiny", extra=extra) as server:
        cold = complete(server)
        assert cached(cold) == 0
        assert httpx.post(f"{server.base_url}/sleep", timeout=60).status_code == 200
        woken = complete(server)  # wakes the engine
        assert woken["choices"][0]["text"] == cold["choices"][0]["text"]
        assert cached(woken) == CACHED
        assert offload_metric(server, "loaded") == CACHED // 16
