"""From a `GenerateRequest` to an engine `Request`: templating, tokenizing and every check that
needs the tokenizer or the engine's limits (vLLM's input processor).

Blocking work (tokenizing, rendering a chat template, the grammar compiler's first use reading
the vocabulary) is called by the asyncio front in a worker thread, never on the event loop nor
on the step loop. The grammar compiler (engine/grammar.py) is made on first use, so a server
that never sees a grammar never loads it.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from predictor.engine import tool_formats
from predictor.engine.adapters import Adapters
from predictor.engine.detokenizer import IncrementalDetokenizer, byte_table
from predictor.engine.kv_cache import blocks_for
from predictor.engine.reasoning import OpenOrGrammar, ReasoningFormat, Splitter, Thinking
from predictor.engine.request import EventSink, Request
from predictor.errors import InvalidRequest, ModelMissing
from predictor.types import GenerateRequest


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...
    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


@dataclass(frozen=True)
class Limits:
    """What one request may ask for."""

    max_tokens: int  # new tokens
    max_prompt_tokens: int
    max_prompts: int  # in one request
    cache_blocks: int  # the KV cache: one request's prompt + max_tokens must fit in it
    block_size: int


class InputProcessor:
    def __init__(
        self,
        tokenizer: Tokenizer,
        limits: Limits,
        eos_ids: Collection[int],
        grammar_timeout: float = 10.0,
        max_grammar_compiles: int = 16,
        adapters: Adapters | None = None,
        reasoning: ReasoningFormat | None = None,
        reasoning_budget: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.reasoning = reasoning  # the model's thinking format (None: it does not think)
        self.reasoning_budget = reasoning_budget  # thinking tokens at most (None: no limit)
        self.adapters = adapters  # LoRA adapters by name (None: none served)
        self.limits = limits
        self._eos_ids = frozenset(eos_ids)
        self._grammar_limits = (grammar_timeout, max_grammar_compiles)
        self._byte_table = byte_table(tokenizer)
        self._markers: dict[str, dict[int, str]] = {}  # kept_markers, by tool format
        # a token never spells more characters than its vocabulary entry has symbols, so a text
        # longer than this is too long without tokenizing it
        longest = max((len(t) for t in _vocabulary(tokenizer)), default=0)
        self._max_prompt_chars = limits.max_prompt_tokens * longest if longest else None
        self._grammars: Any = None  # engine.grammar.Grammars, made by the first grammar
        self._grammars_lock = threading.Lock()

    def close(self) -> None:
        if self._grammars is not None:
            self._grammars.close()

    # -- checks that need no tokenizer (on the event loop) ---------------------------------
    def check(self, requests: Sequence[GenerateRequest]) -> None:
        if not requests:
            raise InvalidRequest("a request needs at least one prompt")
        if len(requests) > self.limits.max_prompts:
            raise InvalidRequest(
                f"{len(requests)} prompts in one request; the limit is {self.limits.max_prompts}"
            )
        for request in requests:
            if request.lora is not None and (
                self.adapters is None or not self.adapters.registered(request.lora)
            ):
                raise ModelMissing(f"LoRA adapter '{request.lora}' is not loaded")
            max_tokens = request.params.max_tokens
            if not 0 <= max_tokens <= self.limits.max_tokens:  # 0: only the prompt (echo)
                raise InvalidRequest(
                    f"max_tokens must be between 0 and {self.limits.max_tokens}, got {max_tokens}"
                )

    # -- blocking (a worker thread) ----------------------------------------------------------
    def encode_prompt(self, request: GenerateRequest) -> list[int]:
        """Template and tokenize."""
        if request.prompt_ids is not None:
            self.check_ids(request.prompt_ids, "prompt")
            ids = list(request.prompt_ids)
        elif request.messages is not None or request.chat:
            conversation = (
                list(request.messages)
                if request.messages is not None
                else [{"role": "user", "content": request.prompt}]
            )
            # a template only adds text: an overlong conversation is refused before rendering
            # (jinja holds the GIL for the whole render of a message, however long)
            self._check_length(sum(map(len, _texts(conversation))))
            text = self._render(
                conversation, request.tools, request.tool_format, request.chat_template_kwargs
            )
            self._check_length(len(text))
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        else:
            self._check_length(len(request.prompt))
            ids = self.tokenizer.encode(request.prompt)
        if not ids:
            raise InvalidRequest("text_input must not be empty")
        limit = self.limits.max_prompt_tokens
        if len(ids) > limit:
            raise InvalidRequest(f"prompt is {len(ids)} tokens; the limit is {limit} tokens")
        return ids

    def prepare(self, request: GenerateRequest) -> tuple[list[int], str | None]:
        """The prompt's tokens and its text when the request echoes it; the grammar compiler
        made if the request has a grammar (its first time reads the vocabulary)."""
        ids = self.encode_prompt(request)
        echo = None
        if request.echo:  # the text as given; token ids (or a rendered chat) decoded
            plain = request.prompt_ids is None and request.messages is None and not request.chat
            echo = request.prompt if plain else self.tokenizer.decode(ids)
        vocab = self.vocab_size()
        if vocab is not None and any(t >= vocab for t, _ in request.params.logit_bias):
            raise InvalidRequest(
                f"logit_bias names a token id outside the vocabulary ({vocab} tokens)",
                param="logit_bias",
            )
        if request.params.grammar is not None:
            self.grammars()
        self._check_fits(ids, request.params.max_tokens)
        return ids, echo

    def grammars(self) -> Any:
        """The grammar compiler (blocking the first time: it reads the vocabulary)."""
        with self._grammars_lock:
            if self._grammars is None:
                from predictor.engine.grammar import Grammars  # xgrammar loads only when used

                timeout, in_flight = self._grammar_limits
                self._grammars = Grammars(
                    self.tokenizer, self._eos_ids, timeout=timeout, max_in_flight=in_flight
                )
            return self._grammars

    def request(
        self,
        request: GenerateRequest,
        prompt_ids: list[int],
        sink: EventSink,
        deadline: float | None,
        compiled: Any = None,
        echo: str | None = None,
    ) -> Request:
        """The engine's state of one prepared request."""
        matcher = None if compiled is None else self.grammars().matcher(compiled)
        thinking = self._thinking(request, prompt_ids)
        if thinking is not None and matcher is not None:
            if thinking.state:  # the prompt opened a thinking: the grammar waits for its end
                thinking.pending, matcher = matcher, None
            elif thinking.state is None:  # the first token may open one
                matcher = OpenOrGrammar(matcher, thinking.format.start_id)
        return Request(
            request_id=request.request_id,
            prompt_ids=prompt_ids,
            params=request.params,
            detokenizer=IncrementalDetokenizer(
                self.tokenizer,
                prompt_ids,
                request.params.stop,
                self._byte_table,
                self.kept_markers(request.tool_format) if request.tools else None,
            ),
            sink=sink,
            deadline=deadline,
            cache_salt=request.cache_salt,
            adapter=0 if request.lora is None else self.adapter_slot(request.lora),
            lora_name=request.lora,
            matcher=matcher,
            prompt_text=echo,
            echo_only=request.params.max_tokens == 0,
            thinking=thinking,
        )

    def _thinking(self, request: GenerateRequest, prompt_ids: Sequence[int]) -> Thinking | None:
        """A chat request to a thinking model: its thinking followed and its text split."""
        form = self.reasoning
        if form is None or not request.split_reasoning or request.prompt_ids is not None:
            return None
        state = form.thinking_at_start(prompt_ids)
        budget = request.thinking_budget
        budget = self.reasoning_budget if budget is None else budget
        return Thinking(form, Splitter(form.start, form.end, state), state, budget)

    def kept_markers(self, tool_format: str) -> dict[int, str]:
        """The special tokens of this tokenizer that spell the format's call markers, by id:
        kept in the text of a request with tools (skip_special_tokens would drop them, and the
        parser would read the calls as content). Looked up once per format."""
        if tool_format not in self._markers:
            wanted = set(tool_formats.get(tool_format).markers)
            added = getattr(self.tokenizer, "added_tokens_decoder", {})
            self._markers[tool_format] = {
                token_id: token.content
                for token_id, token in added.items()
                if token.special and token.content in wanted
            }
        return self._markers[tool_format]

    def adapter_slot(self, name: str) -> int:
        """The runner slot of the LoRA adapter of that name, made resident just before (on
        the event loop, as this runs); ModelMissing where it is not (unloaded meanwhile)."""
        slot = None if self.adapters is None else self.adapters.slot(name)
        if slot is None:
            raise ModelMissing(f"LoRA adapter '{name}' is not loaded")
        return slot

    # -- helpers -----------------------------------------------------------------------------
    def _render(
        self,
        conversation: list[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None,
        tool_format: str = "hermes",
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """The chat template's text; tools and tool turns as the request's tool-call format
        (`engine/tool_formats/`) renders them for this template; `variables`: the request's
        chat_template_kwargs (enable_thinking)."""
        template = getattr(self.tokenizer, "chat_template", None)
        fmt = tool_formats.get(tool_format)
        turns, extra = fmt.render(
            conversation, tools, template if isinstance(template, str) else None
        )
        return str(
            self.tokenizer.apply_chat_template(
                turns,
                add_generation_prompt=True,
                tokenize=False,
                **extra,
                **template_variables(variables),
            )
        )

    def vocab_size(self) -> int | None:
        size: Any = getattr(self.tokenizer, "__len__", None)
        return size() if size is not None else None

    def check_ids(self, ids: Sequence[int], param: str) -> None:
        vocab = self.vocab_size()
        if vocab is not None and any(not 0 <= t < vocab for t in ids):
            raise InvalidRequest(
                f"'{param}' holds a token id outside the vocabulary (0 to {vocab - 1})",
                param=param,
            )

    def _check_length(self, chars: int) -> None:
        if self._max_prompt_chars is not None and chars > self._max_prompt_chars:
            raise InvalidRequest(
                f"prompt is {chars} characters: more than the limit of "
                f"{self.limits.max_prompt_tokens} tokens"
            )

    def _check_fits(self, prompt_ids: list[int], max_tokens: int) -> None:
        limits = self.limits
        if blocks_for(len(prompt_ids) + max_tokens, limits.block_size) > limits.cache_blocks:
            raise InvalidRequest(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceed the "
                f"KV cache ({limits.cache_blocks * limits.block_size} tokens)"
            )


# apply_chat_template's own arguments and what the engine passes: not a template variable
_RESERVED = frozenset(
    "conversation messages tools documents add_generation_prompt tokenize continue_final_message"
    " return_dict return_tensors chat_template tokenizer_kwargs padding truncation max_length"
    " return_assistant_tokens_mask".split()
)


def template_variables(variables: Mapping[str, Any] | None) -> dict[str, Any]:
    """A request's chat_template_kwargs as the template's variables; one that would set the
    renderer's own arguments is refused (400) naming it."""
    if not variables:
        return {}
    for name in variables:
        if name in _RESERVED or not isinstance(name, str) or not name.isidentifier():
            raise InvalidRequest(
                f"chat_template_kwargs may not set {name!r}", param="chat_template_kwargs"
            )
    return dict(variables)


def _vocabulary(tokenizer: Any) -> list[str]:
    get_vocab = getattr(tokenizer, "get_vocab", None)
    try:
        return list(get_vocab()) if get_vocab is not None else []
    except Exception:  # a tokenizer without a vocabulary listing: no early length check
        return []


def _texts(conversation: Sequence[Mapping[str, Any]]) -> Iterator[str]:
    """The text contents of a conversation's messages."""
    for message in conversation:
        content = message.get("content")
        if isinstance(content, str):
            yield content
