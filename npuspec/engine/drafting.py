"""The engine's side of drafting: build the configured method's proposer (the registry,
npuspec/methods.py, names the file that builds it), and one step's drafts, cut to each
request's cap and by the confidence budget.

Token-only proposers (ngram, suffix) return drafts without probabilities or confidences; model
drafters return [B, K] tokens with draft probabilities (sampled steps) and per-position
confidences, which the confidence budget (dynamic K) may cut.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from npuspec.methods import METHODS
from npuspec.spec_decode import dynamic_k, hybrid
from npuspec.spec_decode.base import BuildContext, DraftBatch, Proposer


def make_proposer(ctx: BuildContext) -> Optional[Proposer]:
    """The proposer of ctx.spec's method, or None without speculation."""
    if ctx.spec is None:
        return None
    proposer = METHODS[ctx.spec.method].build_fn()(ctx)
    if ctx.spec.enable_suffix_decoding:
        return hybrid.wrap(proposer, ctx)
    return proposer


def draft(proposer: Proposer, budget: Optional[dynamic_k.ConfidenceBudget], reqs: list, k: int,
          caps: list[int], random: bool):
    """-> (drafts int64 [B, K], -1 = none; draft probs [B, K, V] or None). `caps` bounds each
    request's drafts; `random`: the call has sampled requests (model drafters then sample
    with each request's temperature and return their probabilities)."""
    B = len(reqs)
    if k == 0:
        return np.full((B, 0), -1, dtype=np.int64), None
    temps = np.array([r.params.temperature for r in reqs], dtype=np.float64) if random else None
    d = proposer.draft_batch(DraftBatch(reqs, k, caps, temps))  # [B, K], [B, K, V], [B, K]
    if d.conf is None:  # token-only drafters stay within their caps
        return d.tokens, d.probs
    allow = np.asarray(caps, dtype=np.int64)
    if budget is not None:
        allow = np.minimum(allow, budget(d.conf))
    return dynamic_k.cut_drafts(d.tokens, allow), d.probs
