"""Forward passes over a paged KV cache: every row's new tokens in one flat batch.

One step feeds each decode row its last token and each prefilling row the next chunk of its
prompt, all as one flat sequence of N tokens, so the linear layers (the GPTQ kernels) run once
per layer over all N. Only attention is per row: each row's keys and values live in the blocks
of its block table in one preallocated pool per layer, new ones are written in place (O(new
tokens) per step), and attention reads a row's own positions only.

The model's own modules do the rest (embeddings, norms, rotary tables, MLP, lm_head), so any
Linear replacement works; attention and the cache are ours. Llama-family decoders only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from predictor.engine.int4_linear import fuse_layer

SUPPORTED_MODEL_TYPES = frozenset({"llama"})


@dataclass
class StepRow:
    """One row's part of a forward pass."""

    blocks: Sequence[int]  # the row's block table, covering positions [0, start + len(tokens))
    start: int  # position of tokens[0]: how many of the row's tokens the cache already holds
    tokens: Sequence[int]  # fed this step: 1 for a decode row, a prompt chunk for a prefill row
    logits: bool  # whether the step must return logits for the last of `tokens`


class UnsupportedModel(ValueError):
    pass


class ModelRunner:
    def __init__(
        self,
        model: Any,
        device: torch.device,
        num_blocks: int,
        block_size: int = 16,
        threads: int = 0,
    ) -> None:
        model_type = getattr(model.config, "model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModel(
                f"model type {model_type!r} is not supported (supported: "
                f"{', '.join(sorted(SUPPORTED_MODEL_TYPES))})"
            )
        self.model = model
        self.device = device
        self.threads = threads
        self.block_size = block_size
        self.num_blocks = num_blocks
        decoder = model.model
        self._embed = decoder.embed_tokens
        self._layers = list(decoder.layers)
        self._norm = decoder.norm
        self._rotary = decoder.rotary_emb
        self._lm_head = model.lm_head
        config = model.config
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        self.scale = float(self._layers[0].self_attn.scaling)
        # CPU int4 layers: q/k/v and gate/up fused, 4 kernel calls a layer instead of 7
        self._fused = [fuse_layer(layer) for layer in self._layers]
        dtype = self._embed.weight.dtype
        slots = num_blocks * block_size
        # per layer: keys and values of every token slot, plus one zero slot that padding reads
        # (masked keys must still be finite: 0 * NaN is NaN), [2, kv_heads, slots + 1,
        # head_dim]: one write and one gather a layer serve both, and a gathered row's keys
        # come out [kv_heads, tokens, head_dim], the layout attention multiplies without a copy;
        # empty, so pages are touched (and count in RSS) only as the cache fills
        self._pools = [
            torch.empty((2, self.kv_heads, slots + 1, self.head_dim), dtype=dtype, device=device)
            for _ in self._layers
        ]
        for pool in self._pools:
            pool[:, :, slots].zero_()
        self._pad_slot = slots

    def bind_thread(self) -> None:
        """Called first on the thread that will run the forward passes.

        torch's CPU thread count is per calling thread. Measured here: once the main thread has
        run parallel torch work, another thread's 2-thread matmuls run no faster than 1 thread;
        so the server loads with 1 thread on the main thread and parallelises only here.
        """
        if self.threads > 0:
            torch.set_num_threads(self.threads)

    @property
    def cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._pools)

    @torch.inference_mode()
    def forward(self, rows: Sequence[StepRow]) -> torch.Tensor:
        """Run one step; logits [number of rows with `logits`, V] (float32), in row order."""
        plan = _Plan.build(rows, self.block_size, self._pad_slot, self.device)
        ids = torch.tensor(plan.ids, dtype=torch.long, device=self.device)
        hidden = self._embed(ids).unsqueeze(0)  # [1, N, hidden]
        positions = torch.tensor(plan.positions, dtype=torch.long, device=self.device)
        cos, sin = self._rotary(hidden, positions.unsqueeze(0))  # [1, N, head_dim] each
        cos, sin = cos[0].unsqueeze(1), sin[0].unsqueeze(1)  # [N, 1, head_dim]
        for index, layer in enumerate(self._layers):
            residual = hidden
            normed = layer.input_layernorm(hidden)
            hidden = residual + self._attention(index, layer.self_attn, normed, cos, sin, plan)
            residual = hidden
            hidden = residual + self._mlp(index, layer.mlp, layer.post_attention_layernorm(hidden))
        wanted = torch.tensor(plan.logit_rows, dtype=torch.long, device=self.device)
        last = hidden[0].index_select(0, wanted)  # [R, hidden]; R may be 0 mid-prompt
        return self._lm_head(self._norm(last)).float()  # [R, V]

    def _attention(
        self,
        index: int,
        attn: Any,
        hidden: torch.Tensor,  # [1, N, hidden]
        cos: torch.Tensor,
        sin: torch.Tensor,
        plan: _Plan,
    ) -> torch.Tensor:
        n = hidden.shape[1]
        fused = self._fused[index]
        if fused is not None:
            q, k, v = fused.qkv.split(fused.qkv(hidden))
        else:
            q, k, v = attn.q_proj(hidden), attn.k_proj(hidden), attn.v_proj(hidden)
        q = q.reshape(n, self.heads, self.head_dim)
        k = k.reshape(n, self.kv_heads, self.head_dim)
        v = v.reshape(n, self.kv_heads, self.head_dim)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        pool = self._pools[index]
        new_kv = torch.stack((k, v)).transpose(1, 2)  # [2, kv_heads, N, head_dim]
        pool.index_copy_(2, plan.write_slots, new_kv.to(pool.dtype))
        out = torch.empty_like(q)  # [N, heads, head_dim]
        if plan.decode_rows:
            # one query per row: plain batched matmuls (bf16 SDPA with one query measured 6x
            # slower here), the query heads grouped by the kv head they share (GQA), kv heads
            # leading so the gathered keys and values are multiplied where they lie
            d, group = plan.decode_rows, self.heads // self.kv_heads
            longest = plan.decode_slots.shape[1]
            kv = pool.index_select(2, plan.decode_slots.reshape(-1))  # [2, kvh, d * L, hd]
            kv = kv.view(2, self.kv_heads, d, longest, self.head_dim)
            query = q[:d].view(d, self.kv_heads, group, self.head_dim).transpose(0, 1)
            # scores [kv_heads, d, G, L]
            scores = torch.matmul(query, kv[0].transpose(-1, -2)).float() * self.scale
            if plan.decode_mask is not None:  # [d, 1, 1, L]: rows shorter than the longest
                scores = scores.masked_fill(~plan.decode_mask.view(1, d, 1, longest), -torch.inf)
            probs = torch.softmax(scores, dim=-1).to(kv.dtype)
            attended = torch.matmul(probs, kv[1])  # [kv_heads, d, G, head_dim]
            out[:d] = attended.transpose(0, 1).reshape(d, self.heads, self.head_dim)
        for first, count, slots, mask in plan.prefills:
            query = q[first : first + count].transpose(0, 1).unsqueeze(0)  # [1, heads, n, hd]
            kv = pool.index_select(2, slots)  # [2, kv_heads, T, head_dim]
            attended = F.scaled_dot_product_attention(
                query,
                kv[0].unsqueeze(0),
                kv[1].unsqueeze(0),
                attn_mask=mask,
                is_causal=mask is None,
                scale=self.scale,
                enable_gqa=self.heads != self.kv_heads,
            )
            out[first : first + count] = attended[0].transpose(0, 1)
        o_proj = attn.o_proj if fused is None else fused.o
        return o_proj(out.view(1, n, self.heads * self.head_dim))

    def _mlp(self, index: int, mlp: Any, hidden: torch.Tensor) -> torch.Tensor:
        fused = self._fused[index]
        if fused is None:
            return mlp(hidden)
        gate, up = fused.gate_up.split(fused.gate_up(hidden))
        return fused.down(mlp.act_fn(gate) * up)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@dataclass
