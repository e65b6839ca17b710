"""The fused verify op `npuspec::rejection_sample` (DESIGN.md §3.3, §4) and its PyTorch reference.

One call verifies K drafted tokens per request against the target logits and emits the
accepted prefix plus one recovered/bonus token. Every mode is here: greedy, standard
(Leviathan et al.), exact block verification (Sun et al., ICLR 2025), entropy verify (lossy,
opt-in) and synthetic acceptance (benchmarking). `target_is_probs=True` takes the caller's
probabilities instead of logits and runs standard verify with the eager idiom's arithmetic
(`probs_verify`, plain PyTorch on every device; docs/verify.md).

The op is split in two so that every implementation shares the same decisions:

1. *Row statistics* — the only part that touches [B, K+1, V] data. For every row (request b,
   position j) it computes the greedy argmax, p_j(x_j), q_j(x_j), the exponential races, the
   block residual mass and the entropy. Three implementations compute them:
   `reference_row_stats` below (readable PyTorch, the specification), the Triton kernels in
   `npuspec.kernels.verify_triton` (CUDA/Ascend, and the interpreter on CPU) and the fused CPU
   lowering in `npuspec.kernels.verify_cpu`.
2. *Decisions* — small [B, K] tensor code (`_decide_*`, one function per mode) that turns the
   row statistics and the uniforms into accepted lengths and emitted tokens. It is the same
   code for every implementation, graph-safe (no host syncs, no data-dependent control flow).

Float contract (what "identical" means). All math is float32. Per element, every
implementation computes exactly: z = logit / t, masked to -inf below the top-k/top-p threshold;
e = exp(z - max z); p = e / S with S = sum(e); race score e * R (one-hot
residual: the draft token's score set to 0) or max(w * p - q, 0) * R (residual with draft
probs), where R = 1 / max(E, FLT_MIN) is computed once per request; argmax takes the lowest index among ties. Divisions, max, comparisons and
argmax are exactly reproducible everywhere. Two things are not: `exp` (different vector math
libraries may differ in the last ulp) and the order of the sums S, rho and H. So for the same
draws the implementations return identical tokens unless a comparison (p/q vs u, block test,
race top-2) lies within a few float32 ulps of a tie, which for continuous inputs happens with
probability ~1e-6 per decision. Greedy decisions (argmax of the raw logits) and synthetic
acceptance are exactly identical always. Tests compare the three with `torch.equal`.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import torch
from torch import Tensor

FLT_MIN = 1.1754943508222875e-38  # smallest normal float32: floor for the Exp(1) race draws
ENTROPY_EPS = 1e-10

__all__ = ["rejection_sample", "rejection_sample_reference", "probs_verify",
           "synthetic_rates_from_length", "conditional_rates", "draw_uniforms",
           "draw_exponentials", "use_impl", "RowStats", "reference_row_stats", "filter_thresholds"]


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
# Synthetic rates
# --------------------------------------------------------------------------------------------

def synthetic_rates_from_length(length: float, k: int) -> list[float]:
    """Unconditional per-position rates for a mean emitted length L (DESIGN.md §4).

    d = L-1, f = floor(d): rates = ([1]*f + [d-f] + [0]*(K-f-1))[:K]; L=3.4, K=5 -> [1,1,.4,0,0]."""
    if not 1 <= length <= k + 1:
        raise ValueError(f"synthetic_acceptance_length={length}: must be in [1, K+1] = "
                         f"[1, {k + 1}] for num_speculative_tokens={k}")
    d = length - 1
    f = int(math.floor(d))
    return ([1.0] * f + [d - f] + [0.0] * max(k - f - 1, 0))[:k]


def conditional_rates(rates: Tensor) -> Tensor:
    """c_i = a_i / a_{i-1} with a_0 = 1 and 0 where a_{i-1} = 0; float32 [K]."""
    a = rates.float()
    prev = torch.cat([a.new_ones(1), a[:-1]])
    return torch.where(prev > 0, a / torch.where(prev > 0, prev, 1.0), 0.0)


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


# --------------------------------------------------------------------------------------------
# Decisions: one function per mode, on [B, K] tensors (shared by every implementation)
# --------------------------------------------------------------------------------------------

def _leading(mask: Tensor) -> Tensor:
    """int64 [B]: length of the all-True prefix of a bool [B, K]."""
    return torch.cumprod(mask.to(torch.int64), dim=1).sum(1)


def _ratio(st: RowStats, K: int) -> Tensor:
    """float32 [B, K]: p(x)/q(x), 0 where q(x) = 0 or there is no draft."""
    q = st.qx[:, :K]
    return torch.where(q > 0, st.px[:, :K] / torch.where(q > 0, q, 1.0), 0.0)


def _decide_greedy(xpad: Tensor, st: RowStats) -> Tensor:
    """Accepted length: drafts accepted while they equal the target argmax."""
    K = xpad.shape[1] - 1
    return _leading((xpad[:, :K] >= 0) & (xpad[:, :K] == st.gidx[:, :K]))


def _entropy_theta(st: RowStats, K: int, entropy_verify) -> Tensor:
    """float32 [B, K]: theta = min(exp(-alpha H), posterior_threshold); 1 without entropy verify."""
    if entropy_verify is None:
        return torch.ones_like(st.px[:, :K])
    thr, alpha = entropy_verify
    return torch.clamp_max(torch.exp(-float(alpha) * st.entropy[:, :K]), float(thr))


def _decide_standard(xpad: Tensor, st: RowStats, u: Tensor, theta: Tensor) -> Tensor:
    """Accept x_i iff q(x_i) > 0 and p(x_i)/q(x_i) >= theta_i * u_i (theta = 1: lossless)."""
    K = xpad.shape[1] - 1
    valid = (xpad[:, :K] >= 0) & (st.qx[:, :K] > 0)
    return _leading(valid & (_ratio(st, K) >= theta * u))


def _block_pi(xpad: Tensor, st: RowStats) -> Tensor:
    """float32 [B, K+1]: pi_0 = 1, pi_i = min(pi_{i-1} p_i(x_i)/q_i(x_i), 1); 0 past the drafts."""
    K = xpad.shape[1] - 1
    r = torch.where(xpad[:, :K] >= 0, _ratio(st, K), 0.0)
    pis = [torch.ones_like(st.px[:, 0])]
    for i in range(K):  # K <= 15 small [B] ops; a cumulative min-product has no torch primitive
        pis.append(torch.clamp_max(pis[-1] * r[:, i], 1.0))
    return torch.stack(pis, dim=1)


def _decide_block(xpad: Tensor, st: RowStats, pi: Tensor, u: Tensor, theta: Tensor,
                  onehot: bool) -> Tensor:
    """Sun et al.'s block verification: tau = the largest i with theta_i eta_i <= h_i."""
    K = xpad.shape[1] - 1
    kv = _leading(xpad[:, :K] >= 0)                             # [B] valid drafts K'
    pos = torch.arange(1, K + 1, device=xpad.device)            # draft positions i = 1..K
    pi_i = pi[:, 1:]                                            # [B, K] pi_i
    if onehot:  # sum_v max(pi_i p_{i+1}(v) - 1[v = x_{i+1}], 0) = pi_i (1 - p_{i+1}(x_{i+1}))
        rho = pi_i * (1.0 - torch.cat([st.px[:, 1:K], st.px.new_zeros(xpad.shape[0], 1)], 1))
    else:       # row i scored p_{i+1} with weight pi_i
        rho = torch.cat([st.rho[:, 1:K], st.rho.new_zeros(xpad.shape[0], 1)], 1)
    den = rho + (1.0 - pi_i)
    h = torch.where(pi_i >= 1, 1.0, rho / torch.where(den > 0, den, 1.0))
    h = torch.where(pos == kv[:, None], pi_i, h)                # h_{K'} = pi_{K'}
    ok = (theta * u <= h) & (pos <= kv[:, None])
    return torch.where(ok, pos, 0).amax(1)                      # tau


