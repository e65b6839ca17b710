"""passes/rewrites/scaled_pick.py: a pick scaled by a literal as the pick of the scaled tensor
(bit-equal), on trial: lucidrains' lenient accept test then fuses, and a pick no family takes
gets the user's order back, three ways under both lowerings."""
from __future__ import annotations

import pytest
import torch
from passes_helpers import aten_graph, three_way

from npuspec.passes.rewrites import scaled_pick

NAN, INF = float("nan"), float("inf")
aten = torch.ops.aten


def _x():
    g = torch.Generator().manual_seed(2)
    x = torch.rand(3, 4, 29, generator=g)
    x[0, 0, :6] = torch.tensor([NAN, INF, -INF, -0.0, 1e-45, 3e38])
    ids = torch.randint(0, 29, (3, 4, 1), generator=g)
    ids[0, 0, 0], ids[0, 1, 0], ids[0, 2, 0], ids[0, 3, 0] = 0, 1, 3, 4
    ids[1, 0, 0], ids[1, 1, 0] = 5, 2
    return x, ids


def _bits(t):
    return t.view(torch.int32)


SCALED = {
    "mul": lambda x, ids: x.gather(-1, ids) * 1.3,
    "rmul": lambda x, ids: 1.3 * x.gather(-1, ids),
    "div": lambda x, ids: x.gather(-1, ids) / 0.7,
    "mul_int": lambda x, ids: x.gather(2, ids) * 3,
}
LEFT = {
    "other_reader": lambda x, ids: (lambda g: (g, g * 1.3))(x.gather(-1, ids)),
    "tensor_factor": lambda x, ids: x.gather(-1, ids) * x[:, :, :1],
    "int_gather": lambda x, ids: ids.gather(-1, ids.clamp(max=0)) * 2,
    "plain": lambda x, ids: x.gather(-1, ids),
}


@pytest.mark.parametrize("name", list(SCALED))
def test_scaled_picks_move_bit_equal_and_come_back(name):
    fn, (x, ids) = SCALED[name], _x()
    gm = aten_graph(fn, x, ids)
    assert scaled_pick.apply(gm.graph, "aten") == 1
    gm.recompile()
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert ops[-1] is aten.gather.default  # the pick last, as the families are traced
    assert torch.equal(_bits(gm(x, ids)), _bits(fn(x, ids)))
    assert scaled_pick.undo_untaken(gm.graph) == 1  # no family ran: the user's order again
    gm.recompile()
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert ops[0] is aten.gather.default and len(ops) == 2
    assert torch.equal(_bits(gm(x, ids)), _bits(fn(x, ids)))


@pytest.mark.parametrize("name", list(LEFT))
def test_other_picks_are_left(name):
    gm = aten_graph(LEFT[name], *_x())
    assert scaled_pick.apply(gm.graph, "aten") == 0


def _find_first_true_index(t, dim=-1):
    return (t.cumsum(dim=dim) == 0).sum(dim=dim)


def _prophet_accept(prob, small_prob, ids):
    """lucidrains' speculative_decoding_with_prophet: the draft's pick scaled by a lenience."""
    p = prob[:, :-1].gather(-1, ids)
    q = small_prob.gather(-1, ids) * 1.3
    p, q = [t.reshape(t.shape[0], t.shape[1]) for t in (p, q)]
    r = torch.zeros_like(q).float().uniform_(0, 1)
    return _find_first_true_index(r > (p / q))


def _dists():
    g = torch.Generator().manual_seed(6)
    t = torch.randn(3, 5, 29, generator=g) * 2
    p, q = t.softmax(-1), (0.7 * t[:, :4] + torch.randn(3, 4, 29, generator=g)).softmax(-1)
    return p, q, torch.multinomial(q.reshape(-1, 29), 1, generator=g).view(3, 4, 1)


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
def test_lenient_accept_fuses_three_ways(lowering, no_fx_cache):
    three_way(_prophet_accept, _dists(), lowering=lowering, family="ratio_accept",
              appear=("npuspec.ratio_accept",), gone=("aten.cumsum",))
    assert three_way.last_delta.get("canonical_rewrites.scaled_pick", 0) == 1


def _count_beside_a_scaled_pick(drafts, target, q, ids):
    """A greedy count (which fuses) beside a scaled pick nobody tests: it is put back."""
    return (drafts == target).cumprod(-1).sum(-1), q.gather(-1, ids) * 1.3


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
def test_an_untaken_scaled_pick_gets_its_order_back(lowering, no_fx_cache):
    _, q, ids = _dists()
    drafts, target = torch.tensor([[1, 2, 3]] * 3), torch.tensor([[1, 2, 4]] * 3)
    _, graphs = three_way(_count_beside_a_scaled_pick, (drafts, target, q, ids),
                          lowering=lowering, family="greedy_accept")
    assert three_way.last_delta.get("canonical_rewrites.scaled_pick", 0) == 0
    if lowering == "eager":  # the pick of q itself, then the product: [3, 4, 1] products
        assert "aten.gather.default](args = (%arg2_1," in graphs
