"""passes/residual_proof.py: recovered tokens matched by what they compute.

Three ways through the backend (tokens equal eager's, `npuspec.residual_sample` in the graph,
`verify_patterns_matched.residual_proof` moved) for spellings no residual pattern lists, under
both lowerings; near misses that the check set tells apart stay as written and equal eager;
the op's guard mode against its reference on zero and infinite draws.
"""
from __future__ import annotations

import pytest
import torch
from passes_helpers import aten_graph, three_way

import npuspec.kernels.accept as accept
from npuspec.passes import residual_proof

INF = float("inf")


def _ascend_guarded(prob, q):
    # vllm-ascend's sample_recovered_tokens_pytorch, from the residual on
    safe = torch.where(q == 0, 1e-10, q)
    safe = torch.where(torch.isinf(q), 1e-10, safe)
    score = prob / safe
    return torch.where((q == 0) | torch.isinf(q), -1e10, score).argmax(dim=1)


def ascend_recovered(target_probs, draft_probs, q_rows):
    prob = torch.maximum(target_probs - draft_probs, torch.tensor(0.0))
    return _ascend_guarded(prob, q_rows)


def ascend_recovered_ragged(target_logits, draft_probs, q, tok_req):
    # the flat [N, V] layout: the per-request draws picked per token, the target's softmax
    # also read elsewhere (its pick at the drafts)
    p = target_logits.softmax(-1)
    return ascend_recovered(p, draft_probs, q[tok_req]), p.argmax(-1)


def guarded_full_like(p, dq, e):
    # the guard written with full_like and isinf first, the residual through relu
    r = torch.relu(p - dq)
    bad = torch.isinf(e) | (e == 0)
    return torch.where(bad, torch.full_like(r, -1e10), r / e).argmax(-1, keepdim=True)


def floored_guard(p, dq, e):
    r = torch.clamp(p - dq, min=1e-5)
    return torch.where((e == 0) | torch.isinf(e), -1e10, r / e).argmax(-1)


def _inputs(n=6, v=13, zeros=True):
    g = torch.Generator().manual_seed(4)
    p = torch.softmax(torch.randn(n, v, generator=g), -1)
    dq = torch.softmax(torch.randn(n, v, generator=g), -1)
    e = torch.empty(n, v).exponential_(generator=g)
    if zeros:  # the draws the guard is for
        e[0, 3], e[1, 5], e[2, 0] = 0.0, INF, -0.0
    return p, dq, e


CASES = {
    "ascend": (ascend_recovered, lambda: _inputs()),
    "guarded_full_like": (guarded_full_like, lambda: _inputs()),
    "floored_guard": (floored_guard, lambda: _inputs()),
}


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_guarded_races_fuse_and_equal_eager(name, lowering, no_fx_cache):
    fn, make = CASES[name]
    three_way(fn, make(), lowering=lowering, matched=1, family="residual_proof",
              appear=("npuspec.residual_sample",))


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
def test_ragged_layout_with_a_shared_softmax(lowering, no_fx_cache):
    """The residual's p is a softmax the user also reads: under Inductor's decompositions the
    softmax is exp / sum, and the region stops at the shared value."""
    g = torch.Generator().manual_seed(2)
    logits, d = torch.randn(7, 11, generator=g), torch.softmax(torch.randn(7, 11, generator=g), -1)
    q = torch.empty(3, 11).exponential_(generator=g)
    q[1, 4] = 0.0
    tok_req = torch.tensor([0, 0, 1, 1, 1, 2, 2])
    three_way(ascend_recovered_ragged, (logits, d, q, tok_req), lowering=lowering, matched=1,
              family="residual_proof", appear=("npuspec.residual_sample",))


def near_miss_scaled(p, dq, e):
    # the same order as r / e except where 3 * r / e rounds to a tie or overflows
    return (torch.clamp(p - dq, min=0) / e * 3.0).argmax(-1)


def near_miss_zero_only(p, dq, e):
    r = torch.clamp(p - dq, min=0)
    return torch.where(e == 0, -1e10, r / e).argmax(-1)  # no isinf: r / inf is 0, not -1e10


def near_miss_squared(p, dq, e):
    r = torch.clamp(p - dq, min=0)
    return (r * r / e).argmax(-1)


@pytest.mark.parametrize("fn", [near_miss_scaled, near_miss_zero_only, near_miss_squared])
def test_regions_the_check_tells_apart_stay_as_written(fn, no_fx_cache):
    gm = aten_graph(fn, *_inputs())
    assert residual_proof.prove_recovered(gm.graph) == 0
    three_way(fn, _inputs(), matched=0, gone=("npuspec.residual_sample",))


