"""The verify-pattern library: one class per verify family, and the manager's order.

Each family holds its search patterns (plain PyTorch functions, one per spelling, traced to
ATen by Inductor's pattern matcher), the replacement (a call to an `npuspec::` op), an
`extra_check` that guards shapes and dtypes, and a config whose fields change the family's
`uuid()`. What they share (the base class, the prefix-length tails, the ratio test's pieces)
is patterns_common.py.

Families, in the order the manager runs them (supersets first):

1. GreedyVerify   argmax + accepted prefix + emitted tokens   -> npuspec::rejection_sample
                  (patterns_greedy.py)
2. SampleVerify   ratio test + prefix + residual/bonus race + emission on the user's p
                  (patterns_sample.py)        -> npuspec::rejection_sample(target_is_probs=True)
3. GreedyAccept   eq + cumprod/cumsum/cummin prefix length    -> npuspec::greedy_accept
                  (patterns_greedy.py)
4. RatioAccept    p(x)/q(x) vs u + prefix length              -> npuspec::ratio_accept
                  (patterns_ratio.py)
5. Residual       clamp(p - q, 0) [normalised] + race/Gumbel/multinomial
                  (patterns_ratio.py)         -> npuspec::residual_sample / residual_probs
6. GivenResidual  max(d, 0) normalised with d a graph input (max_fn's own frame), and
                  multinomial of a row with its draft zeroed (EAGLE)
                  (patterns_given.py)         -> npuspec::residual_probs

Exactness: every replacement is bit-identical to the eager idiom it replaces, for the same
inputs and the same RNG state (random draws are pattern *inputs*, so the user's own
torch.rand / exponential_ / Gumbel draws are kept; multinomial stays the user's op).
"""
from __future__ import annotations

from npuspec.passes.patterns_common import TAILS, Spelling, VerifyPattern
from npuspec.passes.patterns_given import GivenResidual, GivenResidualConfig
from npuspec.passes.patterns_greedy import (GreedyAccept, GreedyAcceptConfig, GreedyVerify,
                                            GreedyVerifyConfig)
from npuspec.passes.patterns_ratio import RatioAccept, RatioAcceptConfig, Residual, ResidualConfig
from npuspec.passes.patterns_sample import OTHER_MODES, SampleVerify, SampleVerifyConfig


def default_patterns() -> list[VerifyPattern]:
    """The library, supersets first (the manager's order)."""
    other = SampleVerifyConfig(modes=OTHER_MODES, ratios=("plain", "min", "clamp", "full1"))
    return [GreedyVerify(), SampleVerify(), SampleVerify(other), GreedyAccept(), RatioAccept(),
            Residual(), GivenResidual()]


__all__ = ["VerifyPattern", "Spelling", "GreedyVerify", "GreedyAccept", "RatioAccept", "Residual",
           "GivenResidual", "GivenResidualConfig", "SampleVerify", "GreedyVerifyConfig", "GreedyAcceptConfig", "RatioAcceptConfig",
           "ResidualConfig", "SampleVerifyConfig", "default_patterns", "TAILS"]
