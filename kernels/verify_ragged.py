"""The ragged mode of `npuspec::rejection_sample` (`cu_num_draft_tokens` given): vLLM's layout,
as vllm-ascend's PyTorch rejection sampler takes it (docs/verify.md, "The ragged mode").

Drafts come flat: request b owns the n_b = cu[b] - cu[b-1] rows of p [N, V], q [N, V] and the
ids [N] starting at s_b = cu[b-1] (cu = cu_num_draft_tokens, cumulative; s_0 = 0), and up to
max_spec_len M of them. As vllm-ascend's `rejection_random_sample_pytorch` (and its block-verify
twin) reads them, on a [B, M] grid whose slot (b, j) holds flat row clamp(s_b + j, 0, N - 1):

    x = ids[row]; ph = x == -1; px = p[row, x or 0]; qx = q[row, x or 0] (1.0 for n-gram drafts)
    ok  = (qx > 0) & cmp(px / qx, u[row]) & ~ph                  # accept_rule "prefix"
    a_b = the first j < n_b where ok fails, else n_b
    ok' = (qx > 0) & cmp(cumprod(min(px / qx, 1)), cumprod(u[row])) & j < n_b & ~ph
    a_b = 1 + the last j where ok' holds, else 0                  # accept_rule "cumulative"
    out[b] = x before a_b, then rec(s_b + a_b) if a_b < n_b else bonus[b], then -1
    rec(t) = argmax of score(residual(p[t], q[t]), E[b])           # the residual_* keywords;
                                                                   # n-gram: p[t] with x zeroed

u keeps its dtype (vllm-ascend draws float64; the comparison promotes as the user's does).
Rows of `is_greedy` are left at -1 with num_emitted 0: vllm-ascend's greedy pass writes them.
The recovered token is computed for one row per request, the one emitted: O(B V), where the
user's code races every flat row (O(N V)). Everything else is the user's arithmetic on the same
grid, so the tokens equal `ragged_verify_ref` (the per-request loop written plainly) and
vllm-ascend's PyTorch path bit for bit (tests/kernels/test_ragged_mode.py). Layout values (cu
non-decreasing, n_b <= M) are not checked, as vLLM does not: checking them costs a host sync.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from npuspec.kernels import race_rows_cpu
from npuspec.kernels.accept import (GUARDS, NONNEG, NORMALIZE, SAMPLERS, _residual,
                                    residual_score)
from npuspec.kernels.verify_composed import _row_sums, _rows_sum_alike
from npuspec.kernels.verify_probs import ACCEPT_MODES, ACCEPT_RULES


def check_ragged(p: Tensor, ids: Tensor, q: Optional[Tensor], uniforms: Optional[Tensor],
                 exponentials: Optional[Tensor], bonus: Optional[Tensor], cu: Tensor,
                 is_greedy: Optional[Tensor], max_spec_len: int, residual: dict,
                 target_is_probs: bool, ratio_cap: bool) -> None:
    """Errors naming the value and the fix, for a call with cu_num_draft_tokens."""
    if not target_is_probs:
        raise ValueError("cu_num_draft_tokens given with target_is_probs=False: the ragged mode "
                         "verifies on your finished probabilities [N, V]; pass "
                         "target_is_probs=True")
    if ratio_cap:
        raise ValueError("cu_num_draft_tokens with ratio_cap=True: the ragged mode's prefix "
                         "rule tests p/q as vllm-ascend writes it and its cumulative rule caps "
                         "at 1 itself; pass ratio_cap=False")
    if bonus is None:
        raise ValueError("cu_num_draft_tokens given without bonus_token_ids: the ragged mode "
                         "emits your bonus token after a fully accepted request; pass "
                         "bonus_token_ids [B]")
    check_max_spec_len(max_spec_len)
    if p.dim() != 2:
        raise ValueError(f"target_logits: the ragged mode takes flat probabilities [N, V]; got "
                         f"{tuple(p.shape)}")
    N, V = p.shape
    if ids.dim() != 1 or ids.shape[0] != N or ids.dtype != torch.int64:
        raise ValueError(f"draft_token_ids: expected int64 [N] = [{N}] (one per row of p); got "
                         f"{ids.dtype} {tuple(ids.shape)}; flatten and cast with .long()")
    if cu.dim() != 1 or cu.is_floating_point() or cu.dtype == torch.bool:
        raise ValueError(f"cu_num_draft_tokens: expected int [B] (cumulative draft counts); "
                         f"got {cu.dtype} {tuple(cu.shape)}")
    B = cu.shape[0]
    if tuple(bonus.shape) not in ((B,), (B, 1)) or bonus.is_floating_point():
        raise ValueError(f"bonus_token_ids: expected int [B] or [B, 1] = [{B}]; got "
                         f"{bonus.dtype} {tuple(bonus.shape)}")
    if is_greedy is not None and (is_greedy.dtype != torch.bool or tuple(is_greedy.shape) != (B,)):
        raise ValueError(f"is_greedy: expected bool [B] = [{B}]; got {is_greedy.dtype} "
                         f"{tuple(is_greedy.shape)}")
    for name, v, shape in (("draft_probs", q, (N, V)), ("uniforms", uniforms, (N,)),
                           ("exponentials", exponentials, (B, V))):
        if v is not None and tuple(v.shape) != shape:
            raise ValueError(f"{name}: the ragged mode expects {list(shape)}; got "
                             f"{tuple(v.shape)}")
    for key, allowed in (("residual_normalize", NORMALIZE), ("residual_sampler", SAMPLERS),
                         ("residual_nonneg", NONNEG), ("residual_guard", GUARDS)):
        if residual[key] not in allowed:
            raise ValueError(f"{key}={residual[key]!r}: choose one of {allowed}")
    if residual["residual_normalize"] == "all":
        raise ValueError("residual_normalize='all' with cu_num_draft_tokens: a sum over every "
                         "request's rows has no ragged meaning; use 'row' or 'none'")


def check_max_spec_len(max_spec_len) -> None:
    if isinstance(max_spec_len, bool) or not isinstance(max_spec_len, int) or max_spec_len < 0:
        raise ValueError(f"max_spec_len={max_spec_len!r}: the ragged mode needs the longest "
                         f"draft a request may have, an int >= 0 (the output is [B, "
                         f"max_spec_len + 1])")


def _layout(cu: Tensor, N: int, M: int):
    """-> starts [B], n [B], grid rows [B, M] (clamped into [0, N)), in_req [B, M]."""
    cu = cu.to(torch.int64)
    starts = torch.cat([cu.new_zeros(1), cu[:-1]])                  # [B]
    n = cu - starts                                                 # [B]
    pos = torch.arange(M, device=cu.device)[None, :]                # [1, M]
    rows = (starts[:, None] + pos).clamp(0, max(N - 1, 0))          # [B, M]
    return starts, n, rows, pos < n[:, None]


def _accepted(px: Tensor, qx: Tensor, u: Tensor, ph: Tensor, in_req: Tensor, n: Tensor,
              accept_mode: str, accept_rule: str) -> Tensor:
    """a [B]: the accepted count on the grid (see the module docstring)."""
    M = px.shape[1]
    if accept_rule == "prefix":
        ok = (qx > 0) & ACCEPT_MODES[accept_mode](px / qx, u) & ~ph
        bad = ~ok & in_req                                          # [B, M]
        first = torch.where(bad.any(1), bad.to(torch.uint8).argmax(1), M)
        return torch.minimum(first, n)
    pi = torch.cumprod((px / qx).clamp(max=1.0), dim=1)
    ok = (qx > 0) & ACCEPT_MODES[accept_mode](pi, torch.cumprod(u, dim=1)) & in_req & ~ph
    return torch.where(ok.any(1), M - ok.flip(dims=[1]).to(torch.int64).argmax(1), 0)


def ragged_verify(p: Tensor, ids: Tensor, q: Optional[Tensor], uniforms: Tensor,
                  exponentials: Tensor, bonus: Tensor, cu: Tensor, max_spec_len: int,
                  is_greedy: Optional[Tensor] = None, accept_mode: str = "ge",
                  accept_rule: str = "prefix", residual_normalize: str = "none",
                  residual_sampler: str = "race", residual_nonneg: str = "clamp",
                  residual_floor: float = 0.0, residual_guard: str = "none",
                  residual_fill: float = 0.0, native: bool = True) -> tuple[Tensor, Tensor]:
    """p [N, V], ids int64 [N], q [N, V] or None (n-gram), uniforms [N], exponentials [B, V],
    bonus int [B] or [B, 1], cu int [B] -> (tokens int32 [B, M+1], num_emitted int32 [B]).
    native=False: the recovered tokens in PyTorch, never the CPU kernel (the same tokens; the
    passes' checks, which run on a few tiny rows, need not load or build its library)."""
    assert accept_mode in ACCEPT_MODES and accept_rule in ACCEPT_RULES, (accept_mode, accept_rule)
    N, V = p.shape
    B, M = cu.shape[0], max_spec_len
    starts, n, rows, in_req = _layout(cu, N, M)
    x = ids[rows] if N else ids.new_full((B, M), -1)                # [B, M]
    ph = x == -1
    safe = x.masked_fill(ph, 0)
    if N:
        px = p[rows, safe]                                          # [B, M]
        qx = torch.ones_like(px) if q is None else q[rows, safe]
        u = uniforms[rows]
    else:
        px = qx = p.new_ones((B, M))
        u = uniforms.new_zeros((B, M))
    a = _accepted(px, qx, u, ph, in_req, n, accept_mode, accept_rule)   # [B]
    tok = bonus.reshape(B).to(torch.int64)
    if N and M:
        t = (starts + a.clamp_max(M - 1)).clamp(0, N - 1)           # [B] the row emitted
        fast = None
        if native and q is not None and (residual_normalize == "none" or (
                residual_normalize == "row" and _rows_sum_alike(p, q))):
            sums = None if residual_normalize == "none" else (lambda r: _row_sums(r, N))
            fast = race_rows_cpu.race_flat_rows(p, q, exponentials, t, residual_nonneg,
                                                residual_floor, sums, residual_sampler,
                                                residual_guard, residual_fill)
        if fast is not None:  # the CPU kernel (kernels/race_rows_cpu.py): the same values
            rec = fast[1]
        else:
            r = _row_residual(p, q, ids, t, residual_normalize, residual_nonneg, residual_floor)
            rec = residual_score(r, exponentials, residual_sampler, residual_guard,
                                 residual_fill).argmax(-1)
        tok = torch.where(a < n, rec, tok)
    pos = torch.arange(M + 1, device=p.device)[None, :]
    xs = torch.cat([x, x.new_full((B, 1), -1)], dim=1)              # [B, M+1]
    out = torch.where(pos < a[:, None], xs, -1)
    out = torch.where(pos == a[:, None], tok[:, None], out)
    num = a + 1
    if is_greedy is not None:
        out = out.masked_fill(is_greedy[:, None], -1)
        num = num.masked_fill(is_greedy, 0)
    return out.to(torch.int32), num.to(torch.int32)


def _row_residual(p: Tensor, q: Optional[Tensor], ids: Tensor, t: Tensor, normalize: str,
                  nonneg: str, floor: float) -> Tensor:
    """The residual of flat rows t [B] -> [B, V], as the user's residual over every row [N, V]
    gives them: max(p - q, floor), or (n-gram) p with the row's draft zeroed."""
    if q is None:
        pt, x = p[t], ids[t]                                        # [B, V], [B]
        zeroed = torch.where((x == -1)[:, None], pt, pt.scatter(1, x.clamp_min(0)[:, None], 0.0))
        r = _residual(zeroed, zeroed.new_zeros(()), "none", nonneg, floor)
    else:
        r = _residual(p[t], q[t], "none", nonneg, floor)
    if normalize == "row":
        if _rows_sum_alike(p, p if q is None else q):
            r.div_(_row_sums(r, p.shape[0]))
        else:  # the sums as the user's [N, V] residual adds them
            r.div_(full_residual(p, q, ids, nonneg, floor).sum(-1, keepdim=True)[t])
    return r


def full_residual(p: Tensor, q: Optional[Tensor], ids: Tensor, nonneg: str,
                  floor: float) -> Tensor:
    """Every flat row's residual [N, V], unnormalised, as vllm-ascend builds it (n-gram: a copy
    of p with each row's draft zeroed, -1 drafts zeroing nothing)."""
    if q is None:
        resid = p.clone()
        has = ids != -1
        resid[torch.arange(p.shape[0], device=p.device)[has], ids[has]] = 0.0
        d = resid - 0.0
    else:
        d = p - q
    return (d.clamp(min=floor) if nonneg == "clamp" else d if nonneg == "none"
            else torch.where(d > 0, d, torch.zeros_like(d)))


def ragged_verify_ref(p: Tensor, ids: Tensor, q: Optional[Tensor], uniforms: Tensor,
                      exponentials: Tensor, bonus: Tensor, cu: Tensor, max_spec_len: int,
                      is_greedy: Optional[Tensor] = None, accept_mode: str = "ge",
                      accept_rule: str = "prefix", residual_normalize: str = "none",
                      residual_sampler: str = "race", residual_nonneg: str = "clamp",
                      residual_floor: float = 0.0, residual_guard: str = "none",
                      residual_fill: float = 0.0) -> tuple[Tensor, Tensor]:
    """Every flat row's recovered token (as the user's code races them), then request by
    request: the accepted count by the rule on its own drafts, the emission."""
    N, V = p.shape
    B, M = cu.shape[0], max_spec_len
    cmp = ACCEPT_MODES[accept_mode]
    out = torch.full((B, M + 1), -1, dtype=torch.int64)
    num = torch.zeros(B, dtype=torch.int64)
    starts = [0] + [int(c) for c in cu[:-1]]
    owner = torch.zeros(N, dtype=torch.int64)
    for b in range(B):
        owner[starts[b]:int(cu[b])] = b
    r = full_residual(p, q, ids, residual_nonneg, residual_floor)
    if residual_normalize == "row":
        r = r / r.sum(-1, keepdim=True)
    rec = residual_score(r, exponentials[owner], residual_sampler, residual_guard,
                         residual_fill).argmax(-1)                  # [N]
    for b in range(B):
        if is_greedy is not None and bool(is_greedy[b]):
            continue
        s, nb = starts[b], int(cu[b]) - starts[b]
        ok, a = [], 0
        run_r, run_u = None, None
        for j in range(nb):
            x = int(ids[s + j])
            px = p[s + j, max(x, 0)]
            qx = p.new_tensor(1.0) if q is None else q[s + j, max(x, 0)]
            ratio = px / qx
            if accept_rule == "cumulative":
                ratio = ratio.clamp(max=1.0)
                run_r = ratio if run_r is None else run_r * ratio
                run_u = uniforms[s + j] if run_u is None else run_u * uniforms[s + j]
                ok.append(bool(qx > 0) and bool(cmp(run_r, run_u)) and x != -1)
            else:
                ok.append(bool(qx > 0) and bool(cmp(ratio, uniforms[s + j])) and x != -1)
        if accept_rule == "cumulative":
            a = max([j + 1 for j, o in enumerate(ok) if o], default=0)
        else:
            while a < nb and ok[a]:
                a += 1
        for j in range(a):
            out[b, j] = ids[s + j]
        out[b, a] = rec[s + a] if a < nb else int(bonus.reshape(B)[b])
        num[b] = a + 1
    return out.to(torch.int32), num.to(torch.int32)
