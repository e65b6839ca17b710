"""vLLM's end-to-end speculative-decoding checks, restated for `npuspec.LLM` on the embedded model.

Sources (vllm-project/vllm):
  tests/v1/e2e/test_spec_decode.py (also tests/v1/e2e/spec_decode/ngram_suffix/
    test_ngram_suffix.py): test_ngram_and_suffix_correctness, test_suffix_decoding_acceptance,
    test_draft_model_correctness (its two cases: the target drafting for itself under greedy
    sampling, and stochastic sampling);
  tests/v1/spec_decode/test_max_len.py: test_ngram_max_len.

vLLM runs 8B checkpoints on a GPU, compares texts and accepts 66 % of prompts matching. Here the
0.9 M-parameter embedded model ("tiny") runs uncompiled (`enforce_eager=True`, as vLLM's max-len
test does "for faster initialization") and speculative greedy output must equal plain greedy
output for every prompt, token for token (docs/engine.md, "Differences from vLLM's / HF's
tests"). The prompts follow vLLM's recipe (a seeded mix of "repeat this word" prompts that n-gram
matching predicts easily and "write a sentence" prompts that it mostly does not), in this
suite's own words; `max_tokens=10` as in vLLM's greedy setting.
"""
import random

import pytest

from npuspec import LLM, SamplingParams
from npuspec.models import TINY_MODEL_DIR

MAX_LEN = 128
GREEDY = SamplingParams(temperature=0.0, max_tokens=10)


def mixed_prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = ["test", "temp", "hello", "where"]
    out = []
    for _ in range(n):
        w = rng.choice(words)
        if rng.random() < 0.5:
            out.append(f"say '{w}' ten times, nothing else: {w} {w} {w}")
        else:
            out.append(f"one short sentence with the word {w} in it:\n")
    return out


PROMPTS = mixed_prompts(12)


def engine(spec=None, **kw):
    args = dict(enforce_eager=True, max_model_len=MAX_LEN, max_num_seqs=4)
    args.update(kw)
    return LLM("tiny", speculative_config=spec, **args)


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def plain():
    return engine()


@pytest.fixture(scope="module")
def reference(plain):
    return plain.generate(PROMPTS, GREEDY)


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "prompt_lookup_max": 5, "prompt_lookup_min": 3,
     "num_speculative_tokens": 3},
    {"method": "suffix", "suffix_decoding_max_spec_factor": 2.0},
], ids=["ngram", "suffix"])
def test_ngram_and_suffix_correctness(reference, spec):
    llm = engine(spec)
    out = llm.generate(PROMPTS, GREEDY)
    assert token_ids(out) == token_ids(reference)
    assert [o.outputs[0].text for o in out] == [o.outputs[0].text for o in reference]
    assert llm.metrics.num_drafted > 0  # speculation did run


def test_suffix_decoding_acceptance():
    # the same prompts again and again: the global tree of earlier responses makes the later
    # runs draft (and get accepted) much more than the first (vLLM: 10 runs, here 4).
    # 24 tokens instead of 10: the responses to the different "say 'X' ten times" prompts share
    # their first tokens, so over 10 tokens the globally most frequent continuation is often
    # another prompt's and the last run's rate stays near 0.75; over 24 it is 0.90.
    sp = SamplingParams(temperature=0.0, max_tokens=24)
    llm = engine({"method": "suffix", "suffix_decoding_max_spec_factor": 2.0,
                  "suffix_decoding_max_cached_requests": 1000})
    runs = []
    for _ in range(4):
        out = llm.generate(PROMPTS, sp)
        m = llm.metrics  # the last generate() call's counts (vLLM's counters are cumulative)
        runs.append((m.num_accepted, m.num_drafted, token_ids(out)))
    (acc0, drafted0, first), (acc1, drafted1, last) = runs[0], runs[-1]
    assert drafted0 > 0 and drafted1 > 0
    assert acc0 < acc1
    assert acc0 / drafted0 < acc1 / drafted1
    assert acc1 / drafted1 > 0.80
    assert first == last  # and the output never changes


