"""OpenAI Responses API request bodies (`POST /v1/responses`) -> the engine's chat request.

A Responses body says what a chat completions body says in other words: `instructions` and
`input` (text, or items: messages, function calls and their outputs) are the conversation,
`tools` are flat function definitions, `text.format` is the response format and
`max_output_tokens` is max_tokens. So it is translated into chat's own pieces (`messages.Message`,
`messages.tool_setup`, the parameter table through `validation.validate_body`) and becomes the same
GenerateRequest a chat request becomes; nothing of chat's logic is repeated here.

Stateless: nothing is kept, so `store` is accepted (true or false) and ignored, and
`previous_response_id`, `conversation` and `background` are 400s naming them. What this server
cannot honour (a tool other than a function, non-text content, ...) is a 400 naming the
field. `reasoning` is accepted: effort "none" turns a thinking model's thinking off (its
template's enable_thinking false), the other efforts leave it as the model does; no summary is
written (the reasoning items carry the reasoning as content). Earlier reasoning items in
`input` are accepted and left out of the prompt, as the templates leave earlier thinking out.
The body models are in `responses_bodies.py`, the response shapes in `responses_output.py`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from pydantic import ValidationError

from predictor.errors import InvalidRequest
from predictor.protocols import structured
from predictor.protocols.openai.messages import (
    AssistantToolCall,
    CalledFunction,
    FunctionDefinition,
    Message,
    NamedFunction,
    NamedToolChoice,
    Strict,
    Tool,
    chat_prompt,
    conversation,
    tool_setup,
)
from predictor.protocols.openai.requests import NO_THINKING_EFFORTS
from predictor.protocols.openai.responses_bodies import (
    FIELD_NAMES,
    INCLUDABLE,
    ITEMS,
    REASONING_EFFORTS,
    REASONING_SUMMARIES,
    RENAMES,
    TABLE_KEYS,
    FunctionCallOutputItem,
    FunctionChoice,
    FunctionTool,
    InputText,
    Item,
    MessageItem,
    Reasoning,
    ReasoningItem,
    ResponsesBody,
)
from predictor.protocols.openai.validation import param_of, telling_error, validate_body
from predictor.types import GenerateRequest


@dataclass(frozen=True)
class ResponsesRequest:
    """One Responses request: its engine request, and what the response object echoes."""

    id: str
    model: str
    created: int
    request: GenerateRequest
    stream: bool
    tools: tuple[dict[str, Any], ...]  # the function tools as given (echoed), flat
    tool_choice: str | dict[str, Any]
    parallel_tool_calls: bool
    text_format: dict[str, Any]
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: Mapping[str, str] | None = None
    user: str | None = None
    # the field that asks the model to think (limits.check_thinking), None where none does
    asks_thinking: str | None = None

    @property
    def reads_calls(self) -> bool:
        """Whether the answer is read for tool calls (tools given, tool_choice not none)."""
        return self.request.tools is not None


def _refuse_state(body: Any) -> None:
    """What needs responses kept (this server keeps none) is refused by name, before the rest."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    for key in ("previous_response_id", "conversation", "prompt"):
        if body.get(key) is not None:
            raise InvalidRequest(
                f"'{key}' is not supported: this server keeps no responses, conversations or "
                "prompts (send the whole conversation in 'input')",
                param=key,
            )


def check_reasoning(reasoning: Reasoning | None) -> dict[str, Any] | None:
    """`reasoning`'s effort (REASONING_EFFORTS) and summary (REASONING_SUMMARIES; none is
    written) checked; the chat template's variables it asks for (effort "none": thinking off),
    or None. Absent or null fields ask for nothing. (An effort above minimal on a model that
    does not think: the route's 400, `ResponsesRequest.asks_thinking`.)"""
    if reasoning is None:
        return None
    if reasoning.effort is not None and reasoning.effort not in REASONING_EFFORTS:
        raise InvalidRequest(
            f"'reasoning.effort' {reasoning.effort!r} is not supported (one of "
            f"{', '.join(sorted(REASONING_EFFORTS))})",
            param="reasoning.effort",
        )
    for key in ("summary", "generate_summary"):
        value = getattr(reasoning, key)
        if value is not None and value not in REASONING_SUMMARIES:
            raise InvalidRequest(
                f"'reasoning.{key}' {value!r} is not supported (one of "
                f"{', '.join(sorted(REASONING_SUMMARIES))})",
                param=f"reasoning.{key}",
            )
    return {"enable_thinking": False} if reasoning.effort == "none" else None


