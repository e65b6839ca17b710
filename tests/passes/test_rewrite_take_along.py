"""Pick spellings beyond `gather`: `torch.take_along_dim` (passes/rewrites/take_along.py),
advanced indexing with `arange(K)[None, :]` columns and the flat-rows pick
`p.view(-1, V)[arange(B * K), ids.view(-1)].view(B, K)` (passes/picks.py).

Exactness on NaN, infinities and -0.0 (and take_along_dim's wrap of a negative id), then three
ways: the ratio test fuses as `npuspec::ratio_accept` under both lowerings, equal to eager, and
the counters moved."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from npuspec.passes import picks
from npuspec.passes.rewrites import take_along
from passes_helpers import three_way

B, K, V = 4, 3, 13
aten = torch.ops.aten


def _probs(seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(B, K, V, generator=g), -1)
    q = torch.softmax(torch.randn(B, K, V, generator=g), -1)
    return p, q, torch.randint(0, V, (B, K), generator=g)


def _nasty(p):
    p = p.clone()
    p[0, 0, :] = float("nan")
    p[1, 1, :] = -0.0
    p[2, 2, :] = float("inf")
    return p


def pick_take_along(p, ids):
    return torch.take_along_dim(p, ids[..., None], dim=-1).squeeze(-1)


def pick_index_row(p, ids):
    return p[torch.arange(p.shape[0])[:, None], torch.arange(ids.shape[1])[None, :], ids]


def pick_flat(p, ids):
    return p.reshape(-1, p.shape[-1])[torch.arange(ids.numel()), ids.reshape(-1)].view(ids.shape)


def _bits(x):
    return x.view(torch.int32)


def test_take_along_rewrite_is_exact_and_wraps_negative_ids():
    p, _, ids = _probs(0)
    ids = ids.clone()
    ids[0, 1], ids[3, 2] = -1, -V  # take_along_dim reads p[..., V - 1] and p[..., 0]
    gm = make_fx(pick_take_along, tracing_mode="fake")(p, ids)
    assert take_along.apply(gm.graph, "aten") == 1
    gm.graph.eliminate_dead_code()
    gm.recompile()
    assert not any(n.target is aten.expand.default for n in gm.graph.nodes)
    for x in (p, _nasty(p)):
        assert torch.equal(_bits(gm(x, ids)), _bits(pick_take_along(x, ids)))


@pytest.mark.parametrize("fn", [pick_index_row, pick_flat])
def test_index_picks_become_the_gather_form_exactly(fn):
    p, _, ids = _probs(1)
    for ids_ in (ids, ids.int()):
        gm = make_fx(fn, tracing_mode="fake")(p, ids_)
        assert picks.canonical_picks(gm.graph, "aten") >= 1
        gm.recompile()
        assert not any(n.target is aten.index.Tensor for n in gm.graph.nodes)
        for x in (p, _nasty(p)):
            assert torch.equal(_bits(gm(x, ids_)), _bits(fn(x, ids_)))


def test_other_index_arithmetic_is_left_alone():
    p, _, ids = _probs(2)

    def shifted(p, ids):  # rows b * K + k + 1: not the pick of (b, k)
        rows = torch.arange(ids.numel()).roll(1)
        return p.reshape(-1, V)[rows, ids.reshape(-1)].view(ids.shape)

    def modulo_other(p, ids):  # wraps by another size than V
        return p.gather(-1, (ids % 5)[..., None]).squeeze(-1)

    for fn in (shifted, modulo_other):
        gm = make_fx(fn, tracing_mode="fake")(p, ids)
        before = str(gm.graph)
        take_along.apply(gm.graph, "aten")
        picks.canonical_picks(gm.graph, "aten")
        if fn is shifted:
            assert any(n.target is aten.index.Tensor for n in gm.graph.nodes)
        gm.recompile()
        assert torch.equal(gm(p, ids), fn(p, ids)), before


def _ratio(pick):
    def step(p, q, ids):
        u = torch.rand(ids.shape)
        return (u <= pick(p, ids) / pick(q, ids)).cumprod(1).sum(1)
    step.__name__ = f"ratio_{pick.__name__}"
    return step


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
@pytest.mark.parametrize("pick", [pick_take_along, pick_index_row, pick_flat])
def test_ratio_test_over_each_pick_fuses(pick, lowering, no_fx_cache):
    three_way(_ratio(pick), _probs(3), lowering=lowering, family="ratio_accept",
              appear=("npuspec.ratio_accept",), gone=("aten.cumprod", "aten.index"))
    if pick is pick_take_along:
        assert three_way.last_delta.get("canonical_rewrites.take_along", 0) == 2  # p and q


# issue 37's other spellings of point 1 that need no rule: the families match them as written
def ratio_softmax_as_exp_sum(logits, ids):
    e = torch.exp(logits - logits.amax(-1, keepdim=True))
    p = e / e.sum(-1, keepdim=True)
    u = torch.rand(ids.shape)
    return (u <= p.gather(-1, ids.unsqueeze(-1)).squeeze(-1)).cumprod(1).sum(1)  # one-hot q


def greedy_argmax_after_temperature(logits, ids):
    return ((logits / 0.7).argmax(-1) == ids).cumprod(1).sum(1)


def ratio_rows_picked_before_softmax(logits, ids):
    # the rows taken before the elementwise work (softmax(l[:, :K])), where the other tests
    # take them after it (softmax(l)[:, :K]): p is an input of the family either way
    full = torch.cat([logits, logits[:, :1] * 2], 1)  # K + 1 target rows
    p = torch.softmax(full[:, :ids.shape[1]] / 0.7, -1)
    u = torch.rand(ids.shape)
    return (u <= p.gather(-1, ids.unsqueeze(-1)).squeeze(-1)).cumprod(1).sum(1)


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
@pytest.mark.parametrize("fn,family", [(ratio_softmax_as_exp_sum, "ratio_accept"),
                                       (greedy_argmax_after_temperature, "greedy_accept"),
                                       (ratio_rows_picked_before_softmax, "ratio_accept")])
def test_spellings_that_match_as_written(fn, family, lowering, no_fx_cache):
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(B, K, V, generator=g)
    ids = logits.argmax(-1)
    ids[::2, 1] = (ids[::2, 1] + 1) % V
    three_way(fn, (logits, ids), lowering=lowering, family=family,
              appear=(f"npuspec.{family}",), gone=("aten.cumprod",))
