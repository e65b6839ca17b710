"""The standard-sampling whole step -> one npuspec::rejection_sample(target_is_probs=True).

Three-way tests (eager-identical from the same RNG state, aten ops gone and the op present,
counters moved) for each spelling, near misses that must not become the whole-step op and must
still compute what the user wrote, and the gpt-fast min(1, p/q) ratio test on its own."""
import pytest
import torch
import torch.nn.functional as F

from passes_helpers import compile_npuspec, three_way

B, K, V = 6, 4, 31
GONE = ["aten.cumprod", "aten.cumsum", "aten.argmax", "aten.clamp", "aten.scatter"]
OP = ["npuspec.rejection_sample", "target_is_probs: True"]


def _inputs(seed=0):
    """p [B, K+1, V], q [B, K, V], ids [B, K] sampled from q, u [B, K], E [B, V]; request 0
    accepts everything (bonus row), request 1 has q(x) = 0 < p(x) at its first draft (p/q =
    inf, accepted), request 2 has u == p/q exactly at its first draft (>= accepts)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, K + 1, V, generator=g) * 2
    p = torch.softmax(logits, -1)
    q = torch.softmax(torch.randn(B, K, V, generator=g) + logits[:, :K], -1)
    ids = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(B, K)
    u = torch.rand(B, K, dtype=torch.float64, generator=g).float()
    u[0] = 0.0
    q[1, 0, ids[1, 0]] = 0.0
    u[2, 0] = p[2, 0, ids[2, 0]] / q[2, 0, ids[2, 0]]
    e = torch.empty(B, V).exponential_(generator=g)
    return p, q, ids, u, e


def _at(t, ids):
    return t.gather(-1, ids.unsqueeze(-1)).squeeze(-1)


# vLLM-v1-like: E per request [B, V], recovered for every row, bonus from the last row --------
def step_token(p, q, ids, u, e):
    n = (_at(p[:, :K], ids) / _at(q, ids) >= u).cumprod(dim=-1).sum(dim=-1)      # [B]
    rec = (torch.clamp(p[:, :K] - q, min=0) / e[:, None, :]).argmax(dim=-1)       # [B, K]
    bonus = (p[:, K] / e).argmax(dim=-1)                                          # [B]
    tok = torch.cat([rec, bonus[:, None]], dim=1).gather(1, n[:, None]).squeeze(1)
    return tok, n + 1


# the -1 padded emission, one shared slice, HF's cumsum tail and `u <= ratio` ------------------
def step_padded(p, q, ids, u, e):
    pk = p[:, :-1]
    n = ((~(u <= _at(pk, ids) / _at(q, ids))).cumsum(-1) < 1).sum(-1)
    rec = (torch.clamp(pk - q, min=0) / e.unsqueeze(1)).argmax(-1)
    bonus = (p[:, -1] / e).argmax(-1)
    tok = torch.cat([rec, bonus[:, None]], 1).gather(1, n[:, None]).squeeze(1)
    pos = torch.arange(K + 1, device=p.device)[None, :]
    out = torch.where(pos < n[:, None], F.pad(ids, (0, 1), value=-1), -1)
    return torch.where(pos == n[:, None], tok[:, None], out), n


# gpt-fast's min(1, p/q), temperature softmax and both draws inside the step, E per row -------
def step_gpt_fast(logits, q, ids, temperature, unused):
    p = torch.softmax(logits / temperature[:, None, None], dim=-1)
    u = torch.rand(ids.shape)
    accept_prob = torch.minimum(torch.ones(()), _at(p[:, :K], ids) / _at(q, ids))
    n = (u <= accept_prob).cumprod(dim=-1).sum(dim=-1)
    e = torch.empty(p.shape).exponential_()                                       # [B, K+1, V]
    rec = (torch.clamp(p[:, :K] - q, min=0) / e[:, :K]).argmax(dim=-1)
    bonus = (p[:, K] / e[:, K]).argmax(dim=-1)
    return torch.cat([rec, bonus[:, None]], 1).gather(1, n[:, None]).squeeze(1), n


# one-hot drafts (n-gram): p(x) >= u, the residual is p with the draft zeroed ----------------
def step_onehot(p, q, ids, u, e):
    n = (_at(p[:, :K], ids) >= u).long().cumprod(dim=1).sum(dim=1)
    rec = (p[:, :K].scatter(-1, ids.unsqueeze(-1), 0.0) / e[:, None, :]).argmax(-1)
    bonus = (p[:, K] / e).argmax(-1)
    return torch.cat([rec, bonus[:, None]], 1).gather(1, n[:, None]).squeeze(1), n


# the clamp(max=1) bound, with uniforms that tell u <= min(1, r) apart from u <= r --------------
def step_clamp(p, q, ids, u, e):
    n = ((_at(p[:, :K], ids) / _at(q, ids)).clamp(max=1) >= u).cumprod(-1).sum(-1)
    rec = (torch.clamp(p[:, :K] - q, min=0) / e[:, None, :]).argmax(dim=-1)
    bonus = (p[:, K] / e).argmax(dim=-1)
    return torch.cat([rec, bonus[:, None]], dim=1).gather(1, n[:, None]).squeeze(1), n


# the residual over all K+1 rows against q with a zero row appended; p is a softmax here -----
def step_zero_row(logits, q, ids, u, e):
    p = torch.softmax(logits / 0.8, dim=-1)
    n = (_at(p[:, :K], ids) / _at(q, ids) >= u).cumprod(-1).sum(-1)
    q_all = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)                    # [B, K+1, V]
    race = (torch.clamp(p - q_all, min=0) / e[:, None, :]).argmax(dim=-1)         # [B, K+1]
    return race.gather(1, n[:, None]).squeeze(1), n


def _logit_inputs(seed=0):
    p, q, ids, u, e = _inputs(seed)
    return p.log() * 0.8, q, ids, u, e


def _bounded_inputs(seed=0):
    p, q, ids, u, e = _inputs(seed)
    u[3] = torch.tensor([1.0, 1.5, 0.0, 0.0])     # u = 1 accepts, u = 1.5 rejects (even at inf)
    q[3, 1, ids[3, 1]] = 0.0                       # ... here p/q = inf
    u[4] = torch.tensor([0.0, float("nan"), 0.0, 0.0])  # NaN rejects
    return p, q, ids, u, e


def _gpt_fast_inputs(seed=0):
    p, q, ids, u, e = _inputs(seed)
    g = torch.Generator().manual_seed(seed + 1)
    return (torch.randn(B, K + 1, V, generator=g) * 2, q, ids, torch.rand(B, generator=g) + 0.5, e)


@pytest.mark.parametrize("fn,make", [(step_token, _inputs), (step_padded, _inputs),
                                     (step_gpt_fast, _gpt_fast_inputs), (step_onehot, _inputs),
                                     (step_clamp, _bounded_inputs),
                                     (step_zero_row, _logit_inputs)],
                         ids=["token", "padded", "gpt_fast", "onehot", "clamp", "zero_row"])
def test_sample_verify_three_way(fn, make):
    cf = compile_npuspec(fn)
    for seed in range(3):  # compiled by the first call; the others reuse it
        _, g = three_way(fn, make(seed), family="sample_verify", appear=OP, gone=GONE,
                         compiled=cf, fresh=seed == 0, seed=seed)
        graphs = g if seed == 0 else graphs
    if fn is step_gpt_fast:
        assert "aten.rand" in graphs and "aten.exponential" in graphs   # the user's draws
        assert "aten._softmax" in graphs               # the temperature and softmax stay


def test_sample_verify_exact_on_edge_rows():
    """The crafted rows decide as the eager arithmetic says (inf ratio and u == p/q accept)."""
    p, q, ids, u, e = _inputs(0)
    (tok, n1), _ = three_way(step_token, (p, q, ids, u, e), family="sample_verify", appear=OP)
    assert n1[0] == K + 1 and n1[1] >= 2 and n1[2] >= 2


@pytest.mark.parametrize("fn,make", [(step_padded, _inputs), (step_zero_row, _logit_inputs)],
                         ids=["padded", "zero_row"])
def test_sample_verify_inductor_lowering(no_fx_cache, fn, make):
    # zero_row: Inductor decomposes the softmax; the guard recognises exp(x - max) / sum too
    three_way(fn, make(4), lowering="inductor", family="sample_verify", appear=OP,
              gone=["aten.cumsum", "aten.cumprod", "aten.argmax"])


# --- near misses: not the whole-step op, and still what the user wrote ------------------------
def nm_wrong_dim(p, q, ids, u, e):                     # prefix product over the batch
    n = (_at(p[:, :K], ids) / _at(q, ids) >= u).cumprod(dim=0).sum(dim=-1)
    rec = (torch.clamp(p[:, :K] - q, min=0) / e[:, None, :]).argmax(dim=-1)
    bonus = (p[:, K] / e).argmax(dim=-1)
    return torch.cat([rec, bonus[:, None]], dim=1).gather(1, n[:, None]).squeeze(1), n


def nm_extra_use(p, q, ids, u, e):                     # the recovered rows are returned too
    n = (_at(p[:, :K], ids) / _at(q, ids) >= u).cumprod(dim=-1).sum(dim=-1)
    rec = (torch.clamp(p[:, :K] - q, min=0) / e[:, None, :]).argmax(dim=-1)
    bonus = (p[:, K] / e).argmax(dim=-1)
    return torch.cat([rec, bonus[:, None]], dim=1).gather(1, n[:, None]).squeeze(1), n, rec


def nm_float64_u(p, q, ids, u, e):                     # float64 uniforms: a float64 compare
    return step_token(p, q, ids, u.double(), e)


def nm_normalised(p, q, ids, u, e):                    # residual / its sum: not the op's math
    n = (_at(p[:, :K], ids) / _at(q, ids) >= u).cumprod(dim=-1).sum(dim=-1)
    r = torch.clamp(p[:, :K] - q, min=0)
    rec = (r / r.sum(-1, keepdim=True) / e[:, None, :]).argmax(dim=-1)
    bonus = (p[:, K] / e).argmax(dim=-1)
    return torch.cat([rec, bonus[:, None]], dim=1).gather(1, n[:, None]).squeeze(1), n


def nm_late_draw_dependent(p, q, ids, u, e):           # a draw that uses n, before E is drawn
    n = (_at(p[:, :K], ids) / _at(q, ids) >= u).cumprod(dim=-1).sum(dim=-1)
    noise = torch.normal(n.float(), 1.0)              # random, and reads n's values
    e = torch.empty(B, V).exponential_()
    rec = (torch.clamp(p[:, :K] - q, min=0) / e[:, None, :]).argmax(dim=-1)
    bonus = (p[:, K] / e).argmax(dim=-1)
    return torch.cat([rec, bonus[:, None]], dim=1).gather(1, n[:, None]).squeeze(1), n, noise


def nm_zero_row_not_softmax(p, q, ids, u, e):          # p is an input: it could be negative
    n = (_at(p[:, :K], ids) / _at(q, ids) >= u).cumprod(-1).sum(-1)
    q_all = F.pad(q, (0, 0, 0, 1))
    race = (torch.clamp(p - q_all, min=0) / e[:, None, :]).argmax(dim=-1)
    return race.gather(1, n[:, None]).squeeze(1), n


def nm_e_depends_on_n(p, q, ids, u, e):               # E made from n: no place for one op
    n = (_at(p[:, :K], ids) / _at(q, ids) >= u).cumprod(dim=-1).sum(dim=-1)
    e = e + n[:, None].float()
    rec = (torch.clamp(p[:, :K] - q, min=0) / e[:, None, :]).argmax(dim=-1)
    bonus = (p[:, K] / e).argmax(dim=-1)
    return torch.cat([rec, bonus[:, None]], dim=1).gather(1, n[:, None]).squeeze(1), n


# (`>` in place of `>=` and gpt-fast's `~(u > min(1, r))` were near misses here; they are the
# op's accept modes now: test_sample_verify_modes.py)
NEAR = [nm_e_depends_on_n, nm_zero_row_not_softmax, nm_wrong_dim, nm_extra_use, nm_float64_u,
        nm_normalised, nm_late_draw_dependent]


@pytest.mark.parametrize("fn", NEAR, ids=[f.__name__ for f in NEAR])
def test_near_miss_not_the_whole_step(fn):
    args = _inputs(5)
    args[0][3, 1, 0] = float("nan")        # a NaN ratio somewhere (rejects with >=, not with ~>)
    args[2][3, 1] = 0
    args[0][0, K] = -args[0][0, K]         # a negative bonus row (request 0 accepts all):
    #                                        clamp(p_K - 0, 0) is all 0 there, p_K / E is not
    three_way(fn, args, matched=None, gone=["npuspec.rejection_sample"])
    assert three_way.last_delta.get("verify_patterns_matched.sample_verify", 0) == 0


def test_late_exponential_draw_still_matches():
    """E drawn after the ratio test (only needed at a rejection): the op moves after the draw,
    and the RNG stream is the user's (no random op depends on n in between)."""
    def step(p, q, ids, u, unused):
        n = (_at(p[:, :K], ids) / _at(q, ids) >= u).cumprod(dim=-1).sum(dim=-1)
        e = torch.empty(B, V).exponential_()
        rec = (torch.clamp(p[:, :K] - q, min=0) / e[:, None, :]).argmax(dim=-1)
        bonus = (p[:, K] / e).argmax(dim=-1)
        tok = torch.cat([rec, bonus[:, None]], dim=1).gather(1, n[:, None]).squeeze(1)
        return tok, n, torch.rand(3)          # a draw after: must see the same stream
    three_way(step, _inputs(6), family="sample_verify", appear=OP + ["aten.exponential"])


