"""Offline admission checks for every kind the overlays build, and the rules that tie them.

Per kind (each returns error strings; empty: accepted):
- InferenceService: validate.py (kserve SDK models, the CRD, the KServe/Knative webhooks), plus
  KServe's KEDA rules for Standard mode.
- ClusterServingRuntime: the vendored CRD, the kserve SDK model, KServe's protocol names and the
  placeholders its template step understands.
- InferencePool: the vendored CRD, its two CEL rules ported by hand (validate.CEL_RULES).
- LLMInferenceService: the vendored CRD, and its `main` container's command as KServe's
  controller runs it (engine_command.py: the Go template rendered, the controller's LoRA and
  tracing args appended, run in bash) parsed by our real CLI: port 8000, /mnt/models, both
  served names, the vllm: metric names, the mounted certificate, the drain within the grace
  period, and the KV events its endpoint picker reads (`engine_errors`).
- Deployment, Service, PodDisruptionBudget, ServiceAccount, Role, RoleBinding: the Kubernetes
  JSON schemas in the `kubernetes-validate` package, strict (unknown fields are errors).
- HTTPRoute: HTTPROUTE_SCHEMA, the subset of Gateway API v1 that a route to an InferencePool
  uses, written down here; anything outside it is an error (no Gateway API CRD is at hand).
- PrometheusRule (manifests/observability): PROMETHEUSRULE_SCHEMA, the Prometheus Operator's
  monitoring.coreos.com/v1 CRD schema written down here, and its webhook's one-of record/alert;
  the rules themselves are promtool's to check (tests/observability/test_rules.py). ConfigMap
  (the Grafana dashboard): the Kubernetes schema, as the kinds above.

Across kinds (`build_errors`): the InferenceService's effective container (the runtime's merged
with the model spec, as KServe merges them, placeholders filled) starts our real CLI parser and
keeps timeouts, drain and grace consistent; selectors reach the predictor pods; references
(pool -> picker Service, route -> pool, picker -> pool) resolve.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
from referencing import Registry, Resource

from tests.deploy.engine_command import engine_errors
from tests.deploy.validate import (
    RESERVED_ENV,
    crd_errors,
    crd_schema,
    sdk_errors,
    validate,
    webhook_errors,
)

Doc = dict[str, Any]
CRD_DIR = Path(__file__).resolve().parent / "crd"
RUNTIME_CRD = CRD_DIR / "serving.kserve.io_clusterservingruntimes.yaml"
POOL_CRD = CRD_DIR / "gie" / "inference.networking.k8s.io_inferencepools.yaml"
LLMISVC_CRD = CRD_DIR / "llmisvc" / "serving.kserve.io_llminferenceservices.yaml"
K8S_VERSION = "1.33"  # the oldest cluster the overlays are for (preStop `sleep` needs >= 1.30)
PROTOCOLS = {"v1", "v2", "grpc-v1", "grpc-v2"}  # KServe's InferenceServiceProtocol values
AUTOSCALER_CLASSES = {"hpa", "keda", "external", "none"}
KEDA_METRIC_TYPES = {"Resource", "External", "PodMetric"}
PLACEHOLDER = re.compile(r"\{\{\s*(.*?)\s*\}\}")
META_FIELD = re.compile(r"^\.(Name|Namespace)$|^\.(Labels|Annotations)\.([\w./-]+)$")
DRAIN_MARGIN_S = 5  # stopping the servers after the drain
# manifests/README.md, "Memory and CPU": the figure the memory requests and limits are sized from
PEAK_RSS = re.compile(r"(?i)peak RSS over a cold start and the load \(VmHWM\): \*\*(\d+) MiB\*\*")
MEMORY_HEADROOM = (1.25, 4.0)  # requests within these multiples of the measured peak
QUANTITY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9}


# ---- Kubernetes kinds: the JSON schemas shipped in kubernetes-validate ---------------------------
@functools.cache
def _k8s_validator(kind: str, api_version: str) -> jsonschema.Draft202012Validator:
    group = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    folder = f"kubernetes-json-schema/v{K8S_VERSION}.0-local-strict"
    schema = kubernetes_validate.utils.schema_contents(
        f"{folder}/{kind.lower()}-{group}.json", K8S_VERSION
    )
    defs = kubernetes_validate.utils.schema_contents(f"{folder}/_definitions.json", K8S_VERSION)
    registry: Registry = Resource.from_contents(defs) @ (
        Resource.from_contents(schema) @ Registry()
    )
    return jsonschema.Draft202012Validator(schema, registry=registry)


def k8s_errors(doc: Doc) -> list[str]:
    validator = _k8s_validator(doc["kind"], doc["apiVersion"])
    return [
        f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)
    ]


# ---- HTTPRoute: the Gateway API v1 subset a route to an InferencePool uses ----------------------
_NAME = {"type": "string", "minLength": 1, "maxLength": 253}
_DURATION = {"type": "string", "pattern": r"^([0-9]{1,5}(h|m|s|ms)){1,4}$"}
HTTPROUTE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"type": "string", "enum": ["gateway.networking.k8s.io/v1"]},
        "kind": {"type": "string", "enum": ["HTTPRoute"]},
        "metadata": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
        "spec": {
            "type": "object",
            "properties": {
                "parentRefs": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 32,
                    "items": {
                        "type": "object",
                        "required": ["name"],
                        "properties": {
                            "group": {"type": "string"},
                            "kind": {"type": "string"},
                            "name": _NAME,
                            "namespace": {"type": "string"},
                            "sectionName": {"type": "string"},
                            "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                        },
                    },
                },
                "hostnames": {"type": "array", "items": {"type": "string"}},
                "rules": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 16,
                    "items": {
                        "type": "object",
                        "properties": {
                            "name": {"type": "string"},
                            "matches": {
                                "type": "array",
                                "maxItems": 64,
                                "items": {
                                    "type": "object",
                                    "properties": {
                                        "path": {
                                            "type": "object",
                                            "properties": {
                                                "type": {
                                                    "type": "string",
                                                    "enum": [
                                                        "Exact",
                                                        "PathPrefix",
                                                        "RegularExpression",
                                                    ],
                                                },
                                                "value": {
                                                    "type": "string",
                                                    "maxLength": 1024,
                                                    "pattern": "^/",
                                                },
                                            },
                                        },
                                        "method": {"type": "string"},
                                    },
                                },
                            },
                            "backendRefs": {
                                "type": "array",
                                "maxItems": 16,
                                "items": {
                                    "type": "object",
                                    "required": ["name"],
                                    "properties": {
                                        "group": {"type": "string"},
                                        "kind": {"type": "string"},
                                        "name": _NAME,
                                        "namespace": {"type": "string"},
                                        "port": {"type": "integer", "minimum": 1},
                                        "weight": {"type": "integer", "minimum": 0},
                                    },
                                },
                            },
                            "timeouts": {
                                "type": "object",
                                "properties": {"request": _DURATION, "backendRequest": _DURATION},
                            },
                        },
                    },
                },
            },
        },
    },
}


# ---- PrometheusRule: the Prometheus Operator's CRD (monitoring.coreos.com/v1, operator 0.82) -----
_PROM_DURATION = {
    "type": "string",
    "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?"
    r"(([0-9]+)ms)?)$",
}
_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
PROMETHEUSRULE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"type": "string", "enum": ["monitoring.coreos.com/v1"]},
        "kind": {"type": "string", "enum": ["PrometheusRule"]},
        "metadata": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
        "spec": {
            "type": "object",
            "properties": {
                "groups": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["name"],
                        "properties": {
                            "name": {"type": "string", "minLength": 1},
                            "interval": _PROM_DURATION,
                            "query_offset": _PROM_DURATION,
                            "labels": _STRING_MAP,
                            "limit": {"type": "integer"},
                            "partial_response_strategy": {
                                "type": "string",
                                "pattern": "(?i)^(abort|warn)?$",
                            },
                            "rules": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "required": ["expr"],
                                    "properties": {
                                        "record": {"type": "string"},
                                        "alert": {"type": "string"},
                                        "expr": {"x-kubernetes-int-or-string": True},
                                        "for": _PROM_DURATION,
                                        "keep_firing_for": {**_PROM_DURATION, "minLength": 1},
                                        "labels": _STRING_MAP,
                                        "annotations": _STRING_MAP,
                                    },
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}


def prometheus_rule_errors(doc: Doc) -> list[str]:
    """The CRD, then what the operator's admission webhook adds: group names unique, each rule
    a recording rule or an alert (not both), `for` and annotations on alerts only."""
    errors = crd_errors(doc, PROMETHEUSRULE_SCHEMA)
    if errors:
        return errors
    groups = doc["spec"].get("groups", [])
    names = [g["name"] for g in groups]
    errors += [f"spec.groups: {n!r} twice" for n in sorted(set(names)) if names.count(n) > 1]
    for g in groups:
        for i, rule in enumerate(g.get("rules", [])):
            where = f"spec.groups[{g['name']}].rules[{i}]"
            if ("record" in rule) == ("alert" in rule):
                errors.append(f"{where}: exactly one of record and alert")
            elif "record" in rule and {"for", "keep_firing_for", "annotations"} & set(rule):
                errors.append(f"{where}: for, keep_firing_for and annotations are for alerts")
    return errors


# ---- ClusterServingRuntime --------------------------------------------------------------------
def placeholder_errors(doc: Any, where: str) -> list[str]:
    """KServe fills `{{...}}` in a runtime's container from the InferenceService's ObjectMeta."""
    return [
        f"{where}: {{{{{expr}}}}} is not a field of the InferenceService's metadata"
        for expr in PLACEHOLDER.findall(json.dumps(doc))
        if not META_FIELD.match(expr)
    ]


def runtime_errors(rt: Doc) -> list[str]:
    errors = sdk_errors(rt, "V1alpha1ClusterServingRuntime")
    schema = crd_schema(RUNTIME_CRD, "v1alpha1")
    assert schema is not None, RUNTIME_CRD
    errors += crd_errors(rt, schema)
    spec = rt.get("spec") or {}
    for proto in spec.get("protocolVersions") or []:
        if proto not in PROTOCOLS:
            errors.append(f"spec.protocolVersions: {proto!r} is not one of {sorted(PROTOCOLS)}")
    if not spec.get("supportedModelFormats"):
        errors.append("spec.supportedModelFormats: a runtime serves at least one model format")
    names = [c.get("name") for c in spec.get("containers") or []]
    if names.count("kserve-container") != 1:
        errors.append(f"spec.containers: exactly one kserve-container, got {names}")
    for i, container in enumerate(spec.get("containers") or []):
        errors += placeholder_errors(container, f"spec.containers[{i}]")
        for env in container.get("env") or []:
            if env.get("name") in RESERVED_ENV:
                errors.append(f"spec.containers[{i}].env: {env['name']!r} is reserved")
    return errors


# ---- InferenceService: KServe's KEDA rules (Standard mode) ------------------------------------
def keda_errors(isvc: Doc) -> list[str]:
    annotations = (isvc.get("metadata") or {}).get("annotations") or {}
    predictor = (isvc.get("spec") or {}).get("predictor") or {}
    errors = []
    autoscaler = annotations.get("serving.kserve.io/autoscalerClass")
    if autoscaler is not None and autoscaler not in AUTOSCALER_CLASSES:
        errors.append(f"serving.kserve.io/autoscalerClass: [{autoscaler}] is not supported")
    mode = annotations.get("serving.kserve.io/deploymentMode", "Knative")
    if autoscaler == "keda" and mode not in ("Standard", "RawDeployment"):
        errors.append("serving.kserve.io/autoscalerClass: keda needs Standard (raw) mode")
    if autoscaler != "keda":
        if predictor.get("autoScaling") and mode in ("Knative", "Serverless"):
            errors.append("spec.predictor.autoScaling: only for Standard mode (HPA or KEDA)")
        return errors
    if predictor.get("scaleMetric") is not None:
        errors.append("spec.predictor.scaleMetric: ScaleMetric is not supported for KEDA")
    for i, metric in enumerate((predictor.get("autoScaling") or {}).get("metrics") or []):
        where = f"spec.predictor.autoScaling.metrics[{i}]"
        kind = metric.get("type")
        if kind not in KEDA_METRIC_TYPES:
            errors.append(f"{where}.type: unknown KEDA metric type {kind!r}")
        if kind == "External":
            external = metric.get("external") or {}
            if not (external.get("metric") or {}).get("query"):
                errors.append(f"{where}.external.metric.query: the query should not be empty")
            target = external.get("target") or {}
            if target.get("value") is None:  # KServe makes KEDA's threshold from `value` only
                errors.append(f"{where}.external.target.value: the threshold should not be empty")
    return errors


# ---- the effective predictor container ------------------------------------------------------
MERGE_KEYS = {"env": "name", "ports": "containerPort", "volumeMounts": "mountPath"}
MODEL_ONLY = {
    "modelFormat",
    "storageUri",
    "protocolVersion",
    "runtime",
    "runtimeVersion",
    "storage",
}


def strategic_merge(base: Doc, patch: Doc) -> Doc:
    """Kubernetes' strategic merge of two containers (the list keys of v1.Container)."""
    out = dict(base)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = strategic_merge(out[key], value)
        elif isinstance(value, list) and key in MERGE_KEYS and isinstance(out.get(key), list):
            by_key = {item[MERGE_KEYS[key]]: item for item in out[key]}
            for item in value:
                by_key[item[MERGE_KEYS[key]]] = strategic_merge(
                    by_key.get(item[MERGE_KEYS[key]], {}), item
                )
            out[key] = list(by_key.values())
        else:
            out[key] = value
    return out


