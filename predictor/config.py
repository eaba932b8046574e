"""Settings: read once, at the edge, from CLI flags and PREDICTOR_* environment variables.

This is the only module that looks at argv or the environment; everything else receives a
`Settings` (or the few values it needs) as arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path

from predictor import vllm_args

DEFAULT_MODEL_DIR = Path("models/smollm2-135m-instruct-gptq")
# GPTQ kernels the loader can use: gptqmodel's own choice, the CPU kernels gptqmodel offers (as
# its backend names) and the weights dequantized at load into plain Linear layers. Not offered:
# gptq_torch_fused (gptqmodel 7.6.0), whose logits on an asymmetric checkpoint (the default
# recipe) are off by up to 33 against TorchAtenLinear and the dequantized weights (checked here).
# Then the kernels of the runner's fused projections (TorchAtenLinear's weights): "auto" lets
# the autotune choose per row count; a name from FUSED_KERNELS forces that one: torch's int4 op,
# the weights expanded to bf16 and prepacked for oneDNN, or int4_matmul.c with fp32 or int8
# activations (the widest instruction set, or the one named; engine/runners/native.py).
LOADER_KERNELS = ("auto", "gptq_torch_aten", "gptq_torch", "gptq_torch_int8", "dequantized")
# auto, but not the kernel a checkpoint's build recorded for it (quality.json's `serve`)
AUTOTUNE = "autotune"
NATIVE_ISAS = ("avx512vnni", "avx512", "avx2vnni", "avx2")  # widest first
NATIVE_KERNELS = tuple(
    f"native_{act}{isa}" for act in ("f32", "i8") for isa in ("", *(f"_{i}" for i in NATIVE_ISAS))
)
FUSED_KERNELS = ("int4_op", "prepacked_bf16", *NATIVE_KERNELS)
KERNELS = (*LOADER_KERNELS, AUTOTUNE, *FUSED_KERNELS)
# how decode rows attend: on a CPU native (engine/runners/native.py) or torch; on a GPU triton
# (engine/runners/cuda/triton_ops.py) or torch; auto: native on a CPU, measured on a GPU
ATTENTION = ("auto", "native", "torch", "triton")
SPECULATIVE = ("off", "ngram", "suffix")  # --speculative (engine/speculation.py)
HASH_ALGOS = ("sha256", "sha256_cbor", "builtin")  # --prefix-caching-hash-algo, vLLM's names
# --tool-call-parser: engine/tool_formats/'s names (vLLM's), then the aliases it takes; ""
# (the default): the one the chat template asks for
TOOL_CALL_PARSERS = ("", "hermes", "llama3_json", "mistral", "phi4_mini_json", "pythonic", "qwen",
                     "qwen3_xml", "llama4_json", "phi4_mini")  # fmt: skip
REASONING_PARSERS = ("qwen3", "deepseek_r1", "none")  # --reasoning-parser (engine/reasoning.py)
OTLP_PROTOCOLS = ("grpc", "http/protobuf")
PAYLOAD_MODES = ("off", "hash", "full")
# OpenTelemetry's standard variables, read when our own flag and PREDICTOR_* variable are unset
OTEL_ENV = {
    "otlp_traces_endpoint": ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"),
    "otlp_traces_protocol": ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"),
}


SERVING_CORES = 1  # cores the default thread count leaves to serving (Settings.torch_threads)


def usable_cpus(cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """The CPUs this process may use: its affinity, capped by its cgroup's CPU quota (v2
    `cpu.max`, v1 `cpu.cfs_quota_us`; a container's limit), rounded up."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    quotas = (
        (cgroup / "cpu.max", None),
        (cgroup / "cpu" / "cpu.cfs_quota_us", "cpu.cfs_period_us"),
    )
    for path, period_name in quotas:
        with contextlib.suppress(OSError, ValueError, IndexError):
            words = path.read_text().split()
            period = path.with_name(period_name).read_text() if period_name else words[1]
            if words[0] not in ("max", "-1"):
                cpus = min(cpus or 1, math.ceil(int(words[0]) / int(period)))
            break
    return max(1, cpus or 1)


