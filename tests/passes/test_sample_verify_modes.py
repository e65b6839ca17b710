"""The whole sampling step with the other accept comparisons (the op's `accept_mode`) and the
capped ratio (`ratio_cap`): `u < r`, a kept rejection `~(u > r)` (gpt-fast, lucidrains),
`~(u >= r)`, each with a plain, min(1, r) or clamp(max=1) ratio.

The inputs hold the rows where the spellings disagree: a NaN ratio (0/0: `>=` and `>` reject,
`~(u > r)` accepts), an inf ratio (q(x) = 0) with u = 1.5 (capped: rejected under every mode),
u equal to the ratio (`>=` accepts, `>` rejects) and u = 1 against a capped ratio of 1.
Before the op had these modes, each of these steps stayed as written (nm_strict and
nm_gpt_fast_reject were near misses in test_sample_verify.py). Last, vllm-ascend's PyTorch block
verify count, the op's accept_rule="cumulative"."""
import pytest
import torch

from passes_helpers import three_way

from npuspec.kernels.verify import ACCEPT_MODES, probs_verify, rejection_sample

B, K, V = 7, 4, 31
GONE = ["aten.cumprod", "aten.cumsum", "aten.argmax", "aten.scatter"]
OP = ["npuspec.rejection_sample", "target_is_probs: True"]


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, K + 1, V, generator=g) * 2
    p = torch.softmax(logits, -1)
    q = torch.softmax(torch.randn(B, K, V, generator=g) + logits[:, :K], -1)
    ids = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(B, K)
    u = torch.rand(B, K, dtype=torch.float64, generator=g).float()
    u[0] = 0.0                                           # all accepted: the bonus row
    p[1, 0, ids[1, 0]] = 0.0                             # 0 / 0 = NaN at request 1's first draft
    q[1, 0, ids[1, 0]] = 0.0
    u[1, 1:] = 0.0
    q[2, 0, ids[2, 0]] = 0.0                             # inf ratio, u = 1.5
    u[2] = torch.tensor([1.5, 0.0, 0.0, 0.0])
    u[3, 0] = p[3, 0, ids[3, 0]] / q[3, 0, ids[3, 0]]    # u == ratio
    u[3, 1:] = 0.0
    q[4, 0, ids[4, 0]] = 0.0                             # inf ratio, u = 1 (capped: 1 vs 1)
    u[4] = torch.tensor([1.0, 0.0, 0.0, 0.0])
    e = torch.empty(B, V).exponential_(generator=g)
    return p, q, ids, u, e


def _at(t, ids):
    return t.gather(-1, ids.unsqueeze(-1)).squeeze(-1)


def _finish(p, q, ids, e, n):
    rec = (torch.clamp(p[:, :K] - q, min=0) / e[:, None, :]).argmax(dim=-1)       # [B, K]
    bonus = (p[:, K] / e).argmax(dim=-1)                                          # [B]
    return torch.cat([rec, bonus[:, None]], dim=1).gather(1, n[:, None]).squeeze(1), n


def step_strict(p, q, ids, u, e):                       # vLLM v0 / vllm-ascend: u < r
    return _finish(p, q, ids, e, (u < _at(p[:, :K], ids) / _at(q, ids)).cumprod(-1).sum(-1))


def step_strict_min(p, q, ids, u, e):                   # u < min(1, r)
    r = torch.minimum(torch.ones(()), _at(p[:, :K], ids) / _at(q, ids))
    return _finish(p, q, ids, e, (u < r).cumprod(-1).sum(-1))


def step_gpt_fast_reject(p, q, ids, u, e):              # gpt-fast: rejected = u > min(1, r)
    accept_draft_prob = torch.minimum(torch.ones(()), _at(p[:, :K], ids) / _at(q, ids))
    rejected = u > accept_draft_prob
    return _finish(p, q, ids, e, (~rejected).cumprod(dim=-1).sum(dim=-1))


def step_lucidrains_reject(p, q, ids, u, e):            # leading rejections counted with cumsum
    n = ((u > _at(p[:, :K], ids) / _at(q, ids)).cumsum(dim=-1) == 0).sum(dim=-1)
    return _finish(p, q, ids, e, n)


