"""Plain data shared by the engine and every adapter: requests, sampling, token events."""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, TypeVar, cast

T = TypeVar("T")


class FinishReason(StrEnum):
    LENGTH = "length"
    EOS = "eos_token"
    STOP = "stop_sequence"
    CANCELLED = "cancelled"
    ERROR = "error"
    TIMEOUT = "timeout"


@dataclass(frozen=True)
class Grammar:
    """A constraint on the generated text, as the request gave it (the engine compiles it).

    kind: "json_schema" (text: the schema's JSON), "json_object" (any JSON object; text ""),
    "regex" (text: the pattern), "choice" (text: a JSON list of the allowed strings), "ebnf"
    (text: an EBNF grammar, xgrammar's / GBNF dialect, rule `root`) or "structural_tag" (text:
    an xgrammar structural tag's JSON; the tool calls of `engine/tool_formats/`). `param` names
    the request key it came from, for the 400 when the engine cannot enforce it.
    """

    kind: str
    text: str
    param: str = "structured_outputs"


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation controls. temperature 0 means greedy."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # keep generating past end-of-sequence tokens (benchmarks)
    min_tokens: int = 0  # end-of-sequence tokens and stop strings cannot end the request before
    presence_penalty: float = 0.0  # OpenAI: subtracted once from each token already generated
    frequency_penalty: float = 0.0  # OpenAI: subtracted per occurrence in the generated text
    # HF / vLLM / TGI: logits of tokens in the prompt or the generated text are divided by it
    # where positive and multiplied where negative (1: off; > 1 penalises repeats)
    repetition_penalty: float = 1.0
    # None: no logprobs; 0: the chosen token's logprob; k > 0: also the k most likely tokens
    logprobs: int | None = None
    # (token id, bias) pairs added to the logits before sampling (OpenAI's logit_bias)
    logit_bias: tuple[tuple[int, float], ...] = ()
    # the text must match this grammar: a finished grammar ends the request (EOS)
    grammar: Grammar | None = None
    # None: the prompt is not scored; k >= 0: each prompt token's logprob (the first has none)
    # with its rank and the k most likely tokens at its position (vLLM's prompt_logprobs)
    prompt_logprobs: int | None = None
    # False: this request never drafts tokens (speculative decoding), whatever the server does
    speculative: bool = True
    # vLLM's: lower runs sooner; under pressure the highest is preempted first (then the newest)
    priority: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
            or bool(self.logit_bias)
        )


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt: str
    params: SamplingParams = field(default_factory=SamplingParams)
    chat: bool = False
    timeout: float | None = None  # seconds; None: the server default
    # A conversation ({"role": "system" | "user" | "assistant" | "tool", "content": str} each;
    # an assistant turn may carry HF's "tool_calls" [{"type": "function", "function": {"name",
    # "arguments": dict}}], a tool turn its "tool_call_id"): the engine renders it with the
    # model's chat template (add_generation_prompt=True) instead of using `prompt`. Adapters
    # that set it for a lone user message also set prompt=content, chat=True.
    messages: tuple[dict[str, Any], ...] | None = None
    # OpenAI tools ({"type": "function", "function": {"name", "description", "parameters"}}),
    # rendered into the prompt by `engine/tool_formats/`; None: no tools in the prompt
    tools: tuple[dict[str, Any], ...] | None = None
    # the tool-call format (a parser name of `engine/tool_formats/`) tools and tool turns are
    # rendered in: the served model's (`Limits.tool_format`)
    tool_format: str = "hermes"
    # vLLM's cache_salt: prompts share cached KV blocks only with requests of the same salt
    # (None: the unsalted pool), so one tenant cannot learn another's prompts from timing
    cache_salt: str | None = None
    # the prompt as token ids (OpenAI completions' list-of-ints prompt): used as given
    prompt_ids: tuple[int, ...] | None = None
    # send the prompt back (its text, and its tokens' logprobs when params.prompt_logprobs is
    # set) on the first event: OpenAI completions' echo
    echo: bool = False
    # who the request is for (OpenAI's `user`; a gateway's tenant header wins over it): the
    # tenant label of the token and request counters, and the traces' and payload records' too
    tenant: str | None = None
    # the LoRA adapter (--lora-modules) that runs it, by name; None: the base model
    lora: str | None = None
    # extra variables for the chat template (vLLM's chat_template_kwargs: enable_thinking)
    chat_template_kwargs: dict[str, Any] | None = None
    # a thinking model's thinking tokens at most (then its end tag is forced); None: the
    # server's --reasoning-budget
    thinking_budget: int | None = None
    # a thinking model's reasoning split from the answer (engine/reasoning.py: chat
    # completions, Responses, Messages); False: the text as generated, tags and all (OIP, V2,
    # Triton and completions, as before), its grammar from the first token
    split_reasoning: bool = False


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    generated_tokens: int
    cached_tokens: int = 0  # prompt tokens served from the prefix cache, not computed
    # speculative decoding: draft tokens verified for this request, and of them accepted
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    reasoning_tokens: int = 0  # a thinking model's: generated inside its thinking (tags too)


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    token: str  # the token's own text (may be a partial UTF-8 character, decoded with U+FFFD)
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probability of one generated token under the model's raw distribution
    (log_softmax of the logits, before temperature, penalties, top-k or top-p, as vLLM and
    OpenAI report it), with the `top` most likely tokens when the request asked for them."""

    token_id: int
    token: str
    logprob: float
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class PromptToken:
    """One prompt token scored by the model: log_softmax at the position before it (None for
    the first token, which nothing precedes), its rank there (1: the most likely) and the
    most likely tokens there."""

    token_id: int
    token: str
    logprob: float | None
    rank: int | None = None
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class PromptEcho:
    """The prompt as the engine saw it, sent on a request's first event when it asked
    (echo, prompt_logprobs)."""

    text: str  # the prompt text as given, or the prompt's token ids decoded
    token_ids: tuple[int, ...]
    logprobs: tuple[PromptToken, ...] = ()  # one per prompt token, when prompt_logprobs is set


@dataclass(frozen=True)
class RequestTimes:
    """When the engine handled a request, on time.monotonic's clock (on its final event): the
    traces' queue and prefill times and their preemption events."""

    arrival: float
    scheduled: float | None = None  # its first admission to the batch; None: it never ran
    preempted: tuple[float, ...] = ()  # each time it gave its KV blocks back


