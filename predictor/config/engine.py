"""The engine's groups: its KV cache (and the prefix cache's events and disk copy), the
scheduler's batch and queue, speculative decoding, and LoRA adapters."""

from __future__ import annotations

from dataclasses import dataclass

from predictor import vllm_args
from predictor.config.flags import HASH_ALGOS, SPECULATIVE, option


@dataclass(frozen=True)
class CacheSettings:
    """The KV cache: its size and blocks, the prefix cache, its events and its copy on disk."""

    max_cache_tokens: int = option(
        32768,
        "KV-cache size in tokens; a request takes its prompt's blocks at "
        "admission and one more each block_size tokens it generates (preempted and recomputed "
        "later when the cache is full)",
    )
    kv_block_size: int = option(
        16,
        "tokens per KV-cache block (the prefix cache shares whole blocks; also "
        "--block-size, vLLM's name)",
    )
    prefix_caching: bool = option(
        True,
        "automatic prefix caching: a prompt that starts with blocks another "
        "request computed (same tokens, same cache_salt) reuses them instead of computing them",
    )
    prefix_caching_hash_algo: str = option(
        "sha256",
        "the block hash KV events carry (vLLM's): sha256_cbor "
        "(SHA-256 of canonical CBOR: what llm-d and Dynamo compute), sha256 (of a pickle) or "
        "builtin (Python's hash()); the first block's parent is the hash of PYTHONHASHSEED, "
        "random where unset (set it alike in the router). The prefix cache's own keys are not "
        "these",
        choices=HASH_ALGOS,
    )
    kv_events_config: str = option(
        "",
        "KV-cache events for prefix-aware routers (llm-d, Dynamo), vLLM's "
        'JSON: {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
        '"topic": "kv@POD_IP:PORT@MODEL"} (also replay_endpoint, buffer_steps, hwm, '
        "max_queue_size); every block the prefix cache stores or evicts, over ZeroMQ PUB "
        "(docs/deployment.md)",
    )
    kv_transfer_config: str = option(
        "",
        "vLLM's KV connector as JSON (KServe's LLMInferenceService "
        "spec.kvCacheOffloading passes an OffloadingConnector): accepted and logged, not served: "
        "the KV cache stays in RAM (a value that is not a JSON object stops the start)",
    )
    kv_offload_dir: str = option(
        "",
        "keep the prefix cache's evicted blocks in files in this folder (one "
        "subfolder per model and code identity; empty: off): a prompt that starts with them reads "
        "them back instead of computing them, and a restarted server finds them (docs/engine.md, "
        "'Prefix cache on disk')",
    )
    kv_offload_size: float = option(
        8.0,
        "GiB of block files --kv-offload-dir may hold; the least recently used are removed past it",
    )

    @property
    def kv_events(self) -> vllm_args.KVEventsConfig | None:
        """--kv-events-config read (None: no events); ValueError naming what is wrong."""
        return vllm_args.kv_events_config(self.kv_events_config)

    def check(self) -> None:
        if self.kv_block_size < 1 or self.max_cache_tokens < self.kv_block_size:
            raise ValueError(
                "--kv-block-size must be >= 1 and --max-cache-tokens at least one block"
            )
        events = self.kv_events  # raises for bad JSON or an unknown key
        vllm_args.kv_transfer_config(self.kv_transfer_config)  # raises where it is not JSON
        if events is not None and events.publishing and not self.prefix_caching:
            raise ValueError(
                "--kv-events-config publishes the prefix cache's events: it needs "
                "--enable-prefix-caching"
            )
        if self.kv_offload_dir and (
            self.kv_offload_size <= 0
            or not self.prefix_caching
            or self.prefix_caching_hash_algo == "builtin"
        ):
            raise ValueError(
                "--kv-offload-dir needs --kv-offload-size > 0, prefix caching and "
                "a --prefix-caching-hash-algo other than builtin (Python's hash() "
                "differs between processes)"
            )