def _decide_synthetic(xpad: Tensor, cond: Tensor, u: Tensor) -> Tensor:
    """Accept x_i iff u_i < c_i and x_i >= 0, whatever the target says."""
    K = xpad.shape[1] - 1
    return _leading((xpad[:, :K] >= 0) & (u < cond[None, :]))


def _emit(xpad: Tensor, n_acc: Tensor, st: RowStats, greedy_rows: Tensor, bad: Tensor
          ) -> tuple[Tensor, Tensor]:
    """Tokens [B, K+1] int32 and num_emitted [B] int32 for accepted lengths n_acc.

    The token at row n_acc: greedy rows take the argmax; random rows take the residual race
    when they stopped at a real draft (falling back to p when the residual is empty, which
    only float rounding can cause), else a sample from p (bonus row, or a -1 draft)."""
    K1 = xpad.shape[1]
    j = n_acc[:, None]                                          # [B, 1]
    at = lambda s: s.gather(1, j).squeeze(1)                    # noqa: E731
    rr, rp = at(st.race_r), at(st.race_p)
    sampled = torch.where((at(xpad) >= 0) & (rr >= 0), rr, rp)
    tok = torch.where(greedy_rows, at(st.gidx), sampled)        # [B]
    pos = torch.arange(K1, device=xpad.device)[None, :]
    out = torch.where(pos < j, xpad, -1)
    out = torch.where(pos == j, tok[:, None], out)
    out = torch.where(bad[:, None], -1, out)                    # non-finite logits: emit nothing
    num = torch.where(bad, 0, n_acc + 1)
    return out.to(torch.int32), num.to(torch.int32)