class _Plan:
    """Index tensors of one step, built once and shared by every layer."""

    ids: list[int]
    positions: list[int]
    write_slots: torch.Tensor  # [N]: the cache slot of every fed token
    decode_rows: int  # the first decode_rows rows feed one token each
    decode_slots: torch.Tensor  # [d, L]: each decode row's slots for positions 0..L-1
    decode_mask: torch.Tensor | None  # [d, 1, 1, L] True where a key exists
    # per prefill row: (first flat index, token count, slots of positions 0..end-1, mask)
    prefills: list[tuple[int, int, torch.Tensor, torch.Tensor | None]]
    logit_rows: list[int]  # flat index of the last token of each row that wants logits

    @classmethod
    def build(
        cls, rows: Sequence[StepRow], block_size: int, pad_slot: int, device: torch.device
    ) -> _Plan:
        ids: list[int] = []
        positions: list[int] = []
        writes: list[int] = []
        logit_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lengths: list[int] = []
        prefills: list[tuple[int, int, torch.Tensor, torch.Tensor | None]] = []
        decode_rows = 0
        for row in rows:
            count, end = len(row.tokens), row.start + len(row.tokens)
            first = len(ids)
            ids.extend(row.tokens)
            positions.extend(range(row.start, end))
            writes.extend(_slots(row.blocks, row.start, end, block_size))
            if row.logits:
                logit_rows.append(first + count - 1)
            if count == 1 and row.start > 0 and not prefills:
                decode_rows += 1
                decode_tables.append(list(row.blocks))
                decode_lengths.append(end)
                continue
            slots = torch.tensor(_slots(row.blocks, 0, end, block_size), device=device)
            mask = None
            if row.start:  # query i (position start + i) sees keys 0..start + i
                keys_at = torch.arange(end, device=device)
                queries_at = torch.arange(row.start, end, device=device).unsqueeze(1)
                mask = (keys_at <= queries_at).view(1, 1, count, end)
            prefills.append((first, count, slots, mask))
        decode_slots = torch.empty(0, dtype=torch.long)
        decode_mask = None
        if decode_rows:
            longest = max(decode_lengths)
            widest = max(len(t) for t in decode_tables)
            tables = torch.tensor(
                [t + [0] * (widest - len(t)) for t in decode_tables], device=device
            )  # [d, widest]; padding blocks are masked out below
            offsets = torch.arange(block_size, device=device).repeat(widest)
            decode_slots = (tables * block_size).repeat_interleave(block_size, dim=1) + offsets
            decode_slots = decode_slots[:, :longest]  # [d, longest]
            if min(decode_lengths) < longest:
                lengths = torch.tensor(decode_lengths, device=device).unsqueeze(1)
                exists = torch.arange(longest, device=device) < lengths  # [d, longest]
                decode_slots = decode_slots.masked_fill(~exists, pad_slot)
                decode_mask = exists.view(decode_rows, 1, 1, longest)
        return cls(
            ids,
            positions,
            torch.tensor(writes, dtype=torch.long, device=device),
            decode_rows,
            decode_slots,
            decode_mask,
            prefills,
            logit_rows,
        )


def _slots(blocks: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
    """Cache slots of positions [start, end) of a row with this block table."""
    return [blocks[pos // block_size] * block_size + pos % block_size for pos in range(start, end)]
