"""An Anthropic Messages body -> the engine request the chat-completions path builds.

The body is read as OpenAI's chat pieces (`protocols/openai/messages.py`): `system` and the
messages become chat turns (`tool_use` blocks an assistant's calls, `tool_result` blocks tool
turns), the custom tools OpenAI function tools, `tool_choice` chat's (auto, any -> required,
tool -> a named function, none); then chat's own `conversation`, `tool_setup` (the tools'
grammar) and `chat_prompt` build the request, so both APIs render, constrain and parse alike.
The sampling fields are read by the parameter table (protocol `anthropic`); structured outputs
(`output_config.format`) are chat's json_schema grammar. What this server cannot honour is a
400 naming it: a server tool, an unknown field or block. `thinking` maps onto a thinking
model's reasoning (engine/reasoning.py): enabled with its budget_tokens as the thinking budget,
disabled as its chat template's enable_thinking false, adaptive (or absent) as the model thinks.
On a model that does not think, enabled is a 400 naming `thinking` (`asks_thinking`); disabled
and adaptive (the model decides, and it decides not to) are served as without `thinking`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from pydantic import ValidationError

from predictor.errors import InvalidRequest
from predictor.protocols import parameters
from predictor.protocols.anthropic import bodies
from predictor.protocols.openai import messages as chat
from predictor.protocols.openai.validation import param_of, telling_error
from predictor.types import GenerateRequest, Grammar

PROTOCOL = "anthropic"
# `thinking` types served, each with the keys it may carry beside `type`
THINKING_SERVED = {
    "enabled": {"budget_tokens", "display"},
    "disabled": set(),
    "adaptive": {"display"},
}


@dataclass(frozen=True)
class MessagesRequest:
    """One Messages request: the engine request, and how to answer."""

    id: str  # msg_...
    model: str
    request: GenerateRequest
    stream: bool
    tools: bool  # whether the answer's text is read for tool calls
    # the field that asks the model to think (limits.check_thinking), None where none does
    asks_thinking: str | None = None


def decode_messages(
    body: Any, default_max_tokens: int, counting: bool = False, tool_format: str = "hermes"
) -> MessagesRequest:
    """A /v1/messages body (`counting`: a count_tokens body, where max_tokens may be left out)."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    given = {k: v for k, v in body.items() if v is not None}  # JSON null: the default
    if not counting and "max_tokens" not in given:
        raise InvalidRequest("'max_tokens' is required", param="max_tokens")
    refuse_server_tools(given.get("tools"))
    table = set(parameters.names(PROTOCOL))
    values = parameters.read(
        {k: v for k, v in given.items() if k in table}, PROTOCOL, default_max_tokens
    )
    parsed = _validated({k: v for k, v in given.items() if k not in table})
    budget, variables = thinking_check(parsed.thinking)
    sampling = replace(values.sampling, grammar=output_grammar(parsed.output_config))
    choice, parallel = _tool_choice(parsed.tool_choice)
    tools, sampling = chat.tool_setup(_tools(parsed.tools), choice, parallel, sampling, tool_format)
    turns = chat.conversation(chat_messages(parsed.system, parsed.messages))
    base = f"msg_{uuid.uuid4().hex[:24]}"
    prompt = chat.chat_prompt(base, turns, tools, tool_format)
    tenant = parsed.metadata.user_id if parsed.metadata is not None else None
    request = replace(
        prompt,
        params=sampling,
        cache_salt=values.cache_salt,
        tenant=tenant,
        chat_template_kwargs=variables,
        thinking_budget=budget,
    )
    enabled = parsed.thinking is not None and parsed.thinking.get("type") == "enabled"
    return MessagesRequest(
        base,
        parsed.model,
        request,
        bool(parsed.stream),
        tools is not None,
        asks_thinking="thinking" if enabled else None,
    )