# --------------------------------------------------------------------------------------------
# Probability-input mode (target_is_probs=True): the user's own p, plain PyTorch
# --------------------------------------------------------------------------------------------

# the accept test of `accept_mode` on ratio r [B, K] and uniforms u [B, K], as the user writes
# it: each is one comparison (and a `~`), so NaN and inf behave exactly as in their code
ACCEPT_MODES = {
    "ge": lambda r, u: r >= u,          # u <= ratio         (Leviathan et al., HF, vLLM v1)
    "gt": lambda r, u: r > u,           # u < ratio          (vLLM v0, vllm-ascend)
    "not_lt": lambda r, u: ~(u > r),    # rejected: u > ratio (lucidrains, gpt-fast)
    "not_le": lambda r, u: ~(u >= r),   # rejected: u >= ratio
}


# How the accept tests give the count n of accepted drafts:
#   "prefix":     the leading passes (the first failure ends the run; the standard rule)
#   "cumulative": vllm-ascend's PyTorch block verify: position k passes when
#                 q(x_k) > 0 and cmp(prod_{i<=k} ratio_i, prod_{i<=k} u_i) (torch.cumprod of
#                 each), and n is 1 + the last passing k (0 if none), so a failure before it
#                 is overridden. A different rule from the logits mode's block_verify (Sun et al.)
ACCEPT_RULES = ("prefix", "cumulative")


def _last_pass(ok: Tensor) -> Tensor:
    """int64 [B]: 1 + the index of the last True of a bool [B, K], 0 when there is none."""
    K = ok.shape[1]
    return torch.where(ok.any(dim=1), K - ok.flip(dims=[1]).to(torch.int64).argmax(dim=1), 0)


def probs_verify(p: Tensor, draft_token_ids: Tensor, q: Optional[Tensor], uniforms: Tensor,
                 exponentials: Tensor, accept_mode: str = "ge", ratio_cap: bool = False,
                 accept_rule: str = "prefix") -> tuple[Tensor, Tensor]:
    """Standard verify on already-normalised target probabilities; its own reference.

    p [B, K+1, V] (the user's softmax, after their temperature/top-k/top-p), drafts int [B, K]
    (-1 or out of range = no draft), q [B, K, V] or None (one-hot), uniforms [B, K],
    exponentials [B, V] (one vector per request) or [B, K+1, V] (one per row).
    Every value is the plain float expression the eager idiom evaluates (no softmax, no
    reciprocal, no clamp of E), so the decisions are bit-identical to that idiom:
      accept x_i iff x_i is a draft and p_i(x_i) / q_i(x_i) >= u_i   (one-hot: p_i(x_i) >= u_i;
          one division: q(x) = 0 < p(x) gives inf and accepts, 0/0 gives NaN and rejects)
          `accept_mode` names the comparison (ACCEPT_MODES: "gt" is `u < ratio`, "not_lt" a
          kept rejection `~(u > ratio)`, under which a NaN ratio accepts); `ratio_cap` first
          takes min(ratio, 1) as gpt-fast and vLLM v0 write it (NaN stays NaN);
          `accept_rule` how the passes give the count (ACCEPT_RULES)
      row n = the first rejection: argmax_v max(p_n - q_n, 0) / E_n   (one-hot: p_n with x_n
          set to 0, / E_n); a -1 draft or the bonus row n = K: argmax_v p_n / E_n
    argmax takes the first index among ties (and the first NaN), as torch.argmax does.
    Only row n's [V] vectors are computed: elementwise IEEE ops give the same value per
    element whatever the tensor they sit in. No host syncs, static shapes."""
    B, K1, V = p.shape
    K = K1 - 1
    p = p.float()
    xpad = _padded_drafts(draft_token_ids, V)                   # [B, K+1]
    x, has = xpad[:, :K], xpad[:, :K] >= 0                      # [B, K]
    xs = x.clamp_min(0)[..., None]                              # [B, K, 1]
    px = p[:, :K].gather(-1, xs).squeeze(-1)                    # [B, K]
    qx = None if q is None else q.float().gather(-1, xs).squeeze(-1)
    ratio = px if qx is None else px / qx
    if ratio_cap:
        ratio = ratio.clamp(max=1.0)
    test = ACCEPT_MODES[accept_mode]
    if accept_rule == "prefix":
        n = _leading(has & test(ratio, uniforms.float()))                   # [B]
    else:  # running products, as the block idiom computes them (torch.cumprod: same values)
        ok = test(torch.cumprod(ratio, dim=-1), torch.cumprod(uniforms.float(), dim=-1))
        if qx is not None:
            ok = ok & (qx > 0)
        n = _last_pass(has & ok)                                            # [B]
    b = torch.arange(B, device=p.device)
    pn = p[b, n]                                                # [B, V] p at row n (a copy)
    e = exponentials.float()
    en = e if e.dim() == 2 else e[b, n]                         # [B, V]
    xn = xpad.gather(1, n[:, None])                             # [B, 1] draft at row n, or -1
    if q is None or K == 0:  # (K = 0: row n is the bonus row, xn = -1, r = pn)
        r = pn.masked_fill_(torch.arange(V, device=p.device) == xn, 0.0)
    else:  # max(p - q, 0) in place: the same values as torch.clamp(p - q, min=0)
        r = torch.where(xn >= 0, torch.sub(pn, q.float()[b, n.clamp_max(K - 1)]).clamp_min_(0), pn)
    tok = r.div_(en).argmax(-1)                                 # [B]
    pos = torch.arange(K1, device=p.device)[None, :]
    out = torch.where(pos < n[:, None], xpad, -1)
    out = torch.where(pos == n[:, None], tok[:, None], out)
    return out.to(torch.int32), (n + 1).to(torch.int32)


