"""Forward passes on a CUDA GPU over a paged KV cache: the GPU's runner.

The same step as the CPU runner's (runners/cpu.py): every row's new tokens as one flat batch,
decode rows first, each layer's projections once for all rows, attention per row over its own
blocks. Its parts are the GPU's own:
- projections: cuda/linear.py, the kernel per row-count bucket chosen by cuda/autotune.py;
- small ops: cuda/triton_ops.py (the residual add fused into each RMSNorm, the rotary pass and
  cache write in one launch, SwiGLU in one): a layer is 9 launches;
- decode attention: the paged Triton kernel reading each row's blocks where they lie, or, when
  measured faster at start, torch over the gathered rows (eager steps only); prefill rows: torch
  SDPA over the row's gathered keys and values (flash or memory-efficient attention);
- CUDA graphs: a step of decode rows only, the common step of a busy server, replays a graph
  captured at start for the smallest bucket of rows that holds it (padding rows write nothing
  and attend to nothing), so its ~250 launches cost one; its index tensors go to the device in
  one copy. Sampling stays on the GPU: the step's one wait is the sampler reading the tokens.

Llama-family decoders (the CPU runner's families), read by model/gptq.py (GPTQLinear).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from predictor.engine.runners.cuda import attention as paths
from predictor.engine.runners.cuda import autotune, triton_ops
from predictor.engine.runners.cuda.linear import CudaLinear, fuse
from predictor.engine.runners.family import head_sizes
from predictor.engine.runners.plan import flatten, slots_of
from predictor.engine.step import StepRow
from predictor.errors import UnsupportedModel
from predictor.families import GPU_MODEL_TYPES, check_family

logger = logging.getLogger(__name__)

GRAPH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
ATTENTION = ("auto", "triton", "torch")


@dataclass
class _Step:
    """One step's indexes on the device (int32 views of one copy) and its prefill rows."""

    ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    slots: torch.Tensor  # [N]: each fed token's cache slot
    decode_rows: int  # the first decode_rows rows feed one token each
    tables: torch.Tensor  # [d, widest]
    lengths: torch.Tensor  # [d]: keys each decode row attends to
    # per prefill row: (first flat index, token count, start, slots of positions 0..end-1)
    prefills: list[tuple[int, int, int, torch.Tensor]]
    logit_rows: list[int]


@dataclass
class _Graph:
    rows: int
    static: torch.Tensor  # ids, positions, slots, lengths, then tables [rows, max_blocks]
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [rows, V] float32, written by each replay


