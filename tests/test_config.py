import socket
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from load.random_lora import write_adapter
from predictor import config, vllm_args
from predictor.config import (
    GROUPS,
    CacheSettings,
    LimitsSettings,
    LoraSettings,
    ModelSettings,
    SchedulerSettings,
    ServerSettings,
    Settings,
    SpeculationSettings,
    TelemetrySettings,
    build_parser,
)
from predictor.config import model as model_module
from predictor.model.layout import served_name
from tests.support import ServerProcess

# each setting's group, by the setting's (the flag's) name
GROUP_OF = {f.name: group for group, kind in GROUPS.items() for f in fields(kind)}
# every boolean setting, so that a new one is checked in every form below without a word here
BOOLEANS = [f.name for kind in GROUPS.values() for f in fields(kind) if type(f.default) is bool]
# each one's flag names: ours, then vLLM's (vllm_args.FLAG_ALIASES)
BOOLEAN_FLAGS = [
    (name, flag)
    for name in BOOLEANS
    for flag in ("--" + name.replace("_", "-"), *vllm_args.FLAG_ALIASES.get(name, ()))
]
# accepted for compatibility and always on: false is refused (test_batch_invariant_is_always_on)
ALWAYS_ON = {"batch_invariant"}
SWITCHABLE_FLAGS = [(name, flag) for name, flag in BOOLEAN_FLAGS if name not in ALWAYS_ON]


def setting(settings: Settings, name: str) -> Any:
    """A setting by its flag's name, from its group."""
    return getattr(getattr(settings, GROUP_OF[name]), name)


def test_defaults_and_flags() -> None:
    s = Settings.from_sources(["--http-port", "9000", "--model-dir", "/mnt/models"], {})
    assert s.server.http_port == 9000
    assert s.server.grpc_port == 8081
    assert s.server.host == "127.0.0.1"
    assert s.model.model_dir == Path("/mnt/models")
    assert served_name(s.model.model_name, s.model.model_dir) == "models"


def test_environment_gives_defaults_and_flags_win() -> None:
    env = {"PREDICTOR_THREADS": "3", "PREDICTOR_ENABLE_GRPC": "false", "PREDICTOR_HTTP_PORT": "1"}
    s = Settings.from_sources(["--http-port", "2"], env)
    assert s.model.threads == 3 and s.model.torch_threads == 3
    assert s.server.enable_grpc is False
    assert s.server.http_port == 2


def test_model_name_defaults_to_folder_name() -> None:
    s = Settings.from_sources(["--model-dir", "models/smollm2-135m-instruct-gptq/"], {})
    assert served_name(s.model.model_name, s.model.model_dir) == "smollm2-135m-instruct-gptq"
    named = Settings.from_sources(["--model-name", "x"], {})
    assert served_name(named.model.model_name, named.model.model_dir) == "x"


def test_model_name_of_a_nested_storage_folder_is_the_checkpoints(tmp_path: Path) -> None:
    # KServe's storage initializer may leave the checkpoint one folder below /mnt/models: the
    # served name (for routes and for the manifests' probes alike) is the checkpoint folder's
    # (once computed as the mount's name in one place and the checkpoint's in another)
    (tmp_path / "models" / "smollm2-gptq").mkdir(parents=True)
    (tmp_path / "models" / "smollm2-gptq" / "config.json").write_text("{}")
    s = Settings.from_sources(["--model-dir", str(tmp_path / "models")], {})
    assert served_name(s.model.model_name, s.model.model_dir) == "smollm2-gptq"


def test_kserve_flags_are_not_ours() -> None:
    # KServe's own parser owns --http_port/--model_name; ours use dashes and no abbreviations.
    with pytest.raises(SystemExit):
        Settings.from_sources(["--http_port", "1"], {})
    with pytest.raises(SystemExit):
        Settings.from_sources(["--http", "1"], {})


def test_help_lists_our_flags() -> None:
    text = build_parser({}).format_help()
    for flag in ("--model-dir", "--model-name", "--http-port", "--grpc-port", "--host",
                 "--threads", "--max-tokens-limit"):  # fmt: skip
        assert flag in text


