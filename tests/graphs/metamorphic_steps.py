"""Verify steps and output wrappers for the metamorphic suite (test_metamorphic.py, issue 34).

The steps are the verify shapes the backend's own tests use, restated here because their
modules are not importable from tests/graphs (each test directory is its own rootdir entry):

- greedy_step: README.md's `greedy_verify` (its `.long()` bonus gather is not the greedy
  whole-step pattern: -> npuspec::greedy_accept);
- greedy_emit: docs/passes.md's whole greedy step, -1 padded emission [B, K+1] (same op);
- greedy_count: a greedy accept count, tests/passes/test_corpus.py::medusa_style
  (-> npuspec::greedy_accept);
- first_reject: tests/passes/test_prefix_proof.py::first_reject_argmax, a count the prefix
  proof rewrites before it becomes npuspec::greedy_accept;
- sample_step: tests/passes/test_sample_verify.py::step_token, standard sampling with draft
  probs (-> rejection_sample(target_is_probs=True));
- onehot_step: tests/passes/test_sample_verify.py::step_onehot, one-hot (n-gram) drafts.

Every draw is an input (uniforms u, exponentials e), so a step is a function of its inputs.

A wrapper takes the step's output tuple and returns a tuple of tensors computed from it: batch
reductions, flips, sorts, where against a batch statistic, in-place updates, views. Every
wrapper applies to every output of the step.
"""
from __future__ import annotations

import torch

K, V = 3, 17


# -- inputs --------------------------------------------------------------------------------------
def greedy_inputs(B: int, seed: int) -> tuple:
    """logits [B, K+1, V], drafts [B, K]: each draft kept (accepted) with probability 0.7, so
    batches mix every accept count; row 0 accepts everything when its draws say so."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, K + 1, V, generator=g)
    t = logits.argmax(-1)[:, :K]
    keep = torch.rand(B, K, generator=g) < 0.7
    drafts = torch.where(keep, t, (t + 1 + torch.randint(0, V - 1, (B, K), generator=g)) % V)
    return logits, drafts


def sample_inputs(B: int, seed: int) -> tuple:
    """p [B, K+1, V], q [B, K, V], ids [B, K] drawn from q, u [B, K], e [B, V]."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, K + 1, V, generator=g) * 2
    p = torch.softmax(logits, -1)
    q = torch.softmax(torch.randn(B, K, V, generator=g) + logits[:, :K], -1)
    ids = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(B, K)
    u = torch.rand(B, K, dtype=torch.float64, generator=g).float()
    e = torch.empty(B, V).exponential_(generator=g)
    return p, q, ids, u, e


def onehot_inputs(B: int, seed: int) -> tuple:
    p, _, ids, u, e = sample_inputs(B, seed)
    return p, ids, u, e


# -- steps ---------------------------------------------------------------------------------------
def greedy_step(target_logits, draft_ids):
    target = target_logits.argmax(-1)                                    # [B, K+1]
    accepted = (target[:, :-1] == draft_ids).int().cumprod(-1).sum(-1)  # [B]
    bonus = target.gather(1, accepted[:, None].long()).squeeze(1)       # [B]
    return accepted, bonus


def greedy_emit(logits, drafts):
    target = logits.argmax(dim=-1)
    n = (drafts == target[:, :-1]).cumprod(dim=-1).sum(dim=-1)
    pos = torch.arange(target.shape[1], device=logits.device)
    return torch.where(pos[None, :] <= n[:, None], target, -1), n


def greedy_count(logits, candidates):
    mask = (candidates == torch.argmax(logits[:, :-1], dim=-1)).int()
    return (torch.cumprod(mask, dim=1).sum(dim=1),)


def first_reject(logits, drafts):
    ok = drafts == logits.argmax(-1)[:, :drafts.shape[1]]
    return (torch.where(ok.all(dim=1), drafts.shape[1], (~ok).int().argmax(dim=1)),)


def _at(t, ids):
    return t.gather(-1, ids.unsqueeze(-1)).squeeze(-1)


