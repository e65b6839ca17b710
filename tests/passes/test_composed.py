"""passes/composed.py: whole steps composed from the narrow ops become one rejection_sample.

Three ways through the backend (outputs equal eager's from the same RNG state, one
`npuspec.rejection_sample` where `ratio_accept` and `residual_sample` were, and
`verify_patterns_matched.composed` moved), under both lowerings, for vLLM v1's forward_native
(random and n-gram drafts, transcribed in field_vllm.py) and for an emission written another
way that also returns the count; near misses (another fill, the token one slot late, a second
ids tensor, one row wrong at one count) stay as the narrow ops and equal eager. A correct
emission the user then rewrites (`where(out == -1, -2, out)`) is fused up to the emission, the
rewrite kept.
"""
from __future__ import annotations

import pytest
import torch
from field_corpus import BY_NAME
from passes_helpers import three_way

B, K, V = 5, 4, 23
FAMILY = "verify_patterns_matched.composed"


@pytest.fixture(autouse=True)
def _no_fx_graph_cache():
    # a cache hit skips the passes (the cached graph holds the op already): compile afresh
    from torch._inductor import config
    with config.patch(fx_graph_cache=False):
        yield


def _matched(delta) -> int:
    return delta.get(FAMILY, 0)


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
@pytest.mark.parametrize("name", ["vllm_v1_native_random", "vllm_v1_native_ngram"])
def test_vllm_v1_forward_native_is_one_call(name, lowering):
    e = BY_NAME[name]
    for seed in (3, 4):
        torch._dynamo.reset()
        _, graphs = three_way(e.fn, e.make(seed), lowering=lowering, matched=None,
                              appear=("npuspec.rejection_sample",),
                              gone=("npuspec.ratio_accept", "npuspec.residual_sample"))
        assert _matched(three_way.last_delta) == 1, three_way.last_delta
        assert graphs.count("npuspec.rejection_sample.default]") == 1, graphs


def _pieces(p, q, ids, u, e, floor=1e-5):
    k = ids.shape[1]
    px = p[:, :k].gather(-1, ids[..., None]).squeeze(-1)
    qx = q.gather(-1, ids[..., None]).squeeze(-1)
    n = (px / qx >= u).cumprod(dim=1).sum(dim=1)                          # [B]
    r = torch.clamp(p[:, :k] - q, min=floor)
    rec = (r / r.sum(-1, keepdim=True) / e).argmax(-1)                     # [B, K]
    return n, rec


def _emit(emitted_ids, n, rec, bonus, fill=-1, late=0):
    # ids before n, the token at n (+ late), `fill` elsewhere; late=1 also writes ids at n
    k = emitted_ids.shape[1]
    tok = torch.cat([rec, bonus[:, None]], 1).gather(1, n[:, None])        # [B, 1]
    pos = torch.arange(k + 1)[None, :]
    padded = torch.cat([emitted_ids, torch.full_like(emitted_ids[:, :1], fill)], 1)
    out = torch.where(pos < n[:, None] + late, padded, fill)
    return torch.where(pos == n[:, None] + late, tok, out)


def where_emission(p, q, ids, u, e, bonus):
    # the emission by comparisons, and the count returned as well
    n, rec = _pieces(p, q, ids, u, e)
    return _emit(ids, n, rec, bonus), n


def other_fill(p, q, ids, u, e, bonus):
    n, rec = _pieces(p, q, ids, u, e)
    return _emit(ids, n, rec, bonus, fill=-2), n                          # -2, not -1


def token_late(p, q, ids, u, e, bonus):
    n, rec = _pieces(p, q, ids, u, e)
    return _emit(ids, n, rec, bonus, late=1), n                           # one slot late


def other_ids(p, q, ids, u, e, bonus, ids2):
    n, rec = _pieces(p, q, ids, u, e)
    return _emit(ids2, n, rec, bonus), n                                  # not the test's ids