@dataclass(frozen=True)
class Settings:
    model_dir: Path = DEFAULT_MODEL_DIR
    model_name: str = ""  # empty: the model folder's name
    model_aliases: tuple[str, ...] = ()  # other names the model answers to
    host: str = "127.0.0.1"
    http_port: int = 8080
    grpc_port: int = 8081
    ssl_certfile: str = ""  # REST over HTTPS with this certificate and key (vLLM's flags)
    ssl_keyfile: str = ""
    enable_grpc: bool = True
    threads: int = 0  # 0: every CPU this process may use (usable_cpus) but one
    device: str = "auto"  # auto | cpu | cuda
    runner: str = "model"  # model | null (no forward pass: benchmarks the serving stack)
    # one of KERNELS; auto is gptqmodel's choice: TorchAtenLinear on a CPU, the fastest measured
    # there at batch 16 (load/RESULTS.md, "CPU GPTQ kernels"), the GPU kernels on a GPU
    kernel: str = "auto"
    attention: str = "auto"  # decode attention: one of ATTENTION
    # where the kernel autotune keeps its choices per machine, torch and model ("": nowhere)
    autotune_cache: str = str(Path.home() / ".cache" / "gptq-predictor")
    max_tokens_limit: int = 512  # cap on a request's max_tokens
    default_max_tokens: int = 64
    max_batch_size: int = 16  # rows in the running batch
    max_cache_tokens: int = 32768  # KV-cache size in tokens (rows take blocks as they fill them)
    kv_block_size: int = 16  # tokens per KV-cache block
    prefix_caching: bool = True  # reuse cached blocks of prompts that start alike
    # KV events for prefix-aware routers: vLLM's JSON (vllm_args.KVEventsConfig; "": off)
    kv_events_config: str = ""
    # the block hash the KV events carry (engine/kv_events.py): sha256_cbor | sha256 | builtin
    prefix_caching_hash_algo: str = "sha256"
    # vLLM's KV connector JSON (KServe's spec.kvCacheOffloading): read, logged, not served
    kv_transfer_config: str = ""
    # the prefix cache on disk (engine/kv_offload.py): evicted blocks kept in this folder ("":
    # off), at most this many GiB, read back instead of computed, found again after a restart
    kv_offload_dir: str = ""
    kv_offload_size: float = 8.0
    max_step_tokens: int = 256  # tokens one forward pass may feed: decode rows + prompt chunks
    # speculative decoding without a draft model: off | ngram | suffix; a row drafts only
    # while the steps' measured cost says its drafts pay (so it is on by default: where
    # nothing is copied, or under load, it switches itself off)
    speculative: str = "suffix"
    num_speculative_tokens: int = 8  # draft tokens a row verifies at most per step
    # the tool-call format (engine/tool_formats/, vLLM's parser names); "": the chat template's
    tool_call_parser: str = ""
    # LoRA adapters served beside the model, NAME=PATH each (vLLM's --lora-modules): PEFT
    # folders, all resident; a request picks one by its name as the model's
    lora_modules: tuple[str, ...] = ()
    max_lora_rank: int = 64
    max_loras: int = 0  # distinct adapters in one step (vLLM's meaning); 0: any number
    max_cpu_loras: int = 0  # adapters resident at once (LRU beyond); 0: any number
    allow_runtime_lora: bool = False  # POST /v1/load_lora_adapter and /v1/unload_lora_adapter
    # requests allowed to wait for a row before new ones get 429: 4 batches' worth, so a
    # refused client learns at once instead of waiting minutes behind a deep queue
    max_waiting: int = 64
    max_prompt_tokens: int = 0  # 0: the model's context length minus max_tokens_limit
    request_timeout: float = 0.0  # seconds a request may run (0: no server default)
    drain_seconds: int = 30  # on SIGTERM: how long requests in flight may take to finish
    max_prompts: int = 16  # prompts in one request (V2 text_input [N], OpenAI n x prompts)
    max_body_bytes: int = 8 * 1024 * 1024  # REST body and gRPC message size (413 past it)
    max_json_depth: int = 32  # nesting of a JSON body
    grammar_compile_timeout: float = 10.0  # seconds a grammar's compile may run (from its start)
    max_grammar_compiles: int = 16  # grammar compiles running or waiting at once (then 429)
    # the thinking model's reasoning format (vLLM's names: qwen3, deepseek_r1, none); "":
    # found from the chat template and the vocabulary's <think> and </think> tokens
    reasoning_parser: str = ""
    reasoning_budget: int = -1  # thinking tokens a chat request may spend (-1: no limit)
    max_stream_requests: int = 64  # requests in progress on one ModelStreamInfer stream
    stream_queue_size: int = 256  # responses buffered per ModelStreamInfer stream
    slow_reader_grace: float = 1.0  # seconds a token may wait for room in a full stream queue
    model_control: bool = False  # allow repository load/unload (Triton's explicit mode)
    stall_seconds: float = 120.0  # liveness fails when rows run and no step ends this long
    # free the model's weights and KV cache after this many idle seconds (0: never), reloaded
    # for the next request (llama.cpp's flag; engine/sleep.py)
    sleep_idle_seconds: float = 0.0
    enable_sleep_mode: bool = False  # serve POST /sleep and /wake_up (vLLM's dev endpoints)
    vllm_metric_aliases: bool = False  # also export the queue/running/KV gauges under vLLM's names
    cuda_graphs: bool = True  # on a GPU: decode steps replay CUDA graphs captured at start
    batch_invariant: bool = True  # accepted, always on: tokens independent of the batch (--help)
    otlp_traces_endpoint: str = ""  # "": no traces
    otlp_traces_protocol: str = "grpc"
    tenant_header: str = ""  # a header naming the request's tenant ("": OpenAI's user only)
    max_tenant_labels: int = 64
    log_payloads: str = "off"  # off | hash | full
    payload_logger_url: str = ""
    hf_home: Path = Path.home() / ".cache" / "huggingface"

    @property
    def autotune_dir(self) -> Path | None:
        return Path(self.autotune_cache) if self.autotune_cache else None

    @property
    def torch_threads(self) -> int:
        """--threads, or the CPUs this process may use (`usable_cpus`: a container's CPU limit,
        not the node's cores) less SERVING_CORES, at least one: the event loop, HTTP and gRPC
        need a core of their own, as vLLM-CPU reserves one. On 2 cores, 2 compute threads gave
        0.51x the tokens/s of 1 at C=1 and 0.97x at C=16 (load/bench_threads.py,
        load/RESULTS.md)."""
        if self.threads > 0:
            return self.threads
        return max(1, usable_cpus() - SERVING_CORES)

    @classmethod
    def from_sources(cls, argv: Sequence[str], env: Mapping[str, str]) -> Settings:
        """Parse CLI flags; each flag's default comes from PREDICTOR_<NAME> or the field default."""
        parser = build_parser(env)
        ns = parser.parse_args(list(argv))
        values = {f.name: getattr(ns, f.name) for f in fields(cls)}
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
        values["model_aliases"] = (*ns.served_aliases, *values["model_aliases"])
        settings = cls(**values)
        settings.check()
        return settings

    @property
    def kv_events(self) -> vllm_args.KVEventsConfig | None:
        """--kv-events-config read (None: no events); ValueError naming what is wrong."""
        return vllm_args.kv_events_config(self.kv_events_config)

    @property
    def adapters(self) -> list[tuple[str, str]]:
        """--lora-modules as (name, path): `NAME=PATH`, or vLLM's JSON form `{"name": NAME,
        "path": PATH}` (what KServe's LLMInferenceService passes)."""
        return [vllm_args.lora_module(entry) for entry in self.lora_modules]

    def check(self) -> None:
        if self.default_max_tokens < 1 or self.max_tokens_limit < 1:
            raise ValueError("max token settings must be at least 1")
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError("--default-max-tokens must not exceed --max-tokens-limit")
        if self.max_batch_size < 1 or self.max_waiting < 0:
            raise ValueError("--max-batch-size must be >= 1 and --max-waiting >= 0")
        if self.kv_block_size < 1 or self.max_cache_tokens < self.kv_block_size:
            raise ValueError(
                "--kv-block-size must be >= 1 and --max-cache-tokens at least one block"
            )
        if self.max_step_tokens <= self.max_batch_size:
            raise ValueError("--max-step-tokens must exceed --max-batch-size (room for prefill)")
        if self.speculative not in SPECULATIVE or not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(
                f"--speculative must be one of {', '.join(SPECULATIVE)} and "
                "--num-speculative-tokens between 1 and 16"
            )
        names = [name for name, _ in self.adapters]  # raises for a malformed entry
        events = self.kv_events  # raises for bad JSON or an unknown key
        vllm_args.kv_transfer_config(self.kv_transfer_config)  # raises where it is not JSON
        if events is not None and events.publishing and not self.prefix_caching:
            raise ValueError("--kv-events-config publishes the prefix cache's events: it needs "
                             "--enable-prefix-caching")  # fmt: skip
        if self.kv_offload_dir and (
            self.kv_offload_size <= 0
            or not self.prefix_caching
            or self.prefix_caching_hash_algo == "builtin"
        ):
            raise ValueError("--kv-offload-dir needs --kv-offload-size > 0, prefix caching and "
                             "a --prefix-caching-hash-algo other than builtin (Python's hash() "
                             "differs between processes)")  # fmt: skip
        if len(set(names)) != len(names):
            raise ValueError("--lora-modules names each adapter once")
        if not 1 <= self.max_lora_rank <= 256 or min(self.max_loras, self.max_cpu_loras) < 0:
            raise ValueError("--max-lora-rank must be between 1 and 256, --max-loras and "
                             "--max-cpu-loras at least 0")  # fmt: skip
        if bool(self.ssl_certfile) != bool(self.ssl_keyfile):
            raise ValueError("--ssl-certfile and --ssl-keyfile go together")
        for path in (self.ssl_certfile, self.ssl_keyfile):
            if path and not Path(path).is_file():
                raise ValueError(f"no such file: {path} (--ssl-certfile / --ssl-keyfile)")
        if self.runner not in ("model", "null"):
            raise ValueError(f"--runner must be model or null, got {self.runner!r}")
        limits = (self.max_prompts, self.max_body_bytes, self.max_json_depth,
                  self.max_stream_requests, self.stream_queue_size)  # fmt: skip
        if min(limits) < 1 or self.stall_seconds <= 0 or self.slow_reader_grace <= 0:
            raise ValueError(
                "the --max-* limits and --stream-queue-size must be >= 1, and --stall-seconds "
                "and --slow-reader-grace > 0"
            )
        if self.attention not in ATTENTION:
            raise ValueError(
                f"--attention must be one of {', '.join(ATTENTION)}, not {self.attention!r}"
            )
        if self.kernel not in KERNELS:
            raise ValueError(f"--kernel must be one of {', '.join(KERNELS)}, not {self.kernel!r}")
        if self.grammar_compile_timeout <= 0 or self.max_grammar_compiles < 1:
            raise ValueError(
                "--grammar-compile-timeout must be > 0 and --max-grammar-compiles >= 1"
            )
        if self.reasoning_parser not in ("", *REASONING_PARSERS) or self.reasoning_budget < -1:
            raise ValueError(
                f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)} (or empty), "
                "and --reasoning-budget -1 or more"
            )
        if self.request_timeout < 0 or self.drain_seconds < 0:
            raise ValueError("--request-timeout and --drain-seconds must not be negative")
        if self.otlp_traces_protocol not in OTLP_PROTOCOLS:
            raise ValueError(
                f"--otlp-traces-protocol must be one of {', '.join(OTLP_PROTOCOLS)}, "
                f"not {self.otlp_traces_protocol!r}"
            )
        if self.max_tenant_labels < 1:
            raise ValueError("--max-tenant-labels must be >= 1")
        if self.log_payloads not in PAYLOAD_MODES:
            raise ValueError(f"--log-payloads must be one of {', '.join(PAYLOAD_MODES)}")
        if not self.batch_invariant:
            raise ValueError(
                "--batch-invariant false: determinism is always on (docs/engine.md, Determinism)"
            )
        self._check_sleep()
        if self.log_payloads != "off" and not self.payload_logger_url:
            raise ValueError("--log-payloads needs --payload-logger-url (where records go)")

    def _check_sleep(self) -> None:
        if self.sleep_idle_seconds < 0:
            raise ValueError("--sleep-idle-seconds must not be negative (0: never)")
        sleeps = self.sleep_idle_seconds > 0 or self.enable_sleep_mode
        if sleeps and (self.lora_modules or self.allow_runtime_lora):
            raise ValueError("--sleep-idle-seconds and --enable-sleep-mode serve no LoRA "
                             "adapters (--lora-modules, --allow-runtime-lora)")  # fmt: skip


