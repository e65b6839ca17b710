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
from passes_helpers import every_spelling, three_way


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
    the other would branch on a size, which the memo's two-trace evidence cannot see. And at
    the example sizes with its arguments sliced, the same graph as contiguous."""
    free = follows = 0
    seen = list(every_spelling())
    for fam, sp in seen:
        example = list(sp.example()) + list(sp.scalars.values())
        keys = []
        for shift in (0, 3, 7):
            mode = FakeTensorMode()
            args = _mapped(example, lambda s, k=shift: s + k, mode)
            with mode:  # as the matcher's check traces: under the graph's fake mode
                keys.append(search_memo.graph_key(manager.trace_canonical(sp.search, args)))
        same3, same7 = keys[1] == keys[0], keys[2] == keys[0]
        assert same3 == same7, f"{fam.name}.{sp.name}: graph changes at one shift only"
        # the strides write_traces did not try (it strides every dim): each argument
        # sliced in its second dim, as vLLM's probs[:, :K] is; the shipped file calls
        # every spelling strides-free
        mode = FakeTensorMode()
        with mode:
            sliced = [a if not isinstance(a, torch.Tensor) else
                      torch.empty(a.shape, dtype=a.dtype) if a.dim() < 2 else
                      torch.empty([*a.shape[:1], a.shape[1] + 1, *a.shape[2:]],
                                  dtype=a.dtype)[:, :a.shape[1]] for a in example]
            assert search_memo.graph_key(manager.trace_canonical(sp.search, sliced)) == \
                keys[0], f"{fam.name}.{sp.name}: graph follows the strides"
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


# -- evidence made offline for signatures other than the example's (write_traces) -----------

def contiguous_first(x):
    return x.contiguous() + 1


def floored(p, c):
    return p.clamp_min(c) * 2


def one_minus(p, c):
    return p * (1 - c)


def test_strides_free_sees_a_graph_that_follows_strides():
    trace = lambda f: (lambda a: manager.trace_canonical(f, a))  # noqa: E731
    for fn, free in [(shape_free, True), (flat, False), (contiguous_first, False)]:
        ex = [torch.rand(2, 9)]
        gm = manager.trace_canonical(fn, ex)
        assert search_memo.strides_free(trace(fn), ex, gm) is free, fn.__name__


def test_floats_free_only_where_the_value_is_the_literal():
    ex = [torch.rand(2, 9), 0.3125]
    for fn, free in [(floored, [1]), (one_minus, [])]:
        gm = manager.trace_canonical(fn, ex)
        got = search_memo.floats_free(lambda a, f=fn: manager.trace_canonical(f, a), ex, gm)
        assert got == free, fn.__name__
    gm = manager.trace_canonical(floored, ex)
    moved = search_memo.with_float(gm, 0.3125, 1e-5)
    fresh = manager.trace_canonical(floored, [torch.rand(2, 9), 1e-5])
    assert search_memo.graph_key(moved) == search_memo.graph_key(fresh)
    assert search_memo.graph_key(moved) != search_memo.graph_key(gm)


def _shelved(monkeypatch, fn, example):
    """A SearchMemo registered from a shelf that write_traces' recording filled for `fn`."""
    from npuspec.passes import trace_store
    shelf = trace_store.Shelf("eager", "test-uuid", fn.__name__)
    monkeypatch.setattr(trace_store, "recording", {})
    search_memo.SearchMemo(fn, manager.trace_canonical, shelf)(fn, example)
    stored = dict(trace_store.recording)
    monkeypatch.setattr(trace_store, "recording", None)
    monkeypatch.setattr(trace_store, "_shipped", lambda: stored)
    m = search_memo.SearchMemo(fn, manager.trace_canonical, shelf)
    m(fn, example)
    return m


def test_sliced_wider_and_other_float_matches_reuse_the_shipped_graph(monkeypatch):
    """A first match with an argument sliced from a larger tensor, with a leading dim, or with
    another float reuses what write_traces shipped, and that graph is the one a fresh trace at
    the match's arguments gives; a spelling whose graph follows strides traces."""
    mode = FakeTensorMode()
    m = _shelved(monkeypatch, floored, [torch.rand(2, 9), 0.3125])
    with mode:
        sliced = torch.empty(6, 12)[:, :10]                           # [6, 10], not contiguous
        wide = torch.empty(5, 4, 11)
    for args in ([sliced, 0.3125], [wide, 0.3125], [sliced, 1e-5], [wide, 1e-5]):
        gm, d = _calls(m, floored, args)
        assert d == {"traced": 0, "reused": 1, "kept": 0}, (args[0].shape, args[1], d)
        with mode:
            fresh = manager.trace_canonical(floored, args)
        assert search_memo.graph_key(gm) == search_memo.graph_key(fresh)
    m = _shelved(monkeypatch, contiguous_first, [torch.rand(2, 9)])
    _, d = _calls(m, contiguous_first, [sliced])
    assert d["traced"] == 1 and d["reused"] == 0


def test_vllm_v1_first_graph_traces_no_search(monkeypatch):
    """vLLM v1's step (sliced probs, rank-3 residual rows, a 1e-5 floor) compiled right after
    the families register from the shipped file: every search comes from the file."""
    from npuspec.bench import passes as bench
    manager._compiled.cache_clear()
    torch._dynamo.reset()
    logits, drafts, q = bench.make_inputs(3, 4, 40, "cpu")
    args = (torch.softmax(logits, -1), drafts, q, torch.tensor([1, 2, 3]),
            torch.rand(3, 4), torch.empty(3, 4, 40).exponential_())
    before = dict(search_memo.STATS)
    try:
        three_way(bench.vllm_v1_step_draws, args, matched=None,
                  appear=("npuspec.rejection_sample",))
    finally:
        manager._compiled.cache_clear()
    d = {k: search_memo.STATS[k] - before[k] for k in before}
    assert d["traced"] == 0 and d["reused"] >= 3, d
