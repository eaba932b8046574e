"""Smoke test of the built image (`make image-test`): run it with buildah, ask it for Paris.

The container runs the image's own CMD (`python -m predictor --model-dir /mnt/models ...`) as the
image's USER, with a copy of the model folder bind-mounted read-only at /mnt/models, as KServe's
storage initializer downloads it there (the runtime image carries no model; the copy's files are
world-readable like a download's, where `make model` leaves model.safetensors 0600, which a
non-root container cannot read), on the host network with loopback
ports from IMAGE_TEST_HTTP_PORT / IMAGE_TEST_GRPC_PORT (default: free ports the OS picks). Checks:

- the image's configured user is numeric and non-root (`buildah inspect`), and `id -u` inside is it;
- /v2/health/ready within the start budget;
- "Paris" from V2 REST `/v2/models/<name>/infer` (chat=true, README.md's curl example);
- "Paris" from the openai SDK's chat completions on /openai/v1.

    .venv/bin/python tools/image_smoke.py --image localhost/gptq-predictor:0.1.0 \
        --model-dir models/smollm2-135m-instruct-gptq -- buildah --storage-driver vfs --root ...
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
from openai import OpenAI

QUESTION = "What is the capital of France?"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def port(variable: str) -> int:
    value = os.environ.get(variable, "")
    return int(value) if value else free_port()


def run(buildah: Sequence[str], *args: str) -> str:
    done = subprocess.run([*buildah, *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{shlex.join([*buildah, *args])} failed:\n{done.stderr}")
    return done.stdout.strip()


def check_user(buildah: Sequence[str], image: str, container: str) -> str:
    config = json.loads(run(buildah, "inspect", "--type", "image", image))
    user = str(config["OCIv1"]["config"].get("User", ""))
    uid = user.split(":")[0]
    if not uid.isdigit() or int(uid) == 0:
        raise SystemExit(f"image USER is {user!r}: not a numeric non-root uid")
    inside = run(buildah, "run", "--isolation", "chroot", container, "--", "id", "-u")
    if inside != uid:
        raise SystemExit(f"`id -u` in the container is {inside}, the image says {uid}")
    return user


def wait_ready(url: str, server: subprocess.Popen[bytes], log: Path, timeout: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if server.poll() is not None:
            raise SystemExit(f"server exited with {server.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(f"{url}/v2/health/ready", timeout=2).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"not ready after {timeout:.0f} s:\n{log.read_text()[-4000:]}")


def ask_v2(url: str, model: str) -> str:
    body = {
        "inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": [QUESTION]}],
        "parameters": {"max_tokens": 16, "chat": True, "temperature": 0},
    }
    response = httpx.post(f"{url}/v2/models/{model}/infer", json=body, timeout=120)
    response.raise_for_status()
    (output,) = [o for o in response.json()["outputs"] if o["name"] == "text_output"]
    return str(output["data"][0])


def ask_openai(url: str, model: str) -> str:
    client = OpenAI(base_url=f"{url}/openai/v1", api_key="unused", timeout=120)
    answer = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=16,
        temperature=0,
    )
    return answer.choices[0].message.content or ""


def stop(server: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the buildah process group (the server drains and exits), SIGKILL if stuck."""
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=30)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--image", required=True)
    parser.add_argument("--model-dir", type=Path, required=True, help="mounted at /mnt/models")
    parser.add_argument("--start-timeout", type=float, default=600)
    parser.add_argument("buildah", nargs="+", help="the buildah command line (storage flags)")
    args = parser.parse_args(argv)
    buildah = args.buildah
    model = args.model_dir.name
    http_port, grpc_port = port("IMAGE_TEST_HTTP_PORT"), port("IMAGE_TEST_GRPC_PORT")
    url = f"http://127.0.0.1:{http_port}"

    container = run(buildah, "from", "--pull=never", args.image)
    try:
        user = check_user(buildah, args.image, container)
        print(f"user: image USER {user}, `id -u` inside agrees")
        config = json.loads(run(buildah, "inspect", "--type", "image", args.image))
        cmd = config["OCIv1"]["config"]["Cmd"]
        serve = [*cmd, "--model-name", model, "--host", "127.0.0.1",
                 "--http-port", str(http_port), "--grpc-port", str(grpc_port)]  # fmt: skip
        staged = Path(tempfile.mkdtemp(prefix="image-smoke-")) / "model"
        shutil.copytree(args.model_dir, staged, copy_function=shutil.copyfile)  # umask modes
        mount = f"{staged}:/mnt/models:ro"
        with tempfile.NamedTemporaryFile(suffix=".log", delete=False) as log:
            log_path = Path(log.name)
            command = [*buildah, "run", "--isolation", "chroot", "--network", "host",
                       "--volume", mount, container, "--", *serve]  # fmt: skip
            server = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            ready = wait_ready(url, server, log_path, args.start_timeout)
            print(f"ready after {ready:.1f} s on {url} ({shlex.join(serve)})")
            answers = {"v2 infer": ask_v2(url, model), "openai chat": ask_openai(url, model)}
        finally:
            stop(server)
            shutil.rmtree(staged.parent)
        for route, text in answers.items():
            print(f"{route}: {text!r}")
        failed = [route for route, text in answers.items() if "Paris" not in text]
        if failed:
            print(f"no Paris from {failed}; server log:\n{log_path.read_text()[-4000:]}")
            return 1
        log_path.unlink()
        print("image smoke test passed")
        return 0
    finally:
        run(buildah, "rm", container)


if __name__ == "__main__":
    sys.exit(main())