def fill_placeholders(container: Doc, meta: Doc) -> Doc:
    def value(match: re.Match[str]) -> str:
        field = META_FIELD.match(match[1])
        assert field, match[0]
        if field[1]:
            return str(meta.get(field[1].lower(), "default" if field[1] == "Namespace" else ""))
        return str((meta.get(field[2].lower()) or {}).get(field[3], ""))

    return json.loads(PLACEHOLDER.sub(value, json.dumps(container)))


def runtime_for(isvc: Doc, runtimes: Iterable[Doc]) -> tuple[Doc | None, list[str]]:
    """The runtime KServe picks for a `model` predictor, as its runtime selection does."""
    model = isvc["spec"]["predictor"]["model"]
    fmt = (model.get("modelFormat") or {}).get("name")
    protocol = model.get("protocolVersion", "v1")
    named = model.get("runtime")
    fits = [
        rt
        for rt in runtimes
        if (named is None or rt["metadata"]["name"] == named)
        and not rt["spec"].get("disabled", False)
        and protocol in rt["spec"].get("protocolVersions", ["v1"])
        and any(
            f["name"] == fmt and (named is not None or f.get("autoSelect", False))
            for f in rt["spec"].get("supportedModelFormats", [])
        )
    ]
    if not fits:
        return None, [f"spec.predictor.model: no runtime serves format {fmt!r} over {protocol}"]
    return fits[0], []


