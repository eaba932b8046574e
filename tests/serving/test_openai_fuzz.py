"""schemathesis on the OpenAI routes of the served OpenAPI document: never a 5xx, never a hang;
each body also sent with a non-finite number, which is a 400 in OpenAI's error shape."""

from __future__ import annotations

import httpx
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error

from tests.serving.test_fuzz import post_non_finite
from tests.support import ServerProcess

ROUTES = r"^/(openai/)?v1/(completions|chat/completions|models)$"


def test_openai_routes_never_answer_5xx(server: ServerProcess) -> None:
    schema = schemathesis.openapi.from_url(f"{server.base_url}/openapi.json").include(
        path_regex=ROUTES
    )
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {(op.method.upper(), op.path) for op in operations} == {
        (method, f"{prefix}/{route}")
        for prefix in ("/v1", "/openai/v1")
        for method, route in (
            ("POST", "completions"),
            ("POST", "chat/completions"),
            ("GET", "models"),
        )
    }
    with httpx.Client(timeout=60) as http:  # one TLS context (~20 ms of CPU) for all cases
        for operation in operations:

            @given(case=operation.as_strategy(), data=st.data())
            @settings(
                max_examples=25,
                deadline=None,
                derandomize=True,
                suppress_health_check=list(HealthCheck),
            )
            def check(case: schemathesis.Case, data: st.DataObject) -> None:
                if isinstance(case.body, dict):
                    case.body["model"] = "tiny"  # reach the body checks, not 404s
                    # keep the tiny model's work small: a few tokens, few choices
                    case.body["max_tokens"] = min(case.body.get("max_tokens") or 4, 4)
                    case.body.pop("max_completion_tokens", None)
                    case.body["n"] = min(case.body.get("n") or 1, 2)
                response = case.call(timeout=60)
                case.validate_response(response, checks=[not_a_server_error])
                if case.method.upper() == "POST":
                    post_non_finite(http, case, data, openai=True)

            check()


def test_responses_route_never_answers_5xx(server: ServerProcess) -> None:
    """The Responses API's body, fuzzed from its OpenAPI description alike."""
    schema = schemathesis.openapi.from_url(f"{server.base_url}/openapi.json").include(
        path_regex=r"^/(openai/)?v1/responses$"
    )
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} == {"/v1/responses", "/openai/v1/responses"}
    with httpx.Client(timeout=60) as http:
        for operation in operations:

            @given(case=operation.as_strategy(), data=st.data())
            @settings(
                max_examples=25,
                deadline=None,
                derandomize=True,
                suppress_health_check=list(HealthCheck),
            )
            def check(case: schemathesis.Case, data: st.DataObject) -> None:
                if isinstance(case.body, dict):
                    case.body["model"] = "tiny"
                    tokens = case.body.get("max_output_tokens")
                    case.body["max_output_tokens"] = min(tokens or 4, 4)
                response = case.call(timeout=60)
                case.validate_response(response, checks=[not_a_server_error])
                post_non_finite(http, case, data, openai=True)

            check()