def _validated(rest: Mapping[str, Any]) -> bodies.MessagesBody:
    try:
        return bodies.MessagesBody.model_validate(rest)
    except ValidationError as exc:
        error = telling_error(exc, bodies.FIELD_NAMES)
        loc = error["loc"]
        if error["type"] == "extra_forbidden":  # the unknown key itself is the last part
            param = param_of(loc, bodies.FIELD_NAMES | {str(loc[-1])})
            raise InvalidRequest(f"'{param}' is not supported by this server", param=param) from exc
        param = param_of(loc, bodies.FIELD_NAMES)
        if error["type"] == "union_tag_invalid":  # a content block of a type not served
            tag = error.get("ctx", {}).get("tag")
            raise InvalidRequest(
                f"'{param}': a {tag!r} block is not supported by this server (text, tool_use, "
                "tool_result, and an earlier answer's thinking)",
                param=f"{param}.type",
            ) from exc
        raise InvalidRequest(f"'{param}': {error['msg']}", param=param or None) from exc


def refuse_server_tools(tools: Any) -> None:
    """Anthropic's server tools (web search, code execution, bash, text editor, computer use,
    ...) run on Anthropic's side: a 400 naming them. A custom tool has no type or "custom"."""
    if not isinstance(tools, list):
        return
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind is not None and kind != "custom":
            name = tool.get("name", "") if isinstance(tool, dict) else ""
            raise InvalidRequest(
                f"'tools[{i}]' is Anthropic's server tool '{kind}' ({name}), which this server "
                "does not run: only custom tools (name, description, input_schema) are served",
                param=f"tools[{i}].type",
            )


def thinking_check(
    thinking: Mapping[str, Any] | None,
) -> tuple[int | None, dict[str, Any] | None]:
    """`thinking` as a thinking budget and the chat template's variables: enabled with
    budget_tokens (a budget), disabled (enable_thinking false), adaptive (the model's way); any
    other type or key a 400 naming it. (Enabled on a model that does not think: the route's
    400, `MessagesRequest.asks_thinking`.)"""
    if thinking is None:
        return None, None
    kind = thinking.get("type")
    if not isinstance(kind, str) or kind not in THINKING_SERVED:
        raise InvalidRequest(
            f"'thinking.type' {kind!r} is not supported (one of {', '.join(THINKING_SERVED)})",
            param="thinking.type",
        )
    extra = sorted(set(thinking) - {"type"} - THINKING_SERVED[kind])
    if extra:
        raise InvalidRequest(
            f"'thinking.{extra[0]}' is not supported with thinking {kind}",
            param=f"thinking.{extra[0]}",
        )
    if kind == "disabled":
        return None, {"enable_thinking": False}
    budget = thinking.get("budget_tokens")
    if kind == "enabled" and (
        not isinstance(budget, int) or isinstance(budget, bool) or budget < 0
    ):
        raise InvalidRequest(
            "'thinking.budget_tokens' must be a whole number of tokens, 0 or more",
            param="thinking.budget_tokens",
        )
    return budget, None


def output_grammar(config: bodies.OutputConfig | None) -> Grammar | None:
    """Structured outputs (`output_config.format`): the answer's text held to the JSON schema,
    by the same grammar as chat's response_format json_schema."""
    if config is None or config.format is None:
        return None
    return Grammar("json_schema", json.dumps(config.format.schema_), "output_config.format")


def _tool_choice(
    choice: bodies.ToolChoice | None,
) -> tuple[Literal["none", "auto", "required"] | chat.NamedToolChoice | None, bool | None]:
    """Anthropic's tool_choice as chat's, and whether parallel calls are allowed."""
    if choice is None:
        return None, None
    parallel = (
        None if choice.disable_parallel_tool_use is None else not (choice.disable_parallel_tool_use)
    )
    if choice.type == "tool":
        if choice.name is None:
            raise InvalidRequest(
                "'tool_choice.name' is required with type 'tool'", param="tool_choice.name"
            )
        named = chat.NamedToolChoice(type="function", function=chat.NamedFunction(name=choice.name))
        return named, parallel
    if choice.name is not None:
        raise InvalidRequest(
            f"'tool_choice.name' is only for type 'tool', not {choice.type!r}",
            param="tool_choice.name",
        )
    if choice.type == "none" and choice.disable_parallel_tool_use is not None:
        raise InvalidRequest(
            "'tool_choice.disable_parallel_tool_use' is not for type 'none'",
            param="tool_choice.disable_parallel_tool_use",
        )
    return ("required" if choice.type == "any" else choice.type), parallel