def _check_accept_mode(accept_mode: str, ratio_cap: bool, target_is_probs: bool,
                       accept_rule: str = "prefix") -> None:
    if accept_mode not in ACCEPT_MODES:
        raise ValueError(f"accept_mode={accept_mode!r}: choose one of "
                         f"{', '.join(map(repr, ACCEPT_MODES))}")
    if accept_rule not in ACCEPT_RULES:
        raise ValueError(f"accept_rule={accept_rule!r}: choose one of "
                         f"{', '.join(map(repr, ACCEPT_RULES))}")
    if (accept_mode != "ge" or ratio_cap or accept_rule != "prefix") and not target_is_probs:
        raise ValueError(f"accept_mode={accept_mode!r}, ratio_cap={ratio_cap}, "
                         f"accept_rule={accept_rule!r}: other accept tests than the default "
                         f"(\"ge\", no cap, \"prefix\") apply to the probability mode only; "
                         f"pass target_is_probs=True with your probabilities, or the defaults "
                         f"with logits (block_verify=True for block verification)")


def _check_probs_mode(temperature, top_k, top_p, block_verify, posterior_threshold,
                      synthetic_rates, exponentials, B, K1, V) -> None:
    """target_is_probs=True takes the user's finished distribution: nothing to apply on top."""
    for name, v in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p),
                    ("synthetic_rates", synthetic_rates), ("entropy_verify", posterior_threshold)):
        if v is not None:
            raise ValueError(f"{name} given with target_is_probs=True: target_logits then holds "
                             f"the final probabilities p; apply {name} to p yourself, or pass "
                             f"logits with target_is_probs=False")
    if block_verify:
        raise ValueError("block_verify=True with target_is_probs=True: the probability mode "
                         "runs standard verification only; pass logits with "
                         "target_is_probs=False for block verification")
    if exponentials is not None and tuple(exponentials.shape) not in ((B, V), (B, K1, V)):
        raise ValueError(f"exponentials: expected float32 [B, V] = [{B}, {V}] or [B, K+1, V] = "
                         f"[{B}, {K1}, {V}] with target_is_probs=True; got "
                         f"{tuple(exponentials.shape)}")


# --------------------------------------------------------------------------------------------
# The op
# --------------------------------------------------------------------------------------------

_FORCED_IMPL: list[Optional[str]] = [None]
IMPLS = ("reference", "triton", "cpu")


@contextlib.contextmanager
def use_impl(name: Optional[str]):
    """Force the row-statistics implementation ('reference', 'triton', 'cpu') in a block."""
    if name is not None and name not in IMPLS:
        raise ValueError(f"use_impl({name!r}): choose one of {', '.join(IMPLS)} or None")
    old = _FORCED_IMPL[0]
    _FORCED_IMPL[0] = name
    try:
        yield
    finally:
        _FORCED_IMPL[0] = old


def _pick_impl(device: torch.device) -> str:
    if _FORCED_IMPL[0] is not None:
        return _FORCED_IMPL[0]
    if device.type == "cpu":
        return "cpu"
    from npuspec.platform import triton_available
    return "triton" if triton_available(device.type) else "reference"


