"""bf16 speculative greedy decoding emits exactly bf16 plain greedy decoding's tokens.

The projections give a row the same values whatever the row count (kernels/linear_packed_cpu.py)
and the CPU attention kernel is batch-invariant for decode and verify calls
(kernels/paged_attention_cpu.py, tests/kernels/test_paged_attention_invariance.py), so the
K+1-row verify step computes each row's logits bit for bit as the one-row decode step would.
In bf16 near-ties are common enough that any difference shows: before the attention kernel was
made invariant, these runs left plain decoding's tokens on some prompts.

All of it holds while the verify steps and the plain steps run the same kernel family in each
projection: below the GEMM hand-off (`linear_packed_cpu.gemm_min_rows`: 512 rows for bf16, 32
where the CPU has AMX tiles and the kernel was built without its AMX path), so these engines
run at most 27 rows a step; and, where the kernel runs AMX tiles, below AMX_MIN_ROWS (the tiles
round their sums their own way): cases whose steps reach it run here with the AMX path off."""
import contextlib

import pytest

from npuspec import LLM, SamplingParams
from npuspec.kernels import linear_packed_cpu as lp
from npuspec.kernels.linear_packed_cpu import AMX_BF16_GEMM_MIN_ROWS

PROMPTS = ["def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return a + b\n\n\ndef add(",
           "import os\nimport sys\n", "class Queue:\n    def", "for i in range(10):",
           "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [", "The quick brown fox"]
SP = SamplingParams(temperature=0, max_tokens=48)


def _tokens(llm):
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, SP)]


@contextlib.contextmanager
def _one_kernel_family(max_rows: int):
    """The AMX path off while the engines run steps of `max_rows` rows, if that reaches it."""
    with lp.amx_paused() if max_rows >= lp.AMX_MIN_ROWS else contextlib.nullcontext():
        yield


@pytest.mark.parametrize("seqs", [1, 3])
@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 4,
                                   "k_controller": "fixed"},
                                  {"method": "suffix", "num_speculative_tokens": 8,
                                   "k_controller": "fixed"}], ids=["ngram", "suffix"])
def test_bf16_speculative_greedy_equals_bf16_plain(spec, seqs):
    assert seqs * (spec["num_speculative_tokens"] + 1) < AMX_BF16_GEMM_MIN_ROWS
    kw = dict(dtype="bfloat16", enforce_eager=True, max_model_len=256, max_num_seqs=seqs)
    with _one_kernel_family(seqs * (spec["num_speculative_tokens"] + 1)):
        plain = _tokens(LLM("tiny", **kw))
        llm = LLM("tiny", speculative_config=spec, **kw)
        assert _tokens(llm) == plain
    assert llm.metrics.num_accepted > 0




def test_bf16_captured_speculative_greedy_equals_captured_plain():
    """The path users run: both engines compiled (the default lowering) and captured, the
    online K controller running verify graphs of several K. (This configuration happened to
    match with the old kernel too; the uncaptured cases above are the ones that did not.)"""
    kw = dict(dtype="bfloat16", max_model_len=256, max_num_seqs=1)   # <= 25 rows a step
    with _one_kernel_family(25):
        plain = _tokens(LLM("tiny", **kw))
        llm = LLM("tiny", speculative_config={"method": "suffix",
                                              "num_speculative_tokens": "auto"}, **kw)
        assert _tokens(llm) == plain
    assert llm.metrics.num_accepted > 0
    assert len([k for k in llm.metrics.steps_by_k if k]) >= 2, llm.metrics.steps_by_k
