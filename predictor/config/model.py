"""The model group: the checkpoint served, its names, and how it runs (device, threads,
kernels, attention, its chat formats, sleep while idle)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from predictor.config.flags import (
    ATTENTION,
    LOADER_KERNELS,
    REASONING_PARSERS,
    RUNNER_KERNELS,
    TOOL_CALL_PARSERS,
    option,
)
from predictor.cpus import container_cpus

DEFAULT_MODEL_DIR = Path("models/smollm2-135m-instruct-gptq")
SERVING_CORES = 1  # cores the default thread count leaves to serving (ModelSettings.torch_threads)


@dataclass(frozen=True)
class ModelSettings:
    """The checkpoint served, its names and how it runs: device, kernels, chat formats, sleep."""

    model_dir: Path = option(
        DEFAULT_MODEL_DIR,
        "GPTQ checkpoint folder (KServe mounts storageUri at /mnt/models); also the "
        "first word when it is not a flag (vLLM's `vllm serve MODEL`)",
    )
    model_name: str = option(
        "",
        "name served under /v2/models/{name} and as the OpenAI model (default: the "
        "folder's name; also --served-model-name, vLLM's name)",
    )
    model_aliases: tuple[str, ...] = option(
        (),
        "other names the model answers to on every protocol, each listed in "
        "/v1/models (vLLM: --served-model-name's names after the first)",
    )
    device: str = option(
        "auto",
        "auto, cpu or cuda",
    )
    runner: str = option(
        "model",
        "model, or null: no model, fixed logits at no cost and no end-of-sequence "
        "(measures everything around the model; benchmarks only)",
    )
    threads: int = option(
        0,
        "compute threads (0: the CPUs the process may use, its container's CPU limit, "
        "but one; at least 1)",
    )
    kernel: str = option(
        "auto",
        "the runner's kernel for its fused int4 projections: auto (the kernel the "
        "checkpoint's build chose where its served gate chose one, else for each matmul the "
        "one a short autotune measured fastest for the step's rows), autotune (auto without "
        "the build's choice), or one for every projection: int4_op (torch's), prepacked_bf16 "
        "(oneDNN), native_f32 / native_i8 (runners/native/int4_matmul.c, fp32 or int8 "
        "activations, the widest instruction set; _avx2, _avx512, ... names one)",
    )
    loader_kernel: str = option(
        "auto",
        "how the checkpoint's GPTQ layers are loaded: auto (GPTQ's tensors as stored where the "
        "runner fuses every projection, else gptqmodel's choice), a gptqmodel backend"
        f" ({', '.join(LOADER_KERNELS[1:-1])}), or dequantized (expanded once at load into "
        "plain Linear layers of the model's dtype: the same numbers, 4x the weight memory)",
        choices=LOADER_KERNELS,
    )
    attention: str = option(
        "auto",
        "how decode rows attend: on a CPU native (a C kernel compiled at start with $CC or "
        "cc/gcc/g++/clang, reading the paged cache in place; bf16 models) or torch (gather + "
        "batched matmuls); on a GPU triton (a paged kernel) or torch; auto: native where it "
        "compiles on a CPU, the faster measured at start on a GPU",
        choices=ATTENTION,
    )
    max_weight_copies_gb: float = option(
        1.0,
        "GB (10^9 bytes) the kernels may keep in copies of the weights besides the 4-bit ones "
        "(a bf16 expansion of a projection; lm_head's fp32 or prepacked copy), each only where "
        "the autotune measured it 15%% faster than a kernel without one; past the budget the "
        "copies that save the least time per byte go first (0: none; a forced --kernel is not "
        "bound; lm_head's int8 table is no copy where it replaces the head's bf16 weights)",
    )
    autotune_cache: str = option(
        str(Path.home() / ".cache" / "gptq-predictor"),
        "folder of the kernel autotune's cached choices, the compiled kernels "
        "and the weights' kernel layouts (empty: measure and build at every start)",
    )
    cuda_graphs: bool = option(
        True,
        "on a GPU, replay a CUDA graph captured at start for each step of decode "
        "rows only (one launch instead of ~9 a layer); off: every step launches its kernels",
    )
    batch_invariant: bool = option(
        True,
        "accepted for compatibility, always on (false is refused): a request's "
        "tokens (greedy, or seeded sampling) are the same alone or in any batch, with or without "
        'speculative drafts, prefix-cache hits or a preemption; docs/engine.md, "Determinism"',
    )
    hf_home: Path = option(
        Path.home() / ".cache" / "huggingface",
        "Hugging Face cache folder (HF_HOME) used while loading",
    )
    tool_call_parser: str = option(
        "",
        "the tool-call format tools are rendered, forced and parsed in (vLLM's names: hermes, "
        "llama3_json, mistral, phi4_mini_json, pythonic); empty: the chat template's "
        "(docs/openai.md, 'Tool formats')",
        choices=TOOL_CALL_PARSERS,
    )
    reasoning_parser: str = option(
        "",
        "how a thinking model's reasoning is split from its answer, as vLLM's flag: qwen3 "
        "(<think>...</think>, the model opens it), deepseek_r1 (the same, open from the "
        "start), none (never split); empty: qwen3 when the chat template writes </think> and the "
        "vocabulary has <think> and </think> as tokens, else none",
        choices=("", *REASONING_PARSERS),
    )
    reasoning_budget: int = option(
        -1,
        "thinking tokens a chat request may spend before its end tag is forced "
        "(llama.cpp's --reasoning-budget; -1: no limit, 0: no thinking); a request's "
        "thinking_token_budget or Anthropic's thinking.budget_tokens sets its own",
    )
    sleep_idle_seconds: float = option(
        0.0,
        "after this many seconds with no request running or waiting, free "
        "the model's weights and KV cache (the prefix cache emptied; AllBlocksCleared where KV "
        "events are on) and load them again for the next request, which waits for it (llama.cpp's "
        "flag; readiness stays true; 0: never; docs/deployment.md, Sleep)",
    )
    enable_sleep_mode: bool = option(
        False,
        "serve POST /sleep (?level=1 or 2: both free weights and KV cache) "
        "and POST /wake_up, vLLM's dev endpoints (off: 403); GET /is_sleeping is always served",
    )

    @property
    def autotune_dir(self) -> Path | None:
        return Path(self.autotune_cache) if self.autotune_cache else None

    @property
    def copy_budget(self) -> int:
        """--max-weight-copies-gb in bytes."""
        return int(self.max_weight_copies_gb * 1e9)

    @property
    def torch_threads(self) -> int:
        """--threads, or the CPUs this process may use (`container_cpus`: a container's CPU limit,
        not the node's cores) less SERVING_CORES, at least one: the event loop, HTTP and gRPC
        need a core of their own, as vLLM-CPU reserves one. On 2 cores, 2 compute threads gave
        fewer tokens/s than 1, at one request and at many (load/bench_threads.py,
        load/RESULTS.md)."""
        if self.threads > 0:
            return self.threads
        return max(1, container_cpus() - SERVING_CORES)

    def check(self) -> None:
        if self.runner not in ("model", "null"):
            raise ValueError(f"--runner must be model or null, got {self.runner!r}")
        if self.attention not in ATTENTION:
            raise ValueError(
                f"--attention must be one of {', '.join(ATTENTION)}, not {self.attention!r}"
            )
        if self.kernel in LOADER_KERNELS[1:]:  # the flag named both once
            raise ValueError(
                f"--kernel {self.kernel} is how the checkpoint loads: --loader-kernel "
                f"{self.kernel} (--kernel is the runner's: {', '.join(RUNNER_KERNELS)})"
            )
        if self.kernel not in RUNNER_KERNELS:
            raise ValueError(
                f"--kernel must be one of {', '.join(RUNNER_KERNELS)}, not {self.kernel!r}"
            )
        if self.reasoning_parser not in ("", *REASONING_PARSERS) or self.reasoning_budget < -1:
            raise ValueError(
                f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)} (or empty), "
                "and --reasoning-budget -1 or more"
            )
        if not self.batch_invariant:
            raise ValueError(
                "--batch-invariant false: determinism is always on (docs/engine.md, Determinism)"
            )
        if not self.max_weight_copies_gb >= 0:  # NaN too
            raise ValueError("--max-weight-copies-gb must be 0 or more")
        if self.sleep_idle_seconds < 0:
            raise ValueError("--sleep-idle-seconds must not be negative (0: never)")

    @property
    def sleeps(self) -> bool:
        """The engine may sleep: when idle (--sleep-idle-seconds) or when asked (/sleep)."""
        return self.sleep_idle_seconds > 0 or self.enable_sleep_mode
