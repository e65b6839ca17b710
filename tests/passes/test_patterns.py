"""Three-way tests per verify family: eager-identical outputs, the expected ops replaced by an
npuspec:: op, and counters["verify_patterns_matched"] moved by the expected amount."""
import pytest
import torch

from passes_helpers import three_way

B, K, V = 5, 4, 37


def _greedy_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, K + 1, V, generator=g)
    target = logits.argmax(-1)[:, :K]
    drafts = torch.where(torch.rand(B, K, generator=g) < 0.7, target,
                         torch.randint(0, V, (B, K), generator=g))
    drafts[0] = target[0]      # one request accepts everything (bonus token)
    drafts[1, 0] = -1          # one has no draft at all
    return logits, drafts


def _probs(seed=1, rows=K):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(B, rows, V, generator=g), -1)
    q = torch.softmax(torch.randn(B, rows, V, generator=g) * 0.5, -1)
    ids = torch.multinomial(q.view(-1, V), 1, generator=g).view(B, rows)
    return p, q, ids


# --- 1. whole greedy step -> npuspec::rejection_sample -------------------------------------
def greedy_step_mask(logits, drafts):
    target = logits.argmax(dim=-1)                                   # [B, K+1]
    n = (drafts == target[:, :-1]).cumprod(dim=-1).sum(dim=-1)       # [B]
    pos = torch.arange(target.shape[1], device=logits.device)
    return torch.where(pos[None, :] <= n[:, None], target, -1), n


def greedy_step_token(logits, drafts):
    target = torch.argmax(logits, 2)
    n = ((~(drafts == target[:, :K])).cumsum(1) < 1).sum(1)
    return target.gather(1, n[:, None]).squeeze(1), n + 1


@pytest.mark.parametrize("fn", [greedy_step_mask, greedy_step_token])
def test_greedy_verify(fn):
    out, graphs = three_way(fn, _greedy_inputs(), family="greedy_verify",
                            appear=["npuspec.rejection_sample"],
                            gone=["aten.argmax", "aten.cumprod", "aten.cumsum"])
    assert out[1].tolist()[0] == K + (fn is greedy_step_token)   # all accepted -> bonus


# --- 2. greedy accepted length -> npuspec::greedy_accept ------------------------------------
def ga_cumprod(logits, drafts):
    t = logits.argmax(-1)
    return t, torch.cumprod(drafts == t[:, :-1], dim=1).sum(dim=1)


def ga_cumsum(logits, drafts):
    t = logits.argmax(-1)
    return t, ((~(t[:, :-1] == drafts)).cumsum(dim=-1) < 1).sum(-1)   # operands swapped


def ga_cummin(logits, drafts):
    t = logits.argmax(-1)
    return t, (drafts == t[:, :K]).int().cummin(dim=1)[0].sum(1)


def ga_ne(logits, drafts):
    t = logits.argmax(-1)
    return t, (drafts.ne(t[:, :-1]).cumsum(-1) == 0).sum(-1)


@pytest.mark.parametrize("fn", [ga_cumprod, ga_cumsum, ga_cummin, ga_ne])
def test_greedy_accept(fn):
    # `t` is returned, so the whole-step pattern cannot take the argmax: the narrow op matches
    three_way(fn, _greedy_inputs(1), family="greedy_accept", appear=["npuspec.greedy_accept"],
              gone=["aten.cumprod", "aten.cumsum", "aten.cummin"])


def ga_int32_drafts(logits, drafts):
    """TensorRT-LLM's MTP: int32 drafts against the int64 argmax, counted in int32."""
    t = logits.argmax(-1)
    return t, torch.cumprod((drafts.int() == t[:, :-1]).int(), dim=-1).sum(1)


def test_greedy_accept_mixed_id_dtypes():
    three_way(ga_int32_drafts, _greedy_inputs(1), family="greedy_accept",
              appear=["npuspec.greedy_accept"], gone=["aten.cumprod"])


# --- 3. standard rejection test -> npuspec::ratio_accept ------------------------------------
def ra_gather_ge(p, q, ids):
    u = torch.rand(ids.shape, dtype=torch.float64).float()
    px = p.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    qx = q.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    return (px / qx >= u).cumprod(dim=1).sum(dim=1), u


def ra_gather_le_cumsum(p, q, ids):
    u = torch.rand_like(p[..., 0])
    ratio = torch.gather(p, 2, ids[:, :, None])[:, :, 0] / torch.gather(q, 2, ids[:, :, None])[:, :, 0]
    return ((~(u <= ratio)).cumsum(-1) < 1).sum(-1)


def ra_onehot(p, q, ids):
    u = torch.rand(ids.shape)
    px = p.gather(2, ids.unsqueeze(2)).squeeze(2)
    return (px >= u).long().cumprod(-1).sum(-1)


@pytest.mark.parametrize("fn", [ra_gather_ge, ra_gather_le_cumsum, ra_onehot])
def test_ratio_accept(fn):
    out, graphs = three_way(fn, _probs(), family="ratio_accept", appear=["npuspec.ratio_accept"],
                            gone=["aten.gather", "aten.cumprod", "aten.cumsum"])
    assert "aten.rand" in graphs  # the user's own draw is kept