def kernel_config(device_type: str) -> dict:
    """The verify kernel choices for a device, as plain JSON (recorded in the graph cache).

    The Triton kernel is not autotuned: its vocab block is a fixed function of V (see
    verify_triton._block_v) and its grid of the row count and core count, so the implementation
    name is the whole choice.
    """
    return {"impl": _pick_impl(torch.device(device_type)), "autotuned": False}


def _row_stats_fn(impl: str):
    if impl == "reference":
        return reference_row_stats
    if impl == "triton":
        from npuspec.kernels.verify_triton import triton_row_stats
        return triton_row_stats
    from npuspec.kernels.verify_cpu import cpu_row_stats
    return cpu_row_stats


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _check_values(draft_token_ids: Tensor, V: int, temperature: Optional[Tensor],
                  top_p: Optional[Tensor]) -> None:
    """Host-side value checks (reference and CPU paths; the device path cannot sync)."""
    if temperature is not None and not bool((temperature >= 0).all()):
        raise ValueError(f"temperature={temperature.tolist()}: every value must be >= 0 "
                         f"(0 = greedy for that request)")
    if top_p is not None and not bool(((top_p > 0) & (top_p <= 1)).all()):
        raise ValueError(f"top_p={top_p.tolist()}: every value must be in (0, 1] (1 = off)")
    x = draft_token_ids
    if bool(((x < -1) | (x >= V)).any()):
        raise ValueError(f"draft_token_ids: ids must be in [0, V={V}) or -1 for 'no draft'; "
                         f"got values from {int(x.min())} to {int(x.max())}")


def _check_finite(logits: Tensor, rawmax: Tensor, draft_probs: Optional[Tensor]) -> None:
    """Host-side check (reference and CPU paths): NaN/+inf logits never yield a token."""
    bad = ~torch.isfinite(rawmax)
    if bool(bad.any()):
        b, j = (int(v) for v in bad.nonzero()[0])
        raise ValueError(
            f"target_logits[{b}, {j}] contains NaN or +inf (or is -inf everywhere): the verify "
            f"step cannot sample from it; check the model output (dtype overflow, a bad "
            f"logits processor) before calling rejection_sample")
    # aminmax: one vectorised pass, NaN propagates (isfinite().all() costs ~15x more on CPU)
    if draft_probs is not None and not all(math.isfinite(float(v))
                                           for v in torch.aminmax(draft_probs)):
        raise ValueError("draft_probs contains NaN or inf; pass the drafter's probabilities "
                         "(finite, >= 0) or None for one-hot drafts")


def _verify(target_logits: Tensor, draft_token_ids: Tensor, draft_probs: Optional[Tensor],
            temperature: Optional[Tensor], top_k: Optional[Tensor], top_p: Optional[Tensor],
            uniforms: Optional[Tensor], exponentials: Optional[Tensor], block_verify: bool,
            posterior_threshold: Optional[float], posterior_alpha: Optional[float],
            synthetic_rates: Optional[Tensor], impl: str) -> tuple[Tensor, Tensor]:
    B, K1, V = target_logits.shape
    K = K1 - 1
    dev = target_logits.device
    random = temperature is not None
    synthetic = synthetic_rates is not None
    entropy_verify = None if posterior_threshold is None else (posterior_threshold,
                                                                posterior_alpha or 0.0)
    if uniforms is None and (random or synthetic):
        uniforms = draw_uniforms(B, K, dev)
    if exponentials is None and random:
        exponentials = draw_exponentials(B, V, dev)
    xpad = _padded_drafts(draft_token_ids, V)                   # [B, K+1]
    if impl == "cpu" and not random and not synthetic and draft_probs is None:
        # all greedy: the C++ kernel's greedy rows (max, first argmax, accept, emit) in one
        # call, instead of ~40 small ATen ops around the row statistics (~0.6 ms at V=49152)
        fused = _cpu_greedy(target_logits, xpad)
        if fused is not None:
            if not _capturing(dev):
                _check_finite(target_logits, fused[2], None)
                _check_values(draft_token_ids, V, None, None)
            return fused[0], fused[1]
    if random:
        temp = temperature.to(device=dev, dtype=torch.float32)
        greedy_rows = ~(temp > 0)
        t = torch.where(greedy_rows, 1.0, temp)
    else:
        greedy_rows = torch.ones(B, dtype=torch.bool, device=dev)
        t = torch.ones(B, device=dev)
    thr = filter_thresholds(target_logits, t, top_k, top_p) if random else None
    onehot = draft_probs is None
    block = bool(block_verify) and random and not synthetic
    stats_fn = _row_stats_fn(impl)
    # standard verify never looks past the first rejection: let the CPU lowering skip those rows
    early = (uniforms.to(dev), greedy_rows) if random and not block and not synthetic \
        and entropy_verify is None else None
    if early is not None and impl == "cpu" and K > 0:  # the C++ kernel decides and emits too
        from npuspec.kernels.verify_cpu import cpu_standard_verify
        fused = cpu_standard_verify(target_logits, xpad, draft_probs, t, thr, exponentials, early)
        if fused is not None:
            if not _capturing(dev):
                _check_finite(target_logits, fused[2], draft_probs)
                _check_values(draft_token_ids, V, temperature, top_p)
            return fused[0], fused[1]
    st = stats_fn(target_logits, xpad, draft_probs, t, thr, exponentials, None, random=random,
                  entropy=entropy_verify is not None and random, residual=not block,
                  early_exit=early)
    if impl != "triton" and not _capturing(dev):
        _check_finite(target_logits, st.rawmax, draft_probs)
        _check_values(draft_token_ids, V, temperature, top_p)
    bad = ~torch.isfinite(st.rawmax).all(1)                     # [B]
    u = uniforms.to(device=dev, dtype=torch.float32) if uniforms is not None else None
    greedy_acc = _decide_greedy(xpad, st)
    if K == 0:  # nothing to verify: every request emits its bonus token
        n_acc = greedy_acc
    elif synthetic:
        n_acc = _decide_synthetic(xpad, conditional_rates(synthetic_rates.to(dev)), u)
    elif not random:
        n_acc = greedy_acc
    else:
        theta = _entropy_theta(st, K, entropy_verify)
        if block:
            pi = _block_pi(xpad, st)
            if not onehot:  # second pass: residual races and rho with weights pi_j
                st2 = stats_fn(target_logits, xpad, draft_probs, t, thr, exponentials,
                               pi[:, :K], random=True, entropy=False, residual=True)
                st.race_r, st.rho = st2.race_r, st2.rho
            n_acc = _decide_block(xpad, st, pi, u, theta, onehot)
        else:
            n_acc = _decide_standard(xpad, st, u, theta)
        n_acc = torch.where(greedy_rows, greedy_acc, n_acc)
    return _emit(xpad, n_acc, st, greedy_rows, bad)