def effective_pod(isvc: Doc, runtimes: Iterable[Doc]) -> tuple[Doc, list[Doc], list[str]]:
    """(kserve-container, pod volumes, errors): what KServe would run for this predictor."""
    predictor = isvc["spec"]["predictor"]
    volumes = list(predictor.get("volumes") or [])
    if "model" not in predictor:
        return predictor["containers"][0], volumes, []
    runtime, errors = runtime_for(isvc, runtimes)
    if runtime is None:
        return {}, volumes, errors
    (base,) = [c for c in runtime["spec"]["containers"] if c["name"] == "kserve-container"]
    model = {k: v for k, v in predictor["model"].items() if k not in MODEL_ONLY}
    container = fill_placeholders(strategic_merge(base, model), isvc["metadata"])
    return container, volumes + list(runtime["spec"].get("volumes") or []), errors


def quantity_bytes(text: str | int) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGT]i?|k)?", str(text))
    assert match, text
    return float(match[1]) * QUANTITY.get(match[2] or "", 1)


def measured_peak_rss() -> int:
    readme = (Path(__file__).resolve().parents[2] / "manifests" / "README.md").read_text()
    match = PEAK_RSS.search(readme)
    assert match, "manifests/README.md has no measured peak RSS line"
    return int(match[1]) * 2**20