def step_not_le_clamp(p, q, ids, u, e):                 # ~(u >= r.clamp(max=1)), padded output
    r = (_at(p[:, :K], ids) / _at(q, ids)).clamp(max=1)
    tok, n = _finish(p, q, ids, e, (~(u >= r)).cumprod(-1).sum(-1))
    pos = torch.arange(K + 1)[None, :]
    out = torch.where(pos < n[:, None], torch.nn.functional.pad(ids, (0, 1), value=-1), -1)
    return torch.where(pos == n[:, None], tok[:, None], out), n


def step_onehot_strict(p, q_unused, ids, u, e):         # ngram drafts: u < p(x)
    n = (u < _at(p[:, :K], ids)).long().cumprod(dim=1).sum(dim=1)
    rec = (p[:, :K].scatter(-1, ids.unsqueeze(-1), 0.0) / e[:, None, :]).argmax(-1)
    bonus = (p[:, K] / e).argmax(-1)
    return torch.cat([rec, bonus[:, None]], 1).gather(1, n[:, None]).squeeze(1), n


STEPS = [step_strict, step_strict_min, step_gpt_fast_reject, step_lucidrains_reject,
         step_not_le_clamp, step_onehot_strict]


@pytest.mark.parametrize("fn", STEPS, ids=[f.__name__ for f in STEPS])
def test_mode_steps_three_way(fn):
    three_way(fn, _inputs(0), family="sample_verify", appear=OP, gone=GONE, seed=1)


def test_gpt_fast_reject_under_inductor(no_fx_cache):
    three_way(step_gpt_fast_reject, _inputs(2), lowering="inductor", family="sample_verify",
              appear=OP, gone=["aten.cumprod", "aten.argmax"], seed=1)


def test_the_edge_rows_decide_differently_per_mode():
    """The inputs tell the modes apart, so a wrong mode could not pass the tests above."""
    p, q, ids, u, e = _inputs(0)
    ns = {(m, cap): probs_verify(p, ids, q, u, e, m, cap)[1].tolist()
          for m in ACCEPT_MODES for cap in (False, True)}
    assert len(set(map(tuple, ns.values()))) >= 5, ns
    assert ns[("ge", False)][1] == 1 and ns[("not_lt", False)][1] == K + 1   # NaN ratio
    assert ns[("ge", False)][2] == K + 1 and ns[("ge", True)][2] == 1        # inf vs u = 1.5
    assert ns[("not_lt", True)][2] == 1                                      # the gpt-fast row
    assert ns[("ge", False)][3] >= 2 and ns[("gt", False)][3] == 1           # u == ratio
    assert ns[("ge", True)][4] == K + 1 and ns[("gt", True)][4] == 1         # u = 1 vs cap 1


@pytest.mark.parametrize("mode", list(ACCEPT_MODES))
@pytest.mark.parametrize("cap", [False, True])
def test_op_equals_the_written_test(mode, cap):
    """The op's accepted counts equal an independent eager transcription of each test."""
    p, q, ids, u, e = _inputs(3)
    r = _at(p[:, :K], ids) / _at(q, ids)
    if cap:
        r = torch.minimum(torch.ones(()), r)
    ok = {"ge": u <= r, "gt": u < r, "not_lt": ~(u > r), "not_le": ~(u >= r)}[mode]
    want = ok.long().cumprod(-1).sum(-1)
    _, num = rejection_sample(p, ids, q, uniforms=u, exponentials=e, target_is_probs=True,
                              accept_mode=mode, ratio_cap=cap)
    assert torch.equal(num.long() - 1, want)


def test_bad_accept_mode_names_the_value():
    p, q, ids, u, e = _inputs(0)
    with pytest.raises(ValueError, match="accept_mode='lt'.*'ge', 'gt', 'not_lt', 'not_le'"):
        rejection_sample(p, ids, q, uniforms=u, exponentials=e, target_is_probs=True,
                         accept_mode="lt")
    with pytest.raises(ValueError, match="accept_mode='gt'.*target_is_probs=True"):
        rejection_sample(p.log(), ids, q, temperature=torch.ones(B), uniforms=u,
                         accept_mode="gt")
    with pytest.raises(ValueError, match="ratio_cap=True.*target_is_probs=True"):
        rejection_sample(p.log(), ids, q, temperature=torch.ones(B), uniforms=u,
                         ratio_cap=True)


