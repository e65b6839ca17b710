"""vLLM v1's own rejection-sampler test cases, ported onto our transcription of its
`forward_native` (field_vllm.py) compiled with npuspec (one `rejection_sample` call).

The cases and the acceptance criterion are vLLM's (tests/v1/sample/test_rejection_sampler.py
of early 2025: the greedy cases with their expected outputs, and "rejection sampling
approximates the target distribution", whose sample sizes and 20x improvement margin we keep);
the code is ours. They check two things at once: that our transcription does what vLLM's
tests say vLLM does, and that the fused step still does it.
"""
from __future__ import annotations

import pytest
import torch
from field_vllm import vllm_v1_native_greedy, vllm_v1_native_random

import npuspec
from npuspec import counters

PAD = -1

# (draft tokens per request, the target's argmax per row incl. the bonus row, expected output)
GREEDY_CASES = [
    ([[1, 2, 3]], [[1, 2, 3, 4]], [[1, 2, 3, 4]]),                          # perfect match
    ([[1, 2, 3]], [[1, 5, 3, 4]], [[1, 5, PAD, PAD]]),                      # early mismatch
    ([[1, 2], [3]], [[1, 2, 5], [3, 4]], [[1, 2, 5], [3, 4, PAD]]),         # two requests
    ([[1]], [[1, 2]], [[1, 2]]),                                            # one draft
    ([[1, 2, 3], [4, 5, 6]], [[1, 2, 7, 6], [4, 8, 6, 9]],
     [[1, 2, 7, PAD], [4, 8, PAD, PAD]]),                                   # both mismatch
    ([[1, 2]], [[1, 2, 3]], [[1, 2, 3]]),
    ([[1]], [[2, 3]], [[2, PAD]]),                                          # first mismatch
    ([[1, 2], [3, 4]], [[1, 5, 6], [3, 4, 7]], [[1, 5, PAD], [3, 4, 7]]),   # mixed
]


def _padded(spec, targets, vocab=100):
    """Drafts [B, K] (-1 padded) and logits [B, K+1, V] whose argmax per row is the target
    token (-100 everywhere, 100 there; padded rows all -100), as vLLM's test builds them."""
    b, k = len(spec), max(len(s) for s in spec)
    drafts = torch.full((b, k), PAD, dtype=torch.int64)
    logits = torch.full((b, k + 1, vocab), -100.0)
    for i, (s, t) in enumerate(zip(spec, targets)):
        drafts[i, :len(s)] = torch.tensor(s)
        for j, tok in enumerate(t):
            logits[i, j, tok] = 100.0
    return drafts, logits


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
@pytest.mark.parametrize("case", range(len(GREEDY_CASES)))
def test_greedy_cases(case, lowering, no_fx_cache):
    spec, targets, expected = GREEDY_CASES[case]
    drafts, logits = _padded(spec, targets)
    want = torch.tensor(expected)
    assert torch.equal(vllm_v1_native_greedy(drafts.clone(), logits.clone()), want)
    torch._dynamo.reset()
    f = npuspec.compile(vllm_v1_native_greedy, options={"lowering": lowering, "capture": False})
    before = counters.snapshot()
    assert torch.equal(f(drafts.clone(), logits.clone()), want)
    assert counters.delta(before).get("verify_patterns_matched.composed") == 1


def _sample_pdf(step, target, draft, k, vocab, n):
    """Histogram of the tokens the step emits at its K draft positions over n requests with
    the same target and draft distributions (drafts sampled from the draft)."""
    q = draft.reshape(1, 1, vocab).repeat(n, k, 1)
    p = target.reshape(1, 1, vocab).repeat(n, k + 1, 1)
    ids = torch.multinomial(q[:, 0], num_samples=k, replacement=True).reshape(n, k)
    out = step(ids, q, torch.zeros(n, 1, dtype=torch.int64), p)
    toks = out[:, :-1].flatten()
    toks = toks[toks >= 0]
    return torch.bincount(toks, minlength=vocab).float() / toks.numel()


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
def test_random_sampling_approximates_the_target(lowering, no_fx_cache):
    """vLLM's criterion: as the sample grows, the emitted distribution must approach the
    target more than 20x faster (first-to-last distance ratio) than it approaches random
    reference distributions."""
    torch.manual_seed(0)
    vocab, k = 10, 2
    draft, target = (torch.softmax(torch.rand(vocab), -1) for _ in range(2))
    refs = torch.softmax(torch.rand(100, vocab), -1)
    torch._dynamo.reset()
    step = torch.compile(vllm_v1_native_random, backend="npuspec",
                         options={"lowering": lowering, "capture": False})
    before = counters.snapshot()
    d_target, d_refs = [], []
    for n in (10, 100, 1_000, 10_000, 100_000):
        pdf = _sample_pdf(step, target, draft, k, vocab, n)
        d_target.append(float(torch.dist(target, pdf)))
        d_refs.append(float(torch.dist(refs, pdf)) / refs.shape[0])
    assert counters.delta(before).get("verify_patterns_matched.composed", 0) >= 1
    assert d_target[0] / d_target[-1] > 20 * (d_refs[0] / d_refs[-1]), (d_target, d_refs)
