"""Every overlay, every kind it builds: accepted offline (tests/deploy/kinds.py), and a
deliberately broken sample of each kind caught. No cluster, no network."""

from __future__ import annotations

import copy
import functools
import subprocess
from collections.abc import Callable
from typing import Any

import pytest
import yaml

from tests.deploy.kinds import build_errors, doc_errors, effective_pod, predictor_pod_labels
from tests.deploy.test_manifests import MANIFESTS, OVERLAYS, kubectl

Doc = dict[str, Any]
TARGETS = {"base": "base", "runtime": "runtime", "observability": "observability"} | {
    o: f"overlays/{o}" for o in OVERLAYS
}
CORE = {"ServiceAccount", "Role", "RoleBinding", "Service", "Deployment"}
KINDS = {
    "runtime": {"ClusterServingRuntime"},
    "observability": {"ConfigMap", "PrometheusRule"},  # the Grafana dashboard, the rules
    "storage-uri": {"InferenceService"},
    "standard": {"InferenceService", "PodDisruptionBudget"},
    "inference-pool": {"InferenceService", "PodDisruptionBudget", "InferencePool", "HTTPRoute"}
    | CORE,
    "llm-inference-service": {"LLMInferenceService"},
}


@functools.cache
def _build(target: str) -> tuple[Doc, ...]:
    command = [kubectl(), "kustomize", str(MANIFESTS / TARGETS[target])]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return tuple(doc for doc in yaml.safe_load_all(done.stdout) if doc)


def build(target: str) -> list[Doc]:
    return copy.deepcopy(list(_build(target)))


def runtimes() -> list[Doc]:
    return build("runtime")


def summary(docs: list[Doc]) -> list[str]:
    return sorted(f"{d['kind']}/{d['metadata']['name']}" for d in docs)


@pytest.mark.parametrize("target", TARGETS)
def test_every_kind_of_every_overlay_is_accepted(target: str) -> None:
    docs = build(target)
    if target in KINDS:
        assert {d["kind"] for d in docs} == KINDS[target], summary(docs)
    assert build_errors(docs, runtimes()) == []


def containers_in(node: Any) -> list[Doc]:
    """Every container-like mapping (one with `env` or `resources`) anywhere in a document."""
    if isinstance(node, list):
        return [c for item in node for c in containers_in(item)]
    if not isinstance(node, dict):
        return []
    found = [node] if {"env", "resources"} & node.keys() and "name" in node else []
    return found + [c for value in node.values() for c in containers_in(value)]


def device_and_threads(container: Doc) -> tuple[str | None, int | None]:
    env = {e["name"]: e.get("value") for e in container.get("env") or []}
    threads = env.get("PREDICTOR_THREADS")
    return env.get("PREDICTOR_DEVICE"), None if threads is None else int(threads)


@pytest.mark.parametrize("target", TARGETS)
def test_cpu_by_default_gpu_only_in_the_gpu_overlay(target: str) -> None:
    """The CPU build is the default deployment: nvidia.com/gpu and PREDICTOR_DEVICE=cuda appear
    in overlays/gpu and nowhere else (nor in anything built on it)."""
    docs = build(target)
    devices = {device_and_threads(c)[0] for d in docs for c in containers_in(d)} - {None}
    asks_gpu = "nvidia.com/gpu" in yaml.safe_dump_all(docs)
    if target == "gpu":
        assert devices == {"cuda"} and asks_gpu
    else:
        assert "cuda" not in devices and not asks_gpu, (devices, asks_gpu)


@pytest.mark.parametrize("target", TARGETS)
def test_threads_fit_the_cpu_limit(target: str) -> None:
    """PREDICTOR_THREADS = the CPU limit less the core left to serving (config.SERVING_CORES):
    in a container the default would count every core of the node (os.sched_getaffinity)."""
    from predictor.config import SERVING_CORES

    docs = build(target)
    for container in containers_in(docs):
        limit = ((container.get("resources") or {}).get("limits") or {}).get("cpu")
        _, threads = device_and_threads(container)
        if limit is None and threads is None:
            continue  # e.g. a model spec that takes the runtime's env and resources
        assert limit is not None and threads is not None, container["name"]
        assert threads == max(1, int(limit) - SERVING_CORES), (container["name"], limit, threads)


