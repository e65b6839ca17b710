"""passes/rewrites/nonneg.py: the spellings of max(p - q, 0) reach the Residual family.

Exactness first (each spelling on NaN, -0.0 and inf, under eager ATen and Inductor's code: the
table in the rule's docstring), then the rule on its own graphs, then three ways through the
backend: each spelling fuses under both lowerings and the tokens equal eager's, a rewritten
site that no family takes still returns eager's tokens, and look-alikes stay as written.
"""
from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as pytree
import torch.nn.functional as F
from passes_helpers import aten_graph, compile_npuspec, three_way

from npuspec.passes.rewrites import nonneg

NAN, INF = float("nan"), float("inf")
aten = torch.ops.aten

CLAMP_CLASS = {
    "relu": lambda d: torch.relu(d),
    "F_relu": lambda d: F.relu(d),
    "clamp": lambda d: torch.clamp(d, min=0),  # clamp_min(d, 0) once canonical.py has run
    "clamp_min_float": lambda d: d.clamp_min(0.0),
    "clamp_min": lambda d: d.clamp_min(0),  # the canonical form
    "maximum_tensor": lambda d: torch.maximum(d, torch.tensor(0.0)),
    "maximum_zeros_like": lambda d: torch.maximum(d, torch.zeros_like(d)),
    "maximum_zeros_first": lambda d: torch.maximum(torch.zeros_like(d), d),
}
WHERE_CLASS = {
    "where_scalar": lambda d: torch.where(d > 0, d, 0.0),  # the canonical form itself
    "where_zeros_like": lambda d: torch.where(d > 0, d, torch.zeros_like(d)),
    "where_float_gt": lambda d: torch.where(d > 0.0, d, torch.zeros_like(d)),
    "where_gt_tensor": lambda d: torch.where(d > torch.zeros_like(d), d, 0.0),
    "where_tensor_zero": lambda d: torch.where(d > 0, d, torch.tensor(0.0)),
}
SPELLINGS = {**CLAMP_CLASS, **WHERE_CLASS}
CANONICAL = {"clamp_min", "where_scalar"}  # in both flavours


def _adversarial(dtype=torch.float32) -> torch.Tensor:
    vals = [NAN, -NAN, -0.0, 0.0, -1.0, 1.0, INF, -INF, 1e-45, -1e-45, 3.0, -2.5]
    x = torch.tensor(vals * 3, dtype=torch.float32).to(dtype)
    x.view(torch.int16 if dtype.itemsize == 2 else torch.int32 if dtype.itemsize == 4
           else torch.int64)[12] += 5  # a NaN with another payload
    return x


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.dtype.itemsize])


def _lowered(fn, x, lowering):
    if lowering == "eager":
        return fn(x)
    torch._dynamo.reset()
    return torch.compile(fn, backend="inductor")(x)


