"""bf16 speculative greedy decoding emits exactly bf16 plain greedy decoding's tokens.

The projections give a row the same values whatever the row count (kernels/linear_packed_cpu.py)
and the CPU attention kernel is batch-invariant for decode and verify calls
(kernels/paged_attention_cpu.py, tests/kernels/test_paged_attention_invariance.py), so the
K+1-row verify step computes each row's logits bit for bit as the one-row decode step would.
In bf16 near-ties are common enough that any difference shows: before the attention kernel was
made invariant, these runs left plain decoding's tokens on some prompts."""
import pytest

from npuspec import LLM, SamplingParams

PROMPTS = ["def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return a + b\n\n\ndef add(",
           "import os\nimport sys\n", "class Queue:\n    def", "for i in range(10):",
           "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [", "The quick brown fox"]
SP = SamplingParams(temperature=0, max_tokens=48)


def _tokens(llm):
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, SP)]


@pytest.mark.parametrize("seqs", [1, 3])
@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 4,
                                   "k_controller": "fixed"},
                                  {"method": "suffix", "num_speculative_tokens": 16,
                                   "k_controller": "fixed"}], ids=["ngram", "suffix"])
def test_bf16_speculative_greedy_equals_bf16_plain(spec, seqs):
    kw = dict(dtype="bfloat16", enforce_eager=True, max_model_len=256, max_num_seqs=seqs)
    plain = _tokens(LLM("tiny", **kw))
    llm = LLM("tiny", speculative_config=spec, **kw)
    assert _tokens(llm) == plain
    assert llm.metrics.num_accepted > 0




def test_bf16_captured_speculative_greedy_equals_captured_plain():
    """The path users run: both engines compiled (the default lowering) and captured, the
    online K controller running verify graphs of several K. (This configuration happened to
    match with the old kernel too; the uncaptured cases above are the ones that did not.)"""
    kw = dict(dtype="bfloat16", max_model_len=256, max_num_seqs=3)
    plain = _tokens(LLM("tiny", **kw))
    llm = LLM("tiny", speculative_config={"method": "suffix", "num_speculative_tokens": "auto"},
              **kw)
    assert _tokens(llm) == plain
    assert llm.metrics.num_accepted > 0
    assert len([k for k in llm.metrics.steps_by_k if k]) >= 2, llm.metrics.steps_by_k
