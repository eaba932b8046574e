"""OpenAI request bodies -> engine requests: every field mapped, every refusal naming its field."""

from __future__ import annotations

from typing import Any

import pytest

from predictor.errors import InvalidRequest as InvalidField
from predictor.protocols.limits import Limits, check_thinking
from predictor.protocols.openai.requests import decode_chat, decode_completion
from predictor.protocols.schemas import CHAT_SCHEMA, COMPLETION_SCHEMA

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}


def test_completion_fields_reach_the_sampling_params() -> None:
    body = {
        "model": "m", "prompt": ["a", "b"], "n": 2, "max_tokens": 9, "temperature": 0.5,
        "top_p": 0.9, "stop": "\n", "seed": 7, "logprobs": 3, "presence_penalty": 0.5,
        "frequency_penalty": -0.5, "user": "u", "top_k": 5, "ignore_eos": True, "min_tokens": 2,
        "best_of": 2, "echo": False, "logit_bias": {}, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    request = decode_completion(body, default_max_tokens=16)
    assert request.kind == "completion" and request.id.startswith("cmpl-")
    assert request.n == 2 and request.stream and request.include_usage and request.logprobs
    assert [r.prompt for r in request.choices] == ["a", "a", "b", "b"]
    assert len({r.request_id for r in request.choices}) == 4
    assert [r.params.seed for r in request.choices] == [7, 8, 7, 8]  # choice j: seed + j
    p = request.choices[0].params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.stop) == (9, 0.5, 0.9, 5, ("\n",))
    assert (p.presence_penalty, p.frequency_penalty, p.logprobs) == (0.5, -0.5, 3)
    assert p.ignore_eos and p.min_tokens == 2
    assert not request.choices[0].chat and request.choices[0].messages is None


def test_defaults_follow_openai() -> None:
    request = decode_completion({"model": "m", "prompt": "x", "top_k": -1}, default_max_tokens=16)
    (choice,) = request.choices
    assert choice.params.temperature == 1.0 and choice.params.max_tokens == 16
    assert choice.params.top_k == 0 and choice.params.logprobs is None and not request.stream


def test_chat_messages_and_logprobs() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}],
        },
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    body = {"model": "m", "messages": messages, "max_completion_tokens": 5, "logprobs": True,
            "top_logprobs": 2, "n": 1, "temperature": 0}  # fmt: skip
    request = decode_chat(body, 16)
    (choice,) = request.choices
    assert request.kind == "chat" and request.id.startswith("chatcmpl-")
    assert choice.messages is not None and choice.messages[1] == {
        "role": "user",
        "content": "Hi\nthere",
    }
    assert [m["role"] for m in choice.messages] == ["system", "user", "assistant", "user"]
    assert choice.params.max_tokens == 5 and choice.params.logprobs == 2 and choice.params.greedy


def test_a_lone_user_message_also_takes_the_engines_chat_path() -> None:
    (choice,) = decode_chat(CHAT, 16).choices
    assert choice.chat and choice.prompt == "Hi"
    assert choice.messages == ({"role": "user", "content": "Hi"},)


def test_chat_logprobs_without_top() -> None:
    (choice,) = decode_chat(CHAT | {"logprobs": True}, 16).choices
    assert choice.params.logprobs == 0
    (choice,) = decode_chat(CHAT | {"logprobs": False}, 16).choices
    assert choice.params.logprobs is None


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}] * 2}, "tools"),
        ({"tools": [{"type": "custom", "function": {"name": "f"}}]}, "tools[0].type"),
        ({"tool_choice": "auto"}, "tool_choice"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "tool_choice.function.name",
        ),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "response_format": {"type": "json_object"},
            },
            "response_format",
        ),
        ({"messages": [{"role": "tool", "content": "4"}]}, "messages[0].tool_call_id"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, "messages[0]"),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "f", "arguments": "{"},
                            }
                        ],
                    }
                ]
            },
            "messages[0].tool_calls[0].function.arguments",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"logit_bias": {"1": 500}}, "logit_bias"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"max_tokens": 4, "max_completion_tokens": 5}, "max_tokens"),
        ({"min_tokens": 100, "max_tokens": 4}, "min_tokens"),
        ({"seed": -1}, "seed"),
        ({"stop": ["x"] * 17}, "stop"),
        ({"stop": ""}, "stop"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": 3}, "logprobs"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        (
            {"stream": True, "stream_options": {"continuous_usage_stats": True}},
            "stream_options.continuous_usage_stats",
        ),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": "x", "name": "bob"}]}, "messages[0].name"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content[0]",  # the list's part, not "should be a valid string"
        ),
        ({"repetition_penalty": 0}, "repetition_penalty"),  # must be positive
        ({"length_penalty": 1.1}, "length_penalty"),  # vLLM's beam search: not here
        ({"model": 5}, "model"),
        ({"audio": {"voice": "x"}}, "audio"),
    ],
)
def test_chat_refusals_name_the_field(change: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidField) as info:
        decode_chat(CHAT | change, 16)
    assert info.value.param == param and param.split("[")[0].split(".")[0] in str(info.value)


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"echo": 1}, "echo"),
        ({"max_tokens": 0}, "max_tokens"),  # only with echo
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"best_of": 3}, "best_of"),
        ({"suffix": "end"}, "suffix"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": [[1], []]}, "prompt"),
        ({"prompt": [-1]}, "prompt[0]"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"logprobs": True}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
    ],
)
def test_completion_refusals_name_the_field(change: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidField) as info:
        decode_completion({"model": "m", "prompt": "x"} | change, 16)
    assert info.value.param == param