def _similar(a, b) -> bool:
    """a ~ b: NaN at the same places, every other entry equal as a value (-0.0 == 0.0)."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


# --------------------------------------------------------------------------------------------
# exactness of the spellings themselves
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lowering", ["eager", "inductor"])
def test_where_class_is_bit_equal_to_its_canonical_form(lowering, dtype, no_fx_cache):
    x = _adversarial(dtype)
    want = _bits(_lowered(WHERE_CLASS["where_scalar"], x, lowering))
    for name, fn in WHERE_CLASS.items():
        assert torch.equal(_bits(_lowered(fn, x, lowering)), want), name


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
def test_clamp_class_agrees_up_to_zero_signs_and_nan_payloads(lowering, no_fx_cache):
    x = _adversarial()
    want = _lowered(CLAMP_CLASS["clamp"], x, lowering)
    for name, fn in CLAMP_CLASS.items():
        assert _similar(_lowered(fn, x, lowering), want), name


def test_the_differences_the_rule_argues_about():
    """The docstring's table: which cells differ in bits (so the clamp class needs the token
    argument) and that where is another function (NaN -> 0)."""
    x = torch.tensor([NAN, -0.0] * 33)
    relu, clamp = torch.relu(x), torch.clamp(x, min=0)
    assert torch.equal(_bits(relu), _bits(x)) and torch.equal(_bits(clamp), _bits(x))
    # eager maximum: +0.0 and another NaN in ATen's vectorised loop, x's bits in its scalar
    # tail (so even its own bits depend on where an element sits)
    mx = torch.maximum(x, torch.zeros_like(x))
    assert not torch.equal(_bits(mx), _bits(clamp)) and _similar(mx, clamp)
    torch._dynamo.reset()
    ind = torch.compile(lambda t: torch.clamp(t, min=0), backend="inductor")(x)
    assert (_bits(ind)[1::2] == 0).all()  # Inductor's clamp: +0.0 where eager's keeps -0.0
    where = torch.where(x > 0, x, 0.0)
    assert torch.equal(_bits(where), torch.zeros(66, dtype=torch.int32))


def test_log_and_multinomial_do_not_see_a_zeros_sign():
    z = torch.tensor([-0.0, 0.0] * 8)
    assert torch.equal(_bits(torch.log(z)), _bits(torch.full((16,), -INF)))
    torch._dynamo.reset()
    assert torch.equal(torch.compile(torch.log, backend="inductor")(z), torch.log(z))
    p = torch.tensor([[0.0, 0.0, 0.3, 0.0, 0.7, 0.0]] * 4)
    for seed in range(20):
        torch.manual_seed(seed)
        a = torch.multinomial(p, 1)
        torch.manual_seed(seed)
        assert torch.equal(torch.multinomial(torch.where(p == 0, -0.0, p), 1), a)


# --------------------------------------------------------------------------------------------
# the rule on traced graphs
# --------------------------------------------------------------------------------------------
def _race(nn):
    def fn(p, q, e):
        r = nn(p - q)
        return (r / r.sum(-1, keepdim=True) / e).argmax(-1)
    return fn


def _pq(nan: bool = True):
    g = torch.Generator().manual_seed(5)
    p, q = torch.rand(3, 11, generator=g), torch.rand(3, 11, generator=g)
    p[0, :4], q[0, :4] = -0.0, 0.0  # p - q = -0.0 beside positive entries
    p[1], q[1] = -0.0, 0.0          # a row of -0.0s: 0 / 0 after the row normalisation
    if nan:
        p[2, 0], p[2, 3], q[2, 3], p[2, 7] = NAN, INF, INF, INF  # NaN, inf - inf, inf
    else:
        p[1, 5] = 0.5               # multinomial wants a positive row sum: one entry left
    return p, q, torch.rand(3, 11, generator=g) + 0.1


def _ops(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("name", sorted(SPELLINGS))
def test_rule_rewrites_into_the_canonical_forms(name):
    p, q, e = _pq()
    fn = _race(SPELLINGS[name])
    gm = aten_graph(fn, p, q, e)
    n = nonneg.apply(gm.graph, "aten")
    gm.graph.eliminate_dead_code()
    gm.recompile()
    assert n == (0 if name in CANONICAL else 1)
    ops = _ops(gm)
    if name in WHERE_CLASS:
        assert aten.where.self in ops and aten.scalar_tensor.default in ops
        assert aten.zeros_like.default not in ops and aten.lift_fresh_copy.default not in ops
    else:
        assert aten.clamp_min.default in ops
        assert not {aten.relu.default, aten.maximum.default, aten.clamp.default} & set(ops)
    assert torch.equal(gm(p, q, e), fn(p, q, e))


def test_where_rewrite_is_bit_equal_where_the_value_escapes():
    x = _adversarial().reshape(3, 12)
    fn = WHERE_CLASS["where_zeros_like"]
    gm = aten_graph(fn, x)
    assert nonneg.apply(gm.graph, "aten") == 1
    gm.recompile()
    assert torch.equal(_bits(gm(x)), _bits(fn(x)))


def _returned_too(p, q, e):
    r = torch.relu(p - q)
    return r, (r / e).argmax(-1)


@pytest.mark.parametrize("fn", [
    lambda p, q, e: torch.relu(p - q),                                   # returned
    _returned_too,
    lambda p, q, e: (1.0 / torch.relu(p - q)).argmax(-1),               # +-0 -> +-inf
    lambda p, q, e: (e / torch.relu(p - q)).argmax(-1),
    lambda p, q, e: torch.relu(p - q).amax(-1),                          # a value, not an index
    lambda p, q, e: (torch.relu(p - q) / e.sum(-1, keepdim=True)).max(-1).values,
    lambda p, q, e: torch.multinomial(torch.relu(p - q).double(), 1),
], ids=["output", "second_use", "reciprocal", "denominator", "amax", "max_values",
        "cast"])
def test_clamp_class_put_back_where_a_zeros_sign_could_show(fn):
    """Rewritten on trial (a residual op that takes it computes relu's eager bits); with no
    family taking it, undo_untaken gives the relu back, and the graph computes what it did."""
    p, q, e = _pq(nan=False)
    gm = aten_graph(fn, p, q, e)
    want = fn(p, q, e)
    assert nonneg.apply(gm.graph, "aten") == 1
    assert aten.clamp_min.default in _ops(gm)
    assert nonneg.undo_untaken(gm.graph) == 1
    gm.graph.eliminate_dead_code()
    gm.recompile()
    assert aten.relu.default in _ops(gm) and aten.clamp_min.default not in _ops(gm)
    for a, b in zip(pytree.tree_leaves(gm(p, q, e)), pytree.tree_leaves(want)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fn", [
    lambda d: torch.maximum(d, torch.zeros_like(d)),
    lambda d: torch.maximum(torch.zeros_like(d), d),
], ids=["maximum", "maximum_swapped"])
def test_maximum_read_otherwise_is_not_tried(fn):
    """maximum's eager zero signs and NaN payloads are not clamp_min's: no trial."""
    p, q, e = _pq(nan=False)
    gm = aten_graph(lambda p, q, e: fn(p - q), p, q, e)
    assert nonneg.apply(gm.graph, "aten") == 0


@pytest.mark.parametrize("fn", [
    lambda d: torch.clamp(d, min=1e-5), lambda d: torch.clamp(d, 0, 1),
    lambda d: torch.maximum(d, torch.tensor(0.5)), lambda d: torch.maximum(d, torch.tensor(-0.0)),
    lambda d: torch.where(d > 0, d, 1.0), lambda d: torch.where(d >= 0, d, 0.0),
    lambda d: torch.where(d > 1, d, 0.0), lambda d: torch.where(d > 0, d, -0.0),
    lambda d: torch.where(d > 0, torch.zeros_like(d), d),
], ids=["clamp_1e-5", "clamp_0_1", "maximum_half", "maximum_neg_zero", "where_1",
        "where_ge", "where_gt_1", "where_neg_zero", "where_swapped"])
def test_look_alikes_are_not_rewritten(fn):
    p, q, e = _pq()
    gm = aten_graph(_race(fn), p, q, e)
    assert nonneg.apply(gm.graph, "aten") == 0


# --------------------------------------------------------------------------------------------
# three ways through the backend
# --------------------------------------------------------------------------------------------
SAMPLERS = {
    "race": lambda r, e: (r / r.sum(-1, keepdim=True) / e).argmax(-1),
    "gumbel": lambda r, e: (r.log() + e).argmax(-1),
    "multinomial": lambda r, e: torch.multinomial(r / r.sum(-1, keepdim=True), 1),
}
# every spelling with one sampler, each sampler with a few spellings
CASES = [(s, list(SAMPLERS)[i % 3]) for i, s in enumerate(sorted(SPELLINGS))]


def _fn(spelling, sampler):
    nn, tail = SPELLINGS[spelling], SAMPLERS[sampler]
    return lambda p, q, e: tail(nn(p - q), e)


def _inputs(sampler):
    return _pq(nan=sampler != "multinomial")  # multinomial raises on NaN: on both sides


def _rewrites(spelling, lowering) -> bool:
    """Whether the rule has something to do: the canonical forms are left alone, and
    clamp(min=0) is clamp_min(x, 0) before the rule runs (Inductor's table, or the literal
    canonicaliser in the aten flavour)."""
    return spelling not in CANONICAL and spelling != "clamp"


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
@pytest.mark.parametrize("spelling,sampler", CASES, ids=[f"{a}-{b}" for a, b in CASES])
def test_each_spelling_fuses_three_ways(spelling, sampler, lowering, no_fx_cache):
    op = "npuspec.residual_probs" if sampler == "multinomial" else "npuspec.residual_sample"
    gone = ("aten.where", "aten.relu", "aten.maximum", "aten.clamp")
    three_way(_fn(spelling, sampler), _inputs(sampler), lowering=lowering, family="residual",
              appear=(op,), gone=gone)
    moved = three_way.last_delta.get("canonical_rewrites.nonneg", 0)
    assert moved == (1 if _rewrites(spelling, lowering) else 0), three_way.last_delta


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
def test_where_mode_is_what_fuses_the_where_class(lowering, no_fx_cache):
    _, graphs = three_way(_fn("where_zeros_like", "race"), _pq(), lowering=lowering,
                          family="residual", appear=("npuspec.residual_sample",))
    assert "race, where)" in graphs
    _, graphs = three_way(_fn("relu", "race"), _pq(), lowering=lowering, family="residual")
    assert "race)" in graphs and "where)" not in graphs  # the default mode, clamp


def _unfused(p, q, e, drafts, target):
    """A greedy count (which fuses) beside a relu race whose float64 noise the Residual
    family refuses: the rewritten clamp stays in the graph and is lowered as it is."""
    n = (drafts == target).cumprod(-1).sum(-1)
    r = torch.relu(p - q)
    return n, (r / r.sum(-1, keepdim=True) / e.double()).argmax(-1), (r.log() + e).argmax(-1)


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
def test_a_rewritten_site_no_family_takes_still_returns_eagers_tokens(lowering, no_fx_cache):
    p, q, e = _pq()
    drafts, target = torch.tensor([[1, 2, 3]] * 3), torch.tensor([[1, 2, 4]] * 3)
    _, graphs = three_way(_unfused, (p, q, e, drafts, target), lowering=lowering,
                          family="greedy_accept", gone=("aten.relu",))
    assert three_way.last_delta.get("verify_patterns_matched.residual", 0) == 0
    assert three_way.last_delta.get("canonical_rewrites.nonneg", 0) == 1
    assert "aten.clamp" in graphs


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
@pytest.mark.parametrize("nn", [
    lambda d: torch.maximum(d, torch.tensor(0.5)),
    lambda d: torch.where(d > 0, d, 1.0)], ids=["maximum_half", "where_1"])
def test_look_alikes_stay_unfused_and_eager_equal(nn, lowering, no_fx_cache):
    fn = lambda p, q, e: SAMPLERS["race"](nn(p - q), e)  # noqa: E731
    three_way(fn, _pq(), lowering=lowering, matched=0, gone=("npuspec.residual",))
    assert three_way.last_delta.get("canonical_rewrites.nonneg", 0) == 0


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
def test_clamp_at_another_floor_is_not_rewritten_but_fuses_with_its_floor(lowering, no_fx_cache):
    """clamp(d, min=1e-5) is not max(d, 0): nonneg leaves it, and the residual family takes it
    as written, passing its literal to the op's floor (vLLM v1's forward_native)."""
    fn = lambda p, q, e: SAMPLERS["race"](torch.clamp(p - q, min=1e-5), e)  # noqa: E731
    _, graphs = three_way(fn, _pq(), lowering=lowering, family="residual",
                          appear=("npuspec.residual_sample",))
    assert three_way.last_delta.get("canonical_rewrites.nonneg", 0) == 0
    assert "1e-05" in graphs


def _gpt_fast_residual(draft, target):
    """gpt-fast's rejection branch: where(new > 0, new, 0.0), normalised, then
    multinomial_sample_one_no_sync (its own Exp(1) draw, argmax with keepdim=True, int32)."""
    new = target - draft
    new = torch.where(new > 0, new, 0.0)
    new = new / new.sum(dim=-1, keepdim=True)
    expo = torch.empty_like(new).exponential_(1)
    return torch.argmax(new / expo, dim=-1, keepdim=True).to(dtype=torch.int)


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
def test_gpt_fast_residual_fuses_in_where_mode(lowering, no_fx_cache):
    p, q, _ = _pq()
    _, graphs = three_way(_gpt_fast_residual, (q, p), lowering=lowering, family="residual",
                          appear=("npuspec.residual_sample",), gone=("aten.where", "aten.argmax"))
    assert "race, where)" in graphs


# --------------------------------------------------------------------------------------------
# where(p > q, p - q, 0): the compare written on the operands
# --------------------------------------------------------------------------------------------
def where_p_gt_q(p, q):
    return torch.where(p > q, p - q, torch.zeros_like(p))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lowering", ["eager", "inductor"])
def test_operand_compare_is_bit_equal_to_the_canonical_where(lowering, dtype, no_fx_cache):
    """Every pair of the adversarial values (NaN payloads, +-0.0, +-inf, subnormals): p > q
    decides exactly as p - q > 0."""
    x = _adversarial(dtype)
    p, q = x[:, None].expand(-1, x.numel()), x[None, :].expand(x.numel(), -1)
    canon = lambda p, q: WHERE_CLASS["where_scalar"](p - q)  # noqa: E731
    got = _lowered(lambda t: where_p_gt_q(t[0], t[1]), torch.stack([p, q]), lowering)
    want = _lowered(lambda t: canon(t[0], t[1]), torch.stack([p, q]), lowering)
    assert torch.equal(_bits(got), _bits(want))


def test_operand_compare_is_rewritten_and_look_alikes_are_not():
    p, q, e = _pq()
    gm = aten_graph(lambda p, q, e: (where_p_gt_q(p, q) / e).argmax(-1), p, q, e)
    assert nonneg.apply(gm.graph, "aten") == 1
    gm.recompile()
    assert torch.equal(gm(p, q, e), (where_p_gt_q(p, q) / e).argmax(-1))
    for fn in (lambda p, q: torch.where(p >= q, p - q, torch.zeros_like(p)),   # >=: -0.0 kept
               lambda p, q: torch.where(q > p, p - q, torch.zeros_like(p)),    # the other way
               lambda p, q: torch.where(p > q, q - p, torch.zeros_like(p))):   # the other sub
        gm = aten_graph(lambda p, q, e: (fn(p, q) / e).argmax(-1), p, q, e)
        assert nonneg.apply(gm.graph, "aten") == 0


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
def test_operand_compare_residual_fuses_in_where_mode(lowering, no_fx_cache):
    fn = lambda p, q, e: (where_p_gt_q(p, q) / e).argmax(-1)  # noqa: E731
    three_way(fn, _pq(), lowering=lowering, family="residual",
              appear=("npuspec.residual_sample",), gone=("aten.gt",))
    assert three_way.last_delta.get("canonical_rewrites.nonneg", 0) == 1


# --------------------------------------------------------------------------------------------
# the trial rewrite: relu / clamp read by something other than a token
# --------------------------------------------------------------------------------------------
def _lucidrains_residual(p, q, acc):
    """lucidrains/speculative-decoding's adjusted distribution: relu(p - q) at the rejected
    row, normalised and returned (it is sampled only after a `where` with the bonus row)."""
    rows = torch.arange(p.shape[0])[:, None]
    adjusted = F.relu(p[rows, acc[:, None]] - q[rows, acc[:, None]])       # [B, 1, V]
    adjusted = adjusted / adjusted.sum(dim=-1, keepdim=True)
    return adjusted.reshape(p.shape[0], -1)


def _rows(nan: bool):
    """[3, 4, 11] target and draft rows from _pq's (-0.0 entries, NaN and inf if asked)."""
    p, q, _ = _pq(nan)
    return (torch.stack([p.roll(i, 0) for i in range(4)], 1),
            torch.stack([q.roll(i, 0) for i in range(4)], 1))


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
def test_a_returned_relu_residual_fuses_with_eagers_bits(lowering, no_fx_cache):
    p, q = _rows(nan=False)  # -0.0 differences (three_way compares with torch.equal: no NaN)
    acc = torch.tensor([0, 2, 3])
    three_way(_lucidrains_residual, (p, q, acc), lowering=lowering, family="residual",
              appear=("npuspec.residual_probs",), gone=("aten.relu", "aten.clamp"))
    assert three_way.last_delta.get("canonical_rewrites.nonneg", 0) == 1
    p, q = _rows(nan=True)  # NaN, inf - inf, a row of -0.0s: the same bits as eager's
    torch._dynamo.reset()
    got = compile_npuspec(_lucidrains_residual, lowering)(p, q, acc)
    assert torch.equal(_bits(got), _bits(_lucidrains_residual(p, q, acc)))


def _relu_read_as_a_value(p, q, drafts, target):
    """A greedy count (which fuses) beside a relu read by amax: no family takes the relu."""
    return (drafts == target).cumprod(-1).sum(-1), torch.relu(p - q).amax(-1), torch.relu(p - q)


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
def test_a_trial_site_no_family_takes_gets_its_relu_back(lowering, no_fx_cache):
    p, q, _ = _pq(nan=False)
    drafts, target = torch.tensor([[1, 2, 3]] * 3), torch.tensor([[1, 2, 4]] * 3)
    out, graphs = three_way(_relu_read_as_a_value, (p, q, drafts, target), lowering=lowering,
                            family="greedy_accept")
    assert three_way.last_delta.get("canonical_rewrites.nonneg", 0) == 0
    if lowering == "eager":  # the aten graph the eager lowering runs is in the history
        assert "aten.relu" in graphs and "aten.clamp" not in graphs
    assert torch.equal(_bits(out[2]), _bits(torch.relu(p - q)))  # -0.0 kept, as relu keeps it
