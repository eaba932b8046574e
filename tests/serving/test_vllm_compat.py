"""The server as KServe's LLMInferenceService runs an engine written for `vllm serve`: vLLM's flag
names, HTTPS with the certificate and key it mounts, and `GET /health` as its probes read it."""

from __future__ import annotations

import datetime
import ipaddress
import signal
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from load.local_server import free_port
from load.random_lora import write_adapter
from tests.deploy.engine_command import (
    LLMISVC_TLS,
    NAMESPACE,
    OFFLOADING,
    TRACING_ARGS,
    rendered_argv,
)
from tests.deploy.test_manifests import MANIFESTS, kubectl
from tests.support import REPO, _launcher


def self_signed(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key, as PEM files (tls.crt, tls.key)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "tls.crt", folder / "tls.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


def test_served_with_vllm_flags_over_https_and_probed_at_health(
    tiny_gptq_dir: Path, tmp_path: Path
) -> None:
    cert, key = self_signed(tmp_path)
    port = free_port()
    launch, log = _launcher()
    args = ["-m", "predictor", "--model-dir", str(tiny_gptq_dir), "--served-model-name", "tiny-served",
            "publishers/kserve/models/tiny", "--port", str(port), "--grpc-port", str(free_port()), "--ssl-certfile", str(cert),
            "--ssl-keyfile", str(key), "--threads", "1", "--attention", "torch",
            "--kernel", "int4_op", "--speculative", "off"]  # fmt: skip
    process = launch(args, REPO, log)
    base = f"https://127.0.0.1:{port}"
    try:
        with httpx.Client(verify=str(cert), timeout=5) as client:
            deadline = time.monotonic() + 180
            while True:  # vLLM's probe: 503 (or no answer) until ready, then 200
                assert process.poll() is None, log.read_text()
                try:
                    health = client.get(f"{base}/health")
                    if health.status_code == 200:
                        break
                    assert health.status_code == 503 and health.json()["error"]
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
            assert health.content == b""
            models = client.get(f"{base}/v1/models").json()
            listed = sorted(m["id"] for m in models["data"])
            assert listed == ["publishers/kserve/models/tiny", "tiny-served"]
        with pytest.raises(httpx.TransportError):  # HTTPS only on that port
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
        tls_client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0,
                                   http_client=httpx.Client(verify=str(cert)))  # fmt: skip
        done = tls_client.completions.create(model="tiny-served", prompt="Hi", max_tokens=3)
        assert done.usage is not None and done.usage.completion_tokens == 3
        # the other name (vLLM's second --served-model-name): the same model, answered as named
        again = tls_client.completions.create(model="publishers/kserve/models/tiny", prompt="Hi",
                                              max_tokens=3, temperature=0)  # fmt: skip
        first = tls_client.completions.create(model="tiny-served", prompt="Hi", max_tokens=3,
                                              temperature=0)  # fmt: skip
        assert again.model == "publishers/kserve/models/tiny"
        assert again.choices[0].text == first.choices[0].text
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0


@pytest.fixture(scope="module")
def llmisvc_argv() -> list[str]:
    """The engine's argv in a pod KServe makes of manifests/overlays/llm-inference-service
    (TLS on, spec.kvCacheOffloading set, one LoRA adapter, tracing on): rendered and run in bash
    as the controller does (tests/deploy/engine_command.py)."""
    done = subprocess.run([kubectl(), "kustomize", str(MANIFESTS / "overlays/llm-inference-service")],
                          capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
    (doc,) = [d for d in yaml.safe_load_all(done.stdout) if d]
    return rendered_argv(doc, tls=True, offloading=OFFLOADING)


def test_the_llminferenceservice_argv_starts_and_answers_to_both_names(
    llmisvc_argv: list[str], tiny_gptq_dir: Path, tmp_path: Path
) -> None:
    """That argv, word for word but for this machine's paths and ports: a start without error
    that says what of --kv-transfer-config it serves, and both served names (`{name}` and
    `publishers/{namespace}/models/{name}`) answered alike on every OpenAI-shaped API llm-d
    routes, the adapter beside them."""
    cert, key = self_signed(tmp_path)
    adapter = write_adapter(tmp_path / "sql", tiny_gptq_dir, 8, 1)
    port, events_port, dead_port = free_port(), free_port(), free_port()
    swap = {"/mnt/models": str(tiny_gptq_dir), "8000": str(port), LLMISVC_TLS[0]: str(cert),
            LLMISVC_TLS[1]: str(key), TRACING_ARGS[1]: f"http://127.0.0.1:{dead_port}"}  # fmt: skip
    argv = [swap.get(word, word.replace("tcp://*:5557", f"tcp://*:{events_port}")
                     .replace("/mnt/lora/sql", str(adapter))) for word in llmisvc_argv]  # fmt: skip
    assert argv[:2] == ["-m", "predictor"] and str(port) in argv and str(adapter) in str(argv)
    launch, log = _launcher()
    process = launch([*argv, "--threads", "1", "--attention", "torch", "--kernel", "int4_op",
                      "--speculative", "off"], REPO, log)  # fmt: skip
    base, name = f"https://127.0.0.1:{port}", "smollm2-135m-instruct"
    other = f"publishers/{NAMESPACE}/models/{name}"
    try:
        with httpx.Client(verify=str(cert), timeout=60) as client:
            deadline = time.monotonic() + 180
            while client_ready(client, base) is False:
                assert process.poll() is None, log.read_text()
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
            assert "kv-transfer-config: OffloadingConnector not served, KV stays in RAM" in (
                log.read_text()
            )
            listed = client.get(f"{base}/v1/models").json()["data"]
            assert sorted(m["id"] for m in listed) == sorted([name, other, "sql"])
            answers = {model: each_api(client, base, model) for model in (name, other)}
            assert answers[name] == answers[other], answers
            assert each_api(client, base, "sql") != answers[name]  # the adapter runs
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0, log.read_text()


def client_ready(client: httpx.Client, base: str) -> bool:
    try:
        return client.get(f"{base}/health").status_code == 200
    except httpx.TransportError:
        return False


def each_api(client: httpx.Client, base: str, model: str) -> dict[str, str]:
    """The greedy text `model` gives on each OpenAI-shaped route (and Anthropic's), each
    answered as named."""
    greedy = {"max_tokens": 8, "temperature": 0}
    turn = [{"role": "user", "content": "Once upon a time"}]
    sent = {
        "/v1/completions": {"prompt": "Once upon a time", **greedy},
        "/v1/chat/completions": {"messages": turn, **greedy},
        "/openai/v1/chat/completions": {"messages": turn, **greedy},
        "/v1/responses": {"input": "Once upon a time", "max_output_tokens": 8, "temperature": 0},
        "/v1/messages": {"messages": turn, **greedy},
    }
    texts = {}
    for path, body in sent.items():
        answer = client.post(f"{base}{path}", json={"model": model, **body})
        assert answer.status_code == 200, (path, model, answer.text)
        out = answer.json()
        assert out["model"] == model, (path, out)
        texts[path] = answer_text(out)
    return texts


def answer_text(out: dict) -> str:
    """The text of an OpenAI completion, chat completion or response, or an Anthropic message."""
    if "choices" in out:
        (choice,) = out["choices"]
        return str(choice["text"] if "text" in choice else choice["message"]["content"])
    parts = [p for item in out.get("output", []) for p in item.get("content", [])]
    return "".join(p["text"] for p in parts or out["content"] if "text" in p)
