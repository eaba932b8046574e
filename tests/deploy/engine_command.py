"""An LLMInferenceService's engine command as KServe's controller runs it, checked offline.

KServe (kserve/kserve, pkg/controller/v1alpha2/llmisvc) merges the presets with the service's own
spec, marshals the result to JSON and renders that text as a Go template (`ReplaceVariables`):
`{{ .Spec.Model.Name }}`, `{{ .ObjectMeta.Namespace }}`, `{{ if .GlobalConfig.EnableTLS }}`,
`{{ shutdownTimeout .Spec.Template 15 }}` (the grace period less the preStop pause and 5 s) and
`{{ kvTransferConfig .Spec.KVCacheOffloading }}` (`--kv-transfer-config '<JSON>'`, its quotes
escaped for the shell). Then it appends vLLM's LoRA flags (`workload_lora.go`: each module's JSON
single-quoted, for the preset's `eval`) and the tracing flags (`tracing.go`) to the container's
args. `render` does the template step the same way, over the JSON text; `engine_argv` runs the
rendered command in a real bash with those args appended and a stub `python` that records what
it was given; `engine_errors` parses that with our real CLI and checks it against the contract:
port 8000, /mnt/models, both served names, the drain within the grace period, and, where the
scheduler reads KV events, the events config the endpoint picker's plugin expects.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from predictor import vllm_args
from predictor.config import build_parser

Doc = dict[str, Any]
# what KServe's controller and its preset (kserve-config-llm-template) fix: the engine's Service
# and InferencePool target port, the TLS files, the preStop pause and the grace period
LLMISVC_PORT = 8000
LLMISVC_TLS = ("/var/run/kserve/tls/tls.crt", "/var/run/kserve/tls/tls.key")
PRESET_PRESTOP_S = 15
PRESET_GRACE_S = 60
DRAIN_MARGIN_S = 5  # stopping the servers after the drain (kinds.py's)
NAMESPACE = "team-a"  # the namespace the checks render the templates in
POD_IP = "10.1.2.3"
# what the controller appends: spec.model.lora with one adapter and every limit set, and tracing
LORA_ARGS = ["--enable-lora", "--max-lora-rank=16", "--max-loras=2", "--max-cpu-loras=4",
             "--lora-modules", """'{"name":"sql","path":"/mnt/lora/sql"}'"""]  # fmt: skip
TRACING_ARGS = ["--otlp-traces-endpoint", "http://otel-collector:4317",
                "--collect-detailed-traces", "all"]  # fmt: skip
# spec.kvCacheOffloading as KServe's kv-cache-offloading sample sets it
OFFLOADING = {"cpu": 10 * 2**30, "evictionPolicy": "lru",
              "secondary": [{"fileSystem": {"emptyDir": {"size": "100Gi"}}}]}  # fmt: skip
_TLS = re.compile(r"\{\{ if \.GlobalConfig\.EnableTLS \}\}(.*?)\{\{ end \}\}", re.S)
_SHUTDOWN = re.compile(r"\{\{ shutdownTimeout \.Spec\.Template (\d+) \}\}")
_KV_TRANSFER = "{{ kvTransferConfig .Spec.KVCacheOffloading }}"


def kv_transfer_flag(offloading: Doc | None) -> str:
    """KServe's kvTransferConfig template function (config_merge.go): its output, as it is put
    into the JSON text of the rendered spec."""
    if offloading is None:
        return ""
    extra: Doc = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": offloading["cpu"]}
    if offloading.get("evictionPolicy"):
        extra["eviction_policy"] = offloading["evictionPolicy"]
    tiers = [{"type": "fs", "root_dir": f"/mnt/kv-cache-{i}"}
             for i, tier in enumerate(offloading.get("secondary", [])) if tier.get("fileSystem")]  # fmt: skip
    if tiers:
        extra["secondary_tiers"] = tiers
    config = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": extra}  # fmt: skip
    text = json.dumps(config, sort_keys=True, separators=(",", ":"))  # Go's json.Marshal
    return "--kv-transfer-config '" + text.replace('"', '\\\\\\"') + "'"


def render(text: str, doc: Doc, tls: bool, offloading: Doc | None) -> str:
    """`text` (a string of the spec) as KServe renders it: over the spec's JSON text."""
    spec = doc["spec"]
    name = spec["model"].get("name") or doc["metadata"]["name"]
    grace = (spec.get("template") or {}).get("terminationGracePeriodSeconds", PRESET_GRACE_S)
    raw = json.dumps(text)
    raw = _TLS.sub(lambda m: m[1] if tls else "", raw)
    raw = _SHUTDOWN.sub(lambda m: str(max(0, grace - int(m[1]) - min(5, grace))), raw)
    raw = raw.replace(_KV_TRANSFER, kv_transfer_flag(offloading))
    raw = raw.replace("{{ .Spec.Model.Name }}", name)
    raw = raw.replace("{{ .ObjectMeta.Namespace }}", NAMESPACE)
    raw = raw.replace("{{ .ObjectMeta.Name }}", doc["metadata"]["name"])
    if "{{" in raw:
        raise ValueError(f"a template this check does not know: {json.loads(raw)!r}")
    rendered: str = json.loads(raw)
    return rendered