def _tools(tools: Sequence[bodies.Tool] | None) -> list[chat.Tool] | None:
    if tools is None:
        return None
    return [
        chat.Tool(
            type="function",
            function=chat.FunctionDefinition(
                name=t.name, description=t.description, parameters=t.input_schema
            ),
        )
        for t in tools
    ]


def _text(blocks: str | Sequence[bodies.TextBlock]) -> str | list[chat.TextPart]:
    if isinstance(blocks, str):
        return blocks
    return [chat.TextPart(type="text", text=b.text) for b in blocks]


def _result_text(block: bodies.ToolResultBlock) -> str:
    """A tool_result's content as a tool turn's text; an error says so first."""
    content = block.content
    if content is None or isinstance(content, str):
        text = content or ""
    else:
        text = "\n".join(b.text for b in content)
    return f"Error: {text}" if block.is_error else text


def _user_turns(i: int, blocks: Sequence[Any]) -> list[chat.Message]:
    """A user message's blocks, in order: each tool_result a tool turn, text blocks between
    them one user turn."""
    out: list[chat.Message] = []
    texts: list[chat.TextPart] = []
    for j, block in enumerate(blocks):
        if isinstance(block, bodies.TextBlock):
            texts.append(chat.TextPart(type="text", text=block.text))
        elif isinstance(block, bodies.ToolResultBlock):
            if texts:
                out.append(chat.Message(role="user", content=texts))
                texts = []
            out.append(
                chat.Message(
                    role="tool", content=_result_text(block), tool_call_id=block.tool_use_id
                )
            )
        else:
            raise InvalidRequest(
                f"'messages[{i}].content[{j}]': a {block.type} block is only for assistant "
                "messages",
                param=f"messages[{i}].content[{j}]",
            )
    if texts:
        out.append(chat.Message(role="user", content=texts))
    return out


def _assistant_turn(i: int, blocks: Sequence[Any]) -> chat.Message | None:
    """An assistant message's text and calls as one turn (earlier thinking is left out)."""
    texts: list[chat.TextPart] = []
    calls: list[chat.AssistantToolCall] = []
    for j, block in enumerate(blocks):
        if isinstance(block, bodies.TextBlock):
            texts.append(chat.TextPart(type="text", text=block.text))
        elif isinstance(block, bodies.ToolUseBlock):
            arguments = json.dumps(block.input, ensure_ascii=False)
            calls.append(
                chat.AssistantToolCall(
                    id=block.id,
                    type="function",
                    function=chat.CalledFunction(name=block.name, arguments=arguments),
                )
            )
        elif isinstance(block, bodies.ToolResultBlock):
            raise InvalidRequest(
                f"'messages[{i}].content[{j}]': a tool_result block is only for user messages",
                param=f"messages[{i}].content[{j}]",
            )
    if not texts and not calls:
        return None  # thinking only
    return chat.Message(role="assistant", content=texts or None, tool_calls=calls or None)


def chat_messages(
    system: str | Sequence[bodies.TextBlock] | None, messages: Sequence[bodies.Message]
) -> list[chat.Message]:
    """`system` and the messages as chat messages, in order."""
    out = [] if system is None else [chat.Message(role="system", content=_text(system))]
    for i, message in enumerate(messages):
        if isinstance(message.content, str):
            out.append(chat.Message(role=message.role, content=message.content))
        elif message.role == "user":
            out.extend(_user_turns(i, message.content))
        elif (turn := _assistant_turn(i, message.content)) is not None:
            out.append(turn)
    if messages[-1].role == "assistant":
        last = len(messages) - 1
        raise InvalidRequest(
            f"'messages[{last}]': a last assistant message (a prefill to continue) is not "
            "supported by this server: the answer always begins a new assistant turn",
            param=f"messages[{last}]",
        )
    return out