def _acceptance(llm):
    """vLLM's two figures: accepted / drafted, and 1 + accepted per request-step that drafted.
    npuspec's `mean_acceptance_length` divides by every request-step; a draft model drafts at
    every step, so the two agree here."""
    m = llm.metrics
    assert m.drafted_by_position[0] == m.num_steps  # every request-step drafted
    return m.acceptance_rate, m.mean_acceptance_length


def test_draft_model_correctness_same_model_greedy(plain):
    # vLLM's first case: draft == target, greedy, K = 3: every draft is accepted, K + 1 tokens
    # per step. max_tokens is a multiple of K + 1 so no step is cut short by the budget.
    k = 3
    sp = SamplingParams(temperature=0.0, max_tokens=4 * (k + 1), ignore_eos=True)
    llm = engine({"method": "draft_model", "model": TINY_MODEL_DIR, "num_speculative_tokens": k})
    out = llm.generate(PROMPTS, sp)
    rate, length = _acceptance(llm)
    assert rate == 1.0
    assert length == k + 1
    assert token_ids(out) == token_ids(plain.generate(PROMPTS, sp))


def test_draft_model_correctness_stochastic():
    # vLLM's second case samples at temperature 1 with a smaller draft and expects an acceptance
    # rate >= 0.9 and length >= 3.8. The embedded model has no smaller sibling, so it drafts for
    # itself: q equals p up to rounding and nearly every draft passes p/q >= u.
    k = 3
    sp = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=0)
    llm = engine({"method": "draft_model", "model": TINY_MODEL_DIR, "num_speculative_tokens": k})
    out = llm.generate(PROMPTS, sp)
    rate, length = _acceptance(llm)
    assert rate >= 0.9
    assert length >= 2.8 + 1
    assert all(len(t) == 12 for t in token_ids(out))
    # seeded requests repeat exactly
    assert token_ids(llm.generate(PROMPTS, sp)) == token_ids(out)


def test_draft_model_named_like_the_target():
    # vLLM's "draft == target" case names one checkpoint for both; here the embedded model's
    # name, which LLM(model="tiny") accepts for the target
    llm = engine({"method": "draft_model", "model": "tiny", "num_speculative_tokens": 2})
    out = llm.generate(PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=6))
    assert llm.metrics.num_accepted == llm.metrics.num_drafted > 0
    assert all(len(t) == 6 or t[-1] == 0 for t in token_ids(out))


MAX_LEN_PROMPTS = [
    "1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1",
    "Repeat the following sentence 10 times: Consistency is key to mastering any skill.",
    "Who won the Turing Award in 2018, and for what contribution? Describe in detail.",
]


@pytest.fixture(scope="module")
def max_len_reference(plain):
    # plain greedy tokens up to a 100-token model length, from the module's engine (greedy
    # tokens do not depend on max_model_len, only where they are cut)
    ids = [plain.new_request(p, GREEDY).prompt_ids for p in MAX_LEN_PROMPTS]
    sps = [SamplingParams(temperature=0.0, max_tokens=100 - len(i), ignore_eos=True)
           for i in ids]
    return token_ids(plain.generate(MAX_LEN_PROMPTS, sps))


@pytest.mark.parametrize("k", [1, 3, 10])
def test_ngram_max_len(max_len_reference, k):
    # vLLM only checks that generation survives max_tokens > max_model_len; here the output also
    # stops at exactly max_model_len with finish_reason "length" and equals plain greedy decoding
    llm = engine({"method": "ngram", "prompt_lookup_max": 5, "prompt_lookup_min": 3,
                  "num_speculative_tokens": k}, max_model_len=100)
    out = llm.generate(MAX_LEN_PROMPTS, SamplingParams(temperature=0.0, max_tokens=100,
                                                       ignore_eos=True))
    for o in out:
        assert o.outputs[0].finish_reason == "length"
        assert len(o.prompt_token_ids) + len(o.outputs[0].token_ids) == 100
    assert token_ids(out) == max_len_reference
    assert llm.metrics.num_accepted > 0  # the "1 1 1 ..." prompt is easy to draft
