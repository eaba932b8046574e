"""Fuzzing: schemathesis against the served OpenAPI document, hypothesis on the decoders.

Whatever arrives, the answer is never a 5xx and never a hang. Each schemathesis case is also sent
with one value made non-finite (`NaN`, `Infinity`), which schemathesis' valid JSON never holds:
that is a 4xx naming it.
"""

from __future__ import annotations

import copy
import json
import math
from typing import Any

import httpx
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kserve import InferInput, InferRequest
from schemathesis.checks import not_a_server_error

from predictor.errors import InvalidRequest
from predictor.protocols import generate as oip
from predictor.protocols.limits import Limits
from predictor.protocols.triton.requests import decode_infer_request
from tests.support import ServerProcess

ROUTES = r"/v2/models/\{model_name\}/(generate|generate_stream|infer_stream|infer)$"

# schemathesis sends valid JSON only: each case also goes out with one value made non-finite
NON_FINITE = st.sampled_from([math.nan, math.inf, -math.inf])


def leaves(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[tuple[Any, ...], Any]]:
    """(path, value) of every scalar in a JSON value, the value itself if it is one."""
    if isinstance(value, dict):
        return [leaf for key, item in value.items() for leaf in leaves(item, (*path, key))]
    if isinstance(value, list):
        return [leaf for i, item in enumerate(value) for leaf in leaves(item, (*path, i))]
    return [(path, value)]


def with_non_finite(data: st.DataObject, body: Any) -> str:
    """`body` as Python's json writes it (`NaN`, `Infinity`, `-Infinity`) with one value replaced
    by a non-finite number: one of its numbers if it has any, else any value; an empty object or
    array gets one more member."""
    number = data.draw(NON_FINITE, label="non-finite")
    scalars = leaves(body)
    numbers = [p for p, v in scalars if isinstance(v, int | float) and not isinstance(v, bool)]
    if numbers or scalars:
        path = data.draw(st.sampled_from(numbers or [p for p, _ in scalars]), label="path")
        if not path:
            return json.dumps(number)
        body = copy.deepcopy(body)
        container = body
        for key in path[:-1]:
            container = container[key]
        container[path[-1]] = number
    elif isinstance(body, dict):
        body = {**body, "max_tokens": number}
    else:
        body = [*body, number]
    return json.dumps(body)


def post_non_finite(
    http: httpx.Client, case: schemathesis.Case, data: st.DataObject, openai: bool
) -> None:
    """POST the case's body with a non-finite number: a 4xx naming it, in the route's error shape
    (OpenAI's `{"error": {"message", "type", ...}}` on OpenAI routes, else `{"error": "..."}`).
    One client for all of a test's cases: a client's TLS context alone costs ~20 ms of CPU."""
    request = case.as_transport_kwargs()
    response = http.request(
        request["method"],
        request["url"],
        params=request["params"],
        headers={"Content-Type": "application/json"},
        content=with_non_finite(data, request["json"]),
        timeout=60,
    )
    assert 400 <= response.status_code < 500, (response.status_code, response.text)
    error = response.json()["error"]
    message = error["message"] if openai else error
    assert isinstance(message, str) and "non-finite" in message, response.text
    if openai:
        assert error["type"] == "invalid_request_error", response.text


def test_routes_never_answer_5xx(server: ServerProcess) -> None:
    # schemathesis' pytest plugin does not run under pytest 9 yet: drive its strategies here
    schema = schemathesis.openapi.from_url(f"{server.base_url}/openapi.json").include(
        path_regex=ROUTES
    )
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path.rsplit("/", 1)[1] for op in operations} == {
        "generate",
        "generate_stream",
        "infer_stream",
        "infer",
    }
    with httpx.Client(timeout=60) as http:  # one TLS context (~20 ms of CPU) for all cases
        for operation in operations:

            @given(case=operation.as_strategy(), data=st.data())
            @settings(
                max_examples=40,
                deadline=None,
                derandomize=True,
                suppress_health_check=list(HealthCheck),
            )
            def check(case: schemathesis.Case, data: st.DataObject) -> None:
                if case.path_parameters is not None:
                    case.path_parameters["model_name"] = "tiny"  # reach the body checks, not 404s
                if case.query:  # KServe's own /infer answers 501 to any ?model_version: not ours
                    case.query.pop("model_version", None)
                if isinstance(case.body, dict) and isinstance(case.body.get("parameters"), dict):
                    case.body["parameters"].setdefault("max_tokens", 4)
                response = case.call(timeout=60)
                case.validate_response(response, checks=[not_a_server_error])
                post_non_finite(http, case, data, openai=False)

            check()


def test_openapi_describes_the_generate_routes(server: ServerProcess) -> None:
    import httpx

    paths = httpx.get(f"{server.base_url}/openapi.json", timeout=10).json()["paths"]
    for route in ("generate", "generate_stream", "infer_stream"):
        body = paths[f"/v2/models/{{model_name}}/{route}"]["post"]["requestBody"]
        assert body["content"]["application/json"]["schema"]["type"] == "object"


# any code point, lone surrogates included, and a few chosen ones; floats with NaN and infinities
any_text = st.text(st.characters(exclude_categories=()), max_size=20) | st.sampled_from(
    ["\ud800", "a\udfffb", "\udbff\udbff"]
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | any_text,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=10,
)
parameter_names = st.sampled_from(
    ["max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "chat", "timeout", "x"]
)


@given(
    body=st.dictionaries(
        st.sampled_from(["id", "text_input", "parameters", "other"]),
        json_values | st.dictionaries(parameter_names, json_values),
    )
)
@settings(max_examples=300, deadline=None, derandomize=True)
def test_generate_codec_accepts_or_says_why(body: dict) -> None:
    try:
        request, _ = oip.decode_generate_request(body, Limits(16, 32), streaming=False)
    except InvalidRequest as exc:
        assert str(exc)
        return
    assert request.prompt and request.params.max_tokens >= 1


@given(
    data=st.lists(st.binary(max_size=12) | any_text, max_size=3),
    params=st.dictionaries(parameter_names, json_values, max_size=4),
    datatype=st.sampled_from(["BYTES", "INT32", "FP32"]),
)
@settings(max_examples=300, deadline=None, derandomize=True)
def test_infer_codec_accepts_or_says_why(data: list, params: dict, datatype: str) -> None:
    inp = InferInput(name="text_input", shape=[len(data)], datatype=datatype, data=data)
    try:
        request = InferRequest("m", [inp], "r", parameters=params)
        requests = decode_infer_request(request, Limits(16, 32), streaming=False).requests
    except InvalidRequest as exc:
        assert str(exc)
        return
    assert len(requests) == len(data) and all(r.prompt for r in requests)
