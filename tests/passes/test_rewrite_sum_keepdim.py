"""passes/rewrites/sum_keepdim.py: a sum whose reduced dim a view puts back is the keepdim sum
(bit-equal, NaN, inf and signed zeros included), and vLLM v0's recovered-token normalisation
`f / f.sum(-1).reshape(-1, k, 1)` then fuses, three ways under both lowerings."""
from __future__ import annotations

import pytest
import torch
from passes_helpers import aten_graph, three_way

from npuspec.passes.rewrites import sum_keepdim

NAN, INF = float("nan"), float("inf")
aten = torch.ops.aten


def _x():
    g = torch.Generator().manual_seed(3)
    x = torch.rand(3, 4, 29, generator=g)
    x[0, 0, :5] = torch.tensor([NAN, -0.0, 0.0, INF, -INF])
    x[1, 2] = -0.0  # a row of -0.0s
    x[2, 1, 7] = 1e-45
    return x


def _bits(t):
    return t.view(torch.int32)


PUT_BACK = {  # rewritten
    "unsqueeze_last": lambda x: x / x.sum(-1).unsqueeze(-1),
    "reshape_v0": lambda x: x / torch.sum(x, dim=-1).reshape(-1, 4, 1),
    "view_mid": lambda x: x.sum(1).view(3, 1, 29) * 2,
    "unsqueeze_first": lambda x: x.sum(0).unsqueeze(0) + x,
}
LEFT = {  # not the keepdim shape, not one literal dim, or keepdim already: left as written
    "flattened": lambda x: x.sum(-1).reshape(-1, 1),
    "other_dim": lambda x: x.sum(-1).unsqueeze(0),
    "two_dims": lambda x: x.sum([1, 2]).view(3, 1, 1),
    "kept": lambda x: x / x.sum(-1, keepdim=True),
    "dtype": lambda x: x.sum(-1, dtype=torch.float64).unsqueeze(-1),
    "read_plain": lambda x: x.sum(-1),
}


def _ops(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("name", list(PUT_BACK))
def test_put_back_sums_become_keepdim_sums_bit_equal(name):
    fn, x = PUT_BACK[name], _x()
    gm = aten_graph(fn, x)
    assert sum_keepdim.apply(gm.graph, "aten") == 1
    gm.graph.eliminate_dead_code()
    gm.recompile()
    sums = [n for n in gm.graph.nodes if n.target is aten.sum.dim_IntList]
    assert len(sums) == 1 and sums[0].args[2] is True
    assert not any(t in (aten.view.default, aten.reshape.default, aten.unsqueeze.default)
                   for t in _ops(gm))
    assert torch.equal(_bits(gm(x)), _bits(fn(x)))


@pytest.mark.parametrize("name", list(LEFT))
def test_other_shapes_are_left(name):
    gm = aten_graph(LEFT[name], _x())
    assert sum_keepdim.apply(gm.graph, "aten") == 0


def test_the_plain_sum_stays_for_its_other_readers():
    fn = lambda x: (x.sum(-1), x / x.sum(-1).unsqueeze(-1))  # noqa: E731
    x = _x()
    gm = aten_graph(fn, x)
    assert sum_keepdim.apply(gm.graph, "aten") == 1
    gm.recompile()
    keeps = [n.args[2] if len(n.args) > 2 else False
             for n in gm.graph.nodes if n.target is aten.sum.dim_IntList]
    assert sorted(keeps) == [False, True]
    for a, b in zip(gm(x), fn(x)):
        assert torch.equal(_bits(a), _bits(b))


def _v0_recovered(q, p):
    """vLLM v0's RejectionSampler._get_recovered_probs: max(p - q, tiny), normalised with the
    row sum reshaped back to [B, k, 1]."""
    f = torch.clamp(p - q, min=torch.finfo(p.dtype).tiny)
    return f / torch.sum(f, dim=-1).reshape(-1, q.shape[1], 1)


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
def test_vllm_v0_recovered_probs_fuse_three_ways(lowering, no_fx_cache):
    g = torch.Generator().manual_seed(7)
    p = torch.rand(3, 4, 29, generator=g).softmax(-1)
    q = (0.7 * p + 0.3 * torch.rand(3, 4, 29, generator=g).softmax(-1))
    q[0, 1] = p[0, 1]  # a row whose residual is all floor
    three_way(_v0_recovered, (q, p), lowering=lowering, family="residual",
              appear=("npuspec.residual_probs",), gone=("aten.clamp",))
    assert three_way.last_delta.get("canonical_rewrites.sum_keepdim", 0) == 1
