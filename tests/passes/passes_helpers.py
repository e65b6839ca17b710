"""Shared helpers for the pass tests: the three-way check and a compact graph printer."""
from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from npuspec import counters
from npuspec.passes import manager


def compile_npuspec(fn, lowering="eager"):
    return torch.compile(fn, backend="npuspec", options={"lowering": lowering, "capture": False})


def three_way(fn, args, *, lowering="eager", matched=1, family=None, gone=(), appear=(),
              seed=0, compiled=None, float_tol=None, fresh=None):
    """Run fn eagerly and compiled with backend="npuspec" from the same RNG state.

    Checks (1) outputs are torch.equal, (2) the graphs after the passes contain every op in
    `appear` and none in `gone`, (3) counters["verify_patterns_matched"] moved by `matched`
    (and `verify_patterns_matched.<family>` too when given). Returns (outputs, graph text)."""
    manager.HISTORY.clear()
    fresh = compiled is None if fresh is None else fresh  # fresh: this call compiles
    cf = compile_npuspec(fn, lowering) if compiled is None else compiled
    torch.manual_seed(seed)
    expected = fn(*args)
    before = counters.snapshot()
    torch.manual_seed(seed)
    got = cf(*args)
    delta = counters.delta(before)
    exp_l, got_l = pytree.tree_leaves(expected), pytree.tree_leaves(got)
    assert len(exp_l) == len(got_l)
    for e, g in zip(exp_l, got_l):
        if isinstance(e, torch.Tensor):
            assert e.dtype == g.dtype and e.shape == g.shape, (e, g)
            if float_tol is not None and e.is_floating_point():
                torch.testing.assert_close(g, e, rtol=float_tol, atol=float_tol)
            else:
                assert torch.equal(e, g), (e, g)
        else:
            assert e == g, (e, g)
    graphs = "\n".join(g for _, _, g in manager.HISTORY)
    if fresh:  # a fresh compile: the passes ran in this call
        if matched is not None:
            assert delta.get("verify_patterns_matched", 0) == matched, delta
        if family is not None and matched:
            assert delta.get(f"verify_patterns_matched.{family}", 0) == matched, delta
        for op in appear:
            assert op in graphs, f"{op} missing after the passes:\n{graphs}"
        for op in gone:
            assert op not in graphs, f"{op} still there after the passes:\n{graphs}"
    three_way.last_delta = delta
    return got, graphs


def compact(gm: torch.fx.GraphModule) -> str:
    """One line per node: `name = op(args)`, for assertExpectedInline snapshots."""
    lines = []
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            lines.append(f"{n.name} = input")
        elif n.op == "output":
            lines.append(f"return {n.args[0]}")
        else:
            t = n.target
            name = (f"{t.namespace}.{t._schema.name.split('::')[1]}"
                    if isinstance(t, torch._ops.OpOverload) else getattr(t, "__name__", str(t)))
            args = ", ".join([str(a) for a in n.args] + [f"{k}={v}" for k, v in n.kwargs.items()])
            lines.append(f"{n.name} = {name}({args})")
    return "\n".join(lines)


def aten_graph(fn, *args) -> torch.fx.GraphModule:
    """fn traced to ATen with fake tensors (what AOT autograd hands the eager lowering)."""
    from torch.fx.experimental.proxy_tensor import make_fx
    return make_fx(fn, tracing_mode="fake")(*args)


def every_spelling():
    """(family, spelling) for every spelling of the default families and of SampleVerify's
    other modes, each (family name, spelling name) once."""
    from npuspec.passes.patterns import default_patterns
    from npuspec.passes.patterns_sample import OTHER_MODES, SampleVerify, SampleVerifyConfig
    seen = set()
    for fam in default_patterns() + [SampleVerify(SampleVerifyConfig(modes=OTHER_MODES))]:
        for sp in fam.spellings():
            if (fam.name, sp.name) not in seen:
                seen.add((fam.name, sp.name))
                yield fam, sp
