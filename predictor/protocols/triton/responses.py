"""V2 responses in the Triton vLLM backend's shape: `text_output`, its optional outputs
(finish_reason, num_input_tokens, num_output_tokens), the prompt in front when asked, one whole
response when `stream` is false. The requests' side is `protocols/triton/requests.py`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import numpy as np
from kserve import InferOutput, InferRequest, InferResponse

from predictor.protocols.triton.requests import V2Request
from predictor.protocols.triton.tensors import FINISH_REASON, NUM_INPUT_TOKENS, NUM_OUTPUT_TOKENS
from predictor.protocols.v2 import TEXT_OUTPUT, details, text_response, usage_parameters
from predictor.types import Completion, FinishReason, TokenEvent

# the vLLM backend reports vLLM's finish reasons ("None" until the last response)
_VLLM_FINISH = {
    FinishReason.EOS: "stop",
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.CANCELLED: "abort",
}


def _finish(reason: FinishReason | None) -> str:
    return "None" if reason is None else _VLLM_FINISH.get(reason, reason.value)


def with_prompt(decoded: V2Request, completions: list[Completion]) -> list[Completion]:
    if not decoded.include_prompt:
        return completions
    prompts = {r.request_id: r.prompt for r in decoded.requests}
    return [replace(c, text=prompts[c.request_id] + c.text) for c in completions]


def encode_infer_response(
    request: InferRequest, model_name: str, decoded: V2Request, completions: list[Completion]
) -> InferResponse:
    """One answer for every prompt: text_output and the optional outputs asked for."""
    completions = with_prompt(decoded, completions)
    texts = [c.text for c in completions]
    response = text_response(
        request, model_name, completions[0].request_id, texts, usage_parameters(completions)
    )
    columns: dict[str, list[Any]] = {
        FINISH_REASON: [_finish(c.finish_reason) for c in completions],
        NUM_INPUT_TOKENS: [c.usage.prompt_tokens for c in completions],
        NUM_OUTPUT_TOKENS: [c.usage.generated_tokens for c in completions],
    }
    return _select(request, response, decoded.outputs, columns)


def whole_event(decoded: V2Request, completion: Completion) -> TokenEvent:
    """A non-streamed answer on a streaming route, as one final event."""
    (completion,) = with_prompt(decoded, [completion])
    return TokenEvent(
        completion.request_id, completion.text, (), completion.finish_reason, completion.usage
    )


def encode_stream_response(
    request: InferRequest, model_name: str, decoded: V2Request, event: TokenEvent
) -> InferResponse:
    """One streamed response: the new text, and the optional outputs asked for.

    num_output_tokens counts this response's tokens (all of them for a whole answer);
    num_input_tokens is known once the request ends, so it rides on the last response.
    """
    usage = None
    if event.final and event.finish_reason is not None and event.usage is not None:
        usage = details(event.finish_reason, event.usage)
    response = text_response(request, model_name, event.request_id, [event.text], usage)
    whole = not decoded.stream
    generated = event.usage.generated_tokens if whole and event.usage else len(event.token_ids)
    columns: dict[str, list[Any]] = {
        FINISH_REASON: [_finish(event.finish_reason)],
        NUM_OUTPUT_TOKENS: [generated],
    }
    if event.usage is not None:
        columns[NUM_INPUT_TOKENS] = [event.usage.prompt_tokens]
    return _select(request, response, decoded.outputs, columns)


def wants_every_token(decoded: V2Request) -> bool:
    """Token counts per response must add up: send events whose text is still held back too."""
    return NUM_OUTPUT_TOKENS in decoded.outputs


def _select(
    request: InferRequest,
    response: InferResponse,
    names: tuple[str, ...],
    columns: Mapping[str, list[Any]],
) -> InferResponse:
    (text,) = response.outputs
    outputs = []
    for name in names:
        if name == TEXT_OUTPUT:
            outputs.append(text)
        elif name in columns:
            outputs.append(_output(request, name, columns[name]))
    response.outputs = outputs
    return response


def _output(request: InferRequest, name: str, values: list[Any]) -> InferOutput:
    datatype = "BYTES" if name == FINISH_REASON else "UINT32"
    output = InferOutput(name=name, shape=[len(values)], datatype=datatype)
    if request.from_grpc:  # raw contents, as the text output (see v2.text_response)
        if datatype == "BYTES":
            array = np.array([str(v).encode() for v in values], dtype=np.object_)
        else:
            array = np.array(values, dtype=np.uint32)
        output.set_data_from_numpy(array)
    else:
        output.data = values
    return output
