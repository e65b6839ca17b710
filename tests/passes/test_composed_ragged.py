"""passes/composed_ragged.py: vllm-ascend's PyTorch sampler (random and block-verify paths,
field_vllm.py; its n-gram path under npuspec.compile) becomes one ragged-mode
`rejection_sample` under both lowerings, equal to eager on every seed, greedy rows and
placeholder drafts included; a respelling of the random path in other words (written here)
fuses too; near misses (a placeholder accepted, the bonus at the wrong column, another
request's uniform) are left as written and still equal eager.
"""
from __future__ import annotations

import pytest
import torch
from field_vllm import (_ascend_recovered, _make_ascend, _make_ascend_ngram,
                        vllm_ascend_block_verify, vllm_ascend_ngram, vllm_ascend_random)

import npuspec
from npuspec import counters
from npuspec.passes import manager

OP = torch.ops.npuspec


def _compiled(fn, lowering, whole=False):
    torch._dynamo.reset()
    opts = {"lowering": lowering, "capture": False}
    if whole:  # Dynamo traces mask indexing (npuspec.compile): one graph
        return npuspec.compile(fn, options=opts)
    return torch.compile(fn, backend="npuspec", options=opts)


def _args(seed, ngram=False):
    args = list(_make_ascend_ngram(seed) if ngram else _make_ascend(seed))
    greedy_at = 4 if ngram else 5
    if seed % 2:
        args[greedy_at] = torch.tensor([False, True, False, False])     # a greedy request
    if seed % 3 == 2:
        ids = args[1].clone()
        ids[seed % ids.shape[0]] = -1                           # a placeholder draft
        args[1] = ids
    return args


def _ragged_ops(text: str) -> int:
    return text.count("npuspec.rejection_sample") if "max_spec_len" in text else 0


def _check(fn, lowering, fused: bool, ngram=False):
    before = counters.snapshot()
    manager.HISTORY.clear()
    f = _compiled(fn, lowering, whole=ngram)
    for seed in range(6):
        args = _args(seed, ngram)
        torch.manual_seed(seed)
        got = f(*args)
        torch.manual_seed(seed)
        assert torch.equal(got, fn(*args)), (fn.__name__, seed)
    text = "\n".join(h[2] for h in manager.HISTORY)
    moved = counters.delta(before).get("verify_patterns_matched.composed", 0)
    if fused:
        assert _ragged_ops(text) == 1 and "residual_sample.default" not in text, text
        assert moved >= 1
    else:
        assert _ragged_ops(text) == 0 and "residual_sample.default" in text, text
        assert moved == 0


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
@pytest.mark.parametrize("fn", [vllm_ascend_random, vllm_ascend_block_verify],
                         ids=lambda f: f.__name__)
def test_vllm_ascend_step_is_one_call(fn, lowering, no_fx_cache):
    _check(fn, lowering, fused=True)


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
def test_vllm_ascend_ngram_is_one_call_under_npuspec_compile(lowering, no_fx_cache):
    """The n-gram path zeroes the drafts in the target by mask indexing (a break under
    torch.compile); traced whole, its race reads that copy and the op reads p itself."""
    _check(vllm_ascend_ngram, lowering, fused=True, ngram=True)


def _respelled(cu, ids, q, logits, bonus, is_greedy, M, miss=None):
    """vllm-ascend's random path in other words: request of each slot by searchsorted-free
    arithmetic, the count as a sum of a running product, the emission by scatter."""
    B, V = cu.shape[0], logits.shape[-1]
    p = logits.softmax(dim=-1, dtype=torch.float32)
    u = torch.rand((ids.shape[0],), dtype=torch.float64)
    e = torch.empty((B, V), dtype=torch.float32).exponential_()
    rec = _ascend_recovered(cu, ids, q, p, e)
    first = torch.nn.functional.pad(cu, (1, 0))[:-1]
    lens = cu - first
    j = torch.arange(M)[None, :].expand(B, M)
    live = j < lens[:, None]
    src = torch.clamp(first[:, None] + j, min=0, max=ids.shape[0] - 1)
    if miss == "other_u":
        src_u = torch.clamp(src + 1, max=ids.shape[0] - 1)
    else:
        src_u = src
    x = torch.gather(ids[None, :].expand(B, -1), 1, src)
    xs = torch.where(x < 0, torch.zeros_like(x), x)
    qx = q[src.reshape(-1), xs.reshape(-1)].reshape(B, M)
    px = p[src.reshape(-1), xs.reshape(-1)].reshape(B, M)
    good = (qx > 0) & (px / qx >= u[src_u])
    if miss != "placeholder":
        good = good & (x != -1)
    n = ((good | ~live).long().cumprod(dim=1) * live.long()).sum(dim=1)     # [B]
    n = torch.minimum(n, lens)
    tok = torch.where(n < lens, rec[torch.clamp(first + n, max=ids.shape[0] - 1)],
                      bonus.view(-1).long())
    col = torch.arange(M + 1)[None, :]
    body = torch.where(col[:, :M] < n[:, None], x, -1)
    out = torch.cat([body, torch.full((B, 1), -1)], dim=1)
    at = n if miss != "bonus_col" else torch.where(n < lens, n, M)
    out = out.scatter(1, at[:, None], tok[:, None])
    out = torch.where(is_greedy[:, None], -1, out)
    return out.to(torch.int32)


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
def test_a_respelling_fuses(lowering, no_fx_cache):
    def step(cu, ids, q, logits, bonus, is_greedy, M):
        return _respelled(cu, ids, q, logits, bonus, is_greedy, M)
    for seed in range(4):     # the respelling computes what vllm-ascend's code computes
        args = _args(seed)
        torch.manual_seed(seed)
        a = step(*args)
        torch.manual_seed(seed)
        assert torch.equal(a, vllm_ascend_random(*args)), seed
    _check(step, lowering, fused=True)