# --- vllm-ascend's block verify count: the op's accept_rule="cumulative" ------------------------
def step_ascend_block(p, q, ids, u, e):
    """vllm-ascend, sample/rejection_sampler.py (`rejection_random_sample_block_verify_pytorch`),
    batched [B, K] (ours: no ragged flattening): pi = cumprod(min(1, p/q)) against cumprod(u),
    legal only where q(x) > 0, accepted up to the last legal position, the recovered token
    there (here the exponential race over max(p - q, 0)), the bonus when all K are accepted."""
    target_token_probs, draft_token_probs = _at(p[:, :K], ids), _at(q, ids)
    pi = target_token_probs / draft_token_probs
    pi = pi.clamp(max=1.0)
    pi = torch.cumprod(pi, dim=-1)
    uniform_token_probs = torch.cumprod(u, dim=-1)
    legal_mask = (draft_token_probs > 0) & (pi >= uniform_token_probs)
    max_spec_len = legal_mask.shape[-1]
    last_accept_pos = torch.where(
        legal_mask.any(dim=-1, keepdim=True),
        max_spec_len - legal_mask.flip(dims=[-1]).float().argmax(dim=-1, keepdim=True) - 1, -1)
    return _finish(p, q, ids, e, (last_accept_pos + 1).squeeze(-1))


def _block_inputs(seed=0):
    """Rows where the block count differs from the prefix count: a failure followed by a later
    position whose running product passes again, and q(x) = 0 in the middle."""
    p, q, ids, u, e = _inputs(seed)
    r = _at(p[:, :K], ids) / _at(q, ids)
    u[5] = torch.stack([r[5, 0] * 1.5, torch.tensor(0.9), torch.tensor(1.0), torch.tensor(1.0)])
    q[6, 1, ids[6, 1]] = 0.0
    u[6] = torch.tensor([0.0, 0.0, 0.0, 1.0])
    return p, q, ids, u, e


def _block_reference(p, q, ids, u):
    """The block count request by request: a Python loop over the running products."""
    out = []
    for b in range(ids.shape[0]):
        r = (p[b, torch.arange(K), ids[b]] / q[b, torch.arange(K), ids[b]]).clamp(max=1.0)
        pis, us = torch.cumprod(r, 0), torch.cumprod(u[b], 0)
        last = -1
        for k in range(K):
            if q[b, k, ids[b, k]] > 0 and pis[k] >= us[k]:
                last = k
        out.append(last + 1)
    return torch.tensor(out)


def test_block_rule_differs_from_prefix_on_these_inputs():
    p, q, ids, u, e = _block_inputs(0)
    _, n_block = probs_verify(p, ids, q, u, e, "ge", True, "cumulative")
    _, n_prefix = probs_verify(p, ids, q, u, e, "ge", True)
    assert torch.equal(n_block.long() - 1, _block_reference(p, q, ids, u))
    assert (n_block > n_prefix).any(), (n_block, n_prefix)


def test_ascend_block_step_three_way():
    three_way(step_ascend_block, _block_inputs(0), family="sample_verify", appear=OP + [
        "accept_rule: cumulative"], gone=["aten.cumprod", "aten.flip", "aten.argmax"], seed=1)


def test_ascend_block_step_under_inductor(no_fx_cache):
    three_way(step_ascend_block, _block_inputs(1), lowering="inductor", family="sample_verify",
              appear=OP, gone=["aten.cumprod", "aten.flip"], seed=1)


def test_bad_accept_rule_names_the_value():
    p, q, ids, u, e = _inputs(0)
    with pytest.raises(ValueError, match="accept_rule='last'.*'prefix', 'cumulative'"):
        rejection_sample(p, ids, q, uniforms=u, exponentials=e, target_is_probs=True,
                         accept_rule="last")
