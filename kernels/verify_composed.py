"""The composed mode of `npuspec::rejection_sample` (`bonus_token_ids` given): one call for a
whole verify step whose pieces are the narrow ops' (kernels/accept.py), as vLLM v1's
`forward_native` and its kind write it (docs/verify.md, "The composed mode"):

    n    = ratio_accept(p[:, :K], q_accept, ids, u, accept_mode)              # [B]
    rec  = residual_sample(p[:, :K], q, E, normalize, sampler, nonneg, floor,
                           guard, fill)                                         # [B, K]
    tok  = rec[b, n] if n < K else bonus[b]
    out  = ids before n, tok at n, -1 after                                     # [B, K+1]

The caller supplies the bonus tokens (vLLM samples them apart), so row K of p is never read.
Only row n of the residual is built, scored and raced: O(B V) where the narrow op and the
eager idiom spend O(B K V). Elementwise IEEE results and a first-index argmax do not depend
on the tensor a row sits in; a row's sum (normalize="row") does only in one case, which
`_row_sums` keeps apart. normalize="all" (a sum over everything) computes the whole residual
as the narrow op does. So the tokens equal `composed_verify_ref` (the narrow ops' references,
then the emission written the plainest way) bit for bit.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from npuspec.kernels import race_rows_cpu
from npuspec.kernels.accept import (GUARDS, NONNEG, NORMALIZE, SAMPLERS, _residual, accept_len,
                                    ratio_accept_ref, residual_sample_ref, residual_score)
from npuspec.kernels.verify_probs import ACCEPT_MODES

RESIDUAL_DEFAULTS = {"residual_normalize": "none", "residual_sampler": "race",
                     "residual_nonneg": "clamp", "residual_floor": 0.0, "residual_guard": "none",
                     "residual_fill": 0.0}


def check_composed(target: Tensor, draft_token_ids: Tensor, draft_probs: Optional[Tensor],
                   uniforms: Optional[Tensor], exponentials: Optional[Tensor],
                   bonus_token_ids: Tensor, accept_draft_probs: Optional[Tensor],
                   residual: dict, target_is_probs: bool, ratio_cap: bool,
                   accept_rule: str) -> None:
    """Errors naming the value and the fix, for a call with bonus_token_ids."""
    if not target_is_probs:
        raise ValueError("bonus_token_ids given with target_is_probs=False: the composed mode "
                         "verifies on your finished probabilities; pass target_is_probs=True, "
                         "or leave bonus_token_ids out to sample the bonus row from logits")
    if ratio_cap or accept_rule != "prefix":
        raise ValueError(f"bonus_token_ids with ratio_cap={ratio_cap}, accept_rule="
                         f"{accept_rule!r}: the composed mode tests u against p/q as written "
                         f"(ratio_cap=False, accept_rule='prefix'); leave bonus_token_ids out")
    for name, v in (("draft_probs", draft_probs), ("uniforms", uniforms),
                    ("exponentials", exponentials)):
        if v is None:
            raise ValueError(f"bonus_token_ids given without {name}: the composed mode races "
                             f"the residual against your q with your own draws; pass {name}")
    B, K = draft_token_ids.shape
    V = target.shape[-1]
    if target.dim() != 3 or target.shape[0] != B or target.shape[1] not in (K, K + 1):
        raise ValueError(f"target_logits: expected [B, K, V] or [B, K+1, V] with B, K = {B}, "
                         f"{K} from draft_token_ids; got {tuple(target.shape)}")
    if tuple(bonus_token_ids.shape) not in ((B,), (B, 1)) or bonus_token_ids.is_floating_point():
        raise ValueError(f"bonus_token_ids: expected int [B] or [B, 1] = [{B}]; got "
                         f"{bonus_token_ids.dtype} {tuple(bonus_token_ids.shape)}")
    if draft_token_ids.dtype != torch.int64:
        raise ValueError(f"draft_token_ids: the composed mode takes int64 ids; got "
                         f"{draft_token_ids.dtype}; cast them with .long()")
    for name, v in (("draft_probs", draft_probs), ("exponentials", exponentials),
                    ("accept_draft_probs", accept_draft_probs)):
        if v is None:
            continue
        try:
            shape = torch.broadcast_shapes(v.shape, (B, K, V))
        except RuntimeError:
            shape = None
        if shape != (B, K, V):
            raise ValueError(f"{name}: expected a tensor that broadcasts to [B, K, V] = [{B}, "
                             f"{K}, {V}]; got {tuple(v.shape)}")
    for key, allowed in (("residual_normalize", NORMALIZE), ("residual_sampler", SAMPLERS),
                         ("residual_nonneg", NONNEG), ("residual_guard", GUARDS)):
        if residual[key] not in allowed:
            raise ValueError(f"{key}={residual[key]!r}: choose one of {allowed}")


def composed_verify(p: Tensor, ids: Tensor, q: Tensor, uniforms: Tensor, exponentials: Tensor,
                    bonus: Tensor, accept_q: Optional[Tensor] = None, accept_mode: str = "ge",
                    residual_normalize: str = "none", residual_sampler: str = "race",
                    residual_nonneg: str = "clamp", residual_floor: float = 0.0,
                    residual_guard: str = "none", residual_fill: float = 0.0
                    ) -> tuple[Tensor, Tensor]:
    """p [B, K(+1), V], ids int64 [B, K], q (residual) and accept_q (the test's, None: q)
    broadcasting to [B, K, V], uniforms [B, K], exponentials broadcasting to [B, K, V],
    bonus int [B] or [B, 1] -> (tokens int32 [B, K+1], num_emitted int32 [B])."""
    B, K = ids.shape
    V = p.shape[-1]
    pk = p[:, :K]                                                   # [B, K, V]
    n = accept_len(pk, q if accept_q is None else accept_q, ids, uniforms, accept_mode)  # [B]
    tok = bonus.reshape(B).to(torch.int64)                          # [B]
    if K > 0:
        b = torch.arange(B, device=p.device)
        nk = n.clamp_max(K - 1)                                     # a row for n = K too
        row = lambda t: _row_n(t, b, nk, K, V)                      # noqa: E731  [B, V]
        score = None
        if residual_normalize == "none" or (residual_normalize == "row"
                                            and _rows_sum_alike(pk, q)):
            sums = None if residual_normalize == "none" else (lambda r: _row_sums(r, B * K))
            score = race_rows_cpu.race_scores(pk, q, exponentials, nk, K, residual_nonneg,
                                              residual_floor, sums, residual_sampler,
                                              residual_guard, residual_fill)
        if score is not None:  # the CPU kernel: the same values, rows read in place
            tok = torch.where(n < K, score[1], tok)
            return _emit(ids, n, tok)
        if residual_normalize == "none":  # elementwise: only row n is computed
            r = _residual(row(pk), row(q), "none", residual_nonneg, residual_floor)
        elif residual_normalize == "row" and _rows_sum_alike(pk, q):
            r = _residual(row(pk), row(q), "none", residual_nonneg, residual_floor)
            r.div_(_row_sums(r, B * K))
        else:  # the sums as the narrow op adds them, then row n
            r = _residual(pk, q, residual_normalize, residual_nonneg, residual_floor)[b, nk]
        e = _row_n(exponentials, b, nk, K, V)                       # [B, V]
        rec = residual_score(r, e, residual_sampler, residual_guard, residual_fill).argmax(-1)
        tok = torch.where(n < K, rec, tok)
    return _emit(ids, n, tok)


def _row_n(t: Tensor, b: Tensor, nk: Tensor, K: int, V: int) -> Tensor:
    """t broadcasting to [B, K, V] -> row nk[i] of request i, [B, V], to be read only (a view
    where t has one row per request). Where t's rows lie V apart in memory (a [B, K(+1), V]
    tensor, sliced or not) it picks them with index_select, a copy of each row, instead of
    advanced indexing, which gathers element by element (8 rows of 32,000 fp32: ~170 µs on
    one core). The same values either way."""
    B = b.shape[0]
    if t.dim() == 3 and t.shape[0] == B and t.stride(2) == 1 and t.shape[2] == V:
        s0, s1 = t.stride(0), t.stride(1)
        if t.shape[1] == 1:
            return t[:, 0]
        if t.shape[1] == K and s1 == V and s0 % V == 0 and s0 > 0:
            per = s0 // V                                   # rows from one request to the next
            rows = t.as_strided(((B - 1) * per + K, V), (V, 1))     # every row t spans
            return rows.index_select(0, b * per + nk)
    return torch.broadcast_to(t, (B, K, V))[b, nk]


def _rows_sum_alike(pk: Tensor, q: Tensor) -> bool:
    """On the CPU, where the residual the narrow op builds from pk and q has its [V] rows
    contiguous (V innermost), as the rows picked here do (a GPU's reduction splits a row by
    how many rows there are, so there the whole residual is summed)."""
    return (pk.device.type == "cpu" and pk.stride(-1) == 1
            and (q.stride(-1) == 1 or q.shape[-1] == 1))


def _row_sums(r: Tensor, rows_full: int) -> Tensor:
    """r [B, V] -> its row sums [B, 1], with the bits `full.sum(-1, keepdim=True)` gives each
    of these rows inside the narrow op's [B, K, V] residual (`rows_full` = B * K rows).

    PyTorch's CPU sum reduces a contiguous row with one fixed loop whatever the other rows
    (threads split the rows, not a row), except when the output has a single element: then
    the row itself is split across threads (a two-pass reduction). So a single row is summed alone exactly when the full
    residual is a single row, and otherwise alongside a copy, to keep two outputs.
    tests/kernels/test_composed_mode.py checks this against the full sum at 1, 2 and 4
    threads and rows long enough to be split."""
    if r.shape[0] > 1 or rows_full == 1:
        return r.sum(-1, keepdim=True)
    return torch.cat([r, r]).sum(-1, keepdim=True)[:1]


def _emit(ids: Tensor, n: Tensor, tok: Tensor) -> tuple[Tensor, Tensor]:
    """ids before n, tok at n, -1 after -> (int32 [B, K+1], n + 1 int32 [B])."""
    B, K = ids.shape
    pos = torch.arange(K + 1, device=ids.device)[None, :]           # [1, K+1]
    x = torch.cat([ids, ids.new_full((B, 1), -1)], dim=1)           # [B, K+1]
    out = torch.where(pos < n[:, None], x, -1)
    out = torch.where(pos == n[:, None], tok[:, None], out)
    return out.to(torch.int32), (n + 1).to(torch.int32)


def composed_verify_ref(p: Tensor, ids: Tensor, q: Tensor, uniforms: Tensor,
                        exponentials: Tensor, bonus: Tensor, accept_q: Optional[Tensor] = None,
                        accept_mode: str = "ge", residual_normalize: str = "none",
                        residual_sampler: str = "race", residual_nonneg: str = "clamp",
                        residual_floor: float = 0.0, residual_guard: str = "none",
                        residual_fill: float = 0.0) -> tuple[Tensor, Tensor]:
    """The narrow ops' references on every row, then the emission row by row."""
    assert accept_mode in ACCEPT_MODES, accept_mode
    B, K = ids.shape
    pk = p[:, :K]
    n = ratio_accept_ref(pk, q if accept_q is None else accept_q, ids, uniforms, accept_mode)
    rec = residual_sample_ref(pk, q, exponentials, residual_normalize, residual_sampler,
                              residual_nonneg, residual_floor, residual_guard, residual_fill)
    out = torch.full((B, K + 1), -1, dtype=torch.int64)
    for i in range(B):
        m = int(n[i])
        out[i, :m] = ids[i, :m]
        out[i, m] = int(rec[i, m]) if m < K else int(bonus.reshape(B)[i])
    return out.to(torch.int32), (n + 1).to(torch.int32)
