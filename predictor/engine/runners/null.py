"""A runner without a model: fixed logits at no cost, to measure everything around the model.

`load/bench_engine.py --null` and `python -m predictor --runner null` use it to show what the
scheduler, step loop, sampling, detokenizer, asyncio consumers and the HTTP side cost per step
and per row: the engine must stay well under a GPU's forward pass.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from predictor.engine.step import StepRow


class NullRunner:
    def __init__(
        self, vocab_size: int, num_blocks: int, block_size: int = 16, max_rows: int = 256
    ) -> None:
        self.device = torch.device("cpu")
        self.num_blocks = num_blocks
        self.block_size = block_size
        generator = torch.Generator().manual_seed(0)
        # [max_rows, V]: every row's argmax differs, so rows emit different tokens
        self._logits = torch.randn((max_rows, vocab_size), generator=generator)

    def bind_thread(self) -> None:
        torch.set_num_threads(1)

    def forward(self, rows: Sequence[StepRow]) -> torch.Tensor:
        wanted = sum(row.logit_count for row in rows)
        if wanted > self._logits.shape[0]:
            self._logits = self._logits.repeat(-(-wanted // self._logits.shape[0]), 1)
        return self._logits[:wanted]
