"""passes/search_memo.py: the search re-trace kept and reused only where shapes cannot change it.

Toy search functions show the rule (a shape-free graph is kept and reused, a literal taken
from a size refuses it, a size equal in both traces is pinned); every family's spelling is
traced at three sets of sizes to show none changes its graph at some sizes and not others; and
a verify step compiled at a second batch size reuses the first one's traces, fuses the same
and equals eager.
"""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from npuspec.passes import manager, search_memo
from npuspec.passes.patterns import default_patterns
from npuspec.passes.patterns_sample import OTHER_MODES, SampleVerify, SampleVerifyConfig
from passes_helpers import three_way


def _fake(mode, *shapes, dtype=torch.float32):
    with mode:
        return [torch.empty(s, dtype=dtype) for s in shapes]


def _memo(fn, example):
    m = search_memo.SearchMemo(fn, manager.trace_canonical)
    m(fn, example)  # the registration's trace, at the example shapes
    return m


def _calls(m, fn, args):
    before = dict(search_memo.STATS)
    gm = m(fn, args)
    return gm, {k: search_memo.STATS[k] - before[k] for k in before}


def shape_free(x):
    return torch.cumsum(x, dim=-1).clamp_min(0.0)


def from_size(x):
    return x + x.shape[0]


def flat(x):
    return x.reshape(x.shape[0] * x.shape[1])


def test_shape_free_graph_is_kept_then_reused():
    mode = FakeTensorMode()
    m = _memo(shape_free, [torch.rand(2, 9)])
    gm1, d = _calls(m, shape_free, _fake(mode, (4, 6)))
    assert d == {"traced": 1, "reused": 0, "kept": 1}
    gm2, d = _calls(m, shape_free, _fake(mode, (5, 7)))
    assert d == {"traced": 0, "reused": 1, "kept": 0} and gm2 is gm1
    # another dtype, or a size of 1 where the kept one had none, is another signature
    _, d = _calls(m, shape_free, _fake(mode, (5, 7), dtype=torch.float64))
    assert d["traced"] == 1 and d["reused"] == 0
    _, d = _calls(m, shape_free, _fake(mode, (1, 7)))
    assert d["traced"] == 1 and d["reused"] == 0


def test_literal_from_a_size_is_never_reused():
    mode = FakeTensorMode()
    m = _memo(flat, [torch.rand(2, 9)])
    for shape in [(4, 6), (5, 7), (4, 6)]:
        _, d = _calls(m, flat, _fake(mode, shape))
        assert d["traced"] == 1 and d["reused"] == 0 and d["kept"] == 0
    assert not m.kept


def test_other_rank_is_kept_from_two_of_its_own_traces():
    # the example is 2-D, the matches 3-D: the registration's trace is no evidence for them,
    # so the second match's trace is compared with the first's; the sizes equal in both are
    # pinned
    mode = FakeTensorMode()
    m = _memo(shape_free, [torch.rand(2, 9)])
    _, d = _calls(m, shape_free, _fake(mode, (3, 4, 5)))
    assert d == {"traced": 1, "reused": 0, "kept": 0}
    _, d = _calls(m, shape_free, _fake(mode, (6, 4, 5)))
    assert d == {"traced": 1, "reused": 0, "kept": 1}
    _, d = _calls(m, shape_free, _fake(mode, (7, 4, 5)))
    assert d == {"traced": 0, "reused": 1, "kept": 0}
    _, d = _calls(m, shape_free, _fake(mode, (7, 4, 6)))
    assert d["traced"] == 1 and d["reused"] == 0


def test_size_equal_in_both_traces_is_pinned():
    # the literal is x.shape[0]: the example's 2 equals the first match's, so the kept graph
    # serves only matches with that size
    mode = FakeTensorMode()
    m = _memo(from_size, [torch.rand(2, 9)])
    gm1, d = _calls(m, from_size, _fake(mode, (2, 6)))
    assert d["kept"] == 1
    _, d = _calls(m, from_size, _fake(mode, (2, 11)))
    assert d["reused"] == 1
    gm3, d = _calls(m, from_size, _fake(mode, (3, 11)))
    assert d["traced"] == 1 and d["reused"] == 0
    assert search_memo.graph_key(gm3) != search_memo.graph_key(gm1)


