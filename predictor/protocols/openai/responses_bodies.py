"""OpenAI Responses API request bodies (`POST /v1/responses`): what a body may hold.

The strict pydantic models of a body and of its input items and tools, the parameter table's keys
the route takes, and the values of `include`, `reasoning.effort` and `reasoning.summary` served.
What a body means (its conversation, tools and sampling as chat's request) is read in
`responses_api.py`; the OpenAPI document (`protocols/schemas.py`) is generated from these models.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from predictor.protocols.openai.messages import MAX_TOOLS, Strict

# The parameter table's keys a Responses body takes: OpenAI's, then vLLM's extensions.
# max_output_tokens is the table's max_tokens; text.format its response format.
TABLE_KEYS = frozenset(
    "temperature top_p top_k seed stop presence_penalty frequency_penalty repetition_penalty"
    " logit_bias min_tokens ignore_eos priority cache_salt speculative".split()
)
RENAMES = {"max_output_tokens": "max_tokens"}
MAX_ITEMS = 1024

# `include` entries that ask for nothing this server writes (reasoning items carry their text,
# never encrypted: Codex and the Agents SDK send it with store false); any other is refused.
INCLUDABLE = frozenset({"reasoning.encrypted_content"})

# Reasoning efforts served (OpenAI's): "none" turns a thinking model's thinking off, the others
# leave it as the model thinks (engine/reasoning.py); a model that does not think ignores them
REASONING_EFFORTS = frozenset({"none", "minimal", "low", "medium", "high", "xhigh"})
# Summaries asked for: accepted, none written (the reasoning item's content is the reasoning)
REASONING_SUMMARIES = frozenset({"auto", "concise", "detailed"})


# -- body models --------------------------------------------------------------------------------


class TextConfig(Strict):
    format: dict[str, Any] | None = None  # read by structured.text_format
    verbosity: Literal["medium"] | None = None  # OpenAI's default; no other is honoured


class Reasoning(Strict):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None  # OpenAI's older name of summary


class StreamOptions(Strict):
    include_obfuscation: bool | None = None  # accepted: nothing here is obfuscated


class ResponsesBody(Strict):
    """A Responses body's own fields (the table's keys are read apart)."""

    model: str
    input: str | Annotated[list[dict[str, Any]], Field(min_length=1, max_length=MAX_ITEMS)]
    instructions: str | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: Reasoning | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    store: bool | None = None  # accepted, true or false: nothing is kept either way
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = None
    user: Annotated[str, Field(max_length=256)] | None = None  # the tenant of the counters
    safety_identifier: str | None = None  # accepted: an end user's id, for OpenAI's abuse checks
    prompt_cache_key: str | None = None  # accepted: a routing hint; the prefix cache needs none
    service_tier: Literal["auto", "default"] | None = None
    truncation: Literal["disabled"] | None = None  # a prompt past the context is a 400
    include: Annotated[list[str], Field(max_length=16)] | None = None  # see INCLUDABLE
    top_logprobs: Literal[0] | None = None
    background: Literal[False] | None = None


class InputText(Strict):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # output_text's, as our own output items carry them
    logprobs: list[Any] | None = None


class MessageItem(Strict):
    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: Literal["commentary", "final_answer"] | None = None


class FunctionCallItem(Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class ReasoningItem(Strict):
    """An earlier answer's reasoning, sent back: accepted and left out of the prompt."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] | None = None
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionTool(Strict):
    type: Literal["function"]
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # accepted: arguments are always enforced by grammar here


class FunctionChoice(Strict):
    type: Literal["function"]
    name: str


Item = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
ITEMS: dict[str, type[Strict]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}
FIELD_NAMES = frozenset(
    name
    for model in (
        ResponsesBody,
        TextConfig,
        Reasoning,
        StreamOptions,
        InputText,
        MessageItem,
        FunctionCallItem,
        FunctionCallOutputItem,
        FunctionTool,
        FunctionChoice,
        ReasoningItem,
    )
    for name in model.model_fields
)