def test_the_check_set_holds_what_the_guard_and_floor_turn_on():
    cols = residual_proof._check_set([1e-5, -1e10], [torch.float32] * 3)
    e = cols[2]
    assert bool((e == 0).any()) and bool(e.isinf().any()) and bool(e.isnan().any())
    assert bool((e == 1e-5).any()) and bool((e == torch.nextafter(
        torch.tensor(1e-5), torch.tensor(INF))).any())
    assert all(c.shape == cols[0].shape for c in cols)


def test_guard_mode_against_its_reference():
    p, dq, e = _inputs(zeros=True)
    e[3, 7] = -INF
    got = torch.ops.npuspec.residual_sample(p, dq, e, "none", "race", "clamp", 0.0, "zero_inf",
                                            -1e10)
    assert torch.equal(got, accept.residual_sample_ref(p, dq, e, "none", "race", "clamp", 0.0,
                                                       "zero_inf", -1e10))
    assert torch.equal(got, _ascend_guarded(torch.clamp(p - dq, min=0), e))
    unguarded = torch.ops.npuspec.residual_sample(p, dq, e, "none", "race")
    assert not torch.equal(got, unguarded)  # the zero draws win the plain race


def test_guard_needs_the_race():
    p = torch.rand(2, 5)
    with pytest.raises(ValueError, match="guard='zero_inf' needs sampler='race'"):
        accept.residual_sample(p, p, p, "none", "gumbel", "clamp", 0.0, "zero_inf", -1.0)
    with pytest.raises(ValueError, match="guard='nan'"):
        accept.residual_sample(p, p, p, "none", "race", "clamp", 0.0, "nan", -1.0)


def ascend_ngram_recovered(target_probs, draft_ids, q_rows):
    # vllm-ascend's n-gram branch: the draft's own token zeroed in the target, then the race
    prob = target_probs.clone()
    prob[torch.arange(draft_ids.shape[0]), draft_ids] = 0
    return _ascend_guarded(prob, q_rows)


def plain_race(p, e):
    return (p / e).argmax(-1)  # sampling the target (a bonus token), not a recovered token


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
def test_one_hot_residual_races_against_zero(lowering, no_fx_cache):
    p, _, e = _inputs()
    ids = torch.tensor([3, 0, 12, 5, 5, 1])
    three_way(ascend_ngram_recovered, (p, ids, e), lowering=lowering, matched=1,
              family="residual_proof", appear=("npuspec.residual_sample",))


def test_a_plain_race_is_sampling_and_stays(no_fx_cache):
    p, _, e = _inputs(zeros=False)
    three_way(plain_race, (p, e), matched=0, gone=("npuspec.residual_sample",))


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
def test_one_request_and_one_row(lowering, no_fx_cache):
    """B = 1 ([1, V] rows) and a single 1-D row (argmax over dim 0, keepdim) fuse alike."""
    p, dq, e = _inputs()
    three_way(ascend_recovered, (p[:1], dq[:1], e[:1]), lowering=lowering, matched=1,
              family="residual_proof", appear=("npuspec.residual_sample",))
    torch._dynamo.reset()
    three_way(guarded_full_like, (p[0], dq[0], e[0]), lowering=lowering, matched=1,
              family="residual_proof", appear=("npuspec.residual_sample",))


def test_answers_are_remembered_by_region(monkeypatch, no_fx_cache):
    """_find remembers its answer by the region's key (nodes, literals, leaf dtypes): the same
    race at another size asks again and is served without evaluating; a region one literal
    away is evaluated on its own and stays as written."""
    calls = []
    search = residual_proof._search
    monkeypatch.setattr(residual_proof, "_search", lambda o, l: calls.append(1) or search(o, l))
    monkeypatch.setattr(residual_proof, "_FOUND", {})
    three_way(ascend_recovered, _inputs(n=6), matched=1, family="residual_proof")
    assert len(calls) >= 1
    calls.clear()
    torch._dynamo.reset()
    three_way(ascend_recovered, _inputs(n=9, v=17), matched=1, family="residual_proof")
    assert calls == []
    torch._dynamo.reset()
    three_way(near_miss_zero_only, _inputs(n=9, v=17), matched=0,
              gone=("npuspec.residual_sample",))
    assert len(calls) >= 1
