"""Near misses: look like a verify idiom but mean something else. They must not match and must
still compute what the user wrote (compared with eager, same RNG state)."""
import pytest
import torch

from passes_helpers import three_way

B, K, V = 4, 3, 19


def _inputs(seed=0, draft_dtype=torch.int64):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, K + 1, V, generator=g)
    t = logits.argmax(-1)[:, :K]
    drafts = torch.where(torch.rand(B, K, generator=g) < 0.7, t, 0).to(draft_dtype)
    p = torch.softmax(torch.randn(B, K, V, generator=g), -1)
    q = torch.softmax(torch.randn(B, K, V, generator=g), -1)
    return logits, drafts, p, q


# wrong dim ---------------------------------------------------------------------------------
def greedy_wrong_dim(logits, drafts, p, q):
    t = logits.argmax(-1)
    return t, (drafts == t[:, :-1]).cumprod(dim=0).sum(dim=1)       # cumprod over the batch


def residual_wrong_dim(logits, drafts, p, q):
    e = torch.empty_like(p).exponential_()
    return (torch.clamp(p - q, min=0) / e).argmax(dim=1)             # argmax over positions


def ratio_wrong_slice(logits, drafts, p, q):
    u = torch.rand(B, K)
    px = p.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    qx = q.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    return (px / qx >= u).cumprod(dim=-1)[:, :-1].sum(dim=-1)        # drops the last position


# different comparison -----------------------------------------------------------------------
def greedy_le(logits, drafts, p, q):
    t = logits.argmax(-1)
    return t, (drafts <= t[:, :-1]).cumprod(dim=-1).sum(dim=-1)      # <= instead of ==


def greedy_cumsum_lt2(logits, drafts, p, q):
    t = logits.argmax(-1)
    return t, ((~(drafts == t[:, :-1])).cumsum(-1) < 2).sum(-1)      # allows one mismatch


# an extra use of an intermediate the replacement would remove --------------------------------
def greedy_extra_use(logits, drafts, p, q):
    t = logits.argmax(-1)
    acc = (drafts == t[:, :-1]).cumprod(dim=-1)
    return t, acc.sum(dim=-1), acc                                   # acc is returned too


def residual_extra_use(logits, drafts, p, q):
    e = torch.empty_like(p).exponential_()
    r = torch.clamp(p - q, min=0)
    return (r / e).argmax(dim=-1), r.sum(-1)                         # r is used again


def greedy_step_extra_use(logits, drafts, p, q):
    target = logits.argmax(dim=-1)
    n = (drafts == target[:, :-1]).cumprod(dim=-1).sum(dim=-1)
    pos = torch.arange(K + 1)
    return torch.where(pos[None, :] <= n[:, None], target, -1), n, target   # target returned


# integer dtypes that differ ------------------------------------------------------------------
CASES = [
    (greedy_wrong_dim, 0, torch.int64),
    (residual_wrong_dim, 0, torch.int64),
    (ratio_wrong_slice, 0, torch.int64),
    (greedy_le, 0, torch.int64),
    (greedy_cumsum_lt2, 0, torch.int64),
    (greedy_extra_use, 0, torch.int64),
    (residual_extra_use, 0, torch.int64),
]


@pytest.mark.parametrize("fn,matched,dtype", CASES, ids=[c[0].__name__ for c in CASES])
def test_near_miss_does_not_match(fn, matched, dtype):
    three_way(fn, _inputs(7, dtype), matched=matched, gone=["npuspec."])


def test_superset_blocked_falls_back_to_narrow_op():
    """The whole-step pattern must not fire when `target` is used elsewhere; the narrower
    greedy_accept still takes the prefix length."""
    three_way(greedy_step_extra_use, _inputs(8), matched=1, family="greedy_accept",
              appear=["npuspec.greedy_accept", "aten.argmax"], gone=["npuspec.rejection_sample"])


def greedy_step(logits, drafts, p, q):
    target = logits.argmax(dim=-1)
    n = (drafts == target[:, :-1]).cumprod(dim=-1).sum(dim=-1)
    return target.gather(1, n[:, None]).squeeze(1), n


def test_float64_logits_keep_the_argmax():
    """rejection_sample takes the argmax of float32 logits; float64 could tie after rounding,
    so the whole-step pattern refuses float64 and only the exact prefix count is fused."""
    logits, drafts, p, q = _inputs(9)
    three_way(greedy_step, (logits.double(), drafts, p, q), matched=1, family="greedy_accept",
              appear=["npuspec.greedy_accept", "aten.argmax"], gone=["npuspec.rejection_sample"])
