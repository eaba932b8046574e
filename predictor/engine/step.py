"""What one forward pass is made of, and the face every runner shows the step loop.

No torch here (only `engine/runners/` and `engine/sampling.py` import it at run time): the step
loop, the scheduler's tests and the null runner share these types without loading a model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # annotations only
    import torch


@dataclass
class StepRow:
    """One row's part of a forward pass."""

    blocks: Sequence[int]  # the row's block table, covering positions [0, start + len(tokens))
    start: int  # position of tokens[0]: how many of the row's tokens the cache already holds
    tokens: Sequence[int]  # fed this step: 1 for a decode row, a prompt chunk for a prefill row
    logits: bool  # whether the step must return logits for the last of `tokens`
    # logits for every one of `tokens` (a prompt being scored, prompt_logprobs): len(tokens)
    # rows, the last of them the one `logits` asks for; rows without it cost nothing extra
    all_logits: bool = False
    # a decode row's last token and its drafts (speculative decoding): each token attends as a
    # decode row of its own where the runner can, so its logits are the ones it would have had
    # decoded alone (the same tokens with and without drafts)
    drafts: int = 0
    adapter: int = 0  # the LoRA adapter's slot in the runner (0: the base model)

    @property
    def logit_count(self) -> int:
        """Rows of logits the step returns for this row."""
        return len(self.tokens) if self.all_logits else int(self.logits)


class Runner(Protocol):
    device: torch.device

    def bind_thread(self) -> None: ...

    def forward(self, rows: Sequence[StepRow]) -> torch.Tensor:
        """logits: [sum of the rows' logit_count, vocab], in the order of `rows` (a row with
        all_logits: one per token it was fed, in position order)."""
        ...


@dataclass(frozen=True)
class StepStats:
    """What one step did, handed to the step loop's listener after it (on the loop's thread):
    metrics and the asyncio front read a step only through this."""

    running: int  # rows holding a place in the batch after the step
    waiting: int  # requests in the queue after the step
    sampled: int = 0  # rows that got a token
    fed: int = 0  # tokens fed to the forward pass
    queue_waits: tuple[float, ...] = ()  # seconds each first-admitted request waited
    # (prompt tokens, of them found in the prefix cache) of each first admission, when the
    # prefix cache is on
    prefix_queries: tuple[tuple[int, int], ...] = ()
    preemptions: int = 0
    # speculative decoding (vLLM's spec_decode counters): rows that verified drafts, the draft
    # tokens, of them accepted, and the rows whose draft at each position was accepted
    draft_rows: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()
    # sleep (engine/sleep.py): why the engine fell asleep after this step ("": it did not),
    # and the seconds a wake before it took (0: none)
    slept: str = ""
    woke: float = 0.0


@dataclass(frozen=True)
class LoopStatus:
    """The step loop's state as its thread last published it (`StepLoop.status`): after each
    step, once a step's rows are scheduled, and at each idle wait. Other threads read this
    one immutable value instead of the scheduler's lists, which only the step thread changes."""

    running: int = 0  # rows holding a place in the batch (those being prefilled too)
    waiting: int = 0  # requests in the queue
    handed: int = 0  # requests handed to the queue by then (`StepLoop.add_all` counts them)
    kv_usage: float = 0.0  # share of the KV cache's blocks held by rows (0-1)
    running_adapters: tuple[int, ...] = ()  # each running row's LoRA slot (0: the base model)
    waiting_adapters: tuple[int, ...] = ()  # each waiting request's LoRA slot
    progress: float = 0.0  # when the last step or idle wait ended (the loop's clock): liveness
