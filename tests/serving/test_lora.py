"""LoRA adapters through the real server (vLLM's --lora-modules): each adapter is a model of its
own name on every protocol, listed with its parent; its requests run with it, the base model's
without; an unknown name is a 404; an adapter that cannot be served stops the start with why."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from load.random_lora import write_adapter
from tests.support import ServerProcess, run_predictor


@pytest.fixture(scope="module")
def adapted(
    tiny_gptq_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("lora")
    sql = write_adapter(root / "sql", tiny_gptq_dir, 8, 1)
    chat = write_adapter(root / "chat", tiny_gptq_dir, 16, 2)
    extra = ["--lora-modules", f"tiny-sql={sql}", f"tiny-chat={chat}"]
    with ServerProcess.start(tiny_gptq_dir, "tiny", extra=extra) as proc:
        yield proc


def complete(server: ServerProcess, model: str) -> str:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    done = client.completions.create(model=model, prompt="Once upon a time", max_tokens=12,
                                     temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    return done.choices[0].text


def test_each_adapter_is_a_model_listed_with_its_parent(adapted: ServerProcess) -> None:
    listed = httpx.get(f"{adapted.base_url}/v1/models", timeout=10).json()["data"]
    by_id = {m["id"]: m for m in listed}
    assert set(by_id) == {"tiny", "tiny-sql", "tiny-chat"}
    assert by_id["tiny-sql"]["parent"] == "tiny" and by_id["tiny-sql"]["root"].endswith("sql")
    assert "parent" not in by_id["tiny"]


def test_an_adapter_changes_its_requests_only(adapted: ServerProcess) -> None:
    base, sql, chat = (complete(adapted, m) for m in ("tiny", "tiny-sql", "tiny-chat"))
    assert len({base, sql, chat}) == 3
    assert complete(adapted, "tiny-sql") == sql and complete(adapted, "tiny") == base
    # the OIP path names the adapter too: the same greedy text
    body = {"text_input": "Once upon a time",
            "parameters": {"max_tokens": 12, "ignore_eos": True}}  # fmt: skip
    r = httpx.post(f"{adapted.base_url}/v2/models/tiny-sql/generate", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["text_output"] == sql


def test_on_the_native_kernels_the_lora_modes_are_timed_at_start(
    tiny_bf16_dir: Path, tmp_path: Path
) -> None:
    """A bf16 model (the native layer ops): the autotune timed lora_add's modes (bf16 factors,
    int8 where the CPU has VNNI) at each row count at start (a cache of its own: the run's
    holds the plan once made) and logged its plan, and the adapter's requests run with it."""
    adapter = write_adapter(tmp_path / "a", tiny_bf16_dir, 16, 3, std=0.2)
    extra = ["--attention", "native", "--lora-modules", f"a={adapter}",
             "--autotune-cache", str(tmp_path / "tune")]  # fmt: skip
    with ServerProcess.start(tiny_bf16_dir, "tiny", extra=extra) as proc:
        assert complete(proc, "a") != complete(proc, "tiny")
        log = proc.log()
    timed = re.findall(r"autotune lora rank 16 at \d+ rows \(ms a pass\): bf16 ", log)
    assert len(timed) == 7, log[-3000:]
    plan = re.search(r"kernel lora: (.+)", log)
    assert plan is not None and plan[1].startswith("1+ rows ")
    assert {part.split()[-1] for part in plan[1].split(", ")} <= {"bf16", "int8"}


