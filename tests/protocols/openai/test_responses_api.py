"""Responses API bodies -> the engine's chat request, and answers -> output items and events:
every field mapped onto chat's pieces, every refusal naming its field, the stream and the unary
answer built alike."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types.responses import Response

from predictor.errors import InvalidRequest
from predictor.protocols.openai.requests import decode_chat
from predictor.protocols.openai.responses_api import decode_responses
from predictor.protocols.openai.responses_output import ResponseEncoder
from predictor.protocols.schemas import RESPONSES_SCHEMA
from predictor.types import FinishReason, Usage

TOOL = {
    "type": "function", "name": "f", "description": "d",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
}  # fmt: skip
CALL = '<tool_call>\n{"name": "f", "arguments": {"a": 2}}\n</tool_call>'


def decode(**body: Any) -> Any:
    return decode_responses({"model": "m", "input": "Hi"} | body, default_max_tokens=16)


def refused(body: dict[str, Any]) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        decode_responses({"model": "m", "input": "Hi"} | body, default_max_tokens=16)
    return caught.value


def test_fields_reach_the_sampling_params() -> None:
    request = decode(
        max_output_tokens=9, temperature=0.5, top_p=0.9, user="u", seed=3, top_k=4,
        stream=True, store=True, metadata={"a": "b"}, parallel_tool_calls=False,
    )  # fmt: skip
    p = request.request.params
    assert (p.max_tokens, p.temperature, p.top_p, p.seed, p.top_k) == (9, 0.5, 0.9, 3, 4)
    assert request.stream and request.request.tenant == "u" and request.metadata == {"a": "b"}
    assert request.id.startswith("resp_") and request.request.request_id == request.id
    assert request.max_output_tokens == 9 and not request.parallel_tool_calls
    default = decode()
    assert default.request.params.max_tokens == 16 and default.request.params.temperature == 1.0
    assert default.tool_choice == "auto" and default.text_format == {"type": "text"}


def test_input_becomes_chats_messages() -> None:
    """instructions and items are the chat messages chat would take for the same turns."""
    items = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Hi"},
                                     {"type": "input_text", "text": "there"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Hello!", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a": 1}',
         "id": "fc_1", "status": "completed"},
        {"type": "function_call_output", "call_id": "c1", "output": "3"},
    ]  # fmt: skip
    request = decode(input=items, instructions="Sys", tools=[TOOL])
    chat = decode_chat(
        {"model": "m", "tools": [{"type": "function", "function": {
            k: v for k, v in TOOL.items() if k != "type"}}],
         "messages": [
            {"role": "system", "content": "Sys"}, {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": "Hi\nthere"},
            {"role": "assistant", "content": "Hello!", "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "f", "arguments": '{"a": 1}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "3"},
        ]},
        16,
    )  # fmt: skip
    (choice,) = chat.choices
    assert request.request.messages == choice.messages
    assert request.request.tools == choice.tools
    assert request.request.params.grammar == choice.params.grammar


def test_a_lone_text_input_is_chats_single_message() -> None:
    request = decode(input="Hello there")
    assert request.request.prompt == "Hello there" and request.request.chat
    assert request.request.messages == ({"role": "user", "content": "Hello there"},)


def test_tool_choices_map_onto_chats() -> None:
    assert decode(tools=[TOOL], tool_choice="none").request.tools is None
    named = decode(tools=[TOOL], tool_choice={"type": "function", "name": "f"})
    assert named.request.params.grammar is not None and named.reads_calls
    assert named.tool_choice == {"type": "function", "name": "f"}
    assert named.tools == (TOOL,)


def test_text_format_is_the_grammar() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "name": "x", "schema": schema, "strict": True}
    grammar = decode(text={"format": fmt}).request.params.grammar
    assert grammar.kind == "json_schema" and json.loads(grammar.text) == schema
    assert grammar.param == "text.format"
    assert decode(text={"format": {"type": "json_object"}}).request.params.grammar.kind == (
        "json_object"
    )
    assert decode(text={"format": {"type": "text"}}).request.params.grammar is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"background": True}, "background"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"max_tokens": 4}, "max_tokens"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"max_output_tokens": "many"}, "max_output_tokens"),
        ({"temperature": 3}, "temperature"),
        ({"reasoning": {"effort": "lots"}}, "reasoning.effort"),
        ({"reasoning": {"summary": "verbose"}}, "reasoning.summary"),
        ({"input": [{"type": "reasoning", "summary": [], "extra": 1}]}, "input[0].extra"),
        ({"tools": [{"type": "file_search"}]}, "tools[0].type"),
        ({"tools": [TOOL | {"extra": 1}]}, "tools[0].extra"),
        ({"tools": [TOOL], "tool_choice": {"type": "web_search_preview"}}, "tool_choice.type"),
        ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "g"}}, "tool_choice.name"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [TOOL], "text": {"format": {"type": "json_object"}}}, "text.format"),
        ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
        ({"input": [{"type": "computer_call_output"}]}, "input[0].type"),
        ({"input": [{}]}, "input[0]"),
        ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]},
         "input[0].content[0].type"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
         "input[0].arguments"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"include": ["message.output_text.logprobs"]}, "include[0]"),
        ({"truncation": "auto"}, "truncation"),
        ({"stream_options": {"include_obfuscation": False}}, "stream_options"),
    ],
)  # fmt: skip
def test_refusals_name_the_field(body: dict[str, Any], param: str) -> None:
    assert refused(body).param == param


def test_an_absent_or_null_reasoning_asks_for_nothing() -> None:
    decode(reasoning={"effort": None, "summary": None})
    decode(reasoning=None, store=False, truncation="disabled", service_tier="auto")
    decode(include=["reasoning.encrypted_content"])  # reasoning items are never encrypted


def test_reasoning_effort_none_turns_thinking_off_and_the_others_leave_it() -> None:
    off = decode(reasoning={"effort": "none", "summary": "auto"}).request
    assert off.chat_template_kwargs == {"enable_thinking": False}
    for effort in ("minimal", "low", "medium", "high"):
        assert decode(reasoning={"effort": effort}).request.chat_template_kwargs is None


def test_an_effort_above_minimal_is_named_as_asking_the_model_to_think() -> None:
    """For the route's check (limits.check_thinking: a 400 on a model that does not think)."""
    assert decode().asks_thinking is None
    assert decode(reasoning={"summary": "auto"}).asks_thinking is None
    for effort in ("none", "minimal"):
        assert decode(reasoning={"effort": effort}).asks_thinking is None
    for effort in ("low", "medium", "high", "xhigh"):
        assert decode(reasoning={"effort": effort}).asks_thinking == "reasoning.effort"