def first_row_other_bonus(p, q, ids, u, e, bonus):
    # right everywhere but one (row, count): row 0, all K accepted, emits its last recovered
    # token instead of the bonus. The check must give every row every count to see it (its
    # first evaluation gives row 0 the count 0)
    n, rec = _pieces(p, q, ids, u, e)
    row0 = torch.arange(ids.shape[0]) == 0
    return _emit(ids, n, rec, torch.where(row0, rec[:, -1], bonus)), n


def _inputs(seed, b=None):
    B_ = B if b is None else b
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(B_, K + 1, V, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(B_, K, V, generator=g) * 2, -1)
    ids = torch.multinomial(q.reshape(-1, V), 1, generator=g).reshape(B_, K)
    ids[0] = p[0, :K].argmax(-1)                       # long accepted prefixes
    ids[1] = p[1, :K].argmax(-1)
    u = torch.rand(B_, K, generator=g)
    u[1] = 0.0                                         # every draft accepted: the bonus
    e = torch.empty(B_, K, V).exponential_(generator=g)
    return p, q, ids, u, e, torch.randint(0, V, (B_,), generator=g)


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
def test_an_emission_written_otherwise(lowering):
    torch._dynamo.reset()
    _, graphs = three_way(where_emission, _inputs(1), lowering=lowering, matched=None,
                          appear=("npuspec.rejection_sample",),
                          gone=("npuspec.ratio_accept", "npuspec.residual_sample"))
    assert _matched(three_way.last_delta) == 1, three_way.last_delta


@pytest.mark.parametrize("fn", [other_fill, token_late, other_ids, first_row_other_bonus],
                         ids=lambda f: f.__name__)
def test_near_misses_stay_as_written(fn):
    args = _inputs(2)
    if fn is other_ids:
        args = args + (torch.flip(args[2], [1]),)
    torch._dynamo.reset()
    three_way(fn, args, matched=None, appear=("npuspec.ratio_accept", "npuspec.residual_sample"),
              gone=("npuspec.rejection_sample",))
    assert _matched(three_way.last_delta) == 0, three_way.last_delta


def test_an_emission_that_held_is_taken_at_another_batch_size(monkeypatch):
    """The emission check's verdict is kept by region (B written by name): the step at another
    batch size fuses without evaluating it again and equals eager; a near miss at that size
    is evaluated and stays as written."""
    import npuspec.passes.composed as composed
    calls = []
    holds = composed._emission_holds
    monkeypatch.setattr(composed, "_emission_holds", lambda *a: calls.append(1) or holds(*a))
    monkeypatch.setattr(composed, "_HELD", {})
    # B = 7 and 9: no size name collides with K + 1 = 5 (at B = 6, B - 1 would: the keys then
    # differ and the check runs again, a miss, not a risk)
    for b, fn, fused, evaluated in [(7, where_emission, True, True),
                                    (9, where_emission, True, False),
                                    (9, other_fill, False, True)]:
        calls.clear()
        torch._dynamo.reset()
        three_way(fn, _inputs(3, b), matched=None)
        assert (_matched(three_way.last_delta) == 1) == fused, (b, fn.__name__)
        assert bool(calls) == evaluated, (b, fn.__name__, len(calls))


def post_processed(p, q, ids, u, e, bonus):
    out, n = where_emission(p, q, ids, u, e, bonus)
    return torch.where(out == -1, -2, out), n


def test_a_rewritten_emission_keeps_the_rewrite():
    torch._dynamo.reset()
    _, graphs = three_way(post_processed, _inputs(3), matched=None,
                          appear=("npuspec.rejection_sample", "aten.where"),
                          gone=("npuspec.ratio_accept", "npuspec.residual_sample"))
    assert _matched(three_way.last_delta) == 1, three_way.last_delta


