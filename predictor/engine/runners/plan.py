"""One step's index tensors, built once from its rows and shared by every layer: the tokens and
positions fed, the cache slots they are written to, and what attention reads for decode rows
(slots and bias for torch, block tables and lengths for the native kernel) and prefill rows."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from predictor.engine.runners.native.bindings import ATTENTION_QUERIES
from predictor.engine.step import StepRow


@dataclass
class FlatStep:
    """A step's tokens as one flat sequence, on the host: what every runner feeds."""

    ids: list[int]
    positions: list[int]
    writes: list[int]  # the cache slot of every fed token
    logit_rows: list[int]  # flat indexes of the tokens whose logits the step returns
    firsts: list[int]  # the flat index of each row's first token


def flatten(rows: Sequence[StepRow], block_size: int) -> FlatStep:
    flat = FlatStep([], [], [], [], [])
    for row in rows:
        count, end = len(row.tokens), row.start + len(row.tokens)
        first = len(flat.ids)
        flat.firsts.append(first)
        flat.ids.extend(row.tokens)
        flat.positions.extend(range(row.start, end))
        flat.writes.extend(slots_of(row.blocks, row.start, end, block_size))
        if row.all_logits:
            flat.logit_rows.extend(range(first, first + count))
        elif row.logits:
            flat.logit_rows.append(first + count - 1)
    return flat


@dataclass
class StepPlan:
    """Index tensors of one step, built once and shared by every layer."""

    ids: list[int]
    positions: list[int]
    write_slots: torch.Tensor  # [N]: the cache slot of every fed token
    decode_rows: int  # the first decode_rows tokens attend as decode rows (one query each)
    decode_slots: torch.Tensor  # [d, L]: each decode row's slots for positions 0..L-1
    decode_bias: torch.Tensor  # [d, 1, L] float32: 0 where a key exists, -inf past the row's end
    # per prefill row: (first flat index, token count, slots of positions 0..end-1, mask)
    prefills: list[tuple[int, int, torch.Tensor, torch.Tensor | None]]
    logit_rows: list[int]  # flat indexes of the tokens whose logits the step returns
    # for the native kernel instead of decode_slots and decode_bias, per decode row (a row
    # verifying drafts, or attending token by token, is one with several queries): block tables
    # [r, widest], lengths [r] (the keys its first query sees) and counts [r] (its queries),
    # int64; scratch (float32) for the kernel's passes over the longest row's keys
    native_args: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]

    @classmethod
    def build(
        cls,
        rows: Sequence[StepRow],
        block_size: int,
        pad_slot: int,
        device: torch.device,
        native: bool = False,
        group: int = 1,
        queries_as_decode: bool = False,
    ) -> StepPlan:
        """`queries_as_decode` (with `native`): every fed token attends as a decode row of its
        own (its row's blocks, keys up to its position), prompt chunks too, so a token's
        attention is computed the same way whether it was decoded, prefilled in any chunk, or
        recomputed after a preemption (batch invariance: the runner's --batch-invariant). A row
        with drafts (before any prompt chunk: the scheduler's order) attends so too."""
        flat = flatten(rows, block_size)
        decode_tables: list[list[int]] = []  # per decode row: its blocks,
        decode_lengths: list[int] = []  # the keys its first query sees,
        decode_counts: list[int] = []  # its queries (each next one sees one key more)
        prefills: list[tuple[int, int, torch.Tensor, torch.Tensor | None]] = []
        decode_rows = 0
        for row, first in zip(rows, flat.firsts, strict=True):
            count, end = len(row.tokens), row.start + len(row.tokens)
            if native and (queries_as_decode or row.drafts) and not prefills:
                decode_rows += count
                decode_tables.append(list(row.blocks))
                decode_lengths.append(row.start + 1)
                decode_counts.append(count)
                continue
            if count == 1 and row.start > 0 and not prefills:
                decode_rows += 1
                decode_tables.append(list(row.blocks))
                decode_lengths.append(end)
                decode_counts.append(1)
                continue
            slots = torch.tensor(slots_of(row.blocks, 0, end, block_size), device=device)
            mask = None
            if row.start:  # query i (position start + i) sees keys 0..start + i
                keys_at = torch.arange(end, device=device)
                queries_at = torch.arange(row.start, end, device=device).unsqueeze(1)
                mask = (keys_at <= queries_at).view(1, 1, count, end)
            prefills.append((first, count, slots, mask))
        decode_slots = torch.empty(0, dtype=torch.long)
        decode_bias = torch.empty(0)
        native_args = (decode_slots, decode_slots, decode_slots, decode_bias)
        if decode_rows:
            longest = max(n + c - 1 for n, c in zip(decode_lengths, decode_counts, strict=True))
            widest = max(len(t) for t in decode_tables)
            tables = torch.tensor(
                [t + [0] * (widest - len(t)) for t in decode_tables], device=device
            )  # [d, widest]; padding blocks are masked out below
        if decode_rows and native:
            # the kernel reads blocks by these numbers: they must lie in the pool
            if (
                min(min(t) for t in decode_tables) < 0
                or max(max(t) for t in decode_tables) >= pad_slot // block_size
            ):
                raise ValueError("a block table names a block outside the cache")
            passes = min(max(decode_counts), ATTENTION_QUERIES)  # queries a pass over keys takes
            native_args = (
                tables,
                torch.tensor(decode_lengths, dtype=torch.long),
                torch.tensor(decode_counts, dtype=torch.long),
                torch.empty(passes * group * longest),
            )
        elif decode_rows:  # (torch attention: one query a decode row)
            offsets = torch.arange(block_size, device=device).repeat(widest)
            decode_slots = (tables * block_size).repeat_interleave(block_size, dim=1) + offsets
            decode_slots = decode_slots[:, :longest].contiguous()  # [d, longest]
            decode_bias = torch.zeros((decode_rows, 1, longest), device=device)
            if min(decode_lengths) < longest:
                lengths = torch.tensor(decode_lengths, device=device).unsqueeze(1)
                missing = torch.arange(longest, device=device) >= lengths  # [d, longest]
                decode_slots = decode_slots.masked_fill(missing, pad_slot)
                decode_bias = decode_bias.masked_fill(missing.unsqueeze(1), -torch.inf)
        return cls(
            flat.ids,
            flat.positions,
            torch.tensor(flat.writes, dtype=torch.long, device=device),
            decode_rows,
            decode_slots,
            decode_bias,
            prefills,
            flat.logit_rows,
            native_args,
        )


def slots_of(blocks: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
    """Cache slots of positions [start, end) of a row with this block table."""
    return [blocks[pos // block_size] * block_size + pos % block_size for pos in range(start, end)]