def test_nulls_are_defaults_and_the_body_must_be_an_object() -> None:
    request = decode_chat(CHAT | {"tools": None, "logit_bias": None, "n": None, "x": None}, 16)
    assert request.n == 1
    with pytest.raises(InvalidField):
        decode_chat(["not", "an", "object"], 16)


def test_schemas_are_self_contained() -> None:
    for schema in (COMPLETION_SCHEMA, CHAT_SCHEMA):
        assert "$ref" not in str(schema) and "$defs" not in schema
        assert schema["additionalProperties"] is False
    assert CHAT_SCHEMA["properties"]["messages"]["items"]["properties"]["role"]["enum"]


def test_echo_asks_the_engine_to_score_the_prompt() -> None:
    body = {"model": "m", "prompt": "x", "echo": True, "logprobs": 3}
    request = decode_completion(body, 16)
    assert request.echo and request.prompt_logprobs is None
    assert all(c.echo and c.params.prompt_logprobs == 3 for c in request.choices)
    request = decode_completion(body | {"prompt_logprobs": 5, "max_tokens": 0}, 16)
    assert request.prompt_logprobs == 5 and request.choices[0].params.prompt_logprobs == 5
    assert request.choices[0].params.max_tokens == 0
    bare = decode_completion({"model": "m", "prompt": "x", "echo": True}, 16)
    assert bare.choices[0].params.prompt_logprobs is None  # echo without logprobs: text only
    chat = decode_chat(CHAT | {"prompt_logprobs": 2}, 16)
    assert chat.prompt_logprobs == 2 and chat.choices[0].params.prompt_logprobs == 2
    with pytest.raises(InvalidField) as info:
        decode_chat(CHAT | {"echo": True}, 16)  # vLLM's chat echo means something else
    assert info.value.param == "echo"


def test_fields_missing_side_by_side_are_named_not_looped() -> None:
    """Two top-level fields missing share no place: the message names both (the search for
    their shared field once looped forever there, holding the event loop)."""
    with pytest.raises(InvalidField) as caught:
        decode_chat({}, 16)
    assert "model: field required" in str(caught.value)
    assert "messages: field required" in str(caught.value)


def test_reasoning_fields_reach_the_engine_request() -> None:
    """chat_template_kwargs and thinking_token_budget (vLLM's), and an earlier answer's
    reasoning under either of vLLM's names, given to the template as reasoning_content."""
    turns = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello", "reasoning": "greet back"},
        {"role": "user", "content": "Bye"},
    ]
    body = {"model": "m", "messages": turns, "thinking_token_budget": 7,
            "chat_template_kwargs": {"enable_thinking": False}}  # fmt: skip
    (choice,) = decode_chat(body, 16).choices
    assert choice.thinking_budget == 7
    assert choice.chat_template_kwargs == {"enable_thinking": False}
    assert choice.messages is not None and choice.messages[1]["reasoning_content"] == "greet back"
    for bad, param in (
        ({"thinking_token_budget": -1}, "thinking_token_budget"),
        ({"messages": [{"role": "user", "content": "x", "reasoning_content": "r"}]},
         "messages[0].reasoning_content"),
        ({"reasoning_effort": "lots"}, "reasoning_effort"),
    ):  # fmt: skip
        with pytest.raises(InvalidField) as caught:
            decode_chat(body | bad, 16)
        assert caught.value.param == param


def test_reasoning_effort_none_turns_thinking_off() -> None:
    (off,) = decode_chat(CHAT | {"reasoning_effort": "none"}, 16).choices
    assert off.chat_template_kwargs == {"enable_thinking": False}
    (mine,) = decode_chat(
        CHAT | {"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}}, 16
    ).choices
    assert mine.chat_template_kwargs == {"enable_thinking": True}
    (low,) = decode_chat(CHAT | {"reasoning_effort": "low"}, 16).choices
    assert low.chat_template_kwargs is None


@pytest.mark.parametrize(
    ("extra", "asked"),
    [
        ({}, None),
        ({"reasoning_effort": "none"}, None),
        ({"reasoning_effort": "minimal"}, None),
        ({"chat_template_kwargs": {"enable_thinking": False, "x": 1}}, None),
        ({"thinking_token_budget": 0}, None),
        ({"reasoning_effort": "low"}, "reasoning_effort"),
        ({"reasoning_effort": "xhigh"}, "reasoning_effort"),
        ({"chat_template_kwargs": {"enable_thinking": True}}, "chat_template_kwargs.enable_thinking"),
        ({"thinking_token_budget": 1}, "thinking_token_budget"),
        ({"reasoning_effort": "high", "thinking_token_budget": 5}, "reasoning_effort"),
    ],
)  # fmt: skip
def test_the_field_asking_the_model_to_think_is_named(
    extra: dict[str, Any], asked: str | None
) -> None:
    """Named for the route's check (limits.check_thinking): a 400 on a model that does not
    think, the request as decoded on one that does."""
    decoded = decode_chat(CHAT | extra, 16)
    assert decoded.asks_thinking == asked
    assert decode_completion({"model": "m", "prompt": "Hi"}, 16).asks_thinking is None
    check_thinking(asked, Limits(16, 32, thinks=True))
    if asked is None:
        check_thinking(asked, Limits(16, 32))
        return
    with pytest.raises(InvalidField) as caught:
        check_thinking(asked, Limits(16, 32))
    assert caught.value.param == asked
    assert str(caught.value).startswith(f"'{asked}' asks the model to think")