def pod_errors(isvc: Doc, container: Doc, volumes: list[Doc]) -> list[str]:
    """Hygiene of the effective pod: the real CLI accepts it, readiness is the model's route,
    a read-only root with emptyDirs where it writes, drain and grace that let a stream finish,
    memory that fits the measured RSS."""
    from predictor.config import Settings
    from predictor.model.layout import served_name

    errors: list[str] = []
    env = {e["name"]: e.get("value", "") for e in container.get("env") or []}
    try:
        settings = Settings.from_sources(container.get("args") or [], env)
    except (SystemExit, ValueError) as exc:
        return [f"kserve-container: args/env rejected by `python -m predictor`: {exc!r}"]
    name = served_name(settings.model.model_name, settings.model.model_dir)
    ready = f"/v2/models/{name}/ready"
    for probe in ("readinessProbe", "startupProbe"):
        path = ((container.get(probe) or {}).get("httpGet") or {}).get("path")
        if path != ready:
            errors.append(f"kserve-container.{probe}: {path!r}, not the model route {ready}")
    security = container.get("securityContext") or {}
    if not security.get("readOnlyRootFilesystem"):
        errors.append("kserve-container.securityContext.readOnlyRootFilesystem: not true")
    empty_dirs = {v["name"] for v in volumes if "emptyDir" in v}
    mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts") or []}
    for path in ("/tmp", "/home/app/.cache"):
        if mounts.get(path) not in empty_dirs:
            errors.append(f"kserve-container.volumeMounts: {path} is not an emptyDir")
    errors += timing_errors(
        isvc, container, settings.limits.request_timeout, settings.server.drain_seconds
    )
    resources = container.get("resources") or {}
    memory = (resources.get("requests") or {}).get("memory")
    peak, (low, high) = measured_peak_rss(), MEMORY_HEADROOM
    if memory is None or not low * peak <= quantity_bytes(memory) <= high * peak:
        errors.append(
            f"kserve-container.resources.requests.memory: {memory} does not fit the measured "
            f"peak RSS of {peak >> 20} MiB ({low}x to {high}x)"
        )
    if (resources.get("limits") or {}).get("memory") != memory:
        errors.append("kserve-container.resources: memory limit differs from the request")
    return errors


