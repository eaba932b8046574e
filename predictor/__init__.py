"""gptq-predictor: a KServe predictor serving a GPTQ 4-bit LLM over a continuous-batching engine."""