def engine_argv(command: list[str], env: dict[str, str]) -> list[str]:
    """What `python` is given when the pod runs `command` (a real bash; a stub `python`)."""
    with tempfile.TemporaryDirectory() as folder:
        stub, out = Path(folder) / "python", Path(folder) / "argv"
        stub.write_text('#!/bin/sh\nprintf \'%s\\0\' "$@" > "$ARGV_OUT"\n')
        stub.chmod(0o755)
        bash = shutil.which("bash") or "/bin/bash"
        environ = {"PATH": f"{folder}:{os.environ.get('PATH', '')}", "ARGV_OUT": str(out), **env}
        done = subprocess.run([bash, *command[1:]], env=environ, capture_output=True, text=True,
                              timeout=30, check=False)  # fmt: skip
        if done.returncode != 0 or not out.exists():
            raise ValueError(f"the command fails in bash: {done.stderr.strip()!r}")
        return out.read_bytes().decode().split("\0")[:-1]


def main_env(doc: Doc) -> dict[str, str]:
    """The `main` container's plain variables, POD_IP as the downward API gives it."""
    (main,) = [c for c in doc["spec"]["template"]["containers"] if c["name"] == "main"]
    return {**{e["name"]: e.get("value", "") for e in main.get("env") or []}, "POD_IP": POD_IP}


def rendered_argv(doc: Doc, tls: bool, offloading: Doc | None) -> list[str]:
    """The engine's argv (after `python`) in a pod KServe makes of `doc`: its `main` command
    rendered, run with the controller's LoRA and tracing args (ValueError: it cannot be)."""
    (main,) = [c for c in doc["spec"]["template"]["containers"] if c["name"] == "main"]
    command = [*(main.get("command") or []), *(main.get("args") or [])]
    script = render(command[2], doc, tls, offloading)
    return engine_argv([command[0], "-c", script, *command[3:], *LORA_ARGS, *TRACING_ARGS],
                       main_env(doc))  # fmt: skip


def _producer(doc: Doc) -> Doc | None:
    """The scheduler's precise-prefix-cache-producer parameters, where it reads KV events."""
    scheduler = (doc["spec"].get("router") or {}).get("scheduler") or {}
    inline = (scheduler.get("config") or {}).get("inline") or {}
    for plugin in inline.get("plugins") or []:
        if plugin.get("type") == "precise-prefix-cache-producer":
            parameters: Doc = plugin.get("parameters") or {}
            return parameters
    return None


def engine_errors(doc: Doc) -> list[str]:
    """An LLMInferenceService's `main` container, rendered with KServe's TLS on and off and
    with and without spec.kvCacheOffloading, run with the controller's LoRA and tracing args:
    it starts our real CLI parser with what KServe's controller and preset expect of `vllm
    serve`, and publishes the KV events its endpoint picker reads."""
    spec = doc["spec"]
    mains = [c for c in (spec.get("template") or {}).get("containers") or [] if c["name"] == "main"]
    if len(mains) != 1:
        return ["LLMInferenceService: no `main` container (the engine KServe probes)"]
    command = [*(mains[0].get("command") or []), *(mains[0].get("args") or [])]
    if (
        command[:1] not in (["/bin/bash"], ["/bin/sh"])
        or command[1:2] != ["-c"]
        or len(command) < 4
    ):
        return ["main.command: not `/bin/bash -c SCRIPT --` (the preset's shape)"]
    name = spec["model"].get("name") or doc["metadata"]["name"]
    env = main_env(doc)
    errors = []
    for tls, offloading in ((True, OFFLOADING), (False, None)):
        where = f"main.command (TLS {'on' if tls else 'off'})"
        try:
            argv = rendered_argv(doc, tls, offloading)
        except ValueError as exc:
            errors.append(f"{where}: {exc}")
            continue
        if argv[:2] != ["-m", "predictor"]:
            errors.append(f"{where}: does not exec `python -m predictor`: {argv[:2]}")
            continue
        try:
            ns = build_parser({}).parse_args(argv[2:])
        except SystemExit:
            errors.append(f"{where}: `python -m predictor` rejects {argv[2:]}")
            continue
        errors += _contract_errors(ns, where, name, tls, offloading is not None)
        errors += _kv_events_errors(ns, where, name, _producer(doc), env)
    return errors