def onehot_normalised_shared_idx(p, q, ids, u, e):
    """Not a whole step (normalised residual); `idx` is shared by the ratio test's gather and the
    residual's scatter. The narrow families must still take both halves."""
    idx = ids.unsqueeze(-1)
    n = (p[:, :K].gather(-1, idx).squeeze(-1) >= u).cumprod(-1).sum(-1)
    r = p[:, :K].scatter(-1, idx, 0.0)
    return (r / r.sum(-1, keepdim=True) / e[:, None, :]).argmax(-1), n


def shared_idx_ratio(p, q, ids, u, e):
    idx = ids[..., None]
    ok = p[:, :K].gather(-1, idx).squeeze(-1) / q.gather(-1, idx).squeeze(-1) >= u
    return ok.cumprod(-1).sum(-1)


def test_shared_views_do_not_block_matches():
    three_way(onehot_normalised_shared_idx, _inputs(8), family="ratio_accept",
              appear=["npuspec.ratio_accept"], gone=["aten.cumprod"])
    torch._dynamo.reset()
    three_way(shared_idx_ratio, _inputs(8), family="ratio_accept",
              appear=["npuspec.ratio_accept"], gone=["aten.cumprod"])


# --- gpt-fast's bounded ratio on its own -> npuspec::ratio_accept ------------------------------
def ratio_min(p, q, ids, u, e):
    ok = u <= torch.minimum(torch.ones(()), _at(p[:, :K], ids) / _at(q, ids))
    return ok.cumprod(-1).sum(-1)