def test_symbolic_sizes_are_traced():
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    mode = FakeTensorMode(shape_env=ShapeEnv())
    m = _memo(shape_free, [torch.rand(2, 9)])
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext
    ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC])
    y = mode.from_tensor(torch.rand(4, 6), source=ConstantSource("y"), symbolic_context=ctx)
    assert search_memo.signature([y]) is None
    assert m(shape_free, [torch.rand(3, 5)]) is not None


def _mapped(example, f, mode):
    out = []
    with mode:
        for a in example:
            if isinstance(a, torch.Tensor):
                out.append(torch.empty([f(s) if s >= 2 else s for s in a.shape], dtype=a.dtype))
            else:
                out.append(a)
    return out


def test_no_spelling_changes_its_graph_only_at_some_sizes():
    """Each spelling traced at its example sizes, at every size + 3 and at every size + 7:
    either all three graphs are one (its literals take no size), or both shifted ones differ
    from the example's (a literal follows a size). A graph that changed at one shift and not
    the other would branch on a size, which the memo's two-trace evidence cannot see."""
    families = default_patterns() + [SampleVerify(SampleVerifyConfig(modes=OTHER_MODES))]
    free = follows = 0
    seen = set()
    for fam in families:
        for sp in fam.spellings():
            if (fam.name, sp.name) in seen:
                continue
            seen.add((fam.name, sp.name))
            example = list(sp.example()) + list(sp.scalars.values())
            keys = []
            for shift in (0, 3, 7):
                mode = FakeTensorMode()
                args = _mapped(example, lambda s, k=shift: s + k, mode)
                with mode:  # as the matcher's check traces: under the graph's fake mode
                    keys.append(search_memo.graph_key(manager.trace_canonical(sp.search, args)))
            same3, same7 = keys[1] == keys[0], keys[2] == keys[0]
            assert same3 == same7, f"{fam.name}.{sp.name}: graph changes at one shift only"
            free += same3
            follows += not same3
    print(f"{free} spellings shape-free, {follows} with a literal from a size")
    assert free > 0 and free + follows == len(seen)


def _step(logits, drafts):
    target = logits.argmax(-1)
    n = (drafts == target[:, :-1]).cumprod(dim=1).sum(dim=1)
    return target.gather(1, n[:, None]).squeeze(1), n


def _inputs(b, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, 5, 50, generator=g)
    drafts = logits.argmax(-1)[:, :4].clone()
    drafts[0, 2] = (drafts[0, 2] + 1) % 50
    return logits, drafts


def test_second_batch_size_reuses_the_search_traces():
    # Dynamo reset between: a second shape would otherwise compile with a symbolic batch size
    torch._dynamo.reset()
    three_way(_step, _inputs(3, 0), matched=1)  # the spelling's first match: traced
    before = dict(search_memo.STATS)
    torch._dynamo.reset()
    three_way(_step, _inputs(6, 1), matched=1)  # a fresh compile at another batch size
    reused = search_memo.STATS["reused"] - before["reused"]
    traced = search_memo.STATS["traced"] - before["traced"]
    assert reused >= 1 and traced == 0, (reused, traced)


def test_signature_names_the_device_and_the_scalars():
    a, b = torch.empty(2, 3), torch.empty(2, 3, device="meta")
    assert search_memo.signature([a]) != search_memo.signature([b])
    assert search_memo.signature([a, 1e-5]) != search_memo.signature([a, 2e-5])
    assert search_memo.signature([a, 1e-5]) == search_memo.signature([torch.empty(5, 7), 1e-5])
    assert search_memo.signature([a.t()]) != search_memo.signature([torch.empty(3, 2)])
