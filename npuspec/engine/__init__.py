"""The offline engine: `npuspec.LLM` and `npuspec.SamplingParams` (docs/engine.md).

Shaped like vLLM's offline API, so that the vLLM Ascend speculative decoding guide's examples
port directly:

    llm = LLM(model="tiny", speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    out = llm.generate(["def fib(n):"], SamplingParams(temperature=0, max_tokens=64))
    out[0].outputs[0].text, out[0].metrics.mean_acceptance_length

The package follows nano-vllm's engine layout; docs/engine.md ("Code layout") lists what each
module owns and how one step flows through them.
"""
from typing import Optional

from npuspec.engine.args import (
    COMPILATION_KEYS, CUDAGRAPH_MODES, DEFAULT_MAX_MODEL_LEN, DEFAULT_MAX_NUM_SEQS, DTYPES,
    ENGINE_METHODS)
from npuspec.engine.llm import LLM
from npuspec.engine.metrics import EngineMetrics, RequestMetrics
from npuspec.engine.model_runner import ModelRunner
from npuspec.engine.request import CompletionOutput, Request, RequestOutput
from npuspec.engine.sampling import SamplingParams
from npuspec.engine.scheduler import Scheduler, fill_drafts, pad_rows
from npuspec.engine.step import VerifyStep, fresh_step_fn

# The step's lowering when compilation_config names no backend; None: the backend's platform
# default (Inductor on CPU). Each LLM(...) call reads it from this package
# (args.parse_compilation), so setting it here takes effect: tests set "eager" to skip
# Inductor's C++ build.
DEFAULT_LOWERING: Optional[str] = None

__all__ = [
    "LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics",
    "EngineMetrics", "ENGINE_METHODS", "CUDAGRAPH_MODES", "COMPILATION_KEYS", "DTYPES",
    "DEFAULT_MAX_NUM_SEQS", "DEFAULT_MAX_MODEL_LEN", "DEFAULT_LOWERING", "ModelRunner",
    "Request", "Scheduler", "pad_rows", "fill_drafts", "VerifyStep", "fresh_step_fn",
]
