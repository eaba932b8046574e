"""Chat messages and tools in OpenAI's shapes -> what the engine takes: each turn as the chat
template takes it (HF's shape for tool turns), and the tools with the grammar their
`tool_choice` asks for. The tool-call format itself is the engine's (`engine/tool_formats/`:
the model's format); `protocols/openai/requests.py` reads the rest of a chat body."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from predictor.engine import tool_formats
from predictor.errors import InvalidRequest
from predictor.types import GenerateRequest, Grammar, SamplingParams

MAX_TOOLS = 128


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(Strict):
    type: Literal["text"]
    text: str


class CalledFunction(Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class AssistantToolCall(Strict):
    id: str
    type: Literal["function"]
    function: CalledFunction


class Message(Strict):
    # developer: OpenAI's name for system instructions (the openai SDK and vLLM send it); the
    # chat template takes it as a system turn
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], Field(min_length=1)] | None = None
    tool_calls: Annotated[list[AssistantToolCall], Field(min_length=1)] | None = None
    tool_call_id: str | None = None
    # an earlier answer's reasoning sent back (vLLM's two names): given to the chat template
    # as reasoning_content, which Qwen3's writes for the turns after the last user message
    reasoning_content: str | None = None
    reasoning: str | None = None


class FunctionDefinition(Strict):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: no arguments
    strict: bool | None = None  # accepted: arguments are always enforced by grammar here


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


def content(message: Message) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    return "\n".join(part.text for part in message.content)  # text parts, as vLLM joins them


def _turn(i: int, message: Message) -> dict[str, Any]:
    """One message as the engine's chat template takes it (HF's shape for tool turns)."""
    where = f"messages[{i}]"
    if message.tool_calls is not None and message.role != "assistant":
        raise InvalidRequest(f"'{where}.tool_calls' is only for assistant messages", param=where)
    if message.tool_call_id is not None and message.role != "tool":
        raise InvalidRequest(f"'{where}.tool_call_id' is only for tool messages", param=where)
    if message.content is None and not (message.role == "assistant" and message.tool_calls):
        raise InvalidRequest(f"'{where}.content' is required", param=f"{where}.content")
    role = "system" if message.role == "developer" else message.role
    turn: dict[str, Any] = {"role": role, "content": content(message)}
    if message.role == "tool":
        if message.tool_call_id is None:
            raise InvalidRequest(
                f"'{where}.tool_call_id' is required", param=f"{where}.tool_call_id"
            )
        turn["tool_call_id"] = message.tool_call_id
    thought = (
        message.reasoning_content if message.reasoning_content is not None else (message.reasoning)
    )
    if thought is not None:
        if message.role != "assistant":
            param = f"{where}.reasoning_content"
            raise InvalidRequest(f"'{param}' is only for assistant messages", param=param)
        turn["reasoning_content"] = thought
    for j, call in enumerate(message.tool_calls or ()):
        try:
            arguments = json.loads(call.function.arguments)
        except ValueError as exc:
            param = f"{where}.tool_calls[{j}].function.arguments"
            raise InvalidRequest(f"'{param}' is not valid JSON", param=param) from exc
        turn.setdefault("tool_calls", []).append(
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": arguments},
            }
        )
    return turn


def conversation(messages: Sequence[Message]) -> tuple[dict[str, Any], ...]:
    return tuple(_turn(i, m) for i, m in enumerate(messages))


def chat_prompt(
    request_id: str,
    turns: tuple[dict[str, Any], ...],
    tools: tuple[dict[str, Any], ...] | None,
    tool_format: str = "hermes",
) -> GenerateRequest:
    """A conversation (and its tools) as the prompt of an engine request (chat completions and
    Anthropic's Messages alike; each choice copies it with its own sampling)."""
    # the engine's own single-message chat path renders the same template; a thinking
    # model's reasoning is split from the answer on these APIs
    text = turns[0]["content"] if len(turns) == 1 and turns[0]["role"] == "user" else ""
    return GenerateRequest(
        request_id,
        text,
        chat=True,
        messages=turns,
        tools=tools,
        split_reasoning=True,
        tool_format=tool_format,
    )


def tool_setup(
    given: Sequence[Tool] | None,
    choice: Literal["none", "auto", "required"] | NamedToolChoice | None,
    parallel_calls: bool | None,
    sampling: SamplingParams,
    tool_format: str = "hermes",
) -> tuple[tuple[dict[str, Any], ...] | None, SamplingParams]:
    """The tools the prompt shows and the sampling with their grammar: `required` and a named
    tool force calls, `auto` lets the model choose; either way a call parses and its arguments
    validate, in the model's format (`tool_format`, a parser name of `engine/tool_formats/`).
    `none` (or no tools): no tools in the prompt, no calls read back."""
    if not given:
        if choice is not None and choice != "none":
            raise InvalidRequest("'tool_choice' needs 'tools'", param="tool_choice")
        return None, sampling
    if choice == "none":
        return None, sampling
    functions = [t.function.model_dump(exclude_none=True) for t in given]
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise InvalidRequest("'tools' names a function twice", param="tools")
    wanted: str = "auto" if choice is None else choice if isinstance(choice, str) else ""
    if isinstance(choice, NamedToolChoice):
        wanted = choice.function.name
        if wanted not in names:
            raise InvalidRequest(
                f"'tool_choice' names '{wanted}', which is not among 'tools'",
                param="tool_choice.function.name",
            )
    if sampling.grammar is not None:
        raise InvalidRequest(
            f"'{sampling.grammar.param}' cannot be combined with tools (tool_choice "
            f"'{wanted}' is enforced by a grammar of its own)",
            param=sampling.grammar.param,
        )
    parallel = parallel_calls is not False
    fmt = tool_formats.get(tool_format)
    grammar = Grammar("structural_tag", fmt.structural_tag(functions, wanted, parallel))
    grammar = replace(grammar, param="tools")
    tools = tuple({"type": "function", "function": f} for f in functions)
    return tools, replace(sampling, grammar=grammar)