def test_earlier_reasoning_items_are_left_out_of_the_prompt() -> None:
    given = [
        {"role": "user", "content": "Hi"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Bye"},
    ]  # fmt: skip
    messages = decode(input=given).request.messages
    assert messages is not None and "hmm" not in str(messages) and len(messages) == 3


def test_the_openapi_body_has_the_routes_keys() -> None:
    properties = RESPONSES_SCHEMA["properties"]
    assert {"input", "max_output_tokens", "temperature", "top_p", "tools"} <= set(properties)
    assert "max_tokens" not in properties and "response_format" not in properties


def events_of(request: Any, pieces: list[str], reason: FinishReason) -> list[tuple[str, dict]]:
    encoder = ResponseEncoder(request)
    out = list(encoder.opening())
    for i, piece in enumerate(pieces):
        out += encoder.text(piece, final=i == len(pieces) - 1)
    out += encoder.closing(reason, Usage(3, 5))
    return [(kind, json.loads(data)) for kind, data in out]


def without_ids(response: Response) -> list[dict[str, Any]]:
    drop = ("id", "call_id")
    return [{k: v for k, v in i.model_dump().items() if k not in drop} for i in response.output]


def test_stream_and_whole_answer_agree_on_items() -> None:
    request = decode(tools=[TOOL])
    text = "Sure. " + CALL
    whole = Response.model_validate_json(
        ResponseEncoder(request).whole(text, FinishReason.STOP, Usage(3, 5))
    )
    events = events_of(request, [text[:9], text[9:20], text[20:]], FinishReason.STOP)
    assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
    assert all(kind == e["type"] for kind, e in events)
    final = Response.model_validate(events[-1][1]["response"])
    assert without_ids(whole) == without_ids(final)
    assert [i.type for i in final.output] == ["message", "function_call"]
    assert final.output_text == "Sure." and json.loads(final.output[1].arguments) == {"a": 2}
    kinds = [kind for kind, _ in events]
    assert (
        kinds.count("response.output_item.added") == 2 == kinds.count("response.output_item.done")
    )
    assert "response.function_call_arguments.done" in kinds
    assert final.usage is not None and final.usage.total_tokens == 8


def test_a_cut_answer_is_incomplete() -> None:
    events = events_of(decode(), ["abc"], FinishReason.LENGTH)
    final = Response.model_validate(events[-1][1]["response"])
    assert final.status == "incomplete" and final.incomplete_details is not None
    assert final.incomplete_details.reason == "max_output_tokens"
    assert final.output[0].status == "incomplete"


def test_an_empty_answer_is_an_empty_message() -> None:
    events = events_of(decode(), [""], FinishReason.STOP)
    final = Response.model_validate(events[-1][1]["response"])
    assert final.status == "completed" and final.output_text == ""
    assert [kind for kind, _ in events][2:] == [
        "response.output_item.added", "response.content_part.added",
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed",
    ]  # fmt: skip
