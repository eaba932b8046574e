"""The tensors a V2 request may carry and a response may hold, as the model configuration lists
them: `text_input` / `text_output`, the Triton vLLM backend's optional inputs and outputs, and
one-element input tensors named like parameters (the TensorRT-LLM backend's way), one for each
row of `protocols/parameters.py` that has a tensor datatype."""

from __future__ import annotations

from dataclasses import dataclass

from predictor.protocols import parameters
from predictor.protocols.v2 import TEXT_INPUT, TEXT_OUTPUT


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str  # V2 datatype
    dims: tuple[int, ...]
    optional: bool = True


SAMPLING_PARAMETERS = "sampling_parameters"
STREAM = "stream"
EXCLUDE_INPUT = "exclude_input_in_output"
FINISH_REASON, NUM_INPUT_TOKENS, NUM_OUTPUT_TOKENS = (
    "finish_reason",
    "num_input_tokens",
    "num_output_tokens",
)
RETURN_FLAGS = {
    f"return_{name}": name for name in (FINISH_REASON, NUM_INPUT_TOKENS, NUM_OUTPUT_TOKENS)
}
PARAMETER_TENSORS = parameters.tensor_rows()  # tensor name -> its parameter

INPUTS: tuple[TensorSpec, ...] = (
    TensorSpec(TEXT_INPUT, "BYTES", (-1,), optional=False),
    TensorSpec(STREAM, "BOOL", (1,)),
    TensorSpec(SAMPLING_PARAMETERS, "BYTES", (1,)),
    TensorSpec(EXCLUDE_INPUT, "BOOL", (1,)),
    *(TensorSpec(flag, "BOOL", (1,)) for flag in RETURN_FLAGS),
    *(
        TensorSpec(name, row.tensor, (-1,) if row.kind == "stop" else (1,))
        for name, row in PARAMETER_TENSORS.items()
        if row.tensor is not None
    ),
)
OUTPUTS: tuple[TensorSpec, ...] = (
    TensorSpec(TEXT_OUTPUT, "BYTES", (-1,), optional=False),
    TensorSpec(FINISH_REASON, "BYTES", (-1,)),
    TensorSpec(NUM_INPUT_TOKENS, "UINT32", (1,)),
    TensorSpec(NUM_OUTPUT_TOKENS, "UINT32", (-1,)),
)
INPUT_NAMES = frozenset(spec.name for spec in INPUTS)
OUTPUT_NAMES = frozenset(spec.name for spec in OUTPUTS)
INTEGER_TYPES = frozenset(
    {"INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32", "UINT64"}
)
FLOAT_TYPES = frozenset({"FP16", "FP32", "FP64"})