def _contract_errors(ns: Any, where: str, name: str, tls: bool, offloading: bool) -> list[str]:
    errors = []
    if ns.http_port != LLMISVC_PORT or ns.host != "0.0.0.0":
        errors.append(f"{where}: serves {ns.host}:{ns.http_port}, not 0.0.0.0:{LLMISVC_PORT}")
    names = (ns.model_name, *ns.served_aliases, *ns.model_aliases)
    if str(ns.model_dir) != "/mnt/models" or names != (
        name,
        f"publishers/{NAMESPACE}/models/{name}",
    ):
        errors.append(f"{where}: model {ns.model_dir} as {names}, not /mnt/models as {name!r} "
                      "and publishers/<namespace>/models/<name>")  # fmt: skip
    if not ns.vllm_metric_aliases:
        errors.append(f"{where}: no vllm: metric names, which the endpoint picker reads")
    if (ns.ssl_certfile, ns.ssl_keyfile) != (LLMISVC_TLS if tls else ("", "")):
        errors.append(f"{where}: certificate {ns.ssl_certfile!r}, key {ns.ssl_keyfile!r}")
    if ns.drain_seconds + PRESET_PRESTOP_S + DRAIN_MARGIN_S > PRESET_GRACE_S:
        errors.append(f"{where}: drain {ns.drain_seconds} s + preStop {PRESET_PRESTOP_S} s + "
                      f"{DRAIN_MARGIN_S} > the grace period {PRESET_GRACE_S} s")  # fmt: skip
    try:
        adapters = [vllm_args.lora_module(entry) for entry in ns.lora_modules]
        transfer = vllm_args.kv_transfer_config(ns.kv_transfer_config)
    except ValueError as exc:
        return [*errors, f"{where}: {exc}"]
    if not ns.enable_lora or adapters != [("sql", "/mnt/lora/sql")] or ns.max_cpu_loras != 4:
        errors.append(f"{where}: the controller's LoRA flags arrive as {adapters}")
    if ns.otlp_traces_endpoint != TRACING_ARGS[1]:
        errors.append(f"{where}: the controller's tracing flags arrive as "
                      f"{ns.otlp_traces_endpoint!r}")  # fmt: skip
    connector = (transfer or {}).get("kv_connector")
    if connector != ("OffloadingConnector" if offloading else None):
        errors.append(f"{where}: spec.kvCacheOffloading arrives as {transfer}")
    return errors


def _kv_events_errors(
    ns: Any, where: str, name: str, producer: Doc | None, env: dict[str, str]
) -> list[str]:
    """Where the scheduler reads KV events: the engine publishes them where and as it reads."""
    if producer is None:
        return []
    try:
        events = vllm_args.kv_events_config(ns.kv_events_config)
    except ValueError as exc:
        return [f"{where}: {exc}"]
    if events is None or not events.publishing:
        return [f"{where}: the scheduler reads KV events and the engine publishes none"]
    errors = []
    discovery = producer.get("kvEventsConfig") or {}
    port = (discovery.get("podDiscoveryConfig") or {}).get("socketPort")
    if discovery.get("discoverPods") and events.endpoint != f"tcp://*:{port}":
        errors.append(f"{where}: the picker subscribes to each pod on {port}, the engine "
                      f"publishes on {events.endpoint}")  # fmt: skip
    topic = f"kv@{POD_IP}:{LLMISVC_PORT}@{name}"
    if events.topic != topic or not topic.startswith(discovery.get("topicFilter", "")):
        errors.append(f"{where}: topic {events.topic!r}, not {topic!r}")
    block = (producer.get("tokenProcessorConfig") or {}).get("blockSize", 16)
    if ns.kv_block_size != block:
        errors.append(f"{where}: block size {ns.kv_block_size}, the scheduler's {block}")
    if ns.prefix_caching_hash_algo != "sha256_cbor":
        errors.append(f"{where}: hashes {ns.prefix_caching_hash_algo}, the scheduler sha256_cbor")
    if not env.get("PYTHONHASHSEED"):
        errors.append(f"{where}: no PYTHONHASHSEED, so no router can compute the block hashes")
    return errors