class CudaRunner:
    def __init__(
        self,
        model: Any,
        device: torch.device,
        num_blocks: int,
        block_size: int = 16,
        max_rows: int = 16,
        max_step_tokens: int = 256,
        graphs: bool = True,
        attention: str = "auto",
        release_model_weights: bool = False,
    ) -> None:
        """`max_rows`: the most decode rows a step holds (the largest graph); `max_step_tokens`:
        the most tokens a step feeds (the largest bucket the autotune measures). `attention`:
        "triton" (the paged kernel), "torch" (gather, eager steps), "auto" (measured)."""
        check_family(getattr(model.config, "model_type", ""), GPU_MODEL_TYPES, " on the GPU")
        if attention not in ATTENTION:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION)}")
        self.model, self.device = model, device
        self.num_blocks, self.block_size = num_blocks, block_size
        self.max_rows, self.max_step_tokens = max_rows, max_step_tokens
        self._use_graphs, self._attention_choice = graphs, attention
        decoder, config = model.model, model.config
        self._layers = list(decoder.layers)
        self.dtype = decoder.embed_tokens.weight.dtype
        sizes = head_sizes(model)
        self.heads, self.kv_heads, self.head_dim = sizes.heads, sizes.kv_heads, sizes.head_dim
        if self.head_dim & (self.head_dim - 1) or self.head_dim < 16:
            raise UnsupportedModel(f"head size {self.head_dim}: the GPU kernels take powers of 2")
        self.scale = sizes.scale
        self._heads = paths.Heads(self.heads, self.kv_heads, self.head_dim, self.scale, block_size)
        self._embed = decoder.embed_tokens.weight
        self._head = model.lm_head.weight  # [V, hidden]
        self._qkv, self._o, self._gate_up, self._down = [], [], [], []
        for layer in self._layers:
            attn, mlp = layer.self_attn, layer.mlp
            parts = (
                attn.q_proj,
                attn.k_proj,
                attn.v_proj,
                attn.o_proj,
                mlp.gate_proj,
                mlp.up_proj,
                mlp.down_proj,
            )
            if not all(hasattr(p, "qweight") and hasattr(p, "zeros") for p in parts):
                raise UnsupportedModel(
                    "the GPU runner serves GPTQ checkpoints read by model/gptq.py (GPTQLinear)"
                )
            self._qkv.append(fuse(parts[:3], self.dtype))
            self._o.append(fuse(parts[3:4], self.dtype))
            self._gate_up.append(fuse(parts[4:6], self.dtype))
            self._down.append(fuse(parts[6:], self.dtype))
        norms = []
        for layer in self._layers:
            norms += [layer.input_layernorm, layer.post_attention_layernorm]
        norms.append(decoder.norm)
        self._norms = [(n.weight.detach().contiguous(), float(n.variance_epsilon)) for n in norms]
        slots = num_blocks * block_size
        self._pools = [
            torch.zeros(
                (2 * self.kv_heads, slots + 1, self.head_dim), dtype=self.dtype, device=device
            )
            for _ in self._layers
        ]
        self._pad_slot = slots
        positions = int(getattr(config, "max_position_embeddings", 4096))
        self._cos, self._sin = self._rope_tables(decoder.rotary_emb, positions)
        self.max_blocks = -(-min(positions, slots) // block_size)
        self._release = release_model_weights
        self._tuned = False
        self.choices: autotune.GpuChoices | None = None
        self.attention = "triton"
        self._graphs: dict[int, _Graph] = {}
        self._host = torch.empty(0, dtype=torch.int32).pin_memory()
        self._copied = torch.cuda.Event()

    def _rope_tables(self, rotary: Any, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [positions, head_dim] in the model's dtype, as transformers' rotary
        module computes them (its scaling type and attention factor included)."""
        at = torch.arange(positions, device=self.device).unsqueeze(0)
        probe = torch.empty((1, 1, self.head_dim), dtype=self.dtype, device=self.device)
        with torch.inference_mode():
            cos, sin = rotary(probe, at)
        return cos[0].to(self.dtype).contiguous(), sin[0].to(self.dtype).contiguous()

    @property
    def cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._pools)

    def _linears(self) -> tuple[list[CudaLinear], list[str]]:
        linears, names = [], []
        for kind, table in (
            ("qkv", self._qkv),
            ("o", self._o),
            ("gate_up", self._gate_up),
            ("down", self._down),
        ):
            for parts in table:
                linears += parts
                names += [kind if len(parts) == 1 else f"{kind}[{i}]" for i in range(len(parts))]
        return linears, names

    def bind_thread(self) -> None:
        """On the step thread, once: the kernels measured, attention chosen, graphs captured."""
        if self._tuned:
            return
        start = time.perf_counter()
        with torch.inference_mode():
            linears, names = self._linears()
            self.choices = autotune.tune(linears, names, self.max_step_tokens)
            autotune.log_choices(self.choices)
            tuned = time.perf_counter()
            self.attention = self._attention_choice
            if self.attention == "auto":
                self.attention = paths.choose(
                    self._heads,
                    self._pools[0],
                    min(16, self.max_rows),
                    self.num_blocks,
                    self._pad_slot,
                )
            if self._release:  # only the runner runs the served model: its own copies go
                self._release_model_weights()
            if self._use_graphs:
                self._capture_graphs()
        self._tuned = True
        logger.info(
            "GPU runner ready: kernels measured in %.1f s, %d decode graphs (rows %s) in %.1f s;"
            " %.0f MiB of KV cache, %.0f MiB on the GPU",
            tuned - start,
            len(self._graphs),
            sorted(self._graphs),
            time.perf_counter() - tuned,
            self.cache_bytes / 2**20,
            torch.cuda.memory_allocated(self.device) / 2**20,
        )

    def _release_model_weights(self) -> None:
        for layer in self._layers:
            attn, mlp = layer.self_attn, layer.mlp
            for module in (
                attn.q_proj,
                attn.k_proj,
                attn.v_proj,
                attn.o_proj,
                mlp.gate_proj,
                mlp.up_proj,
                mlp.down_proj,
            ):
                for name in ("qweight", "zeros", "scales"):
                    setattr(module, name, torch.empty(0, device=self.device))
        torch.cuda.empty_cache()

    # -- a step --------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, rows: Sequence[StepRow]) -> torch.Tensor:
        """Run one step; logits [sum of the rows' logit_count, V] float32 on the GPU, in row
        order. A decode-only step's logits are a view of its graph's output, valid until the
        next step."""
        self.bind_thread()
        decode = _decode_rows(rows)
        if (
            decode == len(rows)
            and rows
            and all(r.logits and not r.all_logits for r in rows)
            and self._graphs
            and len(rows) <= max(self._graphs)
        ):
            return self._replay(rows)
        step = self._upload(rows, decode)
        return self._forward(step)

    def _forward(self, step: _Step) -> torch.Tensor:
        hidden = F.embedding(step.ids, self._embed)  # [N, hidden]

        def attend(index: int, qkv: torch.Tensor, out: torch.Tensor) -> None:
            pool, d = self._pools[index], step.decode_rows
            if d and self.attention == "triton":
                triton_ops.paged_decode_attention(
                    qkv,
                    pool,
                    step.tables,
                    step.lengths,
                    out,
                    self.heads,
                    self.kv_heads,
                    self.block_size,
                    self.scale,
                )
            elif d:
                paths.torch_decode(
                    self._heads, qkv[:d], pool, step.tables, step.lengths, out[:d], self._pad_slot
                )
            for first, count, start, slots in step.prefills:
                paths.prefill(self._heads, qkv, pool, first, count, start, slots, out)

        normed = self._layer_stack(hidden, step.positions, step.slots, attend)
        if len(step.logit_rows) != normed.shape[0]:
            wanted = torch.tensor(step.logit_rows, dtype=torch.long, device=self.device)
            normed = normed.index_select(0, wanted)  # [R, hidden]; R may be 0 mid-prompt
        return F.linear(normed, self._head).float()  # [R, V]

    def _layer_stack(
        self,
        hidden: torch.Tensor,  # [N, hidden], updated in place (the residual stream)
        positions: torch.Tensor,
        slots: torch.Tensor,
        attend: Callable[[int, torch.Tensor, torch.Tensor], None],
    ) -> torch.Tensor:
        """Every layer over the step's tokens; the final norm's output [N, hidden]."""
        n, heads, kv_heads = hidden.shape[0], self.heads, self.kv_heads
        weight, eps = self._norms[0]
        normed = triton_ops.add_rms_norm(hidden, None, weight, eps)
        for index in range(len(self._layers)):
            qkv = _project(self._qkv[index], normed)  # [N, (heads + 2 kv_heads) dim]
            triton_ops.rope_write(
                qkv, self._cos, self._sin, positions, slots, self._pools[index], heads, kv_heads
            )
            out = torch.empty((n, heads * self.head_dim), dtype=self.dtype, device=self.device)
            attend(index, qkv, out)
            weight, eps = self._norms[2 * index + 1]
            normed = triton_ops.add_rms_norm(hidden, _project(self._o[index], out), weight, eps)
            act = triton_ops.silu_mul(_project(self._gate_up[index], normed))
            weight, eps = self._norms[2 * index + 2]
            normed = triton_ops.add_rms_norm(hidden, _project(self._down[index], act), weight, eps)
        return normed

    # -- indexes to the device -----------------------------------------------------------------
    def _stage(self, values: np.ndarray, into: torch.Tensor | None = None) -> torch.Tensor:
        """int32 values -> the device (`into`, or a new tensor), through the pinned buffer, in
        one copy that does not wait for the device."""
        self._copied.synchronize()  # the last copy out of the buffer has been read
        if self._host.numel() < values.size:
            self._host = torch.empty(
                max(values.size, 2 * self._host.numel()), dtype=torch.int32
            ).pin_memory()
        host = self._host[: values.size]
        host.numpy()[:] = values
        if into is None:
            into = host.to(self.device, non_blocking=True)
        else:
            into.copy_(host, non_blocking=True)
        self._copied.record()
        return into

    def _upload(self, rows: Sequence[StepRow], decode: int) -> _Step:
        flat = flatten(rows, self.block_size)
        tables = [list(row.blocks) for row in rows[:decode]]
        lengths = [row.start + 1 for row in rows[:decode]]
        chunks = [
            (
                first,
                len(row.tokens),
                row.start,
                slots_of(row.blocks, 0, row.start + len(row.tokens), self.block_size),
            )
            for row, first in zip(rows[decode:], flat.firsts[decode:], strict=True)
        ]
        widest = max((len(t) for t in tables), default=0)
        table = np.zeros((len(tables), widest), dtype=np.int32)
        for i, t in enumerate(tables):
            table[i, : len(t)] = t
        parts: list[Any] = [
            flat.ids,
            flat.positions,
            flat.writes,
            lengths,
            table.ravel(),
            *(c[3] for c in chunks),
        ]
        sizes = [len(p) for p in parts]
        staged = self._stage(np.concatenate([np.asarray(p, dtype=np.int32) for p in parts]))
        views = list(staged.split(sizes))
        prefills = [
            (first, count, start, views[5 + i]) for i, (first, count, start, _) in enumerate(chunks)
        ]
        return _Step(
            views[0],
            views[1],
            views[2],
            decode,
            views[4].view(len(tables), widest),
            views[3],
            prefills,
            flat.logit_rows,
        )

    # -- decode graphs ---------------------------------------------------------------------------
    def _capture_graphs(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        buckets = [b for b in GRAPH_BUCKETS if b < self.max_rows] + [self.max_rows]
        for rows in sorted(set(buckets), reverse=True):  # the largest first: its memory is reused
            self._graphs[rows] = self._capture(rows, pool)

    def _views(self, static: torch.Tensor, rows: int) -> tuple[torch.Tensor, ...]:
        ids, positions, slots, lengths = static[: 4 * rows].view(4, rows)
        return ids, positions, slots, lengths, static[4 * rows :].view(rows, self.max_blocks)

    def _graph_body(self, static: torch.Tensor, rows: int) -> torch.Tensor:
        ids, positions, slots, lengths, tables = self._views(static, rows)
        hidden = F.embedding(ids, self._embed)

        def attend(index: int, qkv: torch.Tensor, out: torch.Tensor) -> None:
            triton_ops.paged_decode_attention(
                qkv,
                self._pools[index],
                tables,
                lengths,
                out,
                self.heads,
                self.kv_heads,
                self.block_size,
                self.scale,
            )

        return F.linear(self._layer_stack(hidden, positions, slots, attend), self._head).float()

    def _capture(self, rows: int, pool: Any) -> _Graph:
        static = torch.zeros(rows * (4 + self.max_blocks), dtype=torch.int32, device=self.device)
        static[2 * rows : 3 * rows] = -1  # padding rows: no cache write, nothing to attend
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._graph_body(static, rows)  # every kernel compiled and warm before capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits = self._graph_body(static, rows)
        return _Graph(rows, static, graph, logits)

    def _replay(self, rows: Sequence[StepRow]) -> torch.Tensor:
        count = len(rows)
        graph = self._graphs[min(b for b in self._graphs if b >= count)]
        size, width = graph.rows, self.max_blocks
        values = np.zeros(size * (4 + width), dtype=np.int32)
        head = values[: 4 * size].reshape(4, size)
        head[2, count:] = -1
        tables = values[4 * size :].reshape(size, width)
        for i, row in enumerate(rows):
            position = row.start
            head[0, i] = row.tokens[0]
            head[1, i] = position
            head[2, i] = row.blocks[position // self.block_size] * self.block_size + (
                position % self.block_size
            )
            head[3, i] = position + 1
            tables[i, : len(row.blocks)] = row.blocks
        self._stage(values, graph.static)
        graph.graph.replay()
        return graph.logits[:count]


def _project(parts: list[CudaLinear], x: torch.Tensor) -> torch.Tensor:
    if len(parts) == 1:
        return parts[0](x)
    return torch.cat([part(x) for part in parts], dim=-1)


def _decode_rows(rows: Sequence[StepRow]) -> int:
    """How many rows lead the step feeding one token after a cached prefix (decode rows)."""
    count = 0
    for row in rows:
        if len(row.tokens) != 1 or row.start == 0:
            break
        count += 1
    return count