def test_the_help_has_a_section_per_group_with_its_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    """--help in sections, as vLLM's: each group's name, its one-line description, then its
    flags (and no flag elsewhere); vLLM's flags without a setting last."""
    monkeypatch.setenv("COLUMNS", "1000")  # one line per flag and per description
    text = build_parser({}).format_help()
    starts = {name: text.index(f"\n{name}:\n") for name in [*GROUPS, "vllm"]}
    assert list(starts) == sorted(starts, key=starts.__getitem__)  # in GROUPS' order
    ends = dict(zip(starts, [*list(starts.values())[1:], len(text)], strict=True))
    for name, kind in GROUPS.items():
        section = text[starts[name] : ends[name]]
        assert section.splitlines()[2].strip() == kind.__doc__.strip()  # one line
        for f in fields(kind):
            assert f"  --{f.name.replace('_', '-')} " in section, (name, f.name)
    assert "--served-model-name" in text[starts["vllm"] :]


def test_each_group_checks_its_own_settings() -> None:
    """A group's check() needs no other group: what concerns one is refused there."""
    for group, message in (
        (ModelSettings(kernel="fastest"), "--kernel must be one of"),
        (LimitsSettings(default_max_tokens=600), "must not exceed --max-tokens-limit"),
        (SchedulerSettings(max_step_tokens=16), "room for prefill"),
        (CacheSettings(kv_block_size=0), "--kv-block-size must be >= 1"),
        (SpeculationSettings(num_speculative_tokens=17), "between 1 and 16"),
        (LoraSettings(max_lora_rank=0), "--max-lora-rank must be between 1 and 256"),
        (ServerSettings(drain_seconds=-1), "must not be negative"),
        (TelemetrySettings(log_payloads="hash"), "needs --payload-logger-url"),
    ):
        with pytest.raises(ValueError, match=message):
            group.check()
        with pytest.raises(ValueError, match=message):  # and Settings' check runs it
            changed: dict[str, Any] = {GROUP_OF[fields(group)[0].name]: group}
            replace(Settings(), **changed).check()
    for kind in GROUPS.values():
        kind().check()  # the defaults are served


def test_inconsistent_limits_are_refused() -> None:
    with pytest.raises(ValueError):
        Settings.from_sources(["--default-max-tokens", "100", "--max-tokens-limit", "10"], {})


def test_kernel_forces_a_runner_kernel_and_the_autotune_cache_is_a_folder() -> None:
    settings = Settings.from_sources(["--kernel", "native_i8_avx2", "--autotune-cache", ""], {})
    assert settings.model.kernel == "native_i8_avx2" and settings.model.autotune_dir is None
    assert Settings().model.autotune_dir == Path(Settings().model.autotune_cache)
    with pytest.raises(ValueError, match="--kernel must be one of auto, autotune"):
        Settings.from_sources(["--kernel", "fastest"], {})
    loads = Settings.from_sources(["--loader-kernel", "dequantized"], {})
    assert loads.model.loader_kernel == "dequantized" and loads.model.kernel == "auto"