# --------------------------------------------------------------------------------------------
# the greedy step (passes/composed_greedy.py)
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("lowering", ["eager", "inductor"])
def test_vllm_v1_greedy_under_npuspec_compile_is_one_call(lowering):
    """vLLM v1's greedy forward_native: one graph under npuspec.compile (its mask indexing
    traced with data-dependent sizes), then one rejection_sample, its size checks gone."""
    import npuspec
    from npuspec import counters
    from npuspec.passes import manager
    e = BY_NAME["vllm_v1_native_greedy"]
    for seed in (3, 4):
        args = e.make(seed)
        torch._dynamo.reset()
        manager.HISTORY.clear()
        f = npuspec.compile(e.fn, options={"lowering": lowering, "capture": False})
        want = e.fn(*[a.clone() for a in args])
        before = counters.snapshot()
        got = f(*[a.clone() for a in args])
        assert torch.equal(want, got)
        delta = counters.delta(before)
        assert _matched(delta) == 1, delta
        text = "\n".join(t for _, _, t in manager.HISTORY)
        assert text.count("npuspec.rejection_sample.default]") == 1, text
        for gone in ("npuspec.greedy_accept", "_assert_scalar", "aten.argmax"):
            assert gone not in text, (gone, text)


def greedy_from_drafts(logits, drafts):
    # the accepted drafts emitted from the drafts, the token at n from the target
    target = logits.argmax(-1)                                             # [B, K+1]
    n = (drafts == target[:, :-1]).cumprod(1).sum(1)
    k = drafts.shape[1]
    pos = torch.arange(k + 1)[None, :]
    padded = torch.cat([drafts, torch.full_like(drafts[:, :1], -1)], 1)
    out = torch.where(pos < n[:, None], padded, -1)
    return out.scatter(1, n[:, None], target.gather(1, n[:, None])), n


def greedy_no_token(logits, drafts):
    # the accepted drafts only, no target token at n: not the step's emission
    target = logits.argmax(-1)
    n = (drafts == target[:, :-1]).cumprod(1).sum(1)
    pos = torch.arange(drafts.shape[1] + 1)[None, :]
    padded = torch.cat([drafts, torch.full_like(drafts[:, :1], -1)], 1)
    return torch.where(pos < n[:, None], padded, -1), n


def _greedy_inputs(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, K + 1, V, generator=g)
    drafts = logits.argmax(-1)[:, :K].clone()
    drafts[0, 1] = (drafts[0, 1] + 1) % V
    drafts[2, 0] = (drafts[2, 0] + 1) % V
    drafts[3, 3] = (drafts[3, 3] + 1) % V
    return logits, drafts


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
def test_a_greedy_emission_from_the_drafts(lowering):
    torch._dynamo.reset()
    three_way(greedy_from_drafts, _greedy_inputs(1), lowering=lowering, matched=None,
              appear=("npuspec.rejection_sample",), gone=("npuspec.greedy_accept",))
    assert _matched(three_way.last_delta) == 1, three_way.last_delta


def test_a_greedy_near_miss_stays():
    torch._dynamo.reset()
    three_way(greedy_no_token, _greedy_inputs(2), matched=None,
              appear=("npuspec.greedy_accept",), gone=("npuspec.rejection_sample",))
    assert _matched(three_way.last_delta) == 0, three_way.last_delta


def greedy_token_also_returned(logits, drafts):
    # the step's emission, and the token at n returned on its own too: the user's argmax stays
    target = logits.argmax(-1)                                             # [B, K+1]
    n = (drafts == target[:, :-1]).cumprod(1).sum(1)
    pos = torch.arange(drafts.shape[1] + 1)[None, :]
    tok = target.gather(1, n[:, None])                                     # [B, 1]
    out = torch.where(pos < n[:, None], target, -1).scatter(1, n[:, None], tok)
    return out, n, tok


def test_a_greedy_step_whose_target_stays_read_is_not_composed():
    """Composing would compute the argmax twice (the op's, and the user's for `tok`): the
    step stays as the greedy family leaves it."""
    torch._dynamo.reset()
    three_way(greedy_token_also_returned, _greedy_inputs(3), matched=None,
              appear=("npuspec.greedy_accept",), gone=("npuspec.rejection_sample",))
    assert _matched(three_way.last_delta) == 0, three_way.last_delta