_HELP = {
    "model_dir": "GPTQ checkpoint folder (KServe mounts storageUri at /mnt/models); also the "
    "first word when it is not a flag (vLLM's `vllm serve MODEL`)",
    "model_name": "name served under /v2/models/{name} and as the OpenAI model (default: the "
    "folder's name; also --served-model-name, vLLM's name)",
    "model_aliases": "other names the model answers to on every protocol, each listed in "
    "/v1/models (vLLM: --served-model-name's names after the first)",
    "host": "address to listen on (the container passes 0.0.0.0)",
    "http_port": "REST port (also --port, vLLM's name)",
    "ssl_certfile": "serve REST over HTTPS with this certificate (PEM; reloaded when renewed, "
    "as KServe's LLMInferenceService mounts them); with --ssl-keyfile",
    "ssl_keyfile": "the private key of --ssl-certfile (PEM)",
    "grpc_port": "gRPC port",
    "enable_grpc": "serve gRPC",
    "threads": "compute threads (0: the CPUs the process may use, its container's CPU limit, "
    "but one; at least 1)",
    "device": "auto, cpu or cuda",
    "runner": "model, or null: no model, fixed logits at no cost and no end-of-sequence "
    "(measures everything around the model; benchmarks only)",
    "kernel": "how the GPTQ Linear layers run: auto (the kernel the checkpoint's build chose "
    "where its served gate chose one, else gptqmodel's choice; on a CPU its int4 "
    "layers fused, each matmul run by the kernel a short autotune measured fastest for the "
    "step's rows), autotune (auto without the build's choice), a gptqmodel backend"
    f" ({', '.join(LOADER_KERNELS[1:-1])}), dequantized "
    "(expanded once at load into plain Linear layers of the model's dtype: the same numbers, 4x "
    "the weight memory), or one kernel for every fused projection: int4_op (torch's), "
    "prepacked_bf16 (oneDNN), native_f32 / native_i8 (engine/runners/int4_matmul.c, fp32 or int8 "
    "activations, the widest instruction set; _avx2, _avx512, ... names one)",
    "autotune_cache": "folder of the kernel autotune's cached choices, the compiled kernels "
    "and the weights' kernel layouts (empty: measure and build at every start)",
    "attention": "how decode rows attend: on a CPU native (a C kernel compiled at start with "
    "$CC or cc/gcc/g++/clang, reading the paged cache in place; bf16 models) or torch (gather + "
    "batched matmuls); on a GPU triton (a paged kernel) or torch; auto: native where it "
    "compiles on a CPU, the faster measured at start on a GPU",
    "max_tokens_limit": "largest max_tokens a request may ask for",
    "default_max_tokens": "max_tokens when a request gives none",
    "max_batch_size": "most requests decoded together",
    "max_cache_tokens": "KV-cache size in tokens; a request takes its prompt's blocks at "
    "admission and one more each block_size tokens it generates (preempted and recomputed "
    "later when the cache is full)",
    "kv_block_size": "tokens per KV-cache block (the prefix cache shares whole blocks; also "
    "--block-size, vLLM's name)",
    "prefix_caching": "automatic prefix caching: a prompt that starts with blocks another "
    "request computed (same tokens, same cache_salt) reuses them instead of computing them",
    "kv_events_config": "KV-cache events for prefix-aware routers (llm-d, Dynamo), vLLM's "
    'JSON: {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
    '"topic": "kv@POD_IP:PORT@MODEL"} (also replay_endpoint, buffer_steps, hwm, '
    "max_queue_size); every block the prefix cache stores or evicts, over ZeroMQ PUB "
    "(docs/deployment.md)",
    "prefix_caching_hash_algo": "the block hash KV events carry (vLLM's): sha256_cbor "
    "(SHA-256 of canonical CBOR: what llm-d and Dynamo compute), sha256 (of a pickle) or "
    "builtin (Python's hash()); the first block's parent is the hash of PYTHONHASHSEED, "
    "random where unset (set it alike in the router). The prefix cache's own keys are not "
    "these",
    "kv_transfer_config": "vLLM's KV connector as JSON (KServe's LLMInferenceService "
    "spec.kvCacheOffloading passes an OffloadingConnector): accepted and logged, not served: "
    "the KV cache stays in RAM (a value that is not a JSON object stops the start)",
    "kv_offload_dir": "keep the prefix cache's evicted blocks in files in this folder (one "
    "subfolder per model and code identity; empty: off): a prompt that starts with them reads "
    "them back instead of computing them, and a restarted server finds them (docs/engine.md, "
    "'Prefix cache on disk')",
    "kv_offload_size": "GiB of block files --kv-offload-dir may hold; the least recently used "
    "are removed past it",
    "max_step_tokens": "tokens per forward pass (decode rows + prompt chunks): bounds how long "
    "a long prompt's prefill may pause the running streams",
    "speculative": "speculative decoding without a draft model: 'ngram' drafts from the "
    "request's own prompt and output (prompt lookup), 'suffix' also from recent answers of "
    "requests with the same cache_salt; a row drafts only while the steps' measured cost says "
    "its expected accepted tokens pay for it (so it switches itself off under load and where "
    "nothing is copied); 'off' never drafts",
    "num_speculative_tokens": "draft tokens a row verifies at most per step",
    "tool_call_parser": "the tool-call format tools are rendered, forced and parsed in (vLLM's "
    "names: hermes, llama3_json, mistral, phi4_mini_json, pythonic); empty: the chat template's "
    "(docs/openai.md, 'Tool formats')",
    "lora_modules": "LoRA adapters served beside the model: NAME=PATH entries (PEFT folders: "
    "adapter_config.json and adapter_model.safetensors); a request runs one by naming it as "
    "its model (OpenAI `model`, the V2 / OIP / Triton path); vLLM's flag",
    "max_lora_rank": "highest adapter rank accepted (vLLM's flag)",
    "max_loras": "most distinct adapters in one step; a request of another adapter waits for "
    "a row of one to end (vLLM's flag; 0: any number)",
    "max_cpu_loras": "most adapters resident at once; beyond, a request's adapter is read "
    "again in place of the least recently used one no request uses (vLLM's flag; 0: any number)",
    "allow_runtime_lora": "allow POST /v1/load_lora_adapter {lora_name, lora_path} and "
    "/v1/unload_lora_adapter {lora_name} (vLLM's; it asks VLLM_ALLOW_RUNTIME_LORA_UPDATING)",
    "max_waiting": "most requests waiting for a batch row; more are refused",
    "max_prompt_tokens": "longest prompt in tokens (0: context length - max tokens limit)",
    "request_timeout": "seconds a request may run before it ends with finish reason timeout "
    "(0: none; a request's own `timeout` parameter may set one)",
    "drain_seconds": "on SIGTERM, seconds for requests in flight to finish before exit (also "
    "--shutdown-timeout, vLLM's name)",
    "max_prompts": "most prompts in one request (V2 text_input [N]; OpenAI n x prompts); "
    "more is a 400",
    "max_body_bytes": "largest REST body (413 past it) and gRPC message (RESOURCE_EXHAUSTED)",
    "max_json_depth": "deepest nesting of a JSON body (400 past it)",
    "grammar_compile_timeout": "seconds a structured-output grammar's own compile may take, "
    "counted from when it starts on a compile thread (not while it waits behind others): past "
    "it the request is refused (400, too complex) and the compile, which cannot be stopped, "
    "finishes in the background and is cached; a request whose compile has not started within "
    "it is answered 429 with Retry-After (the server is busy), never a 400",
    "max_grammar_compiles": "structured-output grammars compiling or waiting to compile at "
    "once (on a pool of their own: every usable CPU but one, at a low CPU priority; a compile "
    "that runs 0.1 s while another waits runs on at the lowest); more are refused with 429 and "
    "Retry-After",
    "reasoning_parser": "how a thinking model's reasoning is split from its answer, as vLLM's "
    "flag: qwen3 (<think>...</think>, the model opens it), deepseek_r1 (the same, open from the "
    "start), none (never split); empty: qwen3 when the chat template writes </think> and the "
    "vocabulary has <think> and </think> as tokens, else none",
    "reasoning_budget": "thinking tokens a chat request may spend before its end tag is forced "
    "(llama.cpp's --reasoning-budget; -1: no limit, 0: no thinking); a request's "
    "thinking_token_budget or Anthropic's thinking.budget_tokens sets its own",
    "max_stream_requests": "requests in progress on one ModelStreamInfer stream; more get "
    "error_message RESOURCE_EXHAUSTED",
    "stream_queue_size": "responses buffered per ModelStreamInfer stream for a slow reader",
    "slow_reader_grace": "seconds a token response may wait for room in a full ModelStreamInfer "
    "queue before its request is cancelled with RESOURCE_EXHAUSTED",
    "model_control": "allow POST /v2/repository/models/{m}/load|unload and their gRPC twins "
    "(off: 403 / PERMISSION_DENIED, as Triton's --model-control-mode none)",
    "stall_seconds": "liveness fails when requests are running and no engine step has ended "
    "for this long (a hung kernel), or the step thread died",
    "sleep_idle_seconds": "after this many seconds with no request running or waiting, free "
    "the model's weights and KV cache (the prefix cache emptied; AllBlocksCleared where KV "
    "events are on) and load them again for the next request, which waits for it (llama.cpp's "
    "flag; readiness stays true; 0: never; docs/deployment.md, Sleep)",
    "enable_sleep_mode": "serve POST /sleep (?level=1 or 2: both free weights and KV cache) "
    "and POST /wake_up, vLLM's dev endpoints (off: 403); GET /is_sleeping is always served",
    "vllm_metric_aliases": "also export the waiting, running and KV-cache gauges under vLLM's "
    "names (vllm:num_requests_waiting, ...) for endpoint pickers and dashboards that expect them",
    "hf_home": "Hugging Face cache folder (HF_HOME) used while loading",
    "batch_invariant": "accepted for compatibility, always on (false is refused): a request's "
    "tokens (greedy, or seeded sampling) are the same alone or in any batch, with or without "
    'speculative drafts, prefix-cache hits or a preemption; docs/engine.md, "Determinism"',
    "otlp_traces_endpoint": "send a trace span per request (OpenTelemetry's GenAI attributes, "
    "vLLM's latency attributes) to this OTLP collector, e.g. http://otel-collector:4317; a "
    'traceparent header or gRPC metadata makes it a child span ("": off; default from '
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT)",
    "otlp_traces_protocol": "grpc or http/protobuf (default from "
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL or OTEL_EXPORTER_OTLP_PROTOCOL)",
    "tenant_header": "a request header (gRPC metadata key) naming the tenant a request is for, "
    "e.g. x-tenant-id set by a gateway; it wins over OpenAI's user field. The tenant labels "
    "the token and request counters and the traces",
    "max_tenant_labels": "distinct tenant label values; later tenants are counted as other",
    "log_payloads": "one record per request (ids, tenant, parameters, usage, latencies, finish "
    "reason and the prompt and response: full text, their sha256 hashes, or off), sent as a "
    "CloudEvent to --payload-logger-url",
    "payload_logger_url": "where the payload records go: an HTTP CloudEvents sink, e.g. the URL "
    "of a KServe InferenceService's logger",
    "cuda_graphs": "on a GPU, replay a CUDA graph captured at start for each step of decode "
    "rows only (one launch instead of ~9 a layer); off: every step launches its kernels",
}


