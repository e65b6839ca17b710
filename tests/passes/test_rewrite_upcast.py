"""passes/rewrites/upcast.py: a half-precision clamp, as Inductor's decompositions write it,
goes back to the user's `clamp_min(d, c)`, so a float16 / bfloat16 residual fuses under the
default (Inductor) lowering as it does under the eager one.

Exactness first (the rule's graph against Inductor's decomposed chain, bit for bit, on NaN,
-0.0, inf and subnormals), then the rule on its own graphs (what it takes and what it leaves),
then three ways through the backend.
"""
from __future__ import annotations

import pytest
import torch
from passes_helpers import three_way
from torch._inductor.decomposition import select_decomp_table
from torch.fx.experimental.proxy_tensor import make_fx

from npuspec import counters
from npuspec.passes.rewrites import upcast

NAN, INF = float("nan"), float("inf")
aten, prims = torch.ops.aten, torch.ops.prims
HALF = [torch.float16, torch.bfloat16]


def _adversarial(dtype) -> torch.Tensor:
    tiny = torch.finfo(dtype).tiny
    vals = [NAN, -NAN, -0.0, 0.0, -1.0, 1.0, INF, -INF, tiny / 4, -tiny / 4, 3.0, -2.5, 6e-5]
    x = torch.tensor(vals * 3, dtype=torch.float32).to(dtype)
    x.view(torch.int16)[13] += 5  # a NaN with another payload
    return x


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def _inductor_graph(fn, *args) -> torch.fx.GraphModule:
    """fn traced to ATen with Inductor's decompositions (the Inductor flavour's input)."""
    return make_fx(fn, decomposition_table=select_decomp_table(), tracing_mode="fake")(*args)


def _targets(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


# --------------------------------------------------------------------------------------------
# exactness: the graph the rule leaves, lowered by Inductor, against Inductor's own chain
# --------------------------------------------------------------------------------------------
def _two_clamps(c):
    def fn(p, q, d):
        # a residual a family takes (so the rewrites land) beside a clamp nothing takes
        r = torch.clamp(p - q, min=0.0)
        return torch.multinomial(r / r.sum(), 1), torch.clamp(d, min=c)
    return fn


@pytest.mark.parametrize("c", [0.0, 1e-5, torch.finfo(torch.float32).tiny])
@pytest.mark.parametrize("dtype", HALF)
def test_a_rewritten_clamp_lowers_to_inductors_bits(dtype, c, no_fx_cache):
    g = torch.Generator().manual_seed(0)
    p, q = (torch.softmax(torch.randn(40, generator=g), -1).to(dtype) for _ in range(2))
    d = _adversarial(dtype)
    torch._dynamo.reset()
    stock = torch.compile(_two_clamps(c), backend="inductor")(p, q, d)[1]
    torch._dynamo.reset()
    before = counters.snapshot()
    ours = torch.compile(_two_clamps(c), backend="npuspec",
                         options={"lowering": "inductor", "capture": False})(p, q, d)[1]
    delta = counters.delta(before)
    assert delta.get("canonical_rewrites.upcast") == 2, delta  # both clamps were rewritten
    assert delta.get("verify_patterns_matched") == 1, delta
    assert torch.equal(_bits(ours), _bits(stock))
    # and eager's, where eager's and Inductor's clamps agree (not in zero signs: the nonneg
    # rule's table, whose argument this rule only hands the aten flavour's spelling)
    want = torch.clamp(d, min=c)
    assert torch.equal(ours.isnan(), want.isnan())
    assert torch.equal(ours.nan_to_num(0.0), want.nan_to_num(0.0))


@pytest.mark.parametrize("c", [0.0, 1e-5, torch.finfo(torch.float32).tiny, -1.5, 3e-8, 0.1])
@pytest.mark.parametrize("dtype", HALF)
def test_the_chain_is_clamp_in_the_half_dtype(dtype, c):
    """The rule's argument, on every value of the dtype: max(float(d), c) converted back has
    eager's `clamp_min(d, c)` values and NaN places (c rounded to the dtype or not)."""
    d = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
    chain = torch.clamp_min(d.float(), c).to(dtype)
    eager = torch.clamp_min(d, c)
    assert torch.equal(chain.isnan(), eager.isnan())
    keep = ~eager.isnan()
    assert torch.equal(chain[keep].float(), eager[keep].float())


# --------------------------------------------------------------------------------------------
# the rule on traced graphs
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", HALF)
def test_the_chain_becomes_one_clamp(dtype):
    d = torch.randn(8).to(dtype)
    gm = _inductor_graph(lambda x: torch.clamp(x, min=0.0), d)
    assert prims.convert_element_type.default in _targets(gm)  # Inductor's chain is there
    assert upcast.apply(gm.graph, "inductor") == 1
    gm.graph.eliminate_dead_code()
    gm.recompile()
    assert _targets(gm) == [aten.clamp_min.default]
    assert torch.equal(gm(d), torch.clamp(d, min=0.0))


@pytest.mark.parametrize("case", ["float32", "past_the_range", "other_dtype", "clamp_max"])
def test_look_alikes_stay(case):
    if case == "float32":  # no chain: Inductor clamps float32 as it is
        fn, arg = (lambda x: torch.clamp(x, min=0.0)), torch.randn(8)
    elif case == "past_the_range":  # eager refuses it on a float16 tensor; left as written
        fn, arg = (lambda x: torch.clamp(x.float(), min=1e6).half()), torch.randn(8).half()
    elif case == "other_dtype":  # the chain ends in another dtype than d's
        fn = lambda x: torch.clamp(x.float(), min=0.0).to(torch.bfloat16)  # noqa: E731
        arg = torch.randn(8).half()
    else:
        fn, arg = (lambda x: torch.clamp(x, max=0.0)), torch.randn(8).half()
    gm = _inductor_graph(fn, arg)
    assert upcast.apply(gm.graph, "inductor") == 0


def test_the_aten_flavour_has_no_chain():
    from passes_helpers import aten_graph
    gm = aten_graph(lambda x: torch.clamp(x, min=0.0), torch.randn(8).half())
    assert upcast.apply(gm.graph, "aten") == 0


# --------------------------------------------------------------------------------------------
# three ways through the backend: ktransformers' residual on float16 probabilities
# --------------------------------------------------------------------------------------------
def kt_residual(main_prob, draft_prob):
    new_prob = main_prob - draft_prob
    new_prob = torch.clamp(new_prob, min=0.0)
    new_prob /= new_prob.sum()
    return torch.multinomial(new_prob, 1)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("lowering", ["inductor", "eager"])
def test_a_half_residual_fuses_under_both_lowerings(lowering, dtype, no_fx_cache):
    g = torch.Generator().manual_seed(3)
    p, q = (torch.softmax(torch.randn(2, 64, generator=g), -1).to(dtype) for _ in range(2))
    for seed in range(3):
        torch._dynamo.reset()
        before = counters.snapshot()
        _, text = three_way(kt_residual, (p[0], q[0]), lowering=lowering, family="residual",
                            appear=("npuspec.residual_probs",), seed=seed)
        rewrites = counters.delta(before).get("canonical_rewrites.upcast", 0)
        assert rewrites == (1 if lowering == "inductor" else 0)
