"""The server's groups: where it listens and how it stops (server), what one request, body or
stream may take (limits), and what it tells about its requests (telemetry)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from predictor.config.flags import OTLP_PROTOCOLS, PAYLOAD_MODES, option

# one message for two groups' settings (as before they were grouped)
NOT_NEGATIVE = "--request-timeout and --drain-seconds must not be negative"


@dataclass(frozen=True)
class ServerSettings:
    """Where the server listens (REST, gRPC, TLS), what it allows, how it drains."""

    host: str = option(
        "127.0.0.1",
        "address to listen on (the container passes 0.0.0.0)",
    )
    http_port: int = option(
        8080,
        "REST port (also --port, vLLM's name)",
    )
    grpc_port: int = option(
        8081,
        "gRPC port",
    )
    enable_grpc: bool = option(
        True,
        "serve gRPC",
    )
    ssl_certfile: str = option(
        "",
        "serve REST over HTTPS with this certificate (PEM; reloaded when renewed, "
        "as KServe's LLMInferenceService mounts them); with --ssl-keyfile",
    )
    ssl_keyfile: str = option(
        "",
        "the private key of --ssl-certfile (PEM)",
    )
    model_control: bool = option(
        False,
        "allow POST /v2/repository/models/{m}/load|unload and their gRPC twins "
        "(off: 403 / PERMISSION_DENIED, as Triton's --model-control-mode none)",
    )
    drain_seconds: int = option(
        30,
        "on SIGTERM, seconds for requests in flight to finish before exit (also "
        "--shutdown-timeout, vLLM's name)",
    )

    def check(self) -> None:
        if bool(self.ssl_certfile) != bool(self.ssl_keyfile):
            raise ValueError("--ssl-certfile and --ssl-keyfile go together")
        for path in (self.ssl_certfile, self.ssl_keyfile):
            if path and not Path(path).is_file():
                raise ValueError(f"no such file: {path} (--ssl-certfile / --ssl-keyfile)")
        if self.drain_seconds < 0:
            raise ValueError(NOT_NEGATIVE)


@dataclass(frozen=True)
class LimitsSettings:
    """What one request, body or stream may take: tokens, prompts, bytes, time."""

    max_tokens_limit: int = option(
        512,
        "largest max_tokens a request may ask for",
    )
    default_max_tokens: int = option(
        64,
        "max_tokens when a request gives none",
    )
    max_prompt_tokens: int = option(
        0,
        "longest prompt in tokens (0: context length - max tokens limit)",
    )
    max_prompts: int = option(
        16,
        "most prompts in one request (V2 text_input [N]; OpenAI n x prompts); more is a 400",
    )
    request_timeout: float = option(
        0.0,
        "seconds a request may run before it ends with finish reason timeout "
        "(0: none; a request's own `timeout` parameter may set one)",
    )
    max_body_bytes: int = option(
        8 * 1024 * 1024,
        "largest REST body (413 past it) and gRPC message (RESOURCE_EXHAUSTED)",
    )
    max_json_depth: int = option(
        32,
        "deepest nesting of a JSON body (400 past it)",
    )
    grammar_compile_timeout: float = option(
        10.0,
        "seconds a structured-output grammar's own compile may take, "
        "counted from when it starts on a compile thread (not while it waits behind others): past "
        "it the request is refused (400, too complex) and the compile, which cannot be stopped, "
        "finishes in the background and is cached; a request whose compile has not started within "
        "it is answered 429 with Retry-After (the server is busy), never a 400",
    )
    max_grammar_compiles: int = option(
        16,
        "structured-output grammars compiling or waiting to compile at "
        "once (on a pool of their own: every usable CPU but one, at a low CPU priority; a compile "
        "that runs 0.1 s while another waits runs on at the lowest); more are refused with 429 and "
        "Retry-After",
    )
    max_stream_requests: int = option(
        64,
        "requests in progress on one ModelStreamInfer stream; more get "
        "error_message RESOURCE_EXHAUSTED",
    )
    stream_queue_size: int = option(
        256,
        "responses buffered per ModelStreamInfer stream for a slow reader",
    )
    slow_reader_grace: float = option(
        1.0,
        "seconds a token response may wait for room in a full ModelStreamInfer "
        "queue before its request is cancelled with RESOURCE_EXHAUSTED",
    )
    stall_seconds: float = option(
        120.0,
        "liveness fails when requests are running and no engine step has ended "
        "for this long (a hung kernel), or the step thread died",
    )

    def check(self) -> None:
        if self.default_max_tokens < 1 or self.max_tokens_limit < 1:
            raise ValueError("max token settings must be at least 1")
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError("--default-max-tokens must not exceed --max-tokens-limit")
        limits = (
            self.max_prompts,
            self.max_body_bytes,
            self.max_json_depth,
            self.max_stream_requests,
            self.stream_queue_size,
        )
        if min(limits) < 1 or self.stall_seconds <= 0 or self.slow_reader_grace <= 0:
            raise ValueError(
                "the --max-* limits and --stream-queue-size must be >= 1, and --stall-seconds "
                "and --slow-reader-grace > 0"
            )
        if self.grammar_compile_timeout <= 0 or self.max_grammar_compiles < 1:
            raise ValueError(
                "--grammar-compile-timeout must be > 0 and --max-grammar-compiles >= 1"
            )
        if self.request_timeout < 0:
            raise ValueError(NOT_NEGATIVE)


@dataclass(frozen=True)
class TelemetrySettings:
    """What the server tells about its requests: traces, tenants, payload records, metric names."""

    otlp_traces_endpoint: str = option(
        "",
        "send a trace span per request (OpenTelemetry's GenAI attributes, "
        "vLLM's latency attributes) to this OTLP collector, e.g. http://otel-collector:4317; a "
        'traceparent header or gRPC metadata makes it a child span ("": off; default from '
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT)",
    )
    otlp_traces_protocol: str = option(
        "grpc",
        "grpc or http/protobuf (default from "
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL or OTEL_EXPORTER_OTLP_PROTOCOL)",
        choices=OTLP_PROTOCOLS,
    )
    tenant_header: str = option(
        "",
        "a request header (gRPC metadata key) naming the tenant a request is for, "
        "e.g. x-tenant-id set by a gateway; it wins over OpenAI's user field. The tenant labels "
        "the token and request counters and the traces",
    )
    max_tenant_labels: int = option(
        64,
        "distinct tenant label values; later tenants are counted as other",
    )
    log_payloads: str = option(
        "off",
        "one record per request (ids, tenant, parameters, usage, latencies, finish "
        "reason and the prompt and response: full text, their sha256 hashes, or off), sent as a "
        "CloudEvent to --payload-logger-url",
        choices=PAYLOAD_MODES,
    )
    payload_logger_url: str = option(
        "",
        "where the payload records go: an HTTP CloudEvents sink, e.g. the URL "
        "of a KServe InferenceService's logger",
    )
    vllm_metric_aliases: bool = option(
        False,
        "also export the waiting, running and KV-cache gauges under vLLM's names "
        "(vllm:num_requests_waiting, ...) for endpoint pickers and dashboards that expect them",
    )

    def check(self) -> None:
        if self.otlp_traces_protocol not in OTLP_PROTOCOLS:
            raise ValueError(
                f"--otlp-traces-protocol must be one of {', '.join(OTLP_PROTOCOLS)}, "
                f"not {self.otlp_traces_protocol!r}"
            )
        if self.max_tenant_labels < 1:
            raise ValueError("--max-tenant-labels must be >= 1")
        if self.log_payloads not in PAYLOAD_MODES:
            raise ValueError(f"--log-payloads must be one of {', '.join(PAYLOAD_MODES)}")
        if self.log_payloads != "off" and not self.payload_logger_url:
            raise ValueError("--log-payloads needs --payload-logger-url (where records go)")