def ratio_clamp(p, q, ids, u, e):
    return ((~((_at(p[:, :K], ids) / _at(q, ids)).clamp(max=1) >= u)).cumsum(-1) < 1).sum(-1)


@pytest.mark.parametrize("fn", [ratio_min, ratio_clamp])
def test_bounded_ratio_accept(fn):
    p, q, ids, u, e = _inputs(7)
    u[4] = torch.tensor([1.0, 0.5, 1.5, float("nan")])[:K]   # u = 1 accepts, u > 1 / NaN reject
    q[4, 1, ids[4, 1]] = 0.0
    three_way(fn, (p, q, ids, u, e), family="ratio_accept", appear=["npuspec.ratio_accept"],
              gone=["aten.minimum", "aten.clamp", "aten.cumprod", "aten.cumsum"])


def test_varying_batch_still_matches():
    """A second batch size recompiles with a symbolic batch; the whole step must match there
    too (K and V stay static), and a third size reuses that graph."""
    from npuspec import counters
    cf = compile_npuspec(step_padded)
    for b, matched in ((3, 1), (5, 1), (7, 0)):
        g = torch.Generator().manual_seed(b)
        p = torch.softmax(torch.randn(b, K + 1, V, generator=g), -1)
        q = torch.softmax(torch.randn(b, K, V, generator=g), -1)
        ids = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(b, K)
        args = (p, q, ids, torch.rand(b, K, generator=g), torch.rand(b, V, generator=g) + 0.1)
        before = counters.snapshot()
        out = cf(*args)
        assert counters.delta(before).get("verify_patterns_matched.sample_verify", 0) == matched
        ref = step_padded(*args)
        assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