def test_the_default_thread_count_leaves_one_core_to_serving(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for cpus, threads in ((1, 1), (2, 1), (16, 15)):
        monkeypatch.setattr(model_module, "container_cpus", lambda n=cpus: n)
        assert Settings().model.torch_threads == threads
    assert Settings(ModelSettings(threads=2)).model.torch_threads == 2


@pytest.mark.parametrize(
    ("name", "value"),
    [("MAX_BATCH_SIZE", "abc"), *((name.upper(), "maybe") for name in BOOLEANS)],
)
def test_a_bad_environment_value_is_a_usage_error_naming_it(
    name: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        Settings.from_sources([], {f"PREDICTOR_{name}": value})
    assert exit_.value.code == 2
    assert f"PREDICTOR_{name}={value!r} is not a valid" in capsys.readouterr().err


def test_opentelemetry_variables_and_payload_settings() -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318",
           "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}  # fmt: skip
    s = Settings.from_sources([], env)
    assert (s.telemetry.otlp_traces_endpoint, s.telemetry.otlp_traces_protocol) == (
        "http://collector:4318/v1/traces", "http/protobuf"
    )  # fmt: skip
    s = Settings.from_sources([], {**env, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:1/x"})
    assert s.telemetry.otlp_traces_endpoint == "http://t:1/x"
    s = Settings.from_sources(["--otlp-traces-endpoint", "http://a:4317"], env)
    assert s.telemetry.otlp_traces_endpoint == "http://a:4317"
    assert Settings.from_sources([], {}).telemetry.otlp_traces_endpoint == ""
    with pytest.raises(ValueError, match="payload-logger-url"):
        Settings.from_sources(["--log-payloads", "hash"], {})
    with pytest.raises(SystemExit):
        Settings.from_sources(["--log-payloads", "everything"], {})


def test_vllm_flag_names_set_the_same_settings(tmp_path: Path) -> None:
    """What `vllm serve` is given (KServe's LLMInferenceService passes vLLM's flags)."""
    s = Settings.from_sources(["--port", "8000", "--served-model-name", "smollm"], {})
    assert (
        s.server.http_port == 8000
        and s.model.model_name == "smollm"
        and s.model.model_aliases == ()
    )
    # several names: the first is the model's, the others answer too (as vLLM's)
    several = Settings.from_sources(
        ["--served-model-name", "a", "org/a", "--model-aliases", "b"], {}
    )
    assert several.model.model_name == "a" and several.model.model_aliases == ("org/a", "b")
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert.write_text("x")
    key.write_text("x")
    tls = Settings.from_sources(["--ssl-certfile", str(cert), "--ssl-keyfile", str(key)], {})
    assert (tls.server.ssl_certfile, tls.server.ssl_keyfile) == (str(cert), str(key))
    with pytest.raises(ValueError, match="go together"):
        Settings.from_sources(["--ssl-certfile", str(cert)], {})
    with pytest.raises(ValueError, match="no such file"):
        Settings.from_sources(["--ssl-certfile", str(cert), "--ssl-keyfile", "/nowhere"], {})


def test_lora_flags_as_vllm_and_kserves_llminferenceservice_write_them() -> None:
    argv = ["--enable-lora", "--max-lora-rank=16", "--max-loras=2", "--max-cpu-loras=4",
            "--lora-modules", '{"name": "sql", "path": "/mnt/lora/sql"}',
            '{"name": "publishers/ns/models/sql", "path": "/mnt/lora/sql"}', "chat=/adapters/chat"]  # fmt: skip
    s = Settings.from_sources(argv, {})
    assert s.lora.adapters == [("sql", "/mnt/lora/sql"), ("publishers/ns/models/sql", "/mnt/lora/sql"),
                          ("chat", "/adapters/chat")]  # fmt: skip
    assert (s.lora.max_lora_rank, s.lora.max_loras, s.lora.max_cpu_loras) == (16, 2, 4)
    # more adapters than --max-cpu-loras: registered, the least recently used evicted
    assert Settings.from_sources(["--max-cpu-loras", "1", "--lora-modules", "a=/p", "b=/q"], {})
    for bad in (["--lora-modules", "sql"], ["--lora-modules", '{"name": "x"}'],
                ["--lora-modules", "a=/p", "a=/q"], ["--lora-modules", "{not json"],
                ["--max-cpu-loras", "-1"]):  # fmt: skip
        with pytest.raises(ValueError, match="lora"):
            Settings.from_sources(bad, {})


# what KServe's LLMInferenceService preset and controller give `vllm serve` (kserve/kserve:
# config/llmisvcconfig/config-llm-template.yaml, workload_lora.go, tracing.go, config_merge.go's
# kvTransferConfig), word for word after `vllm serve`
KSERVE_ARGV = [
    "/mnt/models", "--served-model-name", "smol", "publishers/team-a/models/smol",
    "--port", "8000", "--disable-uvicorn-access-log", "--shutdown-timeout", "40",
    "--kv-transfer-config", '{"kv_connector":"OffloadingConnector","kv_connector_extra_config":'
    '{"cpu_bytes_to_use":10737418240,"eviction_policy":"lru","secondary_tiers":[{"root_dir":'
    '"/mnt/kv-cache-0","type":"fs"}],"spec_name":"TieringOffloadingSpec"},"kv_role":"kv_both"}',
    "--enable-ssl-refresh", "--enable-lora", "--max-lora-rank=16", "--max-loras=2",
    "--max-cpu-loras=4", "--lora-modules", '{"name":"sql","path":"/mnt/lora/sql"}',
    "--otlp-traces-endpoint", "http://otel-collector:4317", "--collect-detailed-traces", "all",
]  # fmt: skip


def test_kserves_llminferenceservice_argv_is_taken_whole() -> None:
    s = Settings.from_sources(KSERVE_ARGV, {"PREDICTOR_DRAIN_SECONDS": "5"})
    assert (s.model.model_dir, s.model.model_name, s.model.model_aliases) == (
        Path("/mnt/models"),
        "smol",
        ("publishers/team-a/models/smol",),
    )
    assert (s.server.http_port, s.server.drain_seconds, s.telemetry.otlp_traces_endpoint) == (
        8000,
        40,
        "http://otel-collector:4317",
    )
    assert s.lora.adapters == [("sql", "/mnt/lora/sql")] and s.lora.max_cpu_loras == 4
    transfer = vllm_args.kv_transfer_config(s.cache.kv_transfer_config)
    assert transfer is not None and transfer["kv_connector"] == "OffloadingConnector"
    notes = vllm_args.kv_transfer_notes(transfer)
    assert notes[0] == "kv-transfer-config: OffloadingConnector not served, KV stays in RAM"
    assert notes[1] == ("kv-transfer-config: keys honoured: none; not honoured: kv_connector, "
                        "kv_connector_extra_config, kv_role")  # fmt: skip


def test_vllms_model_block_size_and_shutdown_timeout_set_our_settings() -> None:
    """vLLM's `vllm serve MODEL`: a first word that is not a flag is --model-dir (a later
    --model-dir counts instead); --block-size is --kv-block-size, --shutdown-timeout is
    --drain-seconds."""
    s = Settings.from_sources(["/m", "--block-size", "64", "--shutdown-timeout", "7"], {})
    assert (s.model.model_dir, s.cache.kv_block_size, s.server.drain_seconds) == (Path("/m"), 64, 7)
    assert Settings.from_sources(["/b", "--model-dir", "/a"], {}).model.model_dir == Path("/a")
    assert Settings.from_sources([], {"PREDICTOR_MODEL_DIR": "/e"}).model.model_dir == Path("/e")
    for stray in (["/a", "/b"], ["--model-dir", "/a", "/b"], ["--no-enable-grpc", "/b"]):
        with pytest.raises(SystemExit):  # a word no flag takes, but the first
            Settings.from_sources(stray, {})


def test_kv_transfer_config_must_be_a_json_object() -> None:
    assert Settings.from_sources([], {}).cache.kv_transfer_config == ""
    for bad, words in (("{kv_connector: x}", "is not JSON"), ('["x"]', "JSON object"),
                       ('"x"', "JSON object")):  # fmt: skip
        with pytest.raises(ValueError, match=f"--kv-transfer-config.*{words}"):
            Settings.from_sources(["--kv-transfer-config", bad], {})
    # a connector of another name is taken and said to be not served, as any key
    other = vllm_args.kv_transfer_notes({"kv_connector": "LMCacheConnectorV1", "kv_port": 1})
    assert other[0].startswith("kv-transfer-config: LMCacheConnectorV1 not served")
    assert other[1].endswith("not honoured: kv_connector, kv_port")


def test_lora_modules_json_takes_vllms_keys_only() -> None:
    entry = '{"name": "sql", "path": "/p", "base_model_name": "smol"}'
    assert Settings.from_sources(["--lora-modules", entry], {}).lora.adapters == [("sql", "/p")]
    with pytest.raises(ValueError, match="unknown key.*rank"):
        Settings.from_sources(["--lora-modules", '{"name": "a", "path": "/p", "rank": 8}'], {})


def test_vllms_flags_without_effect_here_are_taken() -> None:
    parse = build_parser({}).parse_args
    ns = parse(["--disable-uvicorn-access-log", "--enable-ssl-refresh",
                "--disable-access-log-for-endpoints", "/health,/metrics",
                "--collect-detailed-traces", "all"])  # fmt: skip
    assert ns.disable_uvicorn_access_log and ns.enable_ssl_refresh
    assert ns.disable_access_log_for_endpoints == "/health,/metrics"
    assert ns.collect_detailed_traces == "all"


def test_the_boolean_settings_are_found() -> None:
    # the lists the tests below iterate: a dataclass change that hid the booleans would empty them
    assert {"enable_grpc", "prefix_caching", "allow_runtime_lora", "model_control",
            "vllm_metric_aliases", "cuda_graphs", "batch_invariant"} <= set(BOOLEANS)  # fmt: skip
    assert ("prefix_caching", "--enable-prefix-caching") in BOOLEAN_FLAGS


@pytest.mark.parametrize(("name", "flag"), SWITCHABLE_FLAGS)
def test_a_boolean_flag_alone_is_true_and_its_no_form_false(name: str, flag: str) -> None:
    """vLLM's forms (argparse.BooleanOptionalAction's), each against the opposite value from the
    environment, so that neither can pass by being the default."""
    env = f"PREDICTOR_{name.upper()}"
    negated = "--no-" + flag.removeprefix("--")
    assert setting(Settings.from_sources([flag], {env: "false"}), name) is True
    assert setting(Settings.from_sources([negated], {env: "true"}), name) is False
    # alone before another flag, and last: the next flag is not taken for its value
    alone = Settings.from_sources([flag, "--http-port", "9000"], {env: "0"})
    assert setting(alone, name) is True and alone.server.http_port == 9000
    before = Settings.from_sources(["--http-port", "9000", negated], {env: "1"})
    assert setting(before, name) is False and before.server.http_port == 9000
    # the last one given wins, as with any flag
    assert setting(Settings.from_sources([flag, negated], {}), name) is False
    assert setting(Settings.from_sources([negated, flag], {}), name) is True


@pytest.mark.parametrize(("name", "flag"), SWITCHABLE_FLAGS)
def test_a_boolean_flag_still_takes_a_value(name: str, flag: str) -> None:
    """`--flag true` (how the deployments and scripts wrote them first), `--flag=off`, and each
    word of vllm_args.boolean's, in any case."""
    env = f"PREDICTOR_{name.upper()}"
    for words, value in ((vllm_args.TRUE_WORDS, True), (vllm_args.FALSE_WORDS, False)):
        for word in (*words, *(w.upper() for w in words)):
            opposite = {env: str(not value)}
            assert setting(Settings.from_sources([flag, word], opposite), name) is value, word
            assert setting(Settings.from_sources([f"{flag}={word}"], opposite), name) is value
            assert setting(Settings.from_sources([], {env: word}), name) is value, word


@pytest.mark.parametrize(("name", "flag"), BOOLEAN_FLAGS)
def test_a_boolean_flag_refuses_another_word_naming_it(
    name: str, flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    negated = "--no-" + flag.removeprefix("--")
    for argv in ([flag, "maybe"], [f"{flag}=2"], [flag, ""], [negated, "true"],
                 [f"{negated}=false"]):  # fmt: skip
        with pytest.raises(SystemExit) as exit_:
            Settings.from_sources(argv, {})
        assert exit_.value.code == 2, argv
        err = capsys.readouterr().err
        if not argv[0].startswith("--no-"):
            assert "not a boolean" in err and flag in err, (argv, err)


def test_the_help_names_each_boolean_flags_no_form(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "1000")  # no line breaks inside a flag's name
    text = build_parser({}).format_help()
    for _, flag in BOOLEAN_FLAGS:
        negated = "--no-" + flag.removeprefix("--")
        assert f"{flag} [BOOL]" in text and f"({negated}" in text.replace(" or ", " (")


def test_vllms_enable_lora_takes_every_boolean_form() -> None:
    """vLLM's --enable-lora, with no setting of its own here (adapters need no switch)."""
    parse = build_parser({}).parse_args
    assert parse(["--enable-lora", "--max-loras=2"]).enable_lora is True
    assert parse(["--enable-lora", "false"]).enable_lora is False
    assert parse(["--enable-lora", "--no-enable-lora"]).enable_lora is False
    assert parse([]).enable_lora is False
    with pytest.raises(SystemExit):
        parse(["--enable-lora", "maybe"])


def test_the_server_takes_boolean_flags_alone(tiny_gptq_dir: Path, tmp_path: Path) -> None:
    """The flags as vLLM's docs and ours write them, through the real server: run-time adapters
    allowed, vLLM's metric names exported, no gRPC listener (--vllm-metric-aliases last, with
    nothing after it)."""
    extra = ["--allow-runtime-lora", "--max-tokens-limit", "512", "--no-enable-grpc",
             "--vllm-metric-aliases"]  # fmt: skip
    with ServerProcess.start(tiny_gptq_dir, "tiny", extra=extra) as server:
        adapter = write_adapter(tmp_path / "late", tiny_gptq_dir, 8, 1)
        body = {"lora_name": "late", "lora_path": str(adapter)}
        loaded = httpx.post(f"{server.base_url}/v1/load_lora_adapter", json=body, timeout=60)
        assert loaded.status_code == 200, loaded.text  # 403 without --allow-runtime-lora
        models = httpx.get(f"{server.base_url}/v1/models", timeout=10).json()["data"]
        assert "late" in {m["id"] for m in models}
        metrics = httpx.get(f"{server.base_url}/metrics", timeout=10).text
        assert "\nvllm:num_requests_waiting" in metrics and "\nvllm:kv_cache_usage_perc" in metrics
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", server.grpc_port), timeout=5).close()


def test_batch_invariant_is_always_on() -> None:
    """--batch-invariant, as vLLM's users and earlier deployments write it, is accepted in
    every true form; determinism cannot be turned off, so false is refused, naming why."""
    for argv, env in (([], {}), (["--batch-invariant"], {}), (["--batch-invariant", "true"], {}),
                      ([], {"PREDICTOR_BATCH_INVARIANT": "1"})):  # fmt: skip
        assert Settings.from_sources(argv, env).model.batch_invariant is True
    for argv, env in ((["--no-batch-invariant"], {}), (["--batch-invariant=false"], {}),
                      ([], {"PREDICTOR_BATCH_INVARIANT": "off"})):  # fmt: skip
        with pytest.raises(ValueError, match="determinism is always on"):
            Settings.from_sources(argv, env)


def publishing(config: str) -> bool:
    events = Settings.from_sources(["--kv-events-config", config], {}).cache.kv_events
    return events is not None and events.publishing


def test_kv_events_config_is_vllms_json() -> None:
    config = '{"enable_kv_cache_events": true, "publisher": "zmq", "topic": "kv@1.2.3.4:8000@m"}'
    events = Settings.from_sources(["--kv-events-config", config], {}).cache.kv_events
    assert events is not None and events.publishing and events.topic == "kv@1.2.3.4:8000@m"
    defaults = (events.endpoint, events.replay_endpoint, events.buffer_steps, events.hwm)
    assert defaults == ("tcp://*:5557", None, 10_000, 100_000)  # vLLM's
    assert Settings.from_sources([], {}).cache.kv_events is None
    # enabled without a publisher: zmq (vLLM's rule); "null" or not enabled: nothing published
    assert publishing('{"enable_kv_cache_events": true}')
    assert not publishing('{"enable_kv_cache_events": true, "publisher": "null"}')
    assert not publishing('{"topic": "t"}')
    env = {"PREDICTOR_KV_EVENTS_CONFIG": config, "PREDICTOR_PREFIX_CACHING_HASH_ALGO": "builtin"}
    s = Settings.from_sources([], env)
    assert s.cache.kv_events is not None and s.cache.prefix_caching_hash_algo == "builtin"


@pytest.mark.parametrize(
    ("config", "named"),
    [('{"enable_kv_cache_events": true, "topics": "x"}', "topics"),
     ("{bad", "not JSON"), ("[]", "JSON object"), ('{"hwm": "many"}', "hwm"),
     ('{"buffer_steps": 0}', "buffer_steps"), ('{"publisher": "kafka"}', "kafka"),
     ('{"enable_kv_cache_events": true, "endpoint": "localhost:1"}', "endpoint"),
     ('{"enable_kv_cache_events": 1}', "enable_kv_cache_events")],
)  # fmt: skip
def test_a_bad_kv_events_config_is_refused_naming_it(config: str, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        Settings.from_sources(["--kv-events-config", config], {})


def test_kv_events_need_the_prefix_cache_and_a_known_hash() -> None:
    on = ["--kv-events-config", '{"enable_kv_cache_events": true}']
    with pytest.raises(ValueError, match="prefix-caching"):
        Settings.from_sources([*on, "--no-enable-prefix-caching"], {})
    with pytest.raises(SystemExit):
        Settings.from_sources([*on, "--prefix-caching-hash-algo", "xxhash"], {})


def test_the_disk_prefix_cache_is_off_by_default_and_checked() -> None:
    assert Settings.from_sources([], {}).cache.kv_offload_dir == ""
    on = ["--kv-offload-dir", "/var/cache/kv"]
    s = Settings.from_sources([*on, "--kv-offload-size", "0.5"], {})
    assert (s.cache.kv_offload_dir, s.cache.kv_offload_size) == ("/var/cache/kv", 0.5)
    env = {"PREDICTOR_KV_OFFLOAD_DIR": "/d", "PREDICTOR_KV_OFFLOAD_SIZE": "2"}
    assert Settings.from_sources([], env).cache.kv_offload_size == 2.0
    for bad in (["--kv-offload-size", "0"], ["--no-enable-prefix-caching"],
                ["--prefix-caching-hash-algo", "builtin"]):  # fmt: skip
        with pytest.raises(ValueError, match="--kv-offload-dir needs"):
            Settings.from_sources([*on, *bad], {})


def test_tool_call_parser_takes_the_served_formats_by_vllms_names() -> None:
    from predictor.engine import tool_formats

    assert Settings.from_sources([], {}).model.tool_call_parser == ""  # the template's
    for name in config.TOOL_CALL_PARSERS[1:]:  # each name the flag takes is served
        assert tool_formats.get(name).name in tool_formats.NAMES
        assert (
            Settings.from_sources(["--tool-call-parser", name], {}).model.tool_call_parser == name
        )
    assert set(tool_formats.NAMES) <= set(config.TOOL_CALL_PARSERS)
    with pytest.raises(SystemExit):
        Settings.from_sources(["--tool-call-parser", "granite"], {})
    # a vLLM deployment's tool flags start this server as they are
    argv = ["--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"]
    assert Settings.from_sources(argv, {}).model.tool_call_parser == "llama3_json"


def test_the_copies_budget_is_read_and_checked() -> None:
    assert Settings().model.copy_budget == 10**9  # 1 GB by default
    assert (
        Settings.from_sources(["--max-weight-copies-gb", "0.5"], {}).model.copy_budget == 5 * 10**8
    )
    env = {"PREDICTOR_MAX_WEIGHT_COPIES_GB": "0"}
    assert Settings.from_sources([], env).model.copy_budget == 0
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="--max-weight-copies-gb"):
            Settings(ModelSettings(max_weight_copies_gb=bad)).check()


def test_sleep_flags_are_read_and_checked() -> None:
    settings = Settings.from_sources(["--sleep-idle-seconds", "30", "--enable-sleep-mode"], {})
    assert settings.model.sleep_idle_seconds == 30.0 and settings.model.enable_sleep_mode
    env = {"PREDICTOR_SLEEP_IDLE_SECONDS": "5"}
    assert Settings.from_sources([], env).model.sleep_idle_seconds == 5.0
    assert Settings().model.sleep_idle_seconds == 0 and not Settings().model.enable_sleep_mode
    with pytest.raises(ValueError, match="negative"):
        Settings(ModelSettings(sleep_idle_seconds=-1)).check()
    sleeping = ModelSettings(enable_sleep_mode=True)
    Settings(sleeping).check()
    for lora in (LoraSettings(allow_runtime_lora=True), LoraSettings(lora_modules=("a=/tmp/a",))):
        Settings(lora=lora).check()  # adapters without sleep are served
        with pytest.raises(ValueError, match="LoRA"):
            Settings(sleeping, lora=lora).check()