def timing_errors(isvc: Doc, container: Doc, timeout: float, drain: int) -> list[str]:
    annotations = isvc["metadata"].get("annotations") or {}
    predictor = isvc["spec"]["predictor"]
    knative = annotations.get("serving.kserve.io/deploymentMode", "Knative") in (
        "Knative",
        "Serverless",
    )
    pre_stop = ((container.get("lifecycle") or {}).get("preStop") or {}).get("sleep") or {}
    pause = int(pre_stop.get("seconds", 0))
    # Knative sets the pod's terminationGracePeriodSeconds to the revision timeout
    grace = (
        predictor.get("timeout", 300)
        if knative
        else predictor.get("terminationGracePeriodSeconds", 30)
    )
    errors = []
    if timeout <= 0:
        errors.append("PREDICTOR_REQUEST_TIMEOUT: unset, so a stream is bounded by nothing")
    if drain < timeout:
        errors.append(f"a rollout cuts streams: drain {drain} s < request timeout {timeout:.0f} s")
    if grace < pause + drain + DRAIN_MARGIN_S:
        errors.append(
            f"terminationGracePeriodSeconds {grace} < preStop {pause} + drain {drain} "
            f"+ {DRAIN_MARGIN_S}: the kubelet kills the drain"
        )
    if knative and timeout >= predictor.get("timeout", 300):
        errors.append(f"request timeout {timeout:.0f} s does not end before Knative's timeout")
    return errors


# ---- one build: every document, and the rules between them -------------------------------------
KServePodLabels = dict[str, str]


def predictor_pod_labels(isvc: Doc) -> KServePodLabels:
    """Labels KServe puts on the predictor's pods (besides its own hashes)."""
    labels = dict(isvc["metadata"].get("labels") or {})
    labels.update(isvc["spec"]["predictor"].get("labels") or {})
    labels.update(
        {"serving.kserve.io/inferenceservice": isvc["metadata"]["name"], "component": "predictor"}
    )
    return labels


def selects(selector: dict[str, str] | None, labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in (selector or {}).items())


def flag_values(args: list[str]) -> dict[str, str]:
    return dict(a[2:].split("=", 1) for a in args if a.startswith("--") and "=" in a)


