"""The OIP generate body with Triton's conventions: top-level keys, stop_words, bad_words."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from predictor.errors import InvalidRequest
from predictor.protocols import generate as oip
from predictor.protocols.limits import Limits, check_plain

LIMITS = Limits(default_max_tokens=64, max_json_depth=32)


def generate(body: dict[str, Any], streaming: bool = False) -> tuple[Any, bool]:
    return oip.decode_generate_request(body, LIMITS, streaming)


def test_generate_top_level_sampling_keys() -> None:
    req, stream = generate(
        {"text_input": "hi", "max_tokens": 20, "temperature": 0.5, "top_p": 0.9, "top_k": 4,
         "seed": 3, "stop": ["x"], "ignore_eos": True, "min_tokens": 2,
         "parameters": {"chat": True}}
    )  # fmt: skip
    p = req.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed, p.stop) == (
        20, 0.5, 0.9, 4, 3, ("x",),
    )  # fmt: skip
    assert p.ignore_eos and p.min_tokens == 2 and req.chat and stream is False


def test_generate_parameters_object_still_works() -> None:
    req, _ = generate({"text_input": "hi", "parameters": {"max_tokens": 7, "anything": 1}})
    assert req.params.max_tokens == 7


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"text_input": "hi", "max_tokens": 5, "parameters": {"max_tokens": 5}}, "ambiguous"),
        ({"text_input": "hi", "max_token": 5}, "unknown key 'max_token'"),
        ({"text_input": "hi", "stop": ["a"], "stop_words": ["b"]}, "ambiguous"),
        ({"text_input": "hi", "bad_words": ["no"]}, "bad_words"),
        ({"text_input": "hi", "stream": True}, "generate_stream"),
        ({"text_input": "hi", "stream": "yes"}, "'stream' must be a boolean"),
        ({"text_input": "hi", "max_tokens": "5"}, "max_tokens"),
    ],
)
def test_generate_refusals_name_the_key(body: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        generate(body)


def test_generate_tensorrt_llm_example_body() -> None:
    # Triton's TensorRT-LLM example: {"text_input", "max_tokens", "bad_words": "", "stop_words": ""}
    req, _ = generate({"text_input": "hi", "max_tokens": 20, "bad_words": "", "stop_words": ""})
    assert req.params.max_tokens == 20 and req.params.stop == ()
    req, _ = generate({"text_input": "hi", "stop_words": ["\n", ""]})
    assert req.params.stop == ("\n",)


def test_generate_stream_flag_on_the_streaming_route() -> None:
    assert generate({"text_input": "hi"}, streaming=True)[1] is True
    assert generate({"text_input": "hi", "stream": False}, streaming=True)[1] is False


# -- fuzz: whatever arrives is accepted or refused with a reason ---------------------------------

any_text = st.text(st.characters(exclude_categories=()), max_size=12)  # lone surrogates too
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | any_text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=3),
    max_leaves=8,
)  # fmt: skip
keys = st.sampled_from([*oip.top_level_keys(), "id", "text_input", "parameters", "other"])


@given(body=st.dictionaries(keys, json_values), streaming=st.booleans())
@settings(max_examples=300, deadline=None, derandomize=True)
def test_generate_fuzz(body: dict[str, Any], streaming: bool) -> None:
    try:
        check_plain(body, 32)  # what the REST edge (serving/rest/body.py) does first
        request, stream = oip.decode_generate_request(body, Limits(16, 32), streaming)
    except InvalidRequest as exc:
        assert str(exc)
        return
    assert request.prompt and request.params.max_tokens >= 1 and isinstance(stream, bool)
    accepted_is_clean(request)


def accepted_is_clean(request: Any) -> None:
    """What the edge and the decoder let through is finite and valid Unicode."""
    request.prompt.encode()
    for s in request.params.stop:
        s.encode()
    p = request.params
    assert all(math.isfinite(x) for x in (p.temperature, p.top_p, request.timeout or 0.0))
