"""Anthropic Messages bodies -> the engine request chat completions would build for the same
conversation; what is refused, by name."""

from __future__ import annotations

import json
from typing import Any

import pytest

from predictor.errors import InvalidRequest
from predictor.protocols import parameters
from predictor.protocols.anthropic.requests import THINKING_SERVED, decode_messages
from predictor.protocols.openai.requests import decode_chat

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
BODY: dict[str, Any] = {
    "model": "m",
    "max_tokens": 10,
    "messages": [{"role": "user", "content": "Weather in Paris?"}],
}


def test_the_sampling_fields_are_the_tables_rows() -> None:
    assert parameters.names("anthropic") == (
        "max_tokens", "temperature", "top_p", "top_k", "stop_sequences",
    )  # fmt: skip
    request = decode_messages(
        {**BODY, "temperature": 0.5, "top_p": 0.9, "top_k": 7, "stop_sequences": ["X", "Y"]}, 64
    ).request
    params = request.params
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k) == (10, 0.5, 0.9, 7)
    assert params.stop == ("X", "Y")
    assert decode_messages(BODY, 64).request.params.temperature == 1.0  # Anthropic's default


def test_a_conversation_with_tools_is_the_chat_request() -> None:
    """The same conversation through both APIs: the same turns, tools and grammar."""
    anthropic_body = {
        **BODY,
        "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hm", "signature": "s"},
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"},
                {"type": "text", "text": "And tomorrow?"},
            ]},
        ],
        "tools": [{"name": "weather", "description": "d", "input_schema": SCHEMA}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
    }  # fmt: skip
    chat_body = {
        "model": "m", "max_tokens": 10, "temperature": 1.0,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "Let me look.", "tool_calls": [
                {"id": "toolu_1", "type": "function",
                 "function": {"name": "weather", "arguments": json.dumps({"city": "Paris"})}},
            ]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C"},
            {"role": "user", "content": "And tomorrow?"},
        ],
        "tools": [{"type": "function", "function": {
            "name": "weather", "description": "d", "parameters": SCHEMA}}],
        "tool_choice": "required", "parallel_tool_calls": False,
    }  # fmt: skip
    ours = decode_messages(anthropic_body, 64)
    (chat,) = decode_chat(chat_body, 64).choices
    assert ours.tools and ours.id.startswith("msg_")
    assert ours.request.messages == chat.messages
    assert ours.request.tools == chat.tools
    assert ours.request.params == chat.params


@pytest.mark.parametrize(
    ("choice", "wanted"),
    [
        ({"type": "auto"}, '"type": "triggered_tags"'),
        ({"type": "any"}, '"type": "tags_with_separator"'),
        ({"type": "tool", "name": "weather"}, '"type": "tag"'),
    ],
)
def test_tool_choice_maps_onto_chats(choice: dict[str, Any], wanted: str) -> None:
    tools = [{"name": "weather", "input_schema": SCHEMA}]
    request = decode_messages({**BODY, "tools": tools, "tool_choice": choice}, 64).request
    assert request.params.grammar is not None and wanted in request.params.grammar.text
    none = decode_messages({**BODY, "tools": tools, "tool_choice": {"type": "none"}}, 64)
    assert none.request.tools is None and none.request.params.grammar is None


def test_an_error_result_says_so_and_metadata_names_the_tenant() -> None:
    body = {
        **BODY,
        "metadata": {"user_id": "team-a"},
        "messages": [
            {"role": "user", "content": "Go"},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
             "is_error": True, "content": [{"type": "text", "text": "boom"}]}]},
        ],
    }  # fmt: skip
    request = decode_messages(body, 64).request
    assert request.tenant == "team-a"
    assert request.messages is not None
    assert request.messages[-1] == {"role": "tool", "content": "Error: boom", "tool_call_id": "t1"}


def test_output_config_format_is_chats_json_schema_grammar() -> None:
    config = {"format": {"type": "json_schema", "schema": SCHEMA}}
    grammar = decode_messages({**BODY, "output_config": config}, 64).request.params.grammar
    assert grammar is not None and grammar.kind == "json_schema"
    assert json.loads(grammar.text) == SCHEMA and grammar.param == "output_config.format"
    with pytest.raises(InvalidRequest) as info:
        decode_messages(
            {**BODY, "output_config": config, "tools": [{"name": "f", "input_schema": {}}]}, 64
        )
    assert info.value.param == "output_config.format"


def test_count_tokens_needs_no_max_tokens() -> None:
    body = {k: v for k, v in BODY.items() if k != "max_tokens"}
    assert decode_messages(body, 64, counting=True).request.messages
    with pytest.raises(InvalidRequest, match="'max_tokens' is required"):
        decode_messages(body, 64)


def test_thinking_maps_onto_the_models_reasoning() -> None:
    assert set(THINKING_SERVED) == {"enabled", "disabled", "adaptive"}
    off = decode_messages({**BODY, "thinking": {"type": "disabled"}}, 64).request
    assert off.chat_template_kwargs == {"enable_thinking": False} and off.thinking_budget is None
    on = decode_messages({**BODY, "thinking": {"type": "enabled", "budget_tokens": 1024}}, 64)
    assert on.request.thinking_budget == 1024 and on.request.chat_template_kwargs is None
    free = decode_messages({**BODY, "thinking": {"type": "adaptive"}}, 64).request
    assert free.thinking_budget is None and free.chat_template_kwargs is None


def test_only_thinking_enabled_asks_the_model_to_think() -> None:
    """Named for the route's check (limits.check_thinking: a 400 on a model that does not
    think); disabled and adaptive (the model decides) are served by any model."""
    assert decode_messages(BODY, 64).asks_thinking is None
    for kind in ("disabled", "adaptive"):
        assert decode_messages({**BODY, "thinking": {"type": kind}}, 64).asks_thinking is None
    for counting in (False, True):
        enabled = {**BODY, "thinking": {"type": "enabled", "budget_tokens": 0}}
        assert decode_messages(enabled, 64, counting).asks_thinking == "thinking"


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"thinking": {"type": "sometimes"}}, "thinking.type"),
        ({"thinking": {"type": "enabled", "budget_tokens": -1}}, "thinking.budget_tokens"),
        ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
        ({"thinking": {"type": "disabled", "budget_tokens": 5}}, "thinking.budget_tokens"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
        ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools[0].type"),
        ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
        ({"tool_choice": {"type": "any"}}, "tool_choice"),
        ({"tool_choice": {"type": "tool"}, "tools": [{"name": "f", "input_schema": {}}]},
         "tool_choice.name"),
        ({"container": "c"}, "container"),
        ({"output_config": {"effort": "low"}}, "output_config.effort"),
        ({"seed": 1}, "seed"),
        ({"top_k": -1}, "top_k"),
        ({"stop_sequences": [""]}, "stop_sequences"),
        ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
         "messages[0].content[0].type"),
        ({"messages": [{"role": "user", "content": [
            {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
         "messages[0].content[0]"),
        ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
         "messages[1]"),
        ({"messages": [{"role": "system", "content": "a"}]}, "messages[0].role"),
    ],
)  # fmt: skip
def test_what_is_not_served_is_refused_by_name(change: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        decode_messages({**BODY, **change}, 64)
    assert info.value.param == param, info.value
