"""The greedy verify families: the whole greedy step and the greedy accepted length.

1. GreedyVerify   argmax + accepted prefix + emitted tokens   -> npuspec::rejection_sample
3. GreedyAccept   eq + cumprod/cumsum/cummin prefix length    -> npuspec::greedy_accept

(numbers: the manager's order, passes/patterns.py). Both compare token ids only, so the
replacements are exact for any input.
"""
from __future__ import annotations

import dataclasses
import itertools

import torch

from npuspec.passes.patterns_common import (FLOATS, TAILS, Spelling, VerifyPattern, _bind,
                                            _eq_shape, _static_shape, _tail_out, _val,
                                            npuspec_ops)


# --------------------------------------------------------------------------------------------
# 1. greedy whole verify step -> npuspec::rejection_sample
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class GreedyVerifyConfig:
    enabled: bool = True
    tails: tuple = ("cumprod", "cumprod_long", "cumsum_not", "cummin_int")
    max_k: int = 64  # the fused op handles any K; keep pathological shapes on the eager path


def _greedy_op(logits, drafts):
    # checks=False: the step as the eager idiom computes it on every input (NaN logits too)
    out, num = npuspec_ops.rejection_sample(logits, drafts, None, None, None, None, None, None,
                                            False, None, None, None, checks=False)
    return out.to(drafts.dtype), num.to(torch.int64)


class GreedyVerify(VerifyPattern):
    """The whole greedy verify step:

        target = logits.argmax(-1)                                   # [B, K+1]
        n = (drafts == target[:, :-1]).cumprod(-1).sum(-1)           # [B] (any tail spelling)
        out = torch.where(arange(K+1) <= n[:, None], target, -1)     # [B, K+1] emitted, -1 padded
    or, instead of `out`, the one token emitted after the accepted prefix:
        tok = target.gather(1, n[:, None]).squeeze(1)                # [B]

    Replaced by one `npuspec::rejection_sample` call in greedy mode, whose tokens are exactly
    `target[:, :n+1]` (accepted drafts equal the argmax, ties resolve to the lowest index in
    both). `target` and the intermediates must have no other users."""

    name = "greedy_verify"
    Config = GreedyVerifyConfig

    def spellings(self):
        out = []
        for tail in self.config.tails:
            t = TAILS[tail]

            def s_mask(logits, drafts, t):
                target = logits.argmax(dim=-1)                       # [B, K+1]
                n = t(drafts == target[:, :-1])                      # [B]
                pos = torch.arange(target.shape[1], device=logits.device)
                return torch.where(pos[None, :] <= n[:, None], target, -1), n

            def r_mask(logits, drafts):
                tok, num = _greedy_op(logits, drafts)
                return tok, num - 1

            def s_tok(logits, drafts, t):
                target = logits.argmax(dim=-1)
                n = t(drafts == target[:, :-1])
                return target.gather(1, n[:, None]).squeeze(1), n

            def s_fill(logits, drafts, t):
                target = logits.argmax(dim=-1)
                n = t(drafts == target[:, :-1])
                pos = torch.arange(target.shape[1], device=logits.device)
                return target.masked_fill(pos[None, :] > n[:, None], -1), n

            def r_tok(logits, drafts):
                tok, num = _greedy_op(logits, drafts)
                n = num - 1
                return tok.gather(1, n[:, None]).squeeze(1), n

            ex = lambda: [torch.randn(2, 5, 11), torch.randint(0, 11, (2, 4))]  # noqa: E731
            out.append(Spelling(f"mask_{tail}", _bind(s_mask, t=t), r_mask, ex))
            out.append(Spelling(f"token_{tail}", _bind(s_tok, t=t), r_tok, ex))
            out.append(Spelling(f"fill_{tail}", _bind(s_fill, t=t), r_mask, ex))
        return out

    def extra_check(self, match) -> bool:
        logits, drafts = _val(match.kwargs["logits"]), _val(match.kwargs["drafts"])
        if logits is None or drafts is None or not self.config.enabled:
            return False
        # float64 is refused: the op takes the argmax of logits.float(), and rounding to float32
        # could merge two distinct float64 maxima into a tie
        return (logits.dim() == 3 and drafts.dim() == 2 and _static_shape(logits)
                and _static_shape(drafts) and logits.dtype in FLOATS[:3]
                and drafts.dtype == torch.int64 and _eq_shape(drafts.shape[:1], logits.shape[:1])
                and drafts.shape[1] == logits.shape[1] - 1 and 1 <= drafts.shape[1] <= self.config.max_k)


# --------------------------------------------------------------------------------------------
# 3. greedy accepted length -> npuspec::greedy_accept
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class GreedyAcceptConfig:
    enabled: bool = True
    tails: tuple = tuple(TAILS)
    id_dtypes: tuple = ("int32", "int64")


class GreedyAccept(VerifyPattern):
    """The greedy accepted-prefix length of drafts against target choices:

        n = (drafts == target).cumprod(-1).sum(-1)                       # cumprod of equality
        n = ((~(drafts == target)).cumsum(-1) < 1).sum(-1)              # cumsum of inequality < 1
        n = ((~(cand == sel[:, :-1])).cumsum(dim=-1) < 1).sum()         # HF assisted generation
        n = (drafts == target).int().cummin(-1).values.sum(-1)          # cummin
        n = ((drafts != target).cumsum(-1) == 0).sum(-1)                # ne + cumsum == 0

    (either operand order of ==). Replaced by `npuspec::greedy_accept(drafts, target)` (summed
    for the `.sum()` spelling). Both id tensors must be [B, K], int32 or int64 (mixed too)."""

    name = "greedy_accept"
    Config = GreedyAcceptConfig

    def spellings(self):
        out = []
        ex = lambda: [torch.randint(0, 7, (2, 4)), torch.randint(0, 7, (2, 4))]  # noqa: E731
        for tail, swap in itertools.product(self.config.tails, (False, True)):
            t = TAILS[tail]

            def s(drafts, target, t, swap):
                return t(target == drafts if swap else drafts == target)

            def r(drafts, target, tail):
                return _tail_out(tail, npuspec_ops.greedy_accept(drafts, target))

            out.append(Spelling(f"{tail}{'_swapped' if swap else ''}", _bind(s, t=t, swap=swap),
                                _bind(r, tail=tail), ex))

        def s_ne(drafts, target):
            return ((drafts != target).cumsum(dim=-1) == 0).sum(dim=-1)

        out.append(Spelling("ne_cumsum_eq0", s_ne,
                            lambda drafts, target: npuspec_ops.greedy_accept(drafts, target), ex))
        return out

    def extra_check(self, match) -> bool:
        d, t = _val(match.kwargs["drafts"]), _val(match.kwargs["target"])
        if d is None or t is None or not self.config.enabled:
            return False
        ok_dt = tuple(getattr(torch, n) for n in self.config.id_dtypes)
        # int32 drafts against int64 argmax ids (TensorRT-LLM's MTP): `==` compares values
        return (d.dim() == 2 and _eq_shape(d.shape, t.shape) and d.dtype in ok_dt
                and t.dtype in ok_dt and d.shape[1] >= 1)
