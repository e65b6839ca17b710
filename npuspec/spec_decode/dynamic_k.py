"""Dynamic K (docs/engine.md): the batch-size table and the confidence budget.

Two independent mechanisms pick how many draft tokens a step verifies:

- The batch-size table (`SpeculativeConfig.num_speculative_tokens_per_batch_size`) picks K per
  step from the number of running requests; the engine runs that K's captured graph set.
- The confidence budget (DSpark/DFlash, generalised to any drafter that reports per-position
  confidences c[b, i] in [1e-6, 1]) cuts each request's drafts to an allowance. Survival
  s = cumprod(c) estimates P(draft prefix up to i is accepted); the budget (tokens per request)
  adapts every `budget_update_interval` steps to how many positions survive above
  `budget_threshold`, and the B*(budget - min) verify slots above the guaranteed minimum go to
  the positions with the highest survival.

Everything here is pure numpy on the host: confidences arrive with the drafts, and the
allowance has to be known before the verify step's inputs are built.
"""
from __future__ import annotations

import math

import numpy as np

from npuspec.spec_decode.base import CONF_MIN


def k_for_step(spec, batch_size: int) -> int:  # spec: a SpeculativeConfig or None
    """K from the batch-size table (0 without speculation or for an empty batch)."""
    if spec is None:
        return 0
    return spec.k_for_batch_size(batch_size)


def survival(conf: np.ndarray) -> np.ndarray:
    """s[b, i] = prod_{j<=i} clamp(c[b, j], 1e-6, 1).  conf [B, K] -> [B, K] float64."""
    c = np.clip(np.asarray(conf, dtype=np.float64), CONF_MIN, 1.0)
    return np.cumprod(c, axis=1)


def initial_budget(cfg, k: int) -> int:  # cfg: a DynamicSpecConfig
    return max(cfg.min_verify_tokens, min(cfg.initial_verify_budget_per_req, k))


def update_budget(surv: np.ndarray, threshold: float, k: int, min_tokens: int) -> int:
    """New per-request budget from one step's survival [B, K].

    k' = ceil(#{s >= threshold} / B); an even k' below K is bumped by one (the DSpark rule:
    it rounds the budget up to an odd draft count); then clamped to [min, K].
    """
    b = surv.shape[0]
    if b == 0:
        return max(min_tokens, 0)
    kk = math.ceil(int(np.count_nonzero(surv >= threshold)) / b)
    if kk % 2 == 0 and kk < k:
        kk += 1
    return int(min(max(kk, min_tokens), k))


def allocate(surv: np.ndarray, budget: int, min_tokens: int) -> np.ndarray:
    """Per-request draft allowance [B] (int64) for one step.

    Every request keeps `min_tokens`; the top B*(budget - min) survival values over the
    positions past the minimum each add one token to their row. Survival is non-increasing
    along a row, so a row's chosen positions are a prefix; counting per row (rather than
    masking) keeps that true under ties.
    """
    b, k = surv.shape
    lo = min(min_tokens, k)
    extra = b * max(budget - lo, 0)
    allow = np.full(b, lo, dtype=np.int64)
    if extra == 0 or k == lo or b == 0:
        return allow
    rest = surv[:, lo:].reshape(-1)  # [B*(K-lo)]
    if extra >= rest.size:
        return np.full(b, k, dtype=np.int64)
    # stable order: higher survival first, ties broken by row then position
    top = np.argsort(-rest, kind="stable")[:extra]
    allow += np.bincount(top // (k - lo), minlength=b)
    return allow


def cut_drafts(drafts: np.ndarray, allowance: np.ndarray) -> np.ndarray:
    """Set drafts past each row's allowance to -1.  drafts [B, K] int64, allowance [B]."""
    k = drafts.shape[1]
    keep = np.arange(k)[None, :] < allowance[:, None]
    return np.where(keep, drafts, -1)


class ConfidenceBudget:
    """The stateful part: the current budget and the step counter.

    `__call__(conf)` returns the allowance for this step's drafts using the current budget,
    then, every `budget_update_interval` steps, re-estimates the budget from this step's
    survival (so the new budget applies from the next step on).
    """

    def __init__(self, cfg, k: int):  # cfg: a DynamicSpecConfig
        self.cfg = cfg
        self.k = k
        self.budget = initial_budget(cfg, k)
        self.steps = 0

    def __call__(self, conf: np.ndarray) -> np.ndarray:
        conf = np.asarray(conf, dtype=np.float64)  # [B, K']
        assert conf.ndim == 2, conf.shape
        surv = survival(conf)
        allow = allocate(surv, min(self.budget, conf.shape[1]), self.cfg.min_verify_tokens)
        self.steps += 1
        if self.steps % self.cfg.budget_update_interval == 0 and conf.shape[0] > 0:
            self.budget = update_budget(surv, self.cfg.budget_threshold, self.k,
                                        self.cfg.min_verify_tokens)
        return allow