@dataclass(frozen=True)
class TokenEvent:
    """One step of one request: the new text (possibly empty while a stop prefix is held back).

    The last event of a request has `finish_reason` and `usage` set; `error` is set when the
    finish reason is ERROR, and `error_param` when the request itself is to blame (its
    parameter of that name cannot be honoured: a client error, 400), not the engine.
    """

    request_id: str
    text: str
    token_ids: tuple[int, ...] = ()
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    error: str | None = None
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token_ids entry, when the request asked
    prompt: PromptEcho | None = None  # on the first event, when the request asked for it
    error_param: str | None = None
    times: RequestTimes | None = None  # on the final event of a request the engine queued
    stop_sequence: str | None = None  # on a final event of FinishReason.STOP: the stop string
    # on a request's first event (when not final): its prompt's tokens and those cached so far,
    # for answers that say them before the end (Anthropic's message_start)
    first_usage: Usage | None = None
    # a thinking model's chat request: this step's reasoning text (`text` is then the answer's)
    reasoning: str = ""

    @property
    def final(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class Completion:
    """A whole generation, collected from a request's events (what unary endpoints return)."""

    request_id: str
    text: str
    finish_reason: FinishReason
    usage: Usage
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt: PromptEcho | None = None  # when the request asked for it (echo, prompt_logprobs)
    stop_sequence: str | None = None  # the stop string that ended it (FinishReason.STOP)
    reasoning: str = ""  # a thinking model's reasoning, split from `text` (its answer)


def run_to_end(slices: Generator[None, None, T]) -> T:
    """What work done a slice at a time (a generator yielding between its slices: a LoRA
    adapter's read and layout, which the step loop runs between steps) returns, run here at
    once."""
    while True:
        try:
            next(slices)
        except StopIteration as done:
            return cast(T, done.value)