def _nan_logits(seed):
    logits, drafts = _greedy_inputs(seed)
    logits[0, 1, 3] = float("nan")
    logits[2, 0] = float("-inf")
    logits[4, 2, 7] = float("inf")
    return logits, drafts


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
def test_greedy_replacements_equal_eager_on_nan_logits(lowering):
    """The fused greedy steps take the op with checks=False: NaN, +inf and all -inf rows give
    what eager's argmax gives, where the checked op would raise (kernels/verify.py)."""
    import npuspec
    torch._dynamo.reset()
    three_way(greedy_from_drafts, _nan_logits(5), lowering=lowering, matched=None,
              appear=("npuspec.rejection_sample",))
    e = BY_NAME["vllm_v1_native_greedy"]
    drafts, target = e.make(3)
    target[1, 2, 4] = float("nan")
    target[0, 0] = float("-inf")
    torch._dynamo.reset()
    f = npuspec.compile(e.fn, options={"lowering": lowering, "capture": False})
    assert torch.equal(f(drafts.clone(), target.clone()), e.fn(drafts.clone(), target.clone()))


def test_the_pad_fill_is_made_on_the_picks_not_on_q(monkeypatch):
    """vLLM v1 fills padded slots' q with inf; picks._fill_before_pick moves that fill onto q
    ([B, K, V]) for the families to read, and once the step is one call the op reads the
    test's q only at the ids: picks.picked_fill gives it the filled picks [B, K, 1] instead,
    so no node of the graph writes a [B, K, V] copy of q."""
    from npuspec.compilation import lowering
    e = BY_NAME["vllm_v1_native_random"]
    args = e.make(3)
    q_shape = tuple(args[1].shape)                                         # draft_probs
    seen = []

    def keep(gm, flavor="aten", manager=None):
        out = run(gm, flavor=flavor, manager=manager)
        seen.append(gm)
        return out
    run = lowering.run_passes
    monkeypatch.setattr(lowering, "run_passes", keep)
    torch._dynamo.reset()
    three_way(e.fn, args, lowering="eager", matched=None, appear=("npuspec.rejection_sample",))
    assert _matched(three_way.last_delta) == 1, three_way.last_delta
    ops = [n for gm in seen for n in gm.graph.nodes if n.op == "call_function"]
    assert any(n.target is torch.ops.npuspec.rejection_sample.default for n in ops)
    fills = [n for n in ops if "fill" in str(n.target) or "index_put" in str(n.target)
             or n.target is torch.ops.aten.where.self]
    big = [n for n in fills if tuple(n.meta["val"].shape) == q_shape]
    assert not big, [n.format_node() for n in big]
    assert any(tuple(n.meta["val"].shape) == (*q_shape[:2], 1) for n in fills), fills


def test_the_region_checks_eager_stand_ins_for_prims_give_the_prims_values():
    """nodes.eager_op: what a region check runs for a prims op gives the prim's own values,
    dtype and strides (float -> int truncates, bool -> int, a transposed input keeps its
    layout; iota at several starts, steps and dtypes)."""
    from npuspec.passes.rewrites.nodes import eager_op
    prims = torch.ops.prims
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(4, 5, generator=g) * 7, torch.rand(3, 4, generator=g) > 0.5,
          torch.randint(-9, 9, (5, 3), generator=g), (torch.randn(5, 4, generator=g) * 3).T]
    op = prims.convert_element_type.default
    for x in xs:
        for dt in (torch.int64, torch.int32, torch.float32, torch.float64, torch.bool):
            want, got = op(x, dt), eager_op(op)(x, dt)
            assert got.dtype == want.dtype and got.stride() == want.stride(), (x.dtype, dt)
            assert torch.equal(got, want), (x.dtype, dt)
    op = prims.iota.default
    for length, start, step, dt in ((5, 0, 1, torch.int64), (4, 3, 2, torch.int32),
                                    (6, -2, 3, torch.int64), (1, 7, 1, torch.int64)):
        kw = dict(start=start, step=step, dtype=dt, device=torch.device("cpu"),
                  requires_grad=False)
        want, got = op(length, **kw), eager_op(op)(length, **kw)
        assert got.dtype == want.dtype and torch.equal(got, want), (length, start, step, dt)
    assert eager_op(torch.ops.aten.add.Tensor) is torch.ops.aten.add.Tensor
