"""Anthropic's Messages bodies as strict pydantic models: what this server takes of them.

Content blocks: `text`, `tool_use`, `tool_result` (its content a string or text blocks;
`is_error`), and an earlier answer's `thinking` / `redacted_thinking` blocks (accepted and left
out of the prompt, as Anthropic leaves earlier turns' thinking out of the context). Any other
block (image, document, a server tool's result, ...) fails the tag check, a 400 naming it.
`cache_control` is accepted everywhere (the prefix cache is automatic). The sampling fields
(max_tokens, temperature, top_p, top_k, stop_sequences) are not here: the parameter table
reads them (`protocols/parameters.py`, protocol `anthropic`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from predictor.protocols.openai.messages import MAX_TOOLS, Strict


class CacheControl(Strict):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[Any] | None = None  # an earlier answer's; not shown to the model


class ToolUseBlock(Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    caller: dict[str, Any] | None = None  # an earlier answer's (who called it); not shown
    toolset_name: str | None = None


class ToolResultBlock(Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None
    toolset_name: str | None = None


class ThinkingBlock(Strict):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(Strict):
    type: Literal["redacted_thinking"]
    data: str


Block = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class Message(Strict):
    role: Literal["user", "assistant"]
    content: str | Annotated[list[Block], Field(min_length=1)]


class Tool(Strict):
    """A custom tool (Anthropic's server tools, which have a `type` of their own, are refused
    before this model sees them: `requests.py`)."""

    type: Literal["custom"] | None = None
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None
    strict: bool | None = None  # accepted: the input is always held to its schema here
    eager_input_streaming: bool | None = None  # accepted: input always streams as written


class ToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # type "tool": the tool to call
    disable_parallel_tool_use: bool | None = None


class JSONOutputFormat(Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")  # pydantic's BaseModel has a `schema`


class OutputConfig(Strict):
    """Structured outputs: the answer's text held to a JSON schema (`effort` is not served)."""

    format: JSONOutputFormat | None = None


class Metadata(Strict):
    user_id: Annotated[str, Field(max_length=256)] | None = None


class MessagesBody(Strict):
    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | Annotated[list[TextBlock], Field(min_length=1)] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: dict[str, Any] | None = None  # checked by requests.thinking_check
    metadata: Metadata | None = None
    stream: bool | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = None  # automatic prompt caching: ours always is
    service_tier: Literal["auto", "standard_only"] | None = None  # one tier here


FIELD_NAMES = frozenset(
    name
    for model in (
        CacheControl,
        TextBlock,
        ToolUseBlock,
        ToolResultBlock,
        ThinkingBlock,
        RedactedThinkingBlock,
        Message,
        Tool,
        ToolChoice,
        Metadata,
        MessagesBody,
        OutputConfig,
    )
    for name in model.model_fields
) | {"schema"}
