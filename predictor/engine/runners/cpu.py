"""Forward passes over a paged KV cache: every row's new tokens in one flat batch.

One step feeds each decode row its last token and each prefilling row the next chunk of its
prompt, all as one flat sequence of N tokens, so the linear layers (the GPTQ kernels) run once
per layer over all N. Only attention is per row: each row's keys and values live in the blocks
of its block table in one preallocated pool per layer, new ones are written in place (O(new
tokens) per step), and attention reads a row's own positions only.

The model's own modules do the rest (embeddings, norms, rotary tables, MLP, lm_head), so any
Linear replacement works; attention and the cache are ours. Llama-family decoders and their
kin (families.MODEL_TYPES): what differs between them is read once by family.py.
"""

from __future__ import annotations

import logging
from collections.abc import Generator, Sequence
from pathlib import Path
from typing import Any

import torch

from predictor.engine.runners import memory
from predictor.engine.runners.attention import Rope, native_kernel
from predictor.engine.runners.attention import choose as attention_choice
from predictor.engine.runners.family import family, head_sizes
from predictor.engine.runners.kernels import autotune
from predictor.engine.runners.kernels.int4_linear import projections
from predictor.engine.runners.kernels.matmuls import Matmuls
from predictor.engine.runners.kv_pools import KVPools
from predictor.engine.runners.lora import tune as lora_tune
from predictor.engine.runners.lora.weights import Factors, LoraWeights, projection_shapes
from predictor.engine.runners.lora.weights import Step as LoraStep
from predictor.engine.runners.native.layer_kernels import LayerKernels, layer_kernels
from predictor.engine.runners.plan import StepPlan
from predictor.engine.step import StepRow

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        model: Any,
        device: torch.device,
        num_blocks: int,
        block_size: int = 16,
        threads: int = 0,
        attention: str = "auto",
        kernel: str = "auto",
        autotune_cache: Path | None = None,
        release_model_weights: bool = False,
        batch_invariant: bool = True,
        copies_after_ready: bool = False,
        lora: bool = False,
        copy_budget: int | None = None,
    ) -> None:
        """`attention`: how decode rows attend. "native": the C kernel of bindings.py,
        reading the paged cache in place (CPU, bf16); "torch": a gather and batched matmuls;
        "auto": native where it applies and compiles, else torch.

        `kernel`: how the fused int4 projections run: "auto" (autotune.py measures the
        candidates per row-count bucket, at the first step or in `bind_thread`, and caches its
        choices in `autotune_cache` when given) or one of config.FUSED_KERNELS for every step.

        `release_model_weights`: once tuned, empty the model's own 4-bit modules where every
        layer is fused (the runner reads only its own layouts; about 75 MB for SmolLM2-135M):
        the model's forward no longer works then. For a server, whose model only the runner
        runs.

        `batch_invariant` (the default; off only for load/bench_invariance.py's baseline): a
        row's tokens do not depend on its batch, drafts, cache hits or preemption: one
        row-invariant kernel a matmul (autotune.py checks which, here), and every token attends
        by the decode kernel's arithmetic (plan.py, `queries_as_decode`).

        `copies_after_ready`: the kernels that hold a bf16 copy of the weights are built on a
        thread of their own once `bind_thread` returns (autotune.py, `defer_copies`): a server
        is ready seconds sooner, its many-row steps slower until they are built.

        `copy_budget`: bytes the kernels' copies of the weights may keep in all (bf16
        expansions, lm_head's fp32 copy; kernels/copies.py); None: no bound.

        `lora`: adapters will be served (--lora-modules, --allow-runtime-lora): the autotune
        also times LoRA's kernel modes (lora/tune.py)."""
        self.model = model
        self.device = device
        self.threads = threads
        self.block_size = block_size
        self.num_blocks = num_blocks
        decoder = model.model
        self._embed = decoder.embed_tokens
        self._layers = list(decoder.layers)
        traits = family(model, self._layers)  # UnsupportedModel for another type
        self._rotary = decoder.rotary_emb
        self._lm_head = model.lm_head
        sizes = head_sizes(model)
        self.heads, self.kv_heads, self.head_dim = sizes.heads, sizes.kv_heads, sizes.head_dim
        self.scale = sizes.scale
        # LoRA adapters, by slot (`add_adapter`), and this step's tokens grouped by slot
        shapes = projection_shapes(self._layers[0])
        self.lora = LoraWeights(shapes, len(self._layers), device)
        self._tune_lora = lora
        self._lora_step: LoraStep | None = None
        # the matmuls' kernels: layers fused or prepacked now, kernels chosen in `bind_thread`
        self.kernels = Matmuls(
            self._layers,
            self._lm_head,
            kernel,
            batch_invariant,
            autotune_cache,
            copies_after_ready,
            release_model_weights,
            copy_budget,
            self._embed,
        )
        self._fused = self.kernels.fused  # per layer: its fused int4 projections, or None
        # what differs between the families (family.py)
        self._norms, self._final_norm = traits.norms, traits.final_norm
        self._logit_cap = traits.logit_cap
        self._qk_norms = traits.qk_norms
        self.kernel = kernel
        self.batch_invariant = batch_invariant
        self._autotune_cache = autotune_cache
        dtype = self._embed.weight.dtype
        self._pools = KVPools(
            len(self._layers), self.kv_heads, self.head_dim, num_blocks, block_size, dtype, device
        )
        self._native = native_kernel(
            attention,
            sizes,
            block_size,
            device,
            dtype,
            traits.attention_cap,
            traits.windows,
            self.kernels.library_cache(),
        )
        if batch_invariant and self._native is None:
            logger.warning(
                "determinism: the kernels are row-invariant, but attention is torch's (native "
                "attention needs a bf16 model on the CPU, no soft-capping or sliding windows, and "
                "a C compiler): prompt chunks and decode rows attend by different code, so "
                "prefix-cache hits, chunking and preemption may change a request's tokens"
            )
        # with native attention, the layers' norms, rotary + cache write and SwiGLU too
        self._ops: LayerKernels | None = None
        if self._native is not None:
            self._ops = layer_kernels(model, self.head_dim, self.kernels.library_cache())
            self.lora.kernel = self._ops
        # chosen once: how a layer attends, and how the layers run (with the native ops or not)
        self._attend = attention_choice(
            sizes,
            self._rotary,
            traits.rope_kinds,
            traits.attention_cap,
            traits.windows,
            device,
            self._native,
            self._ops,
        )
        self._run_layers = self._torch_layers if self._ops is None else self._native_layers
        # the final norm where the layers leave it to the logits (the native ops apply it)
        self._logits_norm = self._final_norm if self._ops is None else _unchanged

    def bind_thread(self) -> None:
        """Called first on the thread that will run the forward passes.

        torch's CPU thread count is per calling thread. Measured here: once the main thread has
        run parallel torch work, another thread's 2-thread matmuls run no faster than 1 thread;
        so the server loads with 1 thread on the main thread and parallelises only here.
        """
        if self.threads > 0:
            torch.set_num_threads(self.threads)
        self.kernels.choose(self._tune_lora_modes)

    def _tune_lora_modes(self) -> None:
        """LoRA's kernel modes timed (lora/tune.py), where adapters will be served."""
        if self._tune_lora and self.lora.kernel is not None:
            lora_tune.tune(
                self.lora, self.batch_invariant, torch.get_num_threads(), self._autotune_cache
            )

    @property
    def choices(self) -> autotune.Choices | None:
        """Which kernel serves each matmul per bucket (None until chosen)."""
        return self.kernels.choices

    # -- the disk cache's copies (engine/kv_offload.py's BlockCopies) -------------------------
    def kv_layout(self) -> dict[str, Any]:
        return self._pools.layout()

    def kv_block_bytes(self) -> int:
        return self._pools.block_bytes()

    @torch.inference_mode()
    def read_blocks(self, blocks: Sequence[int]) -> memoryview:
        return self._pools.read(blocks)

    @torch.inference_mode()
    def write_blocks(self, blocks: Sequence[int], data: memoryview) -> None:
        self._pools.write(blocks, data)

    def free(self) -> None:
        """Before a sleep drops this runner (engine/sleep.py): every tensor of the model emptied
        and the KV pools let go, so their memory returns even where something else keeps the
        model object alive (gptqmodel's first import keeps an ImportError's traceback, whose
        frames hold the first model transformers loaded). Nothing runs on this runner after."""
        self.kernels.join()  # the deferred copies read the weights: done first
        for module in self.model.modules():
            memory.empty_tensors(module)
        self._pools.free()

    @torch.inference_mode()
    def step_cost(self, fed: int, logit_rows: int) -> float | None:
        """What the autotune measured a step of `fed` tokens (`logit_rows` rows of logits)
        costs on this machine, in seconds (None: not measured, e.g. a forced kernel)."""
        return self.kernels.cost(fed, logit_rows)

    def forward(self, rows: Sequence[StepRow]) -> torch.Tensor:
        """Run one step; logits [sum of the rows' logit_count, V] (float32), in row order.

        Every op here runs once per layer for the whole step (30 layers x 16 rows: a few
        microseconds of dispatch per op add up to milliseconds), so a layer is written as few
        tensor ops as it can be: one rotary pass over q, k and v together, one cache write, and
        decode attention as one native call (or one gather and a few batched matmuls)."""
        self.kernels.choose(self._tune_lora_modes)
        plan = StepPlan.build(
            rows,
            self.block_size,
            self._pools.pad_slot,
            self.device,
            self._attend.native,
            self.heads // self.kv_heads,
            queries_as_decode=self.batch_invariant,
        )
        ids = torch.tensor(plan.ids, dtype=torch.long, device=self.device)
        self._lora_step = None
        if any(row.adapter for row in rows):  # adapters' rows: their tokens by slot
            self._lora_step = self.lora.step([row.adapter for row in rows for _ in row.tokens])
        hidden = self.kernels.embed(ids)  # [N, hidden]: the step's tokens as one flat sequence
        ropes = self._attend.tables(hidden, plan.positions)  # per layer
        return self._logits(self._run_layers(hidden, plan, ropes), plan)

    def _torch_layers(
        self, hidden: torch.Tensor, plan: StepPlan, ropes: list[Rope]
    ) -> torch.Tensor:
        """The layers with the family's norms (family.py): the hidden states [N, hidden]."""
        for index, layer in enumerate(self._layers):
            before_attention, after_attention, before_mlp, after_mlp = self._norms[index]
            out = self._attention(index, before_attention(hidden), ropes[index], plan)
            hidden = hidden + after_attention(out)
            hidden = hidden + after_mlp(self._mlp(index, layer.mlp, before_mlp(hidden)))
        return hidden

    def _native_layers(
        self, hidden: torch.Tensor, plan: StepPlan, ropes: list[Rope]
    ) -> torch.Tensor:
        """The layers with the native layer ops: each residual add fused into the next norm
        (hidden is updated in place); the final norm applied too."""
        ops = self._ops
        assert ops is not None
        normed = ops.add_rms_norm(hidden, None, 0)
        for index, layer in enumerate(self._layers):
            out = self._attention(index, normed, ropes[index], plan)
            normed = ops.add_rms_norm(hidden, out, 2 * index + 1)
            out = self._mlp(index, layer.mlp, normed)
            normed = ops.add_rms_norm(hidden, out, 2 * index + 2)  # the last: the final norm
        return normed

    def _logits(self, hidden: torch.Tensor, plan: StepPlan) -> torch.Tensor:
        """The step's logits [R, V] float32: the rows it returns logits for (`plan.logit_rows`;
        R may be 0 mid-prompt), through the final norm (where the layers left it), lm_head
        and the soft cap where the model caps them."""
        if len(plan.logit_rows) != hidden.shape[0]:
            wanted = torch.tensor(plan.logit_rows, dtype=torch.long, device=self.device)
            hidden = hidden.index_select(0, wanted)  # [R, hidden]
        head = self.kernels.head
        assert head is not None
        logits = head(self._logits_norm(hidden)).float()
        if self._logit_cap is not None:
            cap = float(self._logit_cap)
            logits = torch.tanh(logits / cap).mul_(cap)
        return logits

    def _attention(
        self, index: int, hidden: torch.Tensor, rope: Rope, plan: StepPlan
    ) -> torch.Tensor:
        """Layer `index`'s attention block on `hidden` [N, hidden]: q/k/v, the attention chosen
        at start, o; the adapters' deltas where the step has adapters' rows."""
        fused = self._fused[index]
        if fused is not None:
            qkv = fused.qkv.forward(hidden)  # not __call__: its hook machinery, 120 a step
        else:
            qkv = torch.cat([linear(hidden) for linear in projections(self._layers[index])[0]], -1)
        if self._lora_step is not None:
            qkv = self.lora.apply(index, "qkv", hidden, qkv, self._lora_step)
        if self._qk_norms is not None:
            qkv = self._norm_heads(index, qkv, hidden.shape[0])
        out = self._attend(index, qkv, self._pools[index], rope, plan)  # [N, heads * dim]
        if fused is not None:
            projected = fused.o.forward(out)
        else:
            projected = self._layers[index].self_attn.o_proj(out)
        if self._lora_step is not None:
            projected = self.lora.apply(index, "o", out, projected, self._lora_step)
        return projected

    def add_adapter(self, slot: int, factors: Factors, scale: float) -> None:
        """Make a LoRA adapter resident as `slot` (rows with that `adapter` use it)."""
        self.lora.add(slot, factors, scale)

    def adding_adapter(
        self, slot: int, factors: Factors, scale: float
    ) -> Generator[None, None, None]:
        """`add_adapter` a slice at a time (StepLoop.run_chore runs it between steps)."""
        return self.lora.adding(slot, factors, scale)

    def _norm_heads(self, index: int, qkv: torch.Tensor, n: int) -> torch.Tensor:
        """Qwen3's q_norm and k_norm on each head of q and k, in place ([N, q + 2 kv])."""
        assert self._qk_norms is not None
        q_norm, k_norm = self._qk_norms[index]
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        qkv = qkv.contiguous()
        view = qkv.view(n, heads + 2 * kv_heads, dim)
        view[:, :heads] = q_norm(view[:, :heads])
        view[:, heads : heads + kv_heads] = k_norm(view[:, heads : heads + kv_heads])
        return qkv

    def _mlp(self, index: int, mlp: Any, hidden: torch.Tensor) -> torch.Tensor:
        fused = self._fused[index]
        if self._lora_step is not None:
            return self._mlp_lora(index, mlp, hidden, self._lora_step)
        if fused is None:
            return mlp(hidden)
        if self._ops is not None:
            return fused.down.forward(self._ops.silu_mul(fused.gate_up.forward(hidden)))
        gate, up = fused.gate_up(hidden).chunk(2, -1)  # Phi-3's one gate_up_proj: gate first
        return fused.down(mlp.act_fn(gate) * up)

    def _mlp_lora(self, index: int, mlp: Any, hidden: torch.Tensor, step: LoraStep) -> torch.Tensor:
        """The MLP with the adapters' deltas on gate/up and on down."""
        fused = self._fused[index]
        if fused is not None:
            gate_up = fused.gate_up.forward(hidden)
        else:
            gate_up = torch.cat(
                [linear(hidden) for linear in projections(self._layers[index])[2]], -1
            )
        gate_up = self.lora.apply(index, "gate_up", hidden, gate_up, step)
        if self._ops is not None and fused is not None:
            inner = self._ops.silu_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, -1)
            inner = mlp.act_fn(gate) * up
        down = fused.down.forward(inner) if fused is not None else mlp.down_proj(inner)
        return self.lora.apply(index, "down", inner, down, step)


def _unchanged(x: torch.Tensor) -> torch.Tensor:
    return x