def _strict_item(model: type[Strict], value: Any, where: str) -> Any:
    """`value` as `model`, its errors naming the field at `where` (input[2].content)."""
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        error = telling_error(exc, FIELD_NAMES)
        loc, unknown = error["loc"], error["type"] == "extra_forbidden"
        inside = param_of(loc, FIELD_NAMES | ({str(loc[-1])} if unknown else set()))
        param = f"{where}.{inside}" if inside and not inside.startswith("[") else where + inside
        if unknown:
            raise InvalidRequest(f"'{param}' is not supported by this server", param=param) from exc
        raise InvalidRequest(f"'{param}': {error['msg']}", param=param) from exc


def _item(i: int, value: Any) -> Item:
    where = f"input[{i}]"
    if not isinstance(value, dict):
        raise InvalidRequest(f"'{where}' must be an object", param=where)
    kind = value.get("type", "message")
    model = ITEMS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise InvalidRequest(
            f"'{where}.type' {kind!r} is not supported (one of {', '.join(ITEMS)})",
            param=f"{where}.type",
        )
    content = {"message": value.get("content"), "function_call_output": value.get("output")}.get(
        kind
    )
    if isinstance(content, list):  # name the part this server cannot read (an image, a file)
        field = "content" if kind == "message" else "output"
        for j, part in enumerate(content):
            part_type = part.get("type") if isinstance(part, dict) else None
            if part_type not in ("input_text", "output_text"):
                param = f"{where}.{field}[{j}].type"
                raise InvalidRequest(
                    f"'{param}' {part_type!r} is not supported (text parts only)", param=param
                )
    item: Item = _strict_item(model, {k: v for k, v in value.items() if v is not None}, where)
    return item


def _text(content: str | Sequence[InputText]) -> str:
    return content if isinstance(content, str) else "\n".join(p.text for p in content)


def _messages(instructions: str | None, given: str | list[dict[str, Any]]) -> list[Message]:
    """`instructions` and `input` as chat messages: function calls join the assistant turn
    they follow, their outputs are tool turns."""
    out: list[Message] = (
        [] if instructions is None else [Message(role="system", content=instructions)]
    )
    if isinstance(given, str):
        return [*out, Message(role="user", content=given)]
    for i, value in enumerate(given):
        item = _item(i, value)
        if isinstance(item, MessageItem):
            out.append(Message(role=item.role, content=_text(item.content)))
        elif isinstance(item, FunctionCallOutputItem):
            out.append(Message(role="tool", content=_text(item.output), tool_call_id=item.call_id))
        elif isinstance(item, ReasoningItem):
            continue  # earlier thinking: not in the prompt
        else:
            try:
                json.loads(item.arguments)
            except ValueError as exc:
                param = f"input[{i}].arguments"
                raise InvalidRequest(f"'{param}' is not valid JSON", param=param) from exc
            call = AssistantToolCall(
                id=item.call_id,
                type="function",
                function=CalledFunction(name=item.name, arguments=item.arguments),
            )
            last = out[-1] if out else None
            if last is not None and last.role == "assistant":
                out[-1] = last.model_copy(update={"tool_calls": [*(last.tool_calls or []), call]})
            else:
                out.append(Message(role="assistant", tool_calls=[call]))
    return out