def sample_step(p, q, ids, u, e):
    n = (_at(p[:, :K], ids) / _at(q, ids) >= u).cumprod(dim=-1).sum(dim=-1)
    rec = (torch.clamp(p[:, :K] - q, min=0) / e[:, None, :]).argmax(dim=-1)
    bonus = (p[:, K] / e).argmax(dim=-1)
    tok = torch.cat([rec, bonus[:, None]], dim=1).gather(1, n[:, None]).squeeze(1)
    return tok, n + 1


def onehot_step(p, ids, u, e):
    n = (_at(p[:, :K], ids) >= u).long().cumprod(dim=1).sum(dim=1)
    rec = (p[:, :K].scatter(-1, ids.unsqueeze(-1), 0.0) / e[:, None, :]).argmax(-1)
    bonus = (p[:, K] / e).argmax(-1)
    return torch.cat([rec, bonus[:, None]], 1).gather(1, n[:, None]).squeeze(1), n


class Step:
    def __init__(self, fn, make):
        self.fn, self.make, self.name = fn, make, fn.__name__


STEPS = [Step(greedy_step, greedy_inputs), Step(greedy_emit, greedy_inputs),
         Step(greedy_count, greedy_inputs), Step(first_reject, greedy_inputs),
         Step(sample_step, sample_inputs), Step(onehot_step, onehot_inputs)]
STEP = {s.name: s for s in STEPS}


# -- wrappers: cross-row (a captured step replays at exact sizes only) -----------------------------
def rel_min(outs):
    return tuple(o - o.min() for o in outs)


def rel_max(outs):
    return tuple(o.max() - o for o in outs)


def batch_sum(outs):
    return tuple(o.sum(0) for o in outs) + tuple(o * o.sum() for o in outs)


def batch_mean(outs):
    # float means of small integers: the sum is exact, and both sides divide it by B once
    return tuple(o.float().mean(0) for o in outs)


def cumsum0(outs):
    return tuple(o.cumsum(0) for o in outs)


def flip0(outs):
    return tuple(o.flip(0) for o in outs)


def sort0(outs):
    res = ()
    for o in outs:
        s = o.sort(dim=0, stable=True)  # stable: the indices of equal counts are defined
        res += (s.values, s.indices)
    return res


def where_stat(outs):
    return (tuple(torch.where(o.float() >= o.float().mean(), o, -1) for o in outs)
            + tuple(torch.where(o == o.max(), o, o.min()) for o in outs))


def set_row0(outs):
    for o in outs:
        o[0] = -5
    return outs


def rows_view(outs):
    # a view that drops the first row: B - 1 rows, returned with its base
    return tuple(x for o in outs for x in (o, o[1:]))


# -- wrappers: row-wise (a captured step is padded) ------------------------------------------------
def iadd(outs):
    for o in outs:
        o += 1
    return outs


def clamp_(outs):
    return tuple(o.clamp_(min=1, max=2) for o in outs)


def with_view(outs):
    res = ()
    for o in outs:
        res += (o, o.unsqueeze(-1), o.flatten())
    return res


def view_then_iadd(outs):
    res = ()
    for o in outs:
        v = o.unsqueeze(-1)
        v.add_(3)  # written through the view: o changes too
        res += (o, v)
    return res


CROSS = [rel_min, rel_max, batch_sum, batch_mean, cumsum0, flip0, sort0, where_stat, set_row0,
         rows_view]
ROWWISE = [iadd, clamp_, with_view, view_then_iadd]
WRAPPERS = CROSS + ROWWISE
WRITES = (set_row0, iadd, clamp_, view_then_iadd)


def wrapped(step: Step, wrappers) -> "callable":
    """One function: the step, then every wrapper on its outputs, all results flattened.
    Each wrapper that writes in place gets its own call of the step, so no other wrapper
    reads what it wrote (one compile then tests each wrapper as if it were alone)."""
    fn = step.fn
    pure = [w for w in wrappers if w not in WRITES]
    writes = [w for w in wrappers if w in WRITES]

    def combined(*args):
        outs = fn(*args)
        res = ()
        for w in pure:
            res += tuple(w(outs))
        for w in writes:
            res += tuple(w(tuple(fn(*args))))
        return res

    combined.__name__ = f"{step.name}__{'_'.join(w.__name__ for w in wrappers)}"
    return combined