def _otel_default(name: str, env: Mapping[str, str], default: str) -> str:
    """OpenTelemetry's own variable for this setting. The generic OTEL_EXPORTER_OTLP_ENDPOINT
    is a base URL: over http/protobuf the traces go to its /v1/traces (the specification)."""
    specific, generic = OTEL_ENV[name]
    if env.get(specific):
        return env[specific]
    value = env.get(generic, "")
    if not value:
        return default
    if name == "otlp_traces_endpoint" and _otel_default("otlp_traces_protocol", env, "grpc") != (
        "grpc"
    ):
        return value.rstrip("/") + "/v1/traces"
    return value


def build_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    parser = vllm_args.Parser(
        prog="python -m predictor",
        description="Serve a GPTQ model over KServe's V2 REST and gRPC protocols.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,
    )
    defaults = Settings()
    for f in fields(Settings):
        flag = "--" + f.name.replace("_", "-")
        env_name = "PREDICTOR_" + f.name.upper()
        default = getattr(defaults, f.name)
        kind = type(default)
        convert = vllm_args.boolean if kind is bool else str if kind is tuple else kind
        many = "*" if kind is tuple else None  # a list flag: its values, space-separated
        if env_name not in env and f.name in OTEL_ENV:
            default = _otel_default(f.name, env, default)
        if env_name in env:
            try:
                default = tuple(env[env_name].split()) if many else convert(env[env_name])
            except (ValueError, argparse.ArgumentTypeError):
                parser.error(f"{env_name}={env[env_name]!r} is not a valid {kind.__name__}")
        names = (flag, *vllm_args.FLAG_ALIASES.get(f.name, ()))  # vLLM's names too
        note = f"[env {env_name}]"
        if kind is bool:  # --flag, --no-flag, --flag VALUE
            vllm_args.add_boolean(parser, names, f.name, default, _HELP[f.name], note)
            continue
        parser.add_argument(
            *names,
            dest=f.name,
            type=convert,
            nargs=many,
            default=default,
            choices={
                "kernel": KERNELS,
                "attention": ATTENTION,
                "speculative": SPECULATIVE,
                "prefix_caching_hash_algo": HASH_ALGOS,
                "tool_call_parser": TOOL_CALL_PARSERS,
                "reasoning_parser": ("", *REASONING_PARSERS),
                "otlp_traces_protocol": OTLP_PROTOCOLS,
                "log_payloads": PAYLOAD_MODES,
            }.get(f.name),
            help=f"{_HELP[f.name]} {note}",
        )
    vllm_args.add_arguments(parser)
    return parser
