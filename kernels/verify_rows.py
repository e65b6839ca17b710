"""What every implementation of `npuspec::rejection_sample` shares (kernels/verify.py): the
draws, and the row statistics' specification.

`reference_row_stats` is the readable PyTorch specification of the row statistics (the only
part of the op that touches [B, K+1, V] data); the Triton kernels (verify_triton.py) and the
fused CPU lowering (verify_cpu.py) compute the same values under the float contract that
kernels/verify.py states. They import what they share from here, never from verify.py, which
dispatches to them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional

import torch
from torch import Tensor

FLT_MIN = 1.1754943508222875e-38  # smallest normal float32: floor for the Exp(1) race draws
ENTROPY_EPS = 1e-10


# --------------------------------------------------------------------------------------------
# Draws
# --------------------------------------------------------------------------------------------

def draw_uniforms(B: int, K: int, device, generators: Optional[Mapping[int, torch.Generator]] = None
                  ) -> Tensor:
    """float32 [B, K] acceptance draws: float64 U[0,1) cast to float32 (never exactly 0).

    Rows in `generators` draw their own K values from their generator, so a seeded request's
    draws do not depend on the rest of the batch."""
    u = torch.rand(B, K, dtype=torch.float64, device=device).float()
    for row, g in (generators or {}).items():
        u[row] = torch.rand(K, dtype=torch.float64, generator=g, device=g.device).float().to(device)
    return u


def draw_exponentials(B: int, V: int, device,
                      generators: Optional[Mapping[int, torch.Generator]] = None) -> Tensor:
    """float32 [B, V] Exp(1) draws for the exponential race (one vector per request)."""
    e = torch.empty(B, V, dtype=torch.float32, device=device).exponential_()
    for row, g in (generators or {}).items():
        r = torch.empty(V, dtype=torch.float32, device=g.device).exponential_(generator=g)
        e[row] = r.to(device)
    return e



# --------------------------------------------------------------------------------------------
# Row statistics (the [B, K+1, V] part), reference implementation
# --------------------------------------------------------------------------------------------

@dataclass
class RowStats:
    """Per-row results, all [B, K+1]. Row j scores draft j (j < K); row K is the bonus row."""
    gidx: Tensor      # int64: argmax of the raw logits (greedy token)
    rawmax: Tensor    # float32: max of the raw logits (NaN/+inf/all -inf detection)
    px: Tensor        # float32: p_j(x_j), 0 where there is no draft
    qx: Tensor        # float32: q_j(x_j) (1 for one-hot drafts), 0 where there is no draft
    race_p: Tensor    # int64: argmax_v e_v * R_v, R = 1/max(E, FLT_MIN) (a sample from p_j)
    race_r: Tensor    # int64: residual race, -1 where the residual has no positive entry
    rho: Tensor       # float32: sum_v max(w_j p_j(v) - q_j(v), 0) (draft probs only, else 0)
    entropy: Tensor   # float32: -sum p~ log(p~ + 1e-10) of the raw softmax (entropy mode, else 0)


def filter_thresholds(logits: Tensor, t: Tensor, top_k: Optional[Tensor], top_p: Optional[Tensor]
                      ) -> Optional[Tensor]:
    """float32 [B, K+1] top-k/top-p thresholds on z = logit / t; keep z >= threshold.

    Shared by every implementation (it needs a sort, which the fused kernels leave to torch).
    top_k <= 0 or >= V and top_p >= 1 disable the filter for that request. Ties at the
    threshold are all kept. top-p keeps the smallest prefix of the sorted distribution (after
    top-k) whose mass reaches top_p, always at least one token."""
    if top_k is None and top_p is None:
        return None
    B, K1, V = logits.shape
    z = logits.float() / t[:, None, None]                       # [B, K+1, V]
    zs = z.sort(dim=-1, descending=True).values                 # [B, K+1, V]
    thr = torch.full((B, K1), -math.inf, device=z.device)
    if top_k is not None:
        k = top_k.to(device=z.device, dtype=torch.int64)
        on = (k > 0) & (k < V)                                  # [B]
        kk = k.clamp(1, V)[:, None, None].expand(B, K1, 1) - 1
        kth = zs.gather(-1, kk).squeeze(-1)                     # [B, K+1]
        thr = torch.where(on[:, None], kth, thr)
    if top_p is not None:
        p = top_p.to(device=z.device, dtype=torch.float32)
        on = p < 1                                              # [B]
        zk = torch.where(zs >= thr[..., None], zs, -math.inf)
        probs = torch.softmax(zk, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs            # mass strictly before each token
        n = (before < p[:, None, None]).sum(-1).clamp(1, V)     # [B, K+1] tokens kept
        pth = zs.gather(-1, (n - 1)[..., None]).squeeze(-1)
        thr = torch.where(on[:, None], torch.maximum(thr, pth), thr)
    return thr


def _padded_drafts(draft_token_ids: Tensor, V: int) -> Tensor:
    """int64 [B, K+1]: drafts with out-of-range ids as -1, plus a -1 column for the bonus row."""
    x = draft_token_ids.long()
    x = torch.where((x >= 0) & (x < V), x, -1)
    return torch.cat([x, x.new_full((x.shape[0], 1), -1)], dim=1)


def reference_row_stats(logits: Tensor, xpad: Tensor, draft_probs: Optional[Tensor],
                        t: Tensor, thr: Optional[Tensor], exponentials: Optional[Tensor],
                        weights: Optional[Tensor], *, random: bool, entropy: bool,
                        residual: bool = True, early_exit=None) -> RowStats:
    """The specification of the row statistics, in readable PyTorch.

    logits [B, K+1, V]; xpad [B, K+1] (-1 = none); draft_probs [B, K, V] or None; t [B] > 0
    (1 for greedy rows); thr [B, K+1] or None; exponentials [B, V]; weights [B, K] residual
    weights w_j (1 for standard, pi_j for block) or None; random: compute the races;
    entropy: compute H; residual: compute the draft-probs residual race and rho (block verify
    computes them in a second call, once the weights are known). early_exit=(uniforms,
    greedy_rows) allows an implementation to skip the exp pass on rows after a request's
    first rejected draft (standard verify only; the decisions never read those rows); the
    reference computes every row."""
    l = logits.float()                                          # [B, K+1, V]
    B, K1, V = l.shape
    rawmax = l.amax(-1)                                         # [B, K+1]
    gidx = l.argmax(-1)
    zeros_f = l.new_zeros(B, K1)
    px, qx = zeros_f, zeros_f
    race_p = race_r = torch.zeros(B, K1, dtype=torch.int64, device=l.device)
    rho, ent = zeros_f, zeros_f
    xs = xpad.clamp_min(0)[..., None]                           # [B, K+1, 1]
    has = xpad >= 0
    if random:
        z = l / t[:, None, None]
        if thr is not None:
            z = torch.where(z >= thr[..., None], z, -math.inf)
        e = torch.exp(z - z.amax(-1, keepdim=True))             # [B, K+1, V], max entry is 1
        S = e.sum(-1, keepdim=True)                             # [B, K+1, 1]
        p = e / S
        px = torch.where(has, p.gather(-1, xs).squeeze(-1), 0.0)
        R = (1.0 / exponentials.float().clamp_min(FLT_MIN))[:, None, :]  # [B, 1, V]
        race_p = (e * R).argmax(-1)
        if draft_probs is None:
            qx = has.float()
            onehot = torch.arange(V, device=l.device) == xpad[..., None]  # [B, K+1, V]
            sr = torch.where(onehot, 0.0, e * R)
            race_r = torch.where(sr.amax(-1) > 0, sr.argmax(-1), -1)
        else:
            q = torch.cat([draft_probs.float(), l.new_zeros(B, 1, V)], dim=1)  # [B, K+1, V]
            qx = torch.where(has, q.gather(-1, xs).squeeze(-1), 0.0)
            if residual:
                w = weights.float() if weights is not None else l.new_ones(B, K1 - 1)
                w = torch.cat([w, w.new_ones(B, 1)], dim=1)[..., None]        # [B, K+1, 1]
                r = torch.clamp_min(w * p - q, 0.0)             # [B, K+1, V]
                rho = r.sum(-1)
                sr = r * R
                race_r = torch.where(sr.amax(-1) > 0, sr.argmax(-1), -1)
    if entropy:
        et = torch.exp(l - rawmax[..., None])
        pt = et / et.sum(-1, keepdim=True)
        ent = -(pt * torch.log(pt + ENTROPY_EPS)).sum(-1)
    return RowStats(gidx, rawmax, px, qx, race_p, race_r, rho, ent)



def _leading(mask: Tensor) -> Tensor:
    """int64 [B]: length of the all-True prefix of a bool [B, K]."""
    return torch.cumprod(mask.to(torch.int64), dim=1).sum(1)