@pytest.mark.parametrize("miss", ["placeholder", "bonus_col", "other_u"])
def test_near_misses_are_left_as_written(miss, no_fx_cache):
    def step(cu, ids, q, logits, bonus, is_greedy, M):
        return _respelled(cu, ids, q, logits, bonus, is_greedy, M, miss=miss)
    _check(step, "inductor", fused=False)


def _wide_args(seed, V=300):
    """The corpus's layout (B = 4, N = 15, M = 5) at a vocabulary of V."""
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([5, 8, 13, 15])
    logits = torch.randn(15, V, generator=g) * 3
    q = torch.softmax(torch.randn(15, V, generator=g) + logits, -1)
    ids = torch.multinomial(q, 1, generator=g)[:, 0]
    ids[3] = V - 1                                    # the last id, drafted
    bonus = torch.randint(0, V, (4, 1), generator=g, dtype=torch.int32)
    return [cu, ids, q, logits, bonus, torch.zeros(4, dtype=torch.bool), 5]


@pytest.mark.parametrize("last_id_apart", [False, True])
def test_the_check_runs_at_full_v_when_a_literal_is_about_v(last_id_apart, no_fx_cache):
    """At V = 300 the region is checked at a vocabulary of 13, unless one of its literals could
    be about V: a step that treats the last id apart (`x < V - 1`) is checked at V = 300,
    where that id occurs, and left as written; the plain step fuses."""
    from npuspec.passes import composed_ragged as cr
    seen, orig = [], cr._small_v

    def spy(order, V):
        seen.append(orig(order, V))
        return seen[-1]

    def step(cu, ids, q, logits, bonus, is_greedy, M):
        if last_id_apart:
            ids = torch.where(ids < logits.shape[-1] - 1, ids, -1)
        return _respelled(cu, ids, q, logits, bonus, is_greedy, M)

    cr._small_v = spy
    try:
        before = counters.snapshot()
        f = _compiled(step, "inductor")
        for seed in range(3):
            args = _wide_args(seed)
            torch.manual_seed(seed)
            got = f(*args)
            torch.manual_seed(seed)
            assert torch.equal(got, step(*args)), seed
    finally:
        cr._small_v = orig
    moved = counters.delta(before).get("verify_patterns_matched.composed", 0)
    assert set(seen) == {300 if last_id_apart else cr.SMALL_V}, seen
    assert moved == (0 if last_id_apart else 1), moved


def _vllm_args(B, seed):
    """vllm-ascend's random path at batch size B (drafts per request 0..M, M = 3)."""
    g = torch.Generator().manual_seed(seed)
    M, V = 3, 11
    counts = torch.randint(0, M + 1, (B,), generator=g)
    counts[0] = M
    N = int(counts.sum())
    cu = counts.cumsum(0)
    q = torch.softmax(torch.randn(N, V, generator=g), -1)
    logits = torch.randn(N + B, V, generator=g)
    ids = torch.randint(0, V, (N,), generator=g)
    bonus = torch.randint(0, V, (B, 1), generator=g)
    return cu, ids, q, logits, bonus, torch.zeros(B, dtype=torch.bool), M


def test_a_region_that_held_is_taken_at_another_batch_size(monkeypatch, no_fx_cache):
    """The check's verdict is kept by region, the literals equal to B and N written by name:
    the same step at another batch size fuses without evaluating it again and equals eager;
    a near miss at that size is still evaluated and stays as written."""
    import npuspec.passes.composed_ragged as cr
    calls = []
    holds = cr._holds
    monkeypatch.setattr(cr, "_holds", lambda *a: calls.append(1) or holds(*a))
    monkeypatch.setattr(cr, "_HELD", {})
    monkeypatch.setattr(cr, "_FAILED", {})

    def step(cu, ids, q, logits, bonus, is_greedy, M):
        return _respelled(cu, ids, q, logits[:ids.shape[0]], bonus, is_greedy, M)

    def miss(cu, ids, q, logits, bonus, is_greedy, M):
        return _respelled(cu, ids, q, logits[:ids.shape[0]], bonus, is_greedy, M,
                          miss="placeholder")

    # B = 6 and 8 (N 10 and 11): no size name collides with M or M + 1 (at B = 4, B - 1 is M;
    # a literal 3 is then both, the keys differ and the check runs again: a miss, not a risk)
    for B, fn, fused, evaluated in [(6, step, True, True), (8, step, True, False),
                                    (8, miss, False, True)]:
        args = _vllm_args(B, seed=B)
        calls.clear()
        manager.HISTORY.clear()
        f = _compiled(fn, "eager")
        torch.manual_seed(1)
        got = f(*args)
        torch.manual_seed(1)
        assert torch.equal(got, fn(*args)), (B, fn.__name__)
        text = "\n".join(h[2] for h in manager.HISTORY)
        assert (_ragged_ops(text) == 1) == fused, (B, fn.__name__, text)
        assert bool(calls) == evaluated, (B, fn.__name__, len(calls))