def test_runtime() -> None:
    (rt,) = runtimes()
    spec = rt["spec"]
    assert rt["metadata"]["name"] == "gptq-predictor"
    assert spec["supportedModelFormats"][0] | {"version": "1"} == {
        "name": "gptq", "version": "1", "autoSelect": True, "priority": 1,
    }  # fmt: skip
    assert spec["protocolVersions"] == ["v2", "grpc-v2"]
    assert spec["annotations"] == {
        "prometheus.kserve.io/port": "8080",
        "prometheus.kserve.io/path": "/metrics",
    }
    (c,) = spec["containers"]
    assert c["args"][:2] == ["--model-name={{.Name}}", "--model-dir=/mnt/models"]


def isvc_of(target: str) -> Doc:
    (isvc,) = [d for d in build(target) if d["kind"] == "InferenceService"]
    return isvc


@pytest.mark.parametrize("target", ["storage-uri", "standard", "inference-pool"])
def test_model_format_with_storage_uri_runs_the_runtime(target: str) -> None:
    isvc = isvc_of(target)
    model = isvc["spec"]["predictor"]["model"]
    assert model["modelFormat"] == {"name": "gptq"} and model["storageUri"].startswith("s3://")
    container, _, errors = effective_pod(isvc, runtimes())
    assert errors == []
    # KServe fills {{.Name}}: served under the InferenceService's name, probed on that route
    assert container["args"][0] == "--model-name=gptq-predictor"
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/models/gptq-predictor/ready"
    assert "nvidia.com/gpu" not in container["resources"]["requests"]  # CPU: the runtime's own


def test_standard_mode_serves_rest_and_grpc_and_scales_with_keda() -> None:
    isvc = isvc_of("standard")
    notes = isvc["metadata"]["annotations"]
    assert notes["serving.kserve.io/deploymentMode"] == "Standard"
    assert notes["serving.kserve.io/autoscalerClass"] == "keda"
    assert "serving.knative.dev/progress-deadline" not in notes
    p = isvc["spec"]["predictor"]
    container, _, _ = effective_pod(isvc, runtimes())
    assert {port["containerPort"] for port in container["ports"]} == {8080, 8081}
    (metric,) = p["autoScaling"]["metrics"]
    assert metric["type"] == "External"
    assert metric["external"]["metric"]["query"] == (
        'sum(predictor_num_requests_waiting{model="gptq-predictor"})'
    )
    assert metric["external"]["target"] == {"type": "Value", "value": "4"}
    assert (p["minReplicas"], p["maxReplicas"], p["terminationGracePeriodSeconds"]) == (1, 4, 620)
    (pdb,) = [d for d in build("standard") if d["kind"] == "PodDisruptionBudget"]
    assert pdb["spec"]["maxUnavailable"] == 1