def doc_errors(doc: Doc) -> list[str]:
    """One document on its own, as the API server and the admission webhooks check it."""
    kind = doc["kind"]
    if kind == "InferenceService":
        return validate(doc, crd_schema()) + keda_errors(doc)
    if kind == "ClusterServingRuntime":
        return runtime_errors(doc)
    if kind == "InferencePool":
        schema = crd_schema(POOL_CRD, "v1")
        assert schema is not None, POOL_CRD
        return crd_errors(doc, schema)
    if kind == "LLMInferenceService":
        schema = crd_schema(LLMISVC_CRD, doc["apiVersion"].split("/")[1])
        assert schema is not None, LLMISVC_CRD
        return crd_errors(doc, schema) + engine_errors(doc)
    if kind == "HTTPRoute":
        return crd_errors(doc, HTTPROUTE_SCHEMA)
    if kind == "PrometheusRule":
        return prometheus_rule_errors(doc)
    return k8s_errors(doc)


CrossRule = Callable[[dict[str, list[Doc]]], list[str]]


def build_errors(docs: Iterable[Doc], runtimes: Iterable[Doc] = ()) -> list[str]:
    """Every document of one `kubectl kustomize` output, then the rules between them."""
    docs = list(docs)
    runtimes = [*runtimes, *(d for d in docs if d["kind"] == "ClusterServingRuntime")]
    errors = [f"{d['kind']}/{d['metadata']['name']}: {e}" for d in docs for e in doc_errors(d)]
    by_kind: dict[str, list[Doc]] = {}
    for doc in docs:
        by_kind.setdefault(doc["kind"], []).append(doc)
    for isvc in by_kind.get("InferenceService", []):
        container, volumes, errs = effective_pod(isvc, runtimes)
        errors += errs
        if container:
            errors += [f"InferenceService (effective pod): {e}" for e in pod_errors(
                isvc, container, volumes
            )]  # fmt: skip
            merged = json.loads(json.dumps(isvc))
            merged["spec"]["predictor"].pop("model", None)
            merged["spec"]["predictor"]["containers"] = [container]
            errors += [f"InferenceService (effective pod): {e}" for e in webhook_errors(merged)]
    for rule in CROSS_RULES:
        errors += rule(by_kind)
    return errors


def _predictor(by_kind: dict[str, list[Doc]]) -> Doc | None:
    isvcs = by_kind.get("InferenceService", [])
    return isvcs[0] if len(isvcs) == 1 else None


def pdb_rule(by_kind: dict[str, list[Doc]]) -> list[str]:
    isvc, errors = _predictor(by_kind), []
    for pdb in by_kind.get("PodDisruptionBudget", []):
        spec = pdb["spec"]
        if "minAvailable" in spec and "maxUnavailable" in spec:
            errors.append("PodDisruptionBudget: minAvailable and maxUnavailable both set")
        if isvc and not selects(spec["selector"].get("matchLabels"), predictor_pod_labels(isvc)):
            errors.append("PodDisruptionBudget: its selector matches no predictor pod")
    return errors