@dataclass(frozen=True)
class SchedulerSettings:
    """The batch each step runs and the queue before it."""

    max_batch_size: int = option(
        16,
        "most requests decoded together",
    )
    # requests allowed to wait for a row before new ones get 429: 4 batches' worth, so a
    # refused client learns at once instead of waiting minutes behind a deep queue
    max_waiting: int = option(
        64,
        "most requests waiting for a batch row; more are refused",
    )
    max_step_tokens: int = option(
        256,
        "tokens per forward pass (decode rows + prompt chunks): bounds how long "
        "a long prompt's prefill may pause the running streams",
    )

    def check(self) -> None:
        if self.max_batch_size < 1 or self.max_waiting < 0:
            raise ValueError("--max-batch-size must be >= 1 and --max-waiting >= 0")
        if self.max_step_tokens <= self.max_batch_size:
            raise ValueError("--max-step-tokens must exceed --max-batch-size (room for prefill)")


@dataclass(frozen=True)
class SpeculationSettings:
    """Speculative decoding without a draft model."""

    # speculative decoding without a draft model: off | ngram | suffix; a row drafts only
    # while the steps' measured cost says its drafts pay (so it is on by default: where
    # nothing is copied, or under load, it switches itself off)
    speculative: str = option(
        "suffix",
        "speculative decoding without a draft model: 'ngram' drafts from the "
        "request's own prompt and output (prompt lookup), 'suffix' also from recent answers of "
        "requests with the same cache_salt; a row drafts only while the steps' measured cost says "
        "its expected accepted tokens pay for it (so it switches itself off under load and where "
        "nothing is copied); 'off' never drafts",
        choices=SPECULATIVE,
    )
    num_speculative_tokens: int = option(
        8,
        "draft tokens a row verifies at most per step",
    )

    def check(self) -> None:
        if self.speculative not in SPECULATIVE or not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(
                f"--speculative must be one of {', '.join(SPECULATIVE)} and "
                "--num-speculative-tokens between 1 and 16"
            )


@dataclass(frozen=True)
class LoraSettings:
    """LoRA adapters served beside the model, at the start and at run time."""

    lora_modules: tuple[str, ...] = option(
        (),
        "LoRA adapters served beside the model: NAME=PATH entries (PEFT folders: "
        "adapter_config.json and adapter_model.safetensors); a request runs one by naming it as "
        "its model (OpenAI `model`, the V2 / OIP / Triton path); vLLM's flag",
    )
    max_lora_rank: int = option(
        64,
        "highest adapter rank accepted (vLLM's flag)",
    )
    max_loras: int = option(
        0,
        "most distinct adapters in one step; a request of another adapter waits for "
        "a row of one to end (vLLM's flag; 0: any number)",
    )
    max_cpu_loras: int = option(
        0,
        "most adapters resident at once; beyond, a request's adapter is read again in place of "
        "the least recently used one no request uses (vLLM's flag; 0: any number)",
    )
    allow_runtime_lora: bool = option(
        False,
        "allow POST /v1/load_lora_adapter {lora_name, lora_path} and "
        "/v1/unload_lora_adapter {lora_name} (vLLM's; it asks VLLM_ALLOW_RUNTIME_LORA_UPDATING)",
    )

    @property
    def adapters(self) -> list[tuple[str, str]]:
        """--lora-modules as (name, path): `NAME=PATH`, or vLLM's JSON form `{"name": NAME,
        "path": PATH}` (what KServe's LLMInferenceService passes)."""
        return [vllm_args.lora_module(entry) for entry in self.lora_modules]

    @property
    def served(self) -> bool:
        """Adapters may be served: named at the start or allowed at run time."""
        return bool(self.lora_modules or self.allow_runtime_lora)

    def check(self) -> None:
        names = [name for name, _ in self.adapters]  # raises for a malformed entry
        if len(set(names)) != len(names):
            raise ValueError("--lora-modules names each adapter once")
        if not 1 <= self.max_lora_rank <= 256 or min(self.max_loras, self.max_cpu_loras) < 0:
            raise ValueError(
                "--max-lora-rank must be between 1 and 256, --max-loras and "
                "--max-cpu-loras at least 0"
            )