def test_inference_pool_picks_predictor_pods_with_our_metric_names() -> None:
    docs = {d["kind"]: d for d in build("inference-pool")}
    pool, picker = docs["InferencePool"], docs["Deployment"]
    labels = predictor_pod_labels(docs["InferenceService"])
    assert all(labels[k] == v for k, v in pool["spec"]["selector"]["matchLabels"].items())
    assert pool["spec"]["targetPorts"] == [{"number": 8080}]
    args = picker["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--total-queued-requests-metric=predictor_num_requests_waiting" in args
    assert "--total-running-requests-metric=predictor_num_requests_running" in args
    assert "--kv-cache-usage-percentage-metric=predictor_kv_cache_usage_ratio" in args
    paths = [m["path"]["value"] for m in docs["HTTPRoute"]["spec"]["rules"][0]["matches"]]
    assert {"/v1/completions", "/v1/chat/completions"} <= set(paths)


# ---- broken samples: each kind's, caught -------------------------------------------------------
Change = Callable[[list[Doc]], None]


def of(kind: str, docs: list[Doc]) -> Doc:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


def edit(kind: str, change: Callable[[Doc], None]) -> Change:
    return lambda docs: change(of(kind, docs))


def container0(doc: Doc) -> Doc:
    return doc["spec"]["template"]["spec"]["containers"][0]


def main_script(doc: Doc, old: str, new: str) -> None:
    """Change the LLMInferenceService's engine command (`sh -c SCRIPT`)."""
    (main,) = [c for c in doc["spec"]["template"]["containers"] if c["name"] == "main"]
    assert old in main["command"][2]
    main["command"][2] = main["command"][2].replace(old, new)


def _runtime_container(docs: list[Doc]) -> Doc:
    return of("ClusterServingRuntime", docs)["spec"]["containers"][0]


BROKEN: dict[str, tuple[str, Change, str]] = {
    # ClusterServingRuntime (built with the runtime, as one apply would)
    "runtime: unknown field": (
        "runtime",
        edit("ClusterServingRuntime", lambda d: d["spec"].update(supportedModelFormat=[])),
        "unknown field",
    ),
    "runtime: protocol v3": (
        "runtime",
        edit("ClusterServingRuntime", lambda d: d["spec"]["protocolVersions"].append("v3")),
        "'v3' is not one of",
    ),
    "runtime: unknown placeholder": (
        "runtime",
        lambda docs: _runtime_container(docs)["args"].__setitem__(0, "--model-name={{.Model}}"),
        "{{.Model}} is not a field",
    ),
    "runtime: autoSelect as a string": (
        "runtime",
        edit(
            "ClusterServingRuntime",
            lambda d: d["spec"]["supportedModelFormats"][0].update(autoSelect="yes"),
        ),
        "expected bool",
    ),
    "runtime: no containers": (
        "runtime",
        edit("ClusterServingRuntime", lambda d: d["spec"].pop("containers")),
        "containers: required",
    ),
    # InferenceService (model format, standard/KEDA)
    "isvc: no runtime for the protocol": (
        "standard",
        edit("InferenceService", lambda d: d["spec"]["predictor"]["model"].pop("protocolVersion")),
        "no runtime serves format 'gptq' over v1",
    ),
    "isvc: scaleMetric under KEDA": (
        "standard",
        edit("InferenceService", lambda d: d["spec"]["predictor"].update(scaleMetric="cpu")),
        "not supported for KEDA",
    ),
    "isvc: KEDA threshold as averageValue": (
        "standard",
        edit(
            "InferenceService",
            lambda d: d["spec"]["predictor"]["autoScaling"]["metrics"][0]["external"].update(
                target={"type": "AverageValue", "averageValue": "4"}
            ),
        ),
        "threshold should not be empty",
    ),
    "isvc: unknown autoscaler class": (
        "standard",
        edit(
            "InferenceService",
            lambda d: d["metadata"]["annotations"].update(
                {"serving.kserve.io/autoscalerClass": "kpa"}
            ),
        ),
        "is not supported",
    ),
    "isvc: grace shorter than the drain": (
        "standard",
        edit(
            "InferenceService",
            lambda d: d["spec"]["predictor"].update(terminationGracePeriodSeconds=30),
        ),
        "the kubelet kills the drain",
    ),
    "isvc: drain shorter than the request timeout": (
        "storage-uri",
        lambda docs: _runtime_container(docs)["env"].__setitem__(
            1, {"name": "PREDICTOR_DRAIN_SECONDS", "value": "30"}
        ),
        "a rollout cuts streams",
    ),
    "isvc: a flag the server does not have": (
        "storage-uri",
        lambda docs: _runtime_container(docs)["args"].append("--max-batch=8"),
        "rejected by `python -m predictor`",
    ),
    "isvc: server-level readiness": (
        "storage-uri",
        lambda docs: _runtime_container(docs)["readinessProbe"]["httpGet"].update(
            path="/v2/health/ready"
        ),
        "not the model route",
    ),
    "isvc: writable root": (
        "storage-uri",
        lambda docs: _runtime_container(docs)["securityContext"].pop("readOnlyRootFilesystem"),
        "readOnlyRootFilesystem",
    ),
    "isvc: memory far above the measured RSS": (
        "storage-uri",
        lambda docs: _runtime_container(docs)["resources"]["requests"].update(memory="16Gi"),
        "does not fit the measured peak RSS",
    ),
    "isvc: two ports in Knative mode": (
        "storage-uri",
        edit(
            "InferenceService",
            lambda d: d["spec"]["predictor"]["model"].update(
                ports=[{"containerPort": 8081, "name": "h2c"}]
            ),
        ),
        "more than one container port",
    ),
    # PodDisruptionBudget
    "pdb: unknown field": (
        "standard",
        edit("PodDisruptionBudget", lambda d: d["spec"].update(maxUnavailabe=1)),
        "'maxUnavailabe' was unexpected",
    ),
    "pdb: both bounds": (
        "standard",
        edit("PodDisruptionBudget", lambda d: d["spec"].update(minAvailable=1)),
        "both set",
    ),
    "pdb: selects nothing": (
        "standard",
        edit(
            "PodDisruptionBudget",
            lambda d: d["spec"]["selector"]["matchLabels"].update(component="transformer"),
        ),  # fmt: skip
        "matches no predictor pod",
    ),
    # InferencePool
    "pool: duplicate target port": (
        "inference-pool",
        edit("InferencePool", lambda d: d["spec"]["targetPorts"].append({"number": 8080})),
        "port number must be unique",
    ),
    "pool: port out of range": (
        "inference-pool",
        edit("InferencePool", lambda d: d["spec"]["targetPorts"][0].update(number=70000)),
        "above the maximum",
    ),
    "pool: picker without port": (
        "inference-pool",
        edit("InferencePool", lambda d: d["spec"]["endpointPickerRef"].pop("port")),
        "port is required when kind is 'Service'",
    ),
    "pool: failure mode": (
        "inference-pool",
        edit("InferencePool", lambda d: d["spec"]["endpointPickerRef"].update(failureMode="Maybe")),
        "'Maybe' is not one of",
    ),
    "pool: no selector": (
        "inference-pool",
        edit("InferencePool", lambda d: d["spec"].pop("selector")),
        "selector: required",
    ),
    "pool: selects the picker": (
        "inference-pool",
        edit(
            "InferencePool",
            lambda d: d["spec"].update(
                selector={"matchLabels": {"app.kubernetes.io/name": "gptq-predictor-epp"}}
            ),
        ),  # fmt: skip
        "matches no predictor pod",
    ),
    # Deployment / Service / RBAC (the endpoint picker)
    "picker: unknown container field": (
        "inference-pool",
        edit("Deployment", lambda d: container0(d).update(readinesProbe={})),
        "'readinesProbe' was unexpected",
    ),
    "picker: replicas as a string": (
        "inference-pool",
        edit("Deployment", lambda d: d["spec"].update(replicas="1")),
        "is not of type 'integer'",
    ),
    "picker: another pool": (
        "inference-pool",
        edit("Deployment", lambda d: container0(d)["args"].__setitem__(0, "--pool-name=other")),
        "no endpoint picker Deployment has --pool-name",
    ),
    "picker: shorter grace than the pool": (
        "inference-pool",
        edit(
            "Deployment",
            lambda d: d["spec"]["template"]["spec"].update(terminationGracePeriodSeconds=130),
        ),
        "picker grace 130 s",
    ),
    "service: port as text": (
        "inference-pool",
        edit("Service", lambda d: d["spec"]["ports"][0].update(port="9002")),
        "is not of type 'integer'",
    ),
    "service: no ext_proc port": (
        "inference-pool",
        edit("Service", lambda d: d["spec"]["ports"].pop(0)),
        "is no port of a Service here",
    ),
    "rbac: binding to a missing role": (
        "inference-pool",
        edit("RoleBinding", lambda d: d["roleRef"].update(name="missing")),
        "role missing is not here",
    ),
    # HTTPRoute
    "route: path type": (
        "inference-pool",
        edit(
            "HTTPRoute", lambda d: d["spec"]["rules"][0]["matches"][0]["path"].update(type="Prefix")
        ),  # fmt: skip
        "'Prefix' is not one of",
    ),
    "route: timeout text": (
        "inference-pool",
        edit("HTTPRoute", lambda d: d["spec"]["rules"][0]["timeouts"].update(request="10 min")),
        "does not match",
    ),
    "route: short timeout": (
        "inference-pool",
        edit("HTTPRoute", lambda d: d["spec"]["rules"][0]["timeouts"].update(request="30s")),
        "cuts 590 s streams",
    ),
    "route: to a Service": (
        "inference-pool",
        edit(
            "HTTPRoute",
            lambda d: d["spec"]["rules"][0]["backendRefs"][0].update(group="", kind="Service"),
        ),  # fmt: skip
        "is not an InferencePool here",
    ),
    "route: unknown field": (
        "inference-pool",
        edit("HTTPRoute", lambda d: d["spec"]["rules"][0].update(filter=[])),
        "unknown field",
    ),
    # PrometheusRule and the dashboard's ConfigMap (manifests/observability)
    "rules: unknown rule field": (
        "observability",
        edit("PrometheusRule", lambda d: d["spec"]["groups"][1]["rules"][0].update(summary="x")),
        "unknown field",
    ),
    "rules: for as text": (
        "observability",
        edit(
            "PrometheusRule", lambda d: d["spec"]["groups"][1]["rules"][0].update({"for": "5 min"})
        ),
        "does not match",
    ),
    # LLMInferenceService
    "llmisvc: no model uri": (
        "llm-inference-service",
        edit("LLMInferenceService", lambda d: d["spec"]["model"].pop("uri")),
        "spec.model.uri: required",
    ),
    "llmisvc: replicas and scaling": (
        "llm-inference-service",
        edit("LLMInferenceService", lambda d: d["spec"].update(scaling={"maxReplicas": 2})),
        "replicas and scaling are mutually exclusive",
    ),
    "llmisvc: vLLM's port left": (
        "llm-inference-service",
        edit("LLMInferenceService", lambda d: main_script(d, "--port 8000", "--port 8080")),
        "not 0.0.0.0:8000",
    ),
    "llmisvc: certificate only when TLS is off": (
        "llm-inference-service",
        edit(
            "LLMInferenceService",
            lambda d: main_script(
                d, "{{ if .GlobalConfig.EnableTLS }}", "{{ if not .GlobalConfig.EnableTLS }}"
            ),
        ),
        "template this check does not know",
    ),
    "llmisvc: a flag we do not have": (
        "llm-inference-service",
        edit(
            "LLMInferenceService",
            lambda d: main_script(d, "--port 8000", "--port 8000 --tensor-parallel-size 1"),
        ),
        "rejects",
    ),
    "llmisvc: one served name": (
        "llm-inference-service",
        edit(
            "LLMInferenceService",
            lambda d: main_script(
                d, ' \\"publishers/{{ .ObjectMeta.Namespace }}/models/{{ .Spec.Model.Name }}\\"', ""
            ),
        ),
        "publishers/<namespace>/models/<name>",
    ),  # fmt: skip
    "llmisvc: the controller's args dropped": (
        "llm-inference-service",
        edit("LLMInferenceService", lambda d: main_script(d, '$@"', '"')),
        "the controller's LoRA flags arrive as []",
    ),
    "llmisvc: args without eval": (  # KServe single-quotes each LoRA module for the eval
        "llm-inference-service",
        edit(
            "LLMInferenceService",
            lambda d: (main_script(d, 'eval "exec', "exec"), main_script(d, '$@"', '"$@"')),
        ),
        "is neither NAME=PATH nor",
    ),  # fmt: skip
    "llmisvc: KV offloading dropped": (
        "llm-inference-service",
        edit(
            "LLMInferenceService",
            lambda d: main_script(d, "{{ kvTransferConfig .Spec.KVCacheOffloading }}", ""),
        ),
        "spec.kvCacheOffloading arrives as None",
    ),  # fmt: skip
    "llmisvc: drain past the grace period": (
        "llm-inference-service",
        edit(
            "LLMInferenceService",
            lambda d: main_script(d, "{{ shutdownTimeout .Spec.Template 15 }}", "55"),
        ),
        "> the grace period",
    ),  # fmt: skip
    "llmisvc: block size not the scheduler's": (
        "llm-inference-service",
        edit("LLMInferenceService", lambda d: main_script(d, "--block-size 16", "--block-size 64")),
        "block size 64, the scheduler's 16",
    ),
    "llmisvc: events where the picker does not subscribe": (
        "llm-inference-service",
        edit("LLMInferenceService", lambda d: main_script(d, "tcp://*:5557", "tcp://*:5558")),
        "the picker subscribes to each pod on 5557",
    ),
    "llmisvc: topic without the pod's port": (
        "llm-inference-service",
        edit("LLMInferenceService", lambda d: main_script(d, "${POD_IP}:8000@", "${POD_IP}@")),
        "topic 'kv@10.1.2.3@smollm2-135m-instruct'",
    ),
    "llmisvc: no hash seed": (
        "llm-inference-service",
        edit(
            "LLMInferenceService",
            lambda d: d["spec"]["template"]["containers"][0].update(
                env=[
                    e
                    for e in d["spec"]["template"]["containers"][0]["env"]
                    if e["name"] != "PYTHONHASHSEED"
                ]
            ),
        ),
        "no PYTHONHASHSEED",
    ),  # fmt: skip
    "rules: record and alert": (
        "observability",
        edit("PrometheusRule", lambda d: d["spec"]["groups"][0]["rules"][0].update(alert="X")),
        "exactly one of record and alert",
    ),
    "dashboard: data not text": (
        "observability",
        edit("ConfigMap", lambda d: d["data"].update(extra=1)),
        "is not of type 'string'",
    ),
}


@pytest.mark.parametrize("case", BROKEN)
def test_broken_sample_is_caught(case: str) -> None:
    target, change, message = BROKEN[case]
    docs = build(target)
    extra = runtimes()
    if target != "runtime":  # the runtime applied beside the overlay, as the README says
        docs += extra
    change(docs)
    errors = build_errors(docs)
    assert any(message in e for e in errors), errors


def test_every_new_kind_has_a_broken_sample() -> None:
    prefixes = {case.split(":")[0] for case in BROKEN}
    assert prefixes == {"runtime", "isvc", "pdb", "pool", "picker", "service", "rbac", "route",
                        "rules", "dashboard", "llmisvc"}  # fmt: skip


def test_doc_errors_knows_every_kind_built() -> None:
    for target in TARGETS:
        for doc in build(target):
            doc_errors(doc)  # raises for a kind without a schema at hand