def _cpu_greedy(target_logits: Tensor, xpad: Tensor):
    """(tokens, num_emitted, rawmax) of an all-greedy, one-hot step from the C++ kernel's
    greedy rows, or None when it cannot run. The kernel reads no temperature, threshold,
    uniform or exponential on a greedy row; the placeholders only fill its signature."""
    from npuspec.kernels.verify_cpu import cpu_standard_verify
    B, K1, V = target_logits.shape
    greedy = (torch.ones(B, K1 - 1), torch.ones(B, dtype=torch.bool))
    return cpu_standard_verify(target_logits, xpad, None, torch.ones(B), None,
                               torch.empty(B, V), greedy)


@torch.library.custom_op("npuspec::rejection_sample", mutates_args=())
def _rejection_sample_op(target_logits: Tensor, draft_token_ids: Tensor,
                         draft_probs: Optional[Tensor], temperature: Optional[Tensor],
                         top_k: Optional[Tensor], top_p: Optional[Tensor],
                         uniforms: Optional[Tensor], exponentials: Optional[Tensor],
                         block_verify: bool, posterior_threshold: Optional[float],
                         posterior_alpha: Optional[float], synthetic_rates: Optional[Tensor],
                         *, target_is_probs: bool = False, accept_mode: str = "ge",
                         ratio_cap: bool = False, accept_rule: str = "prefix"
                         ) -> tuple[Tensor, Tensor]:
    """torch.ops.npuspec.rejection_sample: see `rejection_sample` for the arguments.

    Pure when `uniforms`/`exponentials` are given (and always for greedy-only, non-synthetic
    calls); missing draws come from the default generator."""
    _check_accept_mode(accept_mode, ratio_cap, target_is_probs, accept_rule)
    if target_is_probs:  # plain PyTorch on every device (probs_verify is its own reference)
        B, K1, V = target_logits.shape
        _check_probs_mode(temperature, top_k, top_p, block_verify, posterior_threshold,
                          synthetic_rates, exponentials, B, K1, V)
        u = draw_uniforms(B, K1 - 1, target_logits.device) if uniforms is None else uniforms
        e = draw_exponentials(B, V, target_logits.device) if exponentials is None else exponentials
        return probs_verify(target_logits, draft_token_ids, draft_probs, u, e, accept_mode,
                            ratio_cap, accept_rule)
    impl = _pick_impl(target_logits.device)
    return _verify(target_logits, draft_token_ids, draft_probs, temperature, top_k, top_p,
                   uniforms, exponentials, block_verify, posterior_threshold, posterior_alpha,
                   synthetic_rates, impl)


