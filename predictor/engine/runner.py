"""Forward passes over one shared KV cache whose rows are requests.

Rows are left-padded to a common length; every row carries its own positions, so a row's
tokens see exactly what they would see alone. New rows are prefilled together and merged in
between decode steps; rows are dropped by index at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache


class ModelRunner:
    def __init__(
        self, model: Any, device: torch.device, pad_token_id: int, threads: int = 0
    ) -> None:
        self.model = model
        self.device = device
        self.pad_token_id = pad_token_id
        self.threads = threads
        self._cache: DynamicCache | None = None
        self._mask: torch.Tensor | None = None  # [B, T] 1 for real tokens, 0 for left padding
        self._positions: torch.Tensor | None = None  # [B] position of each row's next token

    def bind_thread(self) -> None:
        """Called first on the thread that will run the forward passes.

        torch's CPU thread count is per calling thread. Measured here: once the main thread has
        run parallel torch work, another thread's 2-thread matmuls run no faster than 1 thread;
        so the server loads with 1 thread on the main thread and parallelises only here.
        """
        if self.threads > 0:
            torch.set_num_threads(self.threads)

    @property
    def rows(self) -> int:
        return 0 if self._mask is None else int(self._mask.shape[0])

    @property
    def cache_columns(self) -> int:
        return 0 if self._mask is None else int(self._mask.shape[1])

    @torch.inference_mode()
    def prefill(self, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Run the prompts as new rows appended after the current ones; last-token logits [n, V]."""
        n, width = len(prompts), max(len(p) for p in prompts)
        ids = torch.full((n, width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            mask[row, width - len(prompt) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(dim=-1) - 1).clamp(min=0)  # [n, S]
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=DynamicCache(config=self.model.config),
            use_cache=True,
            logits_to_keep=1,
        )
        self._merge(out.past_key_values, mask, mask.sum(dim=-1))
        return out.logits[:, -1, :].float()

    @torch.inference_mode()
    def decode(self, last_tokens: Sequence[int]) -> torch.Tensor:
        """One token for every row; logits [B, V]."""
        assert self._cache is not None and self._mask is not None and self._positions is not None
        ids = torch.tensor(last_tokens, dtype=torch.long, device=self.device).unsqueeze(1)
        ones = torch.ones((self.rows, 1), dtype=self._mask.dtype, device=self.device)
        mask = torch.cat([self._mask, ones], dim=1)  # [B, T + 1]
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=self._positions.unsqueeze(1),
            past_key_values=self._cache,
            use_cache=True,
        )
        self._mask = mask
        self._positions = self._positions + 1
        return out.logits[:, -1, :].float()

    def keep(self, rows: Sequence[int]) -> None:
        """Keep only these rows (in this order); drop cache columns no remaining row uses."""
        if not rows:
            self.reset()
            return
        assert self._cache is not None and self._mask is not None and self._positions is not None
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        mask = self._mask.index_select(0, index)
        first_used = int(mask.any(dim=0).long().argmax().item())
        self._mask = mask[:, first_used:]
        self._positions = self._positions.index_select(0, index)
        for layer in _layers(self._cache):
            layer.keys = layer.keys.index_select(0, index)[:, :, first_used:]
            layer.values = layer.values.index_select(0, index)[:, :, first_used:]

    def reset(self) -> None:
        self._cache, self._mask, self._positions = None, None, None

    def _merge(self, cache: DynamicCache, mask: torch.Tensor, positions: torch.Tensor) -> None:
        if self._cache is None or self._mask is None or self._positions is None:
            self._cache, self._mask, self._positions = cache, mask, positions
            return
        old_width, new_width = self._mask.shape[1], mask.shape[1]
        width = max(old_width, new_width)
        self._mask = torch.cat(
            [F.pad(self._mask, (width - old_width, 0)), F.pad(mask, (width - new_width, 0))]
        )
        self._positions = torch.cat([self._positions, positions])
        for old, new in zip(_layers(self._cache), _layers(cache), strict=True):
            # keys/values: [B, H, T, D]; pad T on the left
            old.keys = torch.cat(
                [_pad_left(old.keys, width - old_width), _pad_left(new.keys, width - new_width)]
            )
            old.values = torch.cat(
                [_pad_left(old.values, width - old_width), _pad_left(new.values, width - new_width)]
            )


def _layers(cache: DynamicCache) -> list[Any]:
    """The cache's per-layer key/value holders (each has .keys and .values: [B, H, T, D])."""
    return list(cache.layers)


def _pad_left(kv: torch.Tensor, columns: int) -> torch.Tensor:
    return F.pad(kv, (0, 0, columns, 0)) if columns else kv