# --- 4. residual resample -> npuspec::residual_sample / residual_probs ---------------------
def res_race(p, q, ids):
    e = torch.empty_like(p).exponential_()
    return (torch.clamp(p - q, min=0) / e).argmax(dim=-1)


def res_gumbel_row(p, q, ids):
    g = -torch.log(-torch.log(torch.rand_like(p)))
    r = (p - q).clamp_min(0)
    r = r / r.sum(-1, keepdim=True)
    return (r.log() + g).argmax(-1)


def res_multinomial(p, q, ids):
    r = torch.clamp(p[:, 0] - q[:, 0], min=0)
    return torch.multinomial(r / r.sum(dim=-1, keepdim=True), 1)


def res_race_mul(p, q, ids):
    # LMDeploy: one Exp(1) row per request, its reciprocal broadcast over the K rows
    w = torch.empty_like(p[:, 0]).exponential_().reciprocal()
    return (torch.maximum(p - q, torch.tensor(0.0)) * w[:, None, :]).argmax(dim=-1)


def res_floor(p, q, ids):
    # vLLM v1's forward_native: the residual clamped at 1e-5, normalised, raced in place
    r = torch.clamp(p - q, min=1e-5)
    r = r / r.sum(dim=-1, keepdim=True)
    e = torch.empty_like(r)
    e.exponential_()
    return r.div_(e).argmax(dim=-1)


def res_probs(p, q, ids):
    # feifeibear's max_fn, returned as it is (its sampler is across a graph break)
    d = p - q
    r = torch.where(d > 0, d, torch.zeros_like(d))
    return r / torch.sum(r, dim=2, keepdim=True)


@pytest.mark.parametrize("fn,op,draw", [(res_race, "npuspec.residual_sample", "aten.exponential"),
                                        (res_race_mul, "npuspec.residual_sample", "aten.reciprocal"),
                                        (res_floor, "npuspec.residual_sample", "aten.exponential"),
                                        (res_gumbel_row, "npuspec.residual_sample", "aten.rand"),
                                        (res_multinomial, "npuspec.residual_probs", "aten.multinomial"),
                                        (res_probs, "npuspec.residual_probs", "")])
def test_residual(fn, op, draw):
    out, graphs = three_way(fn, _probs(2), family="residual", appear=[op, draw],
                            gone=["aten.clamp", "aten.sub", "aten.maximum", "aten.where"])
    # the user's draw stays theirs
    if fn is res_floor:  # the floor is the user's literal, passed to the op
        assert "1e-05" in graphs, graphs


# --- the same families through Inductor (a few: Inductor compiles are slow) ---------------
def inductor_step(logits, drafts, p, q):
    greedy = greedy_step_mask(logits, drafts)
    u = torch.rand(drafts.shape)
    ids = drafts.clamp_min(0)
    px = p.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    qx = q.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    n = (px / qx >= u).cumprod(dim=-1).sum(dim=-1)
    e = torch.empty_like(p).exponential_()
    rec = (torch.clamp(p - q, min=0) / e).argmax(dim=-1)
    return greedy, n, rec, res_multinomial(p, q, ids), res_gumbel_row(p, q, ids)


def test_inductor_lowering_matches_all_families(no_fx_cache):
    logits, drafts = _greedy_inputs(3)
    p, q, _ = _probs(4)
    three_way(inductor_step, (logits, drafts, p, q), lowering="inductor", matched=5,
              appear=["npuspec.rejection_sample", "npuspec.ratio_accept",
                      "npuspec.residual_sample", "npuspec.residual_probs", "aten.multinomial",
                      "aten.exponential", "aten.rand"],
              gone=["aten.cumprod", "aten.clamp.default", "aten.argmax"])


def test_varying_batch_still_matches():
    """A second batch size makes Dynamo recompile with a symbolic batch; the patterns must
    match that graph too (K and V stay static), and a third size reuses it."""
    from npuspec import counters
    from passes_helpers import compile_npuspec

    def step(logits, drafts, p, q, u):
        greedy = greedy_step_token(logits, drafts)
        px = p.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
        qx = q.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
        return greedy, (px / qx >= u).cumprod(dim=-1).sum(dim=-1)

    cf = compile_npuspec(step)
    for b, matched in ((3, 2), (6, 2), (9, 0)):
        g = torch.Generator().manual_seed(b)
        args = (torch.randn(b, K + 1, V, generator=g), torch.randint(0, V, (b, K), generator=g),
                torch.rand(b, K, V, generator=g), torch.rand(b, K, V, generator=g),
                torch.rand(b, K, generator=g))
        before = counters.snapshot()
        out = cf(*args)
        assert counters.delta(before).get("verify_patterns_matched", 0) == matched
        ref = step(*args)
        assert torch.equal(out[0][0], ref[0][0]) and torch.equal(out[0][1], ref[0][1])
        assert torch.equal(out[1], ref[1])
