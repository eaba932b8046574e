"""The server as KServe's LLMInferenceService runs an engine written for `vllm serve`: vLLM's flag
names, HTTPS with the certificate and key it mounts, and `GET /health` as its probes read it."""

from __future__ import annotations

import datetime
import ipaddress
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from load.local_server import free_port
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
