"""The probability-input mode of `npuspec::rejection_sample` (target_is_probs=True): standard
verification on the user's own finished distribution p, in plain PyTorch on every device, with
the arithmetic of the eager idiom (`probs_verify` is its own reference; docs/verify.md).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from npuspec.kernels import race_rows_cpu
from npuspec.kernels.verify_rows import _leading, _padded_drafts


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
    xn = xpad.gather(1, n[:, None])                             # [B, 1] draft at row n, or -1
    tok = race_rows_cpu.race_probs_rows(p, q, exponentials, n, xn[:, 0], K)
    if tok is not None:  # the CPU kernel (kernels/race_rows_cpu.py): the same values
        return _emit(xpad, n, tok, K1)
    pn = p[b, n]                                                # [B, V] p at row n (a copy)
    e = exponentials.float()
    en = e if e.dim() == 2 else e[b, n]                         # [B, V]
    if q is None or K == 0:  # (K = 0: row n is the bonus row, xn = -1, r = pn)
        r = pn.masked_fill_(torch.arange(V, device=p.device) == xn, 0.0)
    else:  # max(p - q, 0) in place: the same values as torch.clamp(p - q, min=0)
        r = torch.where(xn >= 0, torch.sub(pn, q.float()[b, n.clamp_max(K - 1)]).clamp_min_(0), pn)
    tok = r.div_(en).argmax(-1)                                 # [B]
    return _emit(xpad, n, tok, K1)


def _emit(xpad: Tensor, n: Tensor, tok: Tensor, K1: int) -> tuple[Tensor, Tensor]:
    pos = torch.arange(K1, device=xpad.device)[None, :]
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

