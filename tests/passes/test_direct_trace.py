"""passes/direct_trace.py: a replacement built without make_fx is make_fx's graph, metas
included, and anything it cannot build is declined (then make_fx traces it)."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from npuspec import counters
from npuspec.passes import manager, search_memo, trace_store
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
        out.append((n.op, desc(m.get("val")), repr(m.get("tensor_meta")),
                    str(m.get("original_aten")),
                    None if eager is None else torch.utils._pytree.tree_map(desc, eager)))
    return out


@pytest.mark.parametrize("flavor", ["inductor", "aten"])
def test_every_replacement_built_directly_is_make_fx_s(flavor):
    """Each registered replacement at its example inputs, under the flavour's decompositions
    (Inductor's turn a cast into a prims one): the same graph and metas as make_fx's."""
    table = manager.decomp_table(flavor)
    direct = declined = 0
    for fam, sp in every_spelling():
        mode = FakeTensorMode()
        args = _fake(list(sp.example()) + list(sp.scalars.values()), mode)
        with mode:  # as the matcher traces a replacement: under the graph's fake mode
            got = direct_trace(sp.replace, args, lambda: table)
            want = trace_store.trace_canonical(sp.replace, args, get_decomp_fn=lambda: table)
        where = f"{fam.name}.{sp.name}"
        if got is None:
            declined += 1
            continue
        direct += 1
        assert search_memo.graph_key(got) == search_memo.graph_key(want), where
        assert _metas(got) == _metas(want), where
    print(f"{flavor}: {direct} replacements built directly, {declined} declined")
    assert declined <= 0.05 * (direct + declined), (direct, declined)


def _fake_inputs():
    mode = FakeTensorMode()
    with mode:
        return mode, torch.empty(2, 3, 8), torch.empty(2, 3, dtype=torch.long)


def test_what_it_cannot_record_as_make_fx_would_is_declined():
    mode, p, d = _fake_inputs()
    outside = torch.zeros(2, 3, dtype=torch.long)
    cases = {
        "a tensor from outside": lambda p, d: torch.ops.npuspec.greedy_accept(outside, d),
        "a mutating op": lambda p, d: torch.ops.npuspec.greedy_accept(d.clone().add_(1), d),
        "an explicit detach": lambda p, d: torch.ops.npuspec.greedy_accept(d.detach(), d),
    }
    for what, fn in cases.items():
        before = counters["pattern_direct_trace.declined"]
        with mode:
            assert direct_trace(fn, [p, d]) is None, what
        assert counters["pattern_direct_trace.declined"] == before + 1, what


def test_aten_ops_around_the_op_are_recorded_as_make_fx_records_them():
    """Casts, arithmetic, a shape read and a tuple result, under both flavours' tables."""
    mode, p, d = _fake_inputs()

    def fn(p, d):
        n = torch.ops.npuspec.greedy_accept(d[:, :p.shape[1]], d)
        return p.argmax(-1).long() - 1, (n.int() + 1).view(-1, 1)

    for flavor in ("inductor", "aten"):
        table = manager.decomp_table(flavor)
        with mode:
            got = direct_trace(fn, [p, d], lambda: table)
            want = trace_store.trace_canonical(fn, [p, d], get_decomp_fn=lambda: table)
        assert got is not None, flavor
        assert search_memo.graph_key(got) == search_memo.graph_key(want), flavor
        assert _metas(got) == _metas(want), flavor


def test_real_tensors_and_aliased_inputs_are_declined():
    fn = lambda a, b: torch.ops.npuspec.greedy_accept(a, b)  # noqa: E731
    real = torch.zeros(2, 3, dtype=torch.long)
    assert direct_trace(fn, [real, real.clone()]) is None  # registration: make_fx's job
    mode, _, d = _fake_inputs()
    with mode:
        assert direct_trace(fn, [d, d]) is None  # one value twice: the node is ambiguous


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

