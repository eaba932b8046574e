import os
from pathlib import Path

import pytest

from predictor.config import Settings, build_parser
from predictor.model.layout import served_name


def test_defaults_and_flags() -> None:
    s = Settings.from_sources(["--http-port", "9000", "--model-dir", "/mnt/models"], {})
    assert s.http_port == 9000
    assert s.grpc_port == 8081
    assert s.host == "127.0.0.1"
    assert s.model_dir == Path("/mnt/models")
    assert served_name(s.model_name, s.model_dir) == "models"


def test_environment_gives_defaults_and_flags_win() -> None:
    env = {"PREDICTOR_THREADS": "3", "PREDICTOR_ENABLE_GRPC": "false", "PREDICTOR_HTTP_PORT": "1"}
    s = Settings.from_sources(["--http-port", "2"], env)
    assert s.threads == 3 and s.torch_threads == 3
    assert s.enable_grpc is False
    assert s.http_port == 2


def test_model_name_defaults_to_folder_name() -> None:
    s = Settings.from_sources(["--model-dir", "models/smollm2-135m-instruct-gptq/"], {})
    assert served_name(s.model_name, s.model_dir) == "smollm2-135m-instruct-gptq"
    named = Settings.from_sources(["--model-name", "x"], {})
    assert served_name(named.model_name, named.model_dir) == "x"


def test_model_name_of_a_nested_storage_folder_is_the_checkpoints(tmp_path: Path) -> None:
    # KServe's storage initializer may leave the checkpoint one folder below /mnt/models: the
    # served name (for routes and for the manifests' probes alike) is the checkpoint folder's
    # (once computed as the mount's name in one place and the checkpoint's in another)
    (tmp_path / "models" / "smollm2-gptq").mkdir(parents=True)
    (tmp_path / "models" / "smollm2-gptq" / "config.json").write_text("{}")
    s = Settings.from_sources(["--model-dir", str(tmp_path / "models")], {})
    assert served_name(s.model_name, s.model_dir) == "smollm2-gptq"


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


def test_inconsistent_limits_are_refused() -> None:
    with pytest.raises(ValueError):
        Settings.from_sources(["--default-max-tokens", "100", "--max-tokens-limit", "10"], {})


def test_kernel_forces_a_runner_kernel_and_the_autotune_cache_is_a_folder() -> None:
    settings = Settings.from_sources(["--kernel", "native_i8_avx2", "--autotune-cache", ""], {})
    assert settings.kernel == "native_i8_avx2" and settings.autotune_dir is None
    assert Settings().autotune_dir == Path(Settings().autotune_cache)
    with pytest.raises(SystemExit):
        Settings.from_sources(["--kernel", "fastest"], {})


def test_the_default_thread_count_leaves_one_core_to_serving(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for cores, threads in ((1, 1), (2, 1), (16, 15)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda _pid, n=cores: set(range(n)))
        assert Settings().torch_threads == threads
    assert Settings(threads=2).torch_threads == 2


@pytest.mark.parametrize(("name", "value"), [("MAX_BATCH_SIZE", "abc"), ("MODEL_CONTROL", "maybe")])
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
    assert (s.otlp_traces_endpoint, s.otlp_traces_protocol) == (
        "http://collector:4318/v1/traces", "http/protobuf"
    )  # fmt: skip
    s = Settings.from_sources([], {**env, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:1/x"})
    assert s.otlp_traces_endpoint == "http://t:1/x"
    s = Settings.from_sources(["--otlp-traces-endpoint", "http://a:4317"], env)
    assert s.otlp_traces_endpoint == "http://a:4317"
    assert Settings.from_sources([], {}).otlp_traces_endpoint == ""
    with pytest.raises(ValueError, match="payload-logger-url"):
        Settings.from_sources(["--log-payloads", "hash"], {})
    with pytest.raises(SystemExit):
        Settings.from_sources(["--log-payloads", "everything"], {})


def test_vllm_flag_names_set_the_same_settings(tmp_path: Path) -> None:
    """What `vllm serve` is given (KServe's LLMInferenceService passes vLLM's flags)."""
    s = Settings.from_sources(["--port", "8000", "--served-model-name", "smollm"], {})
    assert s.http_port == 8000 and s.model_name == "smollm" and s.model_aliases == ()
    # several names: the first is the model's, the others answer too (as vLLM's)
    several = Settings.from_sources(
        ["--served-model-name", "a", "org/a", "--model-aliases", "b"], {}
    )
    assert several.model_name == "a" and several.model_aliases == ("org/a", "b")
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert.write_text("x")
    key.write_text("x")
    tls = Settings.from_sources(["--ssl-certfile", str(cert), "--ssl-keyfile", str(key)], {})
    assert (tls.ssl_certfile, tls.ssl_keyfile) == (str(cert), str(key))
    with pytest.raises(ValueError, match="go together"):
        Settings.from_sources(["--ssl-certfile", str(cert)], {})
    with pytest.raises(ValueError, match="no such file"):
        Settings.from_sources(["--ssl-certfile", str(cert), "--ssl-keyfile", "/nowhere"], {})


def test_lora_flags_as_vllm_and_kserves_llminferenceservice_write_them() -> None:
    argv = ["--enable-lora", "--max-lora-rank=16", "--max-loras=2", "--max-cpu-loras=4",
            "--lora-modules", '{"name": "sql", "path": "/mnt/lora/sql"}',
            '{"name": "publishers/ns/models/sql", "path": "/mnt/lora/sql"}', "chat=/adapters/chat"]  # fmt: skip
    s = Settings.from_sources(argv, {})
    assert s.adapters == [("sql", "/mnt/lora/sql"), ("publishers/ns/models/sql", "/mnt/lora/sql"),
                          ("chat", "/adapters/chat")]  # fmt: skip
    assert (s.max_lora_rank, s.max_loras, s.max_cpu_loras) == (16, 2, 4)
    # more adapters than --max-cpu-loras: registered, the least recently used evicted
    assert Settings.from_sources(["--max-cpu-loras", "1", "--lora-modules", "a=/p", "b=/q"], {})
    for bad in (["--lora-modules", "sql"], ["--lora-modules", '{"name": "x"}'],
                ["--lora-modules", "a=/p", "a=/q"], ["--lora-modules", "{not json"],
                ["--max-cpu-loras", "-1"]):  # fmt: skip
        with pytest.raises(ValueError, match="lora"):
            Settings.from_sources(bad, {})