@_rejection_sample_op.register_fake
def _(target_logits, draft_token_ids, draft_probs, temperature, top_k, top_p, uniforms,
      exponentials, block_verify, posterior_threshold, posterior_alpha, synthetic_rates, *,
      target_is_probs=False, accept_mode="ge", ratio_cap=False, accept_rule="prefix"):
    B, K1, _ = target_logits.shape
    return (target_logits.new_empty((B, K1), dtype=torch.int32),
            target_logits.new_empty((B,), dtype=torch.int32))


def _validate(target_logits, draft_token_ids, draft_probs, temperature, top_k, top_p,
              entropy_verify, synthetic_rates, uniforms, exponentials, block_verify,
              target_is_probs=False, accept_mode="ge", ratio_cap=False, accept_rule="prefix"):
    """Shape/dtype checks (metadata only: no host syncs)."""
    _check_accept_mode(accept_mode, ratio_cap, target_is_probs, accept_rule)
    if target_logits.dim() != 3:
        raise ValueError(f"target_logits: expected [B, K+1, V], got shape "
                         f"{tuple(target_logits.shape)}")
    if not target_logits.is_floating_point():
        raise ValueError(f"target_logits: expected a float tensor, got {target_logits.dtype}")
    B, K1, V = target_logits.shape
    K = K1 - 1
    if target_is_probs:
        _check_probs_mode(temperature, top_k, top_p, block_verify, entropy_verify,
                          synthetic_rates, exponentials, B, K1, V)
    if tuple(draft_token_ids.shape) != (B, K):
        raise ValueError(f"draft_token_ids: expected shape [B, K] = [{B}, {K}] to match "
                         f"target_logits [B, K+1, V]; got {tuple(draft_token_ids.shape)}")
    if draft_token_ids.is_floating_point() or draft_token_ids.dtype == torch.bool:
        raise ValueError(f"draft_token_ids: expected int64 token ids, got {draft_token_ids.dtype}")
    if draft_probs is not None and tuple(draft_probs.shape) != (B, K, V):
        raise ValueError(f"draft_probs: expected shape [B, K, V] = [{B}, {K}, {V}] or None for "
                         f"one-hot drafts; got {tuple(draft_probs.shape)}")
    for name, v in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p)):
        if v is not None and tuple(v.shape) != (B,):
            raise ValueError(f"{name}: expected one value per request, shape [{B}]; got "
                             f"{tuple(v.shape)}")
    if (top_k is not None or top_p is not None) and temperature is None:
        raise ValueError("top_k/top_p given with temperature=None (all greedy): pass a "
                         "temperature tensor, or drop top_k/top_p (greedy ignores them)")
    if uniforms is not None and tuple(uniforms.shape) != (B, K):
        raise ValueError(f"uniforms: expected float32 [B, K] = [{B}, {K}]; got "
                         f"{tuple(uniforms.shape)}")
    if exponentials is not None and tuple(exponentials.shape) != (B, V) and not target_is_probs:
        raise ValueError(f"exponentials: expected float32 [B, V] = [{B}, {V}]; got "
                         f"{tuple(exponentials.shape)}")
    if entropy_verify is not None:
        if len(entropy_verify) != 2:
            raise ValueError(f"entropy_verify={entropy_verify!r}: expected None or "
                             f"(posterior_threshold, posterior_alpha)")
        thr, alpha = entropy_verify
        if not 0 < thr <= 1:
            raise ValueError(f"entropy_verify posterior_threshold={thr}: must be in (0, 1]")
        if not alpha >= 0:
            raise ValueError(f"entropy_verify posterior_alpha={alpha}: must be >= 0")
    if synthetic_rates is not None:
        if tuple(synthetic_rates.shape) != (K,):
            raise ValueError(f"synthetic_rates: expected [K] = [{K}] unconditional rates; got "
                             f"{tuple(synthetic_rates.shape)}")
        if block_verify:
            raise ValueError("synthetic_rates with block_verify=True: synthetic acceptance "
                             "ignores the target, so block verification does not apply; "
                             "set block_verify=False")