def _tools(given: list[dict[str, Any]] | None) -> list[FunctionTool]:
    """The function tools; any other kind (web_search, file_search, mcp, ...) is refused."""
    out = []
    for i, value in enumerate(given or ()):
        kind = value.get("type") if isinstance(value, dict) else None
        if kind != "function":
            param = f"tools[{i}].type"
            raise InvalidRequest(
                f"'{param}' {kind!r} is not supported: this server calls functions only",
                param=param,
            )
        out.append(_strict_item(FunctionTool, value, f"tools[{i}]"))
    return out


def _tool_choice(
    choice: str | dict[str, Any] | None,
) -> Literal["none", "auto", "required"] | NamedToolChoice | None:
    if choice is None or isinstance(choice, str):
        return choice  # type: ignore[return-value]  # the body model allows only those words
    if choice.get("type") != "function":
        raise InvalidRequest(
            f"'tool_choice.type' {choice.get('type')!r} is not supported (none, auto, required "
            "or a function)",
            param="tool_choice.type",
        )
    named = _strict_item(FunctionChoice, choice, "tool_choice")
    return NamedToolChoice(type="function", function=NamedFunction(name=named.name))


def decode_responses(
    body: Any, default_max_tokens: int, tool_format: str = "hermes"
) -> ResponsesRequest:
    """A Responses body -> the engine's chat request and what the answer echoes (tools in
    `tool_format`, the model's)."""
    _refuse_state(body)
    parsed, values = validate_body(
        ResponsesBody, body, default_max_tokens, FIELD_NAMES, RENAMES, TABLE_KEYS
    )
    if values.sampling.max_tokens < 1:
        raise InvalidRequest("'max_output_tokens' must be at least 1", param="max_output_tokens")
    variables = check_reasoning(parsed.reasoning)
    effort = parsed.reasoning.effort if parsed.reasoning is not None else None
    for i, entry in enumerate(parsed.include or ()):
        if entry not in INCLUDABLE:
            raise InvalidRequest(f"'include' {entry!r} is not supported", param=f"include[{i}]")
    if parsed.stream_options is not None and not parsed.stream:
        raise InvalidRequest(
            "'stream_options' is only allowed with stream: true", param="stream_options"
        )
    text_format = (parsed.text.format if parsed.text else None) or {"type": "text"}
    grammar = structured.text_format(text_format)
    if text_format["type"] == "json_schema":  # echoed with its schema, as OpenAI's type has it
        text_format = {"schema": {}} | text_format
    functions = _tools(parsed.tools)
    chat_tools = [
        Tool(type="function", function=FunctionDefinition(**t.model_dump(exclude={"type"})))
        for t in functions
    ]
    try:
        tools, sampling = tool_setup(
            chat_tools,
            _tool_choice(parsed.tool_choice),
            parsed.parallel_tool_calls,
            replace(values.sampling, grammar=grammar),
            tool_format,
        )
    except InvalidRequest as exc:  # chat's names, said as Responses names them
        param = "tool_choice.name" if exc.param == "tool_choice.function.name" else exc.param
        raise InvalidRequest(str(exc), param=param) from exc
    base = f"resp_{uuid.uuid4().hex}"
    turns = conversation(_messages(parsed.instructions, parsed.input))
    prompt = chat_prompt(base, turns, tools, tool_format)
    request = replace(
        prompt,
        params=sampling,
        cache_salt=values.cache_salt,
        tenant=parsed.user,
        chat_template_kwargs=variables,
    )
    return ResponsesRequest(
        base,
        parsed.model,
        int(time.time()),
        request,
        bool(parsed.stream),
        tuple(t.model_dump(exclude_none=True) for t in functions),
        parsed.tool_choice if parsed.tool_choice is not None else "auto",
        parsed.parallel_tool_calls is not False,
        text_format,
        parsed.instructions,
        body.get("max_output_tokens"),
        parsed.metadata,
        parsed.user,
        "reasoning.effort" if effort is not None and effort not in NO_THINKING_EFFORTS else None,
    )
