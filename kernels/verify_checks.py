"""The checks of `rejection_sample`'s arguments (kernels/verify.py): shapes and dtypes from
metadata only (no host syncs, so they run inside a captured graph), and the host-side value
checks the reference and CPU paths make (a device path cannot sync)."""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from npuspec.kernels.verify_probs import _check_accept_mode, _check_probs_mode


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
