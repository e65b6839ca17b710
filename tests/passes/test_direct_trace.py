"""passes/direct_trace.py: a replacement built without make_fx is make_fx's graph, metas
included, and anything it cannot build is declined (then make_fx traces it)."""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from npuspec import counters
from npuspec.passes import search_memo, trace_store
from npuspec.passes.direct_trace import direct_trace
from passes_helpers import every_spelling, three_way


def _fake(example, mode):
    return [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in example]


def _metas(gm):
    """Per node: its value's shape, dtype and strides, its tensor_meta, original_aten and
    the eager input values' shapes and strides (what the matcher copies into the user's
    graph)."""
    def desc(v):
        if isinstance(v, torch.Tensor):
            return (tuple(v.shape), v.dtype, v.stride(), v.device)
        return repr(v)
    out = []
    for n in gm.graph.nodes:
        m = n.meta
        eager = m.get("eager_input_vals")
        out.append((n.op, desc(m.get("val")), repr(m.get("tensor_meta")), str(m.get("original_aten")),
                    None if eager is None else torch.utils._pytree.tree_map(desc, eager)))
    return out


def test_every_replacement_built_directly_is_make_fx_s():
    direct = declined = 0
    for fam, sp in every_spelling():
        mode = FakeTensorMode()
        args = _fake(list(sp.example()) + list(sp.scalars.values()), mode)
        with mode:  # as the matcher traces a replacement: under the graph's fake mode
            got = direct_trace(sp.replace, args)
            want = trace_store.trace_canonical(sp.replace, args)
        where = f"{fam.name}.{sp.name}"
        # built exactly when make_fx's graph is npuspec ops returning one tensor each
        only_ours = all(n.op in ("placeholder", "output") or n.target.namespace == "npuspec"
                        and isinstance(n.meta["val"], torch.Tensor)
                        for n in want.graph.nodes)
        assert (got is not None) == only_ours, where
        if got is None:
            declined += 1
            continue
        direct += 1
        assert search_memo.graph_key(got) == search_memo.graph_key(want), where
        assert _metas(got) == _metas(want), where
    # the declined ones are `rejection_sample` (a tuple) with casts after it, or a draw
    print(f"{direct} replacements built directly, {declined} declined")
    assert direct > 0 and declined > 0


def _fake_inputs():
    mode = FakeTensorMode()
    with mode:
        return mode, torch.empty(2, 3, 8), torch.empty(2, 3, dtype=torch.long)


def test_a_replacement_that_is_not_only_npuspec_ops_is_declined():
    mode, p, d = _fake_inputs()
    outside = torch.zeros(2, 3, dtype=torch.long)
    cases = {
        "an aten op": lambda p, d: torch.ops.npuspec.greedy_accept(p.argmax(-1), d),
        "a tensor from outside": lambda p, d: torch.ops.npuspec.greedy_accept(outside, d),
        "a tensor method after": lambda p, d: torch.ops.npuspec.greedy_accept(d, d).sum(),
        "reads a shape": lambda p, d: torch.ops.npuspec.greedy_accept(d[:, :p.shape[1]], d),
        "returns no tensor": lambda p, d: (torch.ops.npuspec.greedy_accept(d, d),),
    }
    for what, fn in cases.items():
        before = counters["pattern_direct_trace.declined"]
        with mode:
            assert direct_trace(fn, [p, d]) is None, what
        assert counters["pattern_direct_trace.declined"] == before + 1, what


def test_real_tensors_and_aliased_inputs_are_declined():
    fn = lambda a, b: torch.ops.npuspec.greedy_accept(a, b)  # noqa: E731
    real = torch.zeros(2, 3, dtype=torch.long)
    assert direct_trace(fn, [real, real.clone()]) is None  # registration: make_fx's job
    mode, _, d = _fake_inputs()
    with mode:
        assert direct_trace(fn, [d, d]) is None  # one value twice: the node is ambiguous


def test_a_chain_of_npuspec_ops_and_literals_is_built():
    mode, p, d = _fake_inputs()
    fn = lambda p, d: torch.ops.npuspec.greedy_accept(  # noqa: E731
        torch.ops.npuspec.greedy_accept(d, d), d)
    with mode:
        got = direct_trace(fn, [p, d])
        want = trace_store.trace_canonical(fn, [p, d])
    assert got is not None
    assert search_memo.graph_key(got) == search_memo.graph_key(want)
    assert _metas(got) == _metas(want)


def test_a_compiled_step_uses_it_and_equals_eager():
    def step(logits, drafts):  # [B, K+1, V], [B, K]
        t = logits.argmax(-1)  # returned: the narrow greedy_accept op matches, not the step
        return t, (drafts == t[:, :-1]).cumprod(dim=1).sum(dim=1)

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 40, generator=g)
    drafts = logits.argmax(-1)[:, :4].clone()
    drafts[1, 2] = (drafts[1, 2] + 1) % 40
    three_way(step, (logits, drafts), family="greedy_accept", appear=["npuspec.greedy_accept"],
              gone=["aten.cumprod"])
    assert three_way.last_delta.get("pattern_direct_trace.direct", 0) >= 1, three_way.last_delta