def pool_rule(by_kind: dict[str, list[Doc]]) -> list[str]:
    isvc, errors = _predictor(by_kind), []
    services = {s["metadata"]["name"]: s for s in by_kind.get("Service", [])}
    for pool in by_kind.get("InferencePool", []):
        spec = pool["spec"]
        match = (spec.get("selector") or {}).get("matchLabels")
        if isvc and not selects(match, predictor_pod_labels(isvc)):
            errors.append("InferencePool: its selector matches no predictor pod")
        ref = spec.get("endpointPickerRef") or {}
        service = services.get(ref.get("name", ""))
        ports = {p["port"] for p in (service or {}).get("spec", {}).get("ports", [])}
        if service is None or (ref.get("port") or {}).get("number") not in ports:
            errors.append(f"InferencePool: endpointPickerRef {ref} is no port of a Service here")
        pickers = [
            d
            for d in by_kind.get("Deployment", [])
            if any(
                flag_values(c.get("args") or []).get("pool-name") == pool["metadata"]["name"]
                for c in d["spec"]["template"]["spec"]["containers"]
            )
        ]
        if not pickers:
            errors.append("InferencePool: no endpoint picker Deployment has --pool-name for it")
        for picker in pickers:
            labels = picker["spec"]["template"]["metadata"].get("labels") or {}
            if service is not None and not selects(service["spec"].get("selector"), labels):
                errors.append("InferencePool: the picker's Service does not select the picker")
            grace = picker["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 30)
            pool_grace = (
                (isvc or {})
                .get("spec", {})
                .get("predictor", {})
                .get("terminationGracePeriodSeconds", 30)
            )
            if grace < pool_grace:
                errors.append(f"picker grace {grace} s < the pool's pods' {pool_grace} s")
    return errors


def route_rule(by_kind: dict[str, list[Doc]]) -> list[str]:
    pools = {p["metadata"]["name"] for p in by_kind.get("InferencePool", [])}
    errors = []
    for route in by_kind.get("HTTPRoute", []):
        for rule in route["spec"].get("rules", []):
            for ref in rule.get("backendRefs", []):
                if (ref.get("group"), ref.get("kind")) != (
                    "inference.networking.k8s.io",
                    "InferencePool",
                ) or ref.get("name") not in pools:
                    errors.append(f"HTTPRoute: backendRef {ref} is not an InferencePool here")
            request = (rule.get("timeouts") or {}).get("request")
            if request is None or seconds(request) < 590:
                errors.append(f"HTTPRoute: request timeout {request} cuts 590 s streams")
    return errors


def rbac_rule(by_kind: dict[str, list[Doc]]) -> list[str]:
    accounts = {a["metadata"]["name"] for a in by_kind.get("ServiceAccount", [])}
    roles = {r["metadata"]["name"] for r in by_kind.get("Role", [])}
    errors = []
    for binding in by_kind.get("RoleBinding", []):
        if binding["roleRef"]["name"] not in roles:
            errors.append(f"RoleBinding: role {binding['roleRef']['name']} is not here")
        errors += [
            f"RoleBinding: ServiceAccount {s['name']} is not here"
            for s in binding.get("subjects", [])
            if s.get("kind") == "ServiceAccount" and s["name"] not in accounts
        ]
    for deployment in by_kind.get("Deployment", []):
        account = deployment["spec"]["template"]["spec"].get("serviceAccountName")
        if account and account not in accounts:
            errors.append(f"Deployment: serviceAccountName {account} is not here")
    return errors


def seconds(duration: str) -> float:
    scale = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    return sum(float(n) * scale[u] for n, u in re.findall(r"(\d+)(ms|h|m|s)", duration))


CROSS_RULES: tuple[CrossRule, ...] = (pdb_rule, pool_rule, route_rule, rbac_rule)


# ---- metric names the manifests rely on ------------------------------------------------------
METRIC_SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}")
PICKER_METRIC_FLAGS = (
    "total-queued-requests-metric",
    "total-running-requests-metric",
    "kv-cache-usage-percentage-metric",
    "lora-info-metric",
    "cache-info-metric",
)


def referenced_metrics(docs: Iterable[Doc]) -> list[tuple[str, dict[str, str], str]]:
    """(metric, label matchers, where) for every KEDA query and picker metric flag."""
    found: list[tuple[str, dict[str, str], str]] = []
    for doc in docs:
        if doc["kind"] == "InferenceService":
            metrics = (doc["spec"]["predictor"].get("autoScaling") or {}).get("metrics") or []
            for m in metrics:
                query = ((m.get("external") or {}).get("metric") or {}).get("query", "")
                found += [(n, _matchers(lbl), "KEDA query") for n, lbl in METRIC_SELECTOR.findall(
                    query
                )]  # fmt: skip
        if doc["kind"] == "Deployment":
            for c in doc["spec"]["template"]["spec"]["containers"]:
                flags = flag_values(c.get("args") or [])
                for flag in PICKER_METRIC_FLAGS:
                    spec = flags.get(flag, "")
                    if spec:  # empty: the picker does not scrape it
                        name, _, labels = spec.partition("{")
                        found.append((name, _matchers(labels.rstrip("}")), f"--{flag}"))
    return found


def _matchers(text: str) -> dict[str, str]:
    return {k.strip(): v.strip().strip('"') for k, v in re.findall(r"(\w+)\s*=\s*([^,]+)", text)}
