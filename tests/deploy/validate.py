"""Offline admission checks for an InferenceService, the way a cluster would run them.

Three layers, each returning a list of error strings (empty: accepted):

- `sdk_errors`: strict structure and types from the kserve SDK's generated models (and the
  kubernetes client's V1Container, V1Probe, ...): every key must be in the model's
  `attribute_map`, every value must have the type its `openapi_types` entry names.
- `crd_errors`: the InferenceService CRD's openAPIV3Schema (types, properties, required, enum,
  pattern, int-or-string), as the API server checks it with strict field validation.
- `webhook_errors`: what KServe's validating webhook and Knative's (Serverless mode) reject:
  one container port named http1/h2c, reserved ports and env names, probe rules, KPA metrics,
  replica bounds, canaryTrafficPercent 0-100, timeout <= Knative's default max of 600 s.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kserve.models as kserve_models
import kubernetes.client as k8s_models
import yaml

# A copy of KServe's CRD (Apache-2.0, see crd/SOURCE.md), so a fresh clone checks against it too.
CRD_PATH = Path(__file__).resolve().parent / "crd" / "serving.kserve.io_inferenceservices.yaml"

# ---- kserve SDK models ------------------------------------------------------------------------
_LIST = re.compile(r"^(?:list|List)\[(.+)\]$")
_DICT = re.compile(r"^(?:dict\(str, (.+)\)|Dict\[str, (.+)\])$")
_QUANTITY_PATH = re.compile(r"\.resources\.(?:limits|requests)\.")
_UPSTREAM = re.compile(r"^K8sIoApi[A-Z][a-z]+(V\d+(?:(?:alpha|beta)\d+)?)([A-Z]\w+)$")


def _scalar_ok(value: Any, type_name: str, path: str) -> bool:
    if type_name in ("object", "datetime"):
        return True
    if type_name == "ResourceQuantity" or (type_name == "str" and _QUANTITY_PATH.search(path)):
        return isinstance(value, str | int | float) and not isinstance(value, bool)
    if type_name == "bool":
        return isinstance(value, bool)
    if type_name == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if type_name == "float":
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(value, str)  # "str"


def sdk_errors(value: Any, type_name: str = "V1beta1InferenceService", path: str = "") -> list[str]:
    if value is None:  # a null field is an absent field to the API server
        return []
    if m := _LIST.match(type_name):
        if not isinstance(value, list):
            return [f"{path}: expected {type_name}, got {type(value).__name__}"]
        return [e for i, v in enumerate(value) for e in sdk_errors(v, m[1], f"{path}[{i}]")]
    if m := _DICT.match(type_name):
        if not isinstance(value, dict):
            return [f"{path}: expected {type_name}, got {type(value).__name__}"]
        return [e for k, v in value.items() for e in sdk_errors(v, m[1] or m[2], f"{path}.{k}")]
    if type_name in ("str", "int", "bool", "float", "object", "datetime", "ResourceQuantity"):
        if _scalar_ok(value, type_name, path):
            return []
        return [f"{path}: expected {type_name}, got {type(value).__name__} {value!r}"]
    if type_name == "V1beta1MetricQuantity":  # a resource.Quantity in the CRD
        type_name = "ResourceQuantity"
        if _scalar_ok(value, type_name, path):
            return []
        return [f"{path}: expected a quantity, got {type(value).__name__} {value!r}"]
    # the SDK names upstream types by Go package: K8sIoApiAppsV1DeploymentStrategy is the
    # kubernetes client's V1DeploymentStrategy
    if m := _UPSTREAM.match(type_name):
        type_name = m[1] + m[2]
    model = getattr(kserve_models, type_name, None) or getattr(k8s_models, type_name, None)
    if model is None:
        return [f"{path}: no SDK model {type_name} to check against"]
    if not isinstance(value, dict):
        return [f"{path}: expected an object ({type_name}), got {type(value).__name__}"]
    fields = {key: model.openapi_types[attr] for attr, key in model.attribute_map.items()}
    errors = []
    for key, item in value.items():
        where = f"{path}.{key}" if path else key
        if key not in fields:
            errors.append(f"{where}: unknown field (not in {type_name})")
        else:
            errors += sdk_errors(item, fields[key], where)
    return errors


# ---- the CRD's openAPIV3Schema ----------------------------------------------------------------
@functools.cache  # parsed once per run: the InferenceService CRD is 2 MB of YAML
def crd_schema(path: Path = CRD_PATH, version: str = "v1beta1") -> dict[str, Any] | None:
    if not path.is_file():
        return None
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load(path.read_text(), Loader=loader)  # noqa: S506 (a safe loader)
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    return served["schema"]["openAPIV3Schema"]


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
}
_INT_RANGE = {"int32": 2**31, "int64": 2**63}


# CEL rules (x-kubernetes-validations) of the vendored CRDs, ported by hand, rule text -> check.
CEL_RULES: dict[str, Callable[[Any], bool]] = {
    # InferencePool spec.targetPorts
    "self.all(p1, self.exists_one(p2, p1.number==p2.number))": lambda ports: all(
        sum(1 for q in ports if q.get("number") == p.get("number")) == 1 for p in ports
    ),
    # InferencePool spec.endpointPickerRef
    "self.kind != 'Service' || has(self.port)": lambda ref: (
        ref.get("kind", "Service") != "Service" or "port" in ref
    ),
    # LLMInferenceService spec (and spec.prefill): a fixed replica count or autoscaling
    "!(has(self.replicas) && has(self.scaling))": lambda spec: (
        not ("replicas" in spec and "scaling" in spec)
    ),
}
_BOUNDS: tuple[tuple[str, Callable[[Any], float], int, str], ...] = (
    ("minLength", len, 1, "is shorter than"),
    ("maxLength", len, -1, "is longer than"),
    ("minItems", len, 1, "has fewer items than"),
    ("maxItems", len, -1, "has more items than"),
    ("minProperties", len, 1, "has fewer properties than"),
    ("maxProperties", len, -1, "has more properties than"),
    ("minimum", float, 1, "is below the minimum"),
    ("maximum", float, -1, "is above the maximum"),
)


def _bound_errors(value: Any, schema: dict[str, Any], path: str) -> list[str]:
    errors = []
    for key, measure, sign, words in _BOUNDS:
        if key in schema and (measure(value) - schema[key]) * sign < 0:
            errors.append(f"{path}: {value!r} {words} {schema[key]} ({key})")
    return errors


def crd_errors(value: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    if value is None:
        return []
    if schema.get("x-kubernetes-int-or-string"):
        if isinstance(value, bool) or not isinstance(value, int | str):
            return [f"{path}: expected an integer or a string, got {value!r}"]
        if (
            isinstance(value, str)
            and "pattern" in schema
            and not re.search(schema["pattern"], value)
        ):
            return [f"{path}: {value!r} does not match {schema['pattern']}"]
        return []
    kind = schema.get("type")
    if kind and (
        not isinstance(value, _JSON_TYPES[kind]) or (kind != "boolean" and isinstance(value, bool))
    ):
        return [f"{path}: expected {kind}, got {type(value).__name__} {value!r}"]
    errors = []
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} is not one of {schema['enum']}")
    if kind == "string" and "pattern" in schema and not re.search(schema["pattern"], value):
        errors.append(f"{path}: {value!r} does not match {schema['pattern']}")
    bound = _INT_RANGE.get(schema.get("format", "")) if kind == "integer" else None
    if bound and not -bound <= value < bound:
        errors.append(f"{path}: {value} does not fit {schema['format']}")
    errors += _bound_errors(value, schema, path)
    for validation in schema.get("x-kubernetes-validations", []):
        check = CEL_RULES.get(validation["rule"])
        if check is None:  # fail closed: a rule nobody ported is not silently passed
            errors.append(f"{path}: CEL rule not checked offline: {validation['rule']}")
        elif not check(value):
            errors.append(f"{path}: {validation.get('message', validation['rule'])}")
    if kind == "object":
        props, extra = schema.get("properties"), schema.get("additionalProperties")
        errors += [f"{path}.{r}: required" for r in schema.get("required", []) if r not in value]
        for key, item in value.items():
            where = f"{path}.{key}" if path else key
            if props is not None and key in props:
                errors += crd_errors(item, props[key], where)
            elif isinstance(extra, dict):
                errors += crd_errors(item, extra, where)
            elif props is not None and not schema.get("x-kubernetes-preserve-unknown-fields"):
                errors.append(f"{where}: unknown field (not in the CRD schema)")
    if kind == "array" and "items" in schema:
        errors += [
            e for i, v in enumerate(value) for e in crd_errors(v, schema["items"], f"{path}[{i}]")
        ]
    return errors


# ---- KServe + Knative webhooks (Knative/Serverless mode) --------------------------------------
ISVC_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DEPLOYMENT_MODES = {"Knative", "Serverless", "Standard", "RawDeployment", "ModelMesh"}
PORT_NAMES = {"", "http1", "h2c"}
RESERVED_PORTS = {8012, 8013, 8022, 9090, 9091, 8008}  # queue-proxy and profiling
RESERVED_ENV = {"PORT", "K_SERVICE", "K_CONFIGURATION", "K_REVISION"}
# Knative's ContainerMask (+ startupProbe, allowed since Knative Serving 1.15).
CONTAINER_FIELDS = {
    "name", "args", "command", "env", "workingDir", "envFrom", "image", "imagePullPolicy",
    "livenessProbe", "readinessProbe", "startupProbe", "ports", "resources", "securityContext",
    "terminationMessagePath", "terminationMessagePolicy", "volumeMounts",
}  # fmt: skip
SECURITY_FIELDS = {
    "allowPrivilegeEscalation", "capabilities", "readOnlyRootFilesystem", "runAsGroup",
    "runAsNonRoot", "runAsUser", "seccompProfile",
}  # fmt: skip
SCALE_METRICS = {"cpu", "memory", "concurrency", "rps"}
KPA_METRICS = {"concurrency", "rps"}
MAX_REVISION_TIMEOUT = 600  # Knative config-defaults max-revision-timeout-seconds, by default
MAX_CONTAINER_CONCURRENCY = 1000  # Knative container-concurrency-max-limit, by default


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def duration_seconds(text: str) -> float:
    """A Go duration such as "1200s", "20m" or "1h30m"."""
    parts = re.fullmatch(r"((?:\d+(?:\.\d+)?(?:h|m|s|ms))+)", text)
    if not parts:
        raise ValueError(f"not a duration: {text!r}")
    scale = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    return sum(float(n) * scale[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", text))


def startup_budget(probe: dict[str, Any]) -> int:
    """Seconds a startupProbe waits before the kubelet gives up (Kubernetes defaults)."""
    delay = _int(probe.get("initialDelaySeconds")) or 0
    period = _int(probe.get("periodSeconds")) or 10
    return delay + period * (_int(probe.get("failureThreshold")) or 3)


def _string_map_errors(where: str, mapping: Any) -> list[str]:
    if not isinstance(mapping, dict):
        return []
    return [
        f"{where}.{k}: annotation/label values must be strings, got {type(v).__name__} {v!r}"
        for k, v in mapping.items()
        if not isinstance(v, str)
    ]


def _probe_errors(where: str, probe: dict[str, Any], port_name: str) -> list[str]:
    errors = []
    handlers = [h for h in ("httpGet", "tcpSocket", "exec", "grpc") if h in probe]
    if len(handlers) != 1:
        errors.append(f"{where}: exactly one of httpGet, tcpSocket, exec, grpc, got {handlers}")
    for handler in ("httpGet", "tcpSocket"):
        port = (probe.get(handler) or {}).get("port")
        if isinstance(port, str) and port != port_name:
            errors.append(f"{where}.{handler}.port: Probe port must match container port")
    return errors


def _container_errors(where: str, c: dict[str, Any], port_name: str) -> list[str]:
    errors = [f"{where}.{k}: not allowed by Knative" for k in c if k not in CONTAINER_FIELDS]
    for i, env in enumerate(c.get("env") or []):
        if isinstance(env, dict) and env.get("name") in RESERVED_ENV:
            errors.append(f"{where}.env[{i}]: {env['name']!r} is a reserved environment variable")
    for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
        if isinstance(c.get(kind), dict):
            errors += _probe_errors(f"{where}.{kind}", c[kind], port_name)
    security = c.get("securityContext") or {}
    errors += [
        f"{where}.securityContext.{k}: not allowed by Knative"
        for k in security
        if k not in SECURITY_FIELDS
    ]
    if (security.get("capabilities") or {}).get("add"):
        errors.append(f"{where}.securityContext.capabilities.add: not allowed by Knative")
    return errors


def _port_errors(containers: list[dict[str, Any]]) -> tuple[str, list[str]]:
    ports = [p for c in containers for p in (c.get("ports") or [])]
    errors = []
    if len(ports) > 1:
        errors.append("containers[*].ports: more than one container port is set (Knative: one)")
    if not ports:
        return "", errors + (["containers[*].ports: missing"] if len(containers) > 1 else [])
    port = ports[0]
    if port.get("name", "") not in PORT_NAMES:
        errors.append(
            f"containers[*].ports[0].name: port name {port.get('name')!r} is not allowed (http1, h2c)"
        )
    if port.get("protocol", "TCP") != "TCP":
        errors.append(f"containers[*].ports[0].protocol: {port.get('protocol')!r}, only TCP")
    number = _int(port.get("containerPort"))
    if number in RESERVED_PORTS or (number is not None and not 0 < number < 65536):
        errors.append(f"containers[*].ports[0].containerPort: {number} is reserved or out of range")
    return str(port.get("name", "")), errors


def webhook_errors(isvc: dict[str, Any]) -> list[str]:
    meta, errors = isvc.get("metadata") or {}, []
    name = str(meta.get("name", ""))
    if not ISVC_NAME.match(name) or len(name + "-predictor") > 63:
        errors.append(f"metadata.name: {name!r} is not a DNS-1035 label short enough for Knative")
    annotations = meta.get("annotations") or {}
    predictor = (isvc.get("spec") or {}).get("predictor") or {}
    for where, mapping in (
        ("metadata.annotations", annotations),
        ("metadata.labels", meta.get("labels")),
    ):
        errors += _string_map_errors(where, mapping)
    for key in ("annotations", "labels"):
        errors += _string_map_errors(f"spec.predictor.{key}", predictor.get(key))
    mode = annotations.get("serving.kserve.io/deploymentMode", "Knative")
    if mode not in DEPLOYMENT_MODES:
        errors.append(f"serving.kserve.io/deploymentMode: {mode!r} is not a deployment mode")
    knative = mode in ("Knative", "Serverless")
    lo, hi = _int(predictor.get("minReplicas")), _int(predictor.get("maxReplicas"))
    if (lo is not None and lo < 0) or (hi is not None and hi < 0):
        errors.append("spec.predictor: minReplicas and maxReplicas must be >= 0")
    if lo is not None and hi and lo > hi:
        errors.append("spec.predictor: minReplicas must not exceed maxReplicas")
    canary = _int(predictor.get("canaryTrafficPercent"))
    if canary is not None and not 0 <= canary <= 100:
        errors.append(f"spec.predictor.canaryTrafficPercent: {canary} is not within 0-100")
    concurrency = _int(predictor.get("containerConcurrency"))
    if concurrency is not None and not 0 <= concurrency <= MAX_CONTAINER_CONCURRENCY:
        errors.append(f"spec.predictor.containerConcurrency: {concurrency} not in 0-1000")
    metric = predictor.get("scaleMetric")
    if metric is not None and metric not in SCALE_METRICS:
        errors.append(f"spec.predictor.scaleMetric: {metric!r} is not a supported metric")
    if not knative:
        return errors
    timeout = _int(predictor.get("timeout"))
    if timeout is not None and not 0 <= timeout <= MAX_REVISION_TIMEOUT:
        errors.append(
            f"spec.predictor.timeout: {timeout} exceeds Knative's max-revision-timeout-seconds "
            f"({MAX_REVISION_TIMEOUT} unless the cluster's config-defaults raises it)"
        )
    hpa = annotations.get("autoscaling.knative.dev/class", "").startswith("hpa")
    if metric is not None and not hpa and metric not in KPA_METRICS:
        errors.append(
            f"spec.predictor.scaleMetric: {metric!r} is not a KPA metric (concurrency, rps)"
        )
    if metric == "rps" and (_int(predictor.get("scaleTarget")) or 0) < 1:
        errors.append("spec.predictor.scaleTarget: the target for rps should be at least 1")
    if predictor.get("deploymentStrategy") is not None:
        errors.append("spec.predictor.deploymentStrategy: only for Standard (raw) mode")
    containers = [c for c in predictor.get("containers") or [] if isinstance(c, dict)]
    port_name, port_errs = _port_errors(containers)
    errors += [f"spec.predictor.{e}" for e in port_errs]
    for i, container in enumerate(containers):
        errors += _container_errors(f"spec.predictor.containers[{i}]", container, port_name)
    deadline = annotations.get("serving.knative.dev/progress-deadline")
    if isinstance(deadline, str):
        try:
            seconds = duration_seconds(deadline)
        except ValueError as exc:
            return [*errors, f"serving.knative.dev/progress-deadline: {exc}"]
        for c in containers:
            if (
                isinstance(c.get("startupProbe"), dict)
                and startup_budget(c["startupProbe"]) >= seconds
            ):
                errors.append("progress-deadline must exceed the startupProbe's budget")
    return errors


def validate(isvc: dict[str, Any], schema: dict[str, Any] | None) -> list[str]:
    """Every layer's errors; the CRD layer only when its schema is at hand."""
    crd = crd_errors(isvc, schema) if schema is not None else []
    return sdk_errors(isvc) + crd + webhook_errors(isvc)
