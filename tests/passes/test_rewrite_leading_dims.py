"""passes/rewrites/leading_dims.py: an accept region over [B, C, K] (or more leading dims) run
on [B * C, K] rows gives the same values, and EAGLE's batched tree posterior then fuses, three
ways under both lowerings."""
from __future__ import annotations

import pytest
import torch
from passes_helpers import aten_graph, three_way

from npuspec.passes.rewrites import leading_dims

aten = torch.ops.aten


def _ids(shape=(3, 4, 5), seed=0):
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(0, 4, shape, generator=g)
    drafts = torch.where(torch.rand(shape, generator=g) < 0.7, target,
                         torch.randint(0, 4, shape, generator=g))
    return drafts, target


REGIONS = {  # rewritten
    "cumprod_int": lambda d, t: torch.cumprod((d == t).int(), dim=-1).sum(dim=-1),
    "cumsum_not": lambda d, t: ((~(d == t)).cumsum(-1) < 1).sum(-1),
    "cummin_long": lambda d, t: (d == t).long().cummin(-1).values.sum(-1),
    "ne_cumsum": lambda d, t: ((d != t).cumsum(d.dim() - 1) == 0).sum(d.dim() - 1),
    "two_counts": lambda d, t: (lambda m: (m.cumprod(-1).sum(-1), m.sum(-1)))((d == t).int()),
}
LEFT = {  # not a row-local region ending in last-dim sums: left as written
    "mask_returned": lambda d, t: (lambda m: (m, m.cumprod(-1).sum(-1)))((d == t).int()),
    "other_dim": lambda d, t: (d == t).int().cumprod(-1).sum(1),
    "no_sum": lambda d, t: (d == t).int().cumprod(-1),
    "amax_tail": lambda d, t: (d == t).int().cumprod(-1).amax(-1),
}


@pytest.mark.parametrize("shape", [(3, 4, 5), (2, 3, 2, 4)], ids=["rank3", "rank4"])
@pytest.mark.parametrize("name", list(REGIONS))
def test_regions_run_on_rows_with_the_same_values(name, shape):
    fn, (d, t) = REGIONS[name], _ids(shape)
    gm = aten_graph(fn, d, t)
    assert leading_dims.apply(gm.graph, "aten") == 1
    gm.recompile()
    ranks = [n.meta["val"].dim() for n in gm.graph.nodes
             if n.target in (aten.eq.Tensor, aten.ne.Tensor)]
    assert ranks == [2]
    got, want = gm(d, t), fn(d, t)
    for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("name", list(LEFT))
def test_other_regions_are_left(name):
    gm = aten_graph(LEFT[name], *_ids())
    assert leading_dims.apply(gm.graph, "aten") == 0


def test_rank_two_and_float_compares_are_left():
    d, t = _ids((3, 5))
    assert leading_dims.apply(aten_graph(REGIONS["cumprod_int"], d, t).graph, "aten") == 0
    d, t = _ids()
    assert leading_dims.apply(
        aten_graph(REGIONS["cumprod_int"], d.float(), t.float()).graph, "aten") == 0


def _eagle_batched_greedy(logits, candidates):
    """SafeAILab/EAGLE modeling_eagle.py evaluate_posterior, greedy: every path of every
    request at once, then the best path per request."""
    posterior_mask = (candidates[:, :, 1:] == torch.argmax(logits[:, :, :-1], dim=-1)).int()
    accept = torch.cumprod(posterior_mask, dim=-1).sum(dim=-1)              # [B, C]
    return accept.max(dim=1).values, torch.argmax(accept, dim=-1)


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
def test_eagle_batched_tree_posterior_fuses_three_ways(lowering, no_fx_cache):
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 4, 6, 29, generator=g)                           # [B, C, K+1, V]
    cand = torch.cat([torch.zeros(3, 4, 1, dtype=torch.long), logits.argmax(-1)[..., :-1]], -1)
    cand[0, 1, 2] += 1
    cand[1, :, 1] += 1
    cand[2, 3, 4] += 1
    three_way(_eagle_batched_greedy, (logits, cand), lowering=lowering, family="greedy_accept",
              appear=("npuspec.greedy_accept",), gone=("aten.cumprod",))
    assert three_way.last_delta.get("canonical_rewrites.leading_dims", 0) == 1
