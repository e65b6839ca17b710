"""vllm-ascend's own unit-test cases for its PyTorch rejection sampler
(tests/ut/sample/test_rejection_sampler.py: the greedy, random and recovered-token cases with
their expected outputs), ported onto our transcriptions (field_vllm.py), eager and compiled
with npuspec. The cases are theirs, the code ours; they check that our transcriptions do
what vllm-ascend's tests say its sampler does, and that the compiled step (its recovered
tokens fused by the check of passes/residual_proof.py) still does.
"""
from __future__ import annotations

import pytest
import torch
from field_vllm import _ascend_random, _ascend_recovered, vllm_ascend_greedy

from npuspec import counters

PAD = -1


def _compiled(fn, lowering):
    torch._dynamo.reset()
    return torch.compile(fn, backend="npuspec", options={"lowering": lowering, "capture": False})


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
def test_greedy_case(lowering, no_fx_cache):
    # two requests of two drafts; the first mismatches at its second draft, the second at
    # its second too: [10, 99, -1] and [20, 22, -1]
    cu, drafts = torch.tensor([2, 4]), torch.tensor([10, 11, 20, 21])
    target = torch.tensor([10, 99, 20, 22])
    logits = torch.full((4, 128), -100.0)
    logits[torch.arange(4), target] = 100.0
    bonus = torch.tensor([[100], [200]])
    for f in (vllm_ascend_greedy, _compiled(vllm_ascend_greedy, lowering)):
        out = f(cu, drafts, logits, bonus, [2, 2], 2)
        assert (out[0, 0], out[0, 1], out[1, 0], out[1, 2]) == (10, 99, 20, PAD), out


def _random_step(cu, drafts, draft_probs, target_probs, bonus, recovered, uniform, greedy):
    out = torch.full((2, 4), PAD, dtype=torch.int32)
    _ascend_random(out, cu, drafts, draft_probs, target_probs, bonus, recovered, uniform,
                   greedy, 3)
    return out


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
def test_random_case(lowering, no_fx_cache):
    args = (torch.tensor([2, 1]), torch.tensor([1, 0, 2]),
            torch.tensor([[0.0, 0.6, 0.0, 0.4], [0.1, 0.2, 0.3, 0.4], [0.5, 0.5, 0.0, 0.0]]),
            torch.tensor([[0.0, 0.8, 0.0, 0.2], [0.2, 0.1, 0.3, 0.4], [0.9, 0.1, 0.0, 0.0]]),
            torch.tensor([[100], [200]]), torch.tensor([1, 2, 3]),
            torch.tensor([0.7, 0.6, 0.5]), torch.tensor([False, False]))
    for f in (_random_step, _compiled(_random_step, lowering)):
        out = f(*args)
        assert out[0, :3].tolist() == [1, 0, 100], out   # both drafts accepted, then the bonus


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
@pytest.mark.parametrize("ngram", [True, False], ids=["ngram", "autoregressive"])
def test_recovered_token_cases(ngram, lowering, no_fx_cache):
    cu = torch.tensor([1, 2])
    if ngram:
        drafts, draft_probs, want = torch.tensor([1, 2]), None, [0, 1]
        target = torch.tensor([[0.1, 0.2, 0.7], [0.3, 0.3, 0.4]])
        q = torch.tensor([[0.1, 0.2, 0.7], [0.5, 0.4, 0.1]])
    else:
        drafts, want = torch.tensor([0, 1]), [0, 0]
        draft_probs = torch.tensor([[0.6, 0.1, 0.3], [0.2, 0.7, 0.1]])
        target = torch.tensor([[0.8, 0.1, 0.1], [0.3, 0.6, 0.1]])
        q = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.8, 0.1]])
    assert _ascend_recovered(cu, drafts, draft_probs, target, q).tolist() == want
    f = _compiled(_ascend_recovered, lowering)
    before = counters.snapshot()
    assert f(cu, drafts, draft_probs, target, q).tolist() == want
    # the recovered-token race was fused (its guarded spelling, by the check set)
    assert counters.delta(before).get("verify_patterns_matched.residual_proof", 0) >= 1