def rejection_sample(target_logits: Tensor, draft_token_ids: Tensor,
                     draft_probs: Optional[Tensor] = None, *, temperature: Optional[Tensor] = None,
                     top_k: Optional[Tensor] = None, top_p: Optional[Tensor] = None,
                     generators: Optional[Mapping[int, torch.Generator]] = None,
                     block_verify: bool = False,
                     entropy_verify: Optional[Sequence[float]] = None,
                     synthetic_rates: Optional[Tensor] = None,
                     uniforms: Optional[Tensor] = None, exponentials: Optional[Tensor] = None,
                     target_is_probs: bool = False, accept_mode: str = "ge",
                     ratio_cap: bool = False, accept_rule: str = "prefix"
                     ) -> tuple[Tensor, Tensor]:
    """Verify K drafts per request (DESIGN.md §3.3). Returns (tokens int32 [B, K+1] -1 padded,
    num_emitted int32 [B]).

    target_is_probs=True: `target_logits` holds the caller's final target probabilities p
    [B, K+1, V] (their temperature/top-k/top-p already applied); every row is sampled by
    standard verification with exactly the eager arithmetic (`probs_verify`), and temperature,
    top_k, top_p, block_verify, entropy_verify and synthetic_rates are refused. exponentials
    may then also be [B, K+1, V] (one vector per row). With it, `accept_mode` picks the
    accept test's comparison as the caller writes it ("ge": u <= p/q, the default; "gt":
    u < p/q; "not_lt": not u > p/q; "not_le": not u >= p/q, which differ from the first two
    only at NaN ratios), `ratio_cap=True` compares min(p/q, 1) instead of p/q, and
    `accept_rule="cumulative"` counts as vllm-ascend's PyTorch block verify does (ACCEPT_RULES).

    Draws not given are made here: uniforms [B, K] (float64 U[0,1) cast to float32) and
    exponentials [B, V] (float32 Exp(1)), from `generators[row]` for seeded rows (uniforms
    first, then exponentials) and from the default generator for the others. Then the pure
    custom op `torch.ops.npuspec.rejection_sample` runs."""
    _validate(target_logits, draft_token_ids, draft_probs, temperature, top_k, top_p,
              entropy_verify, synthetic_rates, uniforms, exponentials, block_verify,
              target_is_probs, accept_mode, ratio_cap, accept_rule)
    B, K1, V = target_logits.shape
    dev = target_logits.device
    sampled = temperature is not None or target_is_probs
    if uniforms is None and (sampled or synthetic_rates is not None):
        uniforms = draw_uniforms(B, K1 - 1, dev, generators)
    if exponentials is None and sampled:
        exponentials = draw_exponentials(B, V, dev, generators)
    thr, alpha = (None, None) if entropy_verify is None else (float(entropy_verify[0]),
                                                              float(entropy_verify[1]))
    if synthetic_rates is not None:
        synthetic_rates = synthetic_rates.to(device=dev, dtype=torch.float32)
    return torch.ops.npuspec.rejection_sample(
        target_logits, draft_token_ids, draft_probs, temperature, top_k, top_p, uniforms,
        exponentials, bool(block_verify), thr, alpha, synthetic_rates,
        target_is_probs=bool(target_is_probs), accept_mode=accept_mode,
        ratio_cap=bool(ratio_cap), accept_rule=accept_rule)


def rejection_sample_reference(target_logits: Tensor, draft_token_ids: Tensor,
                               draft_probs: Optional[Tensor] = None, *,
                               temperature: Optional[Tensor] = None,
                               top_k: Optional[Tensor] = None, top_p: Optional[Tensor] = None,
                               block_verify: bool = False,
                               entropy_verify: Optional[Sequence[float]] = None,
                               synthetic_rates: Optional[Tensor] = None,
                               uniforms: Optional[Tensor] = None,
                               exponentials: Optional[Tensor] = None,
                               impl: str = "reference", target_is_probs: bool = False,
                               accept_mode: str = "ge", ratio_cap: bool = False,
                               accept_rule: str = "prefix") -> tuple[Tensor, Tensor]:
    """The op computed directly (no dispatcher) with the chosen row-statistics implementation;
    `impl="reference"` is the specification. Raises ValueError on non-finite logits.
    target_is_probs=True runs `probs_verify` (one implementation, its own reference)."""
    _validate(target_logits, draft_token_ids, draft_probs, temperature, top_k, top_p,
              entropy_verify, synthetic_rates, uniforms, exponentials, block_verify,
              target_is_probs, accept_mode, ratio_cap, accept_rule)
    if target_is_probs:
        B, K1, V = target_logits.shape
        u = draw_uniforms(B, K1 - 1, target_logits.device) if uniforms is None else uniforms
        e = draw_exponentials(B, V, target_logits.device) if exponentials is None else exponentials
        return probs_verify(target_logits, draft_token_ids, draft_probs, u, e, accept_mode,
                            ratio_cap, accept_rule)
    thr, alpha = (None, None) if entropy_verify is None else entropy_verify
    return _verify(target_logits, draft_token_ids, draft_probs, temperature, top_k, top_p,
                   uniforms, exponentials, bool(block_verify), thr, alpha, synthetic_rates, impl)