def test_an_unknown_adapter_is_a_404_naming_it(adapted: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{adapted.base_url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError, match="tiny-sq"):
        client.completions.create(model="tiny-sq", prompt="Hi", max_tokens=2)


def test_an_adapter_that_cannot_be_served_stops_the_start(
    tiny_gptq_dir: Path, tmp_path: Path
) -> None:
    big = write_adapter(tmp_path / "big", tiny_gptq_dir, 32, 3)
    code, out = run_predictor(["--model-dir", str(tiny_gptq_dir), "--lora-modules",
                               f"big={big}", "--max-lora-rank", "16"])  # fmt: skip
    assert code == 2 and "adapter 'big': rank 32 is not between 1 and 16" in out
    code, out = run_predictor(["--model-dir", str(tiny_gptq_dir), "--lora-modules",
                               f"gone={tmp_path / 'nowhere'}"])  # fmt: skip
    assert code == 2 and "no adapter_config.json" in out


@pytest.fixture(scope="module")
def runtime(tiny_gptq_dir: Path) -> Iterator[ServerProcess]:
    extra = ["--allow-runtime-lora", "true", "--max-tokens-limit", "512",
             "--vllm-metric-aliases", "true"]  # fmt: skip
    with ServerProcess.start(tiny_gptq_dir, "tiny", extra=extra) as proc:
        yield proc


def post(server: ServerProcess, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/{route}", json=body, timeout=60)


def listed(server: ServerProcess) -> set[str]:
    return {m["id"] for m in httpx.get(f"{server.base_url}/v1/models", timeout=10).json()["data"]}


def test_load_use_unload_reload_at_run_time(
    runtime: ServerProcess, adapted: ServerProcess, tiny_gptq_dir: Path, tmp_path: Path
) -> None:
    sql = write_adapter(tmp_path / "sql", tiny_gptq_dir, 8, 1)  # tiny-sql's factors
    r = post(runtime, "load_lora_adapter", {"lora_name": "late-sql", "lora_path": str(sql)})
    assert r.status_code == 200, r.text
    assert "late-sql" in listed(runtime)
    assert complete(runtime, "late-sql") == complete(adapted, "tiny-sql")  # as if given at start
    again = post(runtime, "load_lora_adapter", {"lora_name": "late-sql", "lora_path": str(sql)})
    assert again.status_code == 400 and "already" in again.json()["error"]["message"]
    assert post(runtime, "unload_lora_adapter", {"lora_name": "late-sql"}).status_code == 200
    assert "late-sql" not in listed(runtime)
    client = openai.OpenAI(base_url=f"{runtime.base_url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="late-sql", prompt="Hi", max_tokens=2)
    gone = post(runtime, "unload_lora_adapter", {"lora_name": "late-sql"})
    assert gone.status_code == 404
    assert post(runtime, "load_lora_adapter",
                {"lora_name": "late-sql", "lora_path": str(sql)}).status_code == 200  # fmt: skip
    assert complete(runtime, "late-sql") == complete(adapted, "tiny-sql")


def test_a_bad_adapter_at_run_time_is_a_400_and_nothing_stays(
    runtime: ServerProcess, tiny_gptq_dir: Path, tmp_path: Path
) -> None:
    big = write_adapter(tmp_path / "big", tiny_gptq_dir, 128, 5)
    cases = {
        "big": (str(big), "rank 128 is not between 1 and 64"),
        "nowhere": (str(tmp_path / "nowhere"), "no adapter_config.json"),
        "tiny": (str(big), "already served"),
    }
    for name, (path, reason) in cases.items():
        r = post(runtime, "load_lora_adapter", {"lora_name": name, "lora_path": path})
        assert r.status_code == 400 and reason in r.json()["error"]["message"], r.text
    assert post(runtime, "load_lora_adapter", {"lora_name": "x"}).status_code == 400
    assert listed(runtime) == {"tiny"} | (listed(runtime) - {"big", "nowhere"})
    assert "big" not in listed(runtime)


def test_an_adapter_unloaded_mid_stream_finishes_that_stream_with_it(
    runtime: ServerProcess, tiny_gptq_dir: Path, tmp_path: Path
) -> None:
    path = str(write_adapter(tmp_path / "mid", tiny_gptq_dir, 8, 7))
    assert post(runtime, "load_lora_adapter", {"lora_name": "mid", "lora_path": path}).is_success
    body = {"model": "mid", "prompt": "Go", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    whole = httpx.post(f"{runtime.base_url}/v1/completions", json=body, timeout=120).json()
    texts = []
    with (
        httpx.Client(timeout=120) as client,
        client.stream(
            "POST", f"{runtime.base_url}/v1/completions", json=body | {"stream": True}
        ) as response,
    ):
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            texts.append(json.loads(line[6:])["choices"][0]["text"])
            if len(texts) == 5:  # under way: unloaded now
                assert post(runtime, "unload_lora_adapter", {"lora_name": "mid"}).is_success
    assert "".join(texts) == whole["choices"][0]["text"]


def test_beyond_max_cpu_loras_the_least_recently_used_adapter_is_evicted_never_one_in_use(
    adapted: ServerProcess, tiny_gptq_dir: Path, tmp_path: Path
) -> None:
    """One resident adapter (--max-cpu-loras 1) for two: each request of the other has it read
    again in place of the first, with the same tokens as a server holding both; a request of
    the second waits while a stream of the first runs, and that stream is not disturbed."""
    sql = write_adapter(tmp_path / "sql", tiny_gptq_dir, 8, 1)  # tiny-sql's and tiny-chat's
    chat = write_adapter(tmp_path / "chat", tiny_gptq_dir, 16, 2)
    extra = ["--max-cpu-loras", "1", "--max-tokens-limit", "512", "--lora-modules",
             f"tiny-sql={sql}", f"tiny-chat={chat}"]  # fmt: skip
    with ServerProcess.start(tiny_gptq_dir, "tiny", extra=extra) as lru:
        expected = {name: complete(adapted, name) for name in ("tiny-sql", "tiny-chat")}
        assert lora_info(lru)["predictor_lora_requests_info"][0]["max_lora"] == "1"
        for name in ("tiny-chat", "tiny-sql", "tiny-chat", "tiny"):  # each a switch
            assert complete(lru, name) == (expected.get(name) or complete(adapted, name))
        body = {"model": "tiny-sql", "prompt": "Go", "max_tokens": 500, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        whole = httpx.post(f"{lru.base_url}/v1/completions", json=body, timeout=120).json()
        texts: list[str] = []
        ended: dict[str, float] = {}
        with ThreadPoolExecutor(1) as pool:
            with (
                httpx.Client(timeout=120) as client,
                client.stream(
                    "POST", f"{lru.base_url}/v1/completions", json=body | {"stream": True}
                ) as response,  # fmt: skip
            ):
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    texts.append(json.loads(line[6:])["choices"][0]["text"])
                    if len(texts) == 5:  # tiny-sql is in use: tiny-chat must wait for it

                        def other() -> str:
                            text = complete(lru, "tiny-chat")
                            ended["chat"] = time.monotonic()
                            return text

                        waiting = pool.submit(other)
            ended["sql"] = time.monotonic()
            assert waiting.result(timeout=120) == expected["tiny-chat"]
        assert "".join(texts) == whole["choices"][0]["text"]
        assert ended["chat"] >= ended["sql"] - 0.5  # it ran once the stream's row was free


def test_run_time_loading_is_off_unless_allowed(adapted: ServerProcess, tmp_path: Path) -> None:
    r = post(adapted, "load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path)})
    assert r.status_code == 403 and "--allow-runtime-lora" in r.json()["error"]["message"]


def lora_info(server: ServerProcess) -> dict[str, tuple[dict[str, str], float]]:
    found = {}
    for line in httpx.get(f"{server.base_url}/metrics", timeout=10).text.splitlines():
        if line.startswith(("predictor_lora_requests_info{", "vllm:lora_requests_info{")):
            name, rest = line.split("{", 1)
            labels, value = rest.rsplit("} ", 1)
            found[name] = (dict(re.findall(r'(\w+)="([^"]*)"', labels)), float(value))
    return found


def test_the_lora_gauge_names_running_adapters_as_the_picker_reads_it(
    runtime: ServerProcess, tiny_gptq_dir: Path, tmp_path: Path
) -> None:
    path = str(write_adapter(tmp_path / "g", tiny_gptq_dir, 8, 9))
    assert post(runtime, "load_lora_adapter", {"lora_name": "gauged", "lora_path": path}).is_success
    before = time.time()
    idle = lora_info(runtime)
    assert set(idle) == {"predictor_lora_requests_info", "vllm:lora_requests_info"}
    labels, value = idle["vllm:lora_requests_info"]
    assert int(labels["max_lora"]) >= 1 and value >= before - 1
    body = {"model": "gauged", "prompt": "Go", "max_tokens": 300, "ignore_eos": True,
            "stream": True}  # fmt: skip
    seen = []
    with (
        httpx.Client(timeout=120) as client,
        client.stream("POST", f"{runtime.base_url}/v1/completions", json=body) as response,
    ):
        for n, _ in enumerate(response.iter_lines()):
            if n == 3:
                seen.append(lora_info(runtime)["vllm:lora_requests_info"][0])
    assert seen and "gauged" in seen[0]["running_lora_adapters"].split(",")
    assert lora_info(runtime)["vllm:lora_requests_info"][0]["running_lora_adapters"] == ""
    post(runtime, "unload_lora_adapter", {"lora_name": "gauged"})
