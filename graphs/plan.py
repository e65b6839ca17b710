"""Capture planning: which token counts get a captured graph (docs/graphs.md, "Capture
sizes").

A speculative step carries B requests of m = K+1 tokens each, so every captured token count must
be a multiple of m; otherwise a request's draft block would straddle the padding boundary.

Sources, highest priority first: the `sizes` argument (options["capture_sizes"]), then
NPUSPEC_CAPTURE_SIZES, then the default request ladder {1, 2, 4, 8, 16, 24, 32, ...} x m.
Sizes that are not multiples of m round up (one warning naming them); sizes above the maximum,
max_num_seqs*m capped at MAX_CAPTURE_TOKENS, are dropped; an empty plan falls back to [m].
"""
from __future__ import annotations

import logging
import warnings
from typing import Iterable, Optional, Sequence

from npuspec import envs
from npuspec.platform import named

log = logging.getLogger("npuspec.graphs")

# Largest token count the planner will capture. The reference systems cap at 512, which leaves
# big speculative batches (256 requests x 8 tokens = 2048) running eagerly; we cap higher and let
# NPUSPEC_CAPTURE_SIZES / options["capture_sizes"] pin anything else.
MAX_CAPTURE_TOKENS = 4096

# Default ladder in requests: small powers of two, then every 8 (vLLM's shape: 1, 2, 4, 8, 16, ...).
LADDER_HEAD = (1, 2, 4)
LADDER_STEP = 8

class CaptureSizeWarning(UserWarning):
    """Capture sizes were rounded up to multiples of K+1 or dropped for exceeding the maximum."""


def max_capture_tokens(k: int, max_num_seqs: int, cap: int = MAX_CAPTURE_TOKENS) -> int:
    """Largest multiple of K+1 that fits min(max_num_seqs*(K+1), cap) (at least K+1)."""
    m = k + 1
    limit = min(max_num_seqs * m, cap)
    return max(m, (limit // m) * m)


def default_ladder(max_requests: int) -> list[int]:
    """Request counts {1, 2, 4, 8, 16, 24, ...} up to and including `max_requests`."""
    reqs = [r for r in LADDER_HEAD if r <= max_requests]
    reqs += range(LADDER_STEP, max_requests + 1, LADDER_STEP)
    if max_requests not in reqs:
        reqs.append(max_requests)
    return sorted(set(reqs))


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _check_k(k, key: str) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"{key}={k!r} must be an integer >= 0 (K = draft tokens per request)")
    return k


def _plan_one(k: int, max_num_seqs: int, sizes: Optional[Sequence[int]], platform,
              cap: int, notes: list[str]) -> list[int]:
    if isinstance(platform, str):  # a name plans for that device without needing it here
        platform = named(platform)
    if platform is not None:
        platform.check_tokens_per_request(k)
    m = k + 1
    top = max_capture_tokens(k, max_num_seqs, cap)
    if sizes is None:  # default ladder: already multiples of m and <= top
        return [r * m for r in default_ladder(top // m)]
    rounded = {s: _round_up(s, m) for s in sizes}
    bumped = sorted(s for s, r in rounded.items() if r != s)
    if bumped:
        notes.append(f"K={k}: {', '.join(f'{s}->{rounded[s]}' for s in bumped)} "
                     f"(rounded up to multiples of K+1={m})")
    dropped = sorted({r for r in rounded.values() if r > top})
    if dropped:
        notes.append(f"K={k}: {dropped} dropped (above the maximum {top} = "
                     f"min(max_num_seqs*(K+1), {cap}))")
    plan = sorted({r for r in rounded.values() if r <= top})
    return plan or [m]


def _resolve_sizes(sizes) -> tuple[Optional[list[int]], str]:
    if sizes is not None:
        sizes = list(sizes)
        if not sizes or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0
                                for s in sizes):
            raise ValueError(f"capture_sizes={sizes!r} must be a non-empty list of positive "
                             f"integers, e.g. [4, 8, 16]")
        return sizes, "options['capture_sizes']"
    env = envs.capture_sizes()  # raises EnvError quoting NPUSPEC_CAPTURE_SIZES on garbage
    if env is not None:
        return env, "NPUSPEC_CAPTURE_SIZES"
    return None, "default ladder"


def _warn(source: str, notes: list[str]) -> None:
    if notes:
        msg = f"npuspec capture sizes from {source}: " + "; ".join(notes)
        log.warning(msg)
        warnings.warn(msg, CaptureSizeWarning, stacklevel=3)


def plan_capture_sizes(num_speculative_tokens: int, max_num_seqs: int,
                       sizes: Optional[Sequence[int]] = None, platform=None, *,
                       cap: int = MAX_CAPTURE_TOKENS) -> list[int]:
    """Sorted unique token counts to capture for one K (each a multiple of K+1).

    `sizes` (options["capture_sizes"]) beats NPUSPEC_CAPTURE_SIZES beats the default ladder.
    `platform` (a npuspec Platform, or its name "npu" / "cuda" / "cpu") enforces its
    per-request token limit (16 on npu).
    """
    k = _check_k(num_speculative_tokens, "num_speculative_tokens")
    if isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, int) or max_num_seqs < 1:
        raise ValueError(f"max_num_seqs={max_num_seqs!r} must be an integer >= 1")
    given, source = _resolve_sizes(sizes)
    notes: list[str] = []
    plan = _plan_one(k, max_num_seqs, given, platform, cap, notes)
    _warn(source, notes)
    return plan


def plan_capture_sets(k_values: Iterable[int], max_num_seqs: int,
                      sizes: Optional[Sequence[int]] = None, platform=None, *,
                      cap: int = MAX_CAPTURE_TOKENS) -> dict[int, list[int]]:
    """One ladder per K in use (dynamic K); rounding for all K is reported in one warning."""
    ks = sorted({_check_k(k, "K") for k in k_values})
    if not ks:
        raise ValueError("k_values is empty: pass every K the dynamic-K table can pick")
    if isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, int) or max_num_seqs < 1:
        raise ValueError(f"max_num_seqs={max_num_seqs!r} must be an integer >= 1")
    given, source = _resolve_sizes(sizes)
    notes: list[str] = []
    plans = {k: _plan_one(k, max_num_seqs, given, platform, cap, notes) for k in ks}
    _warn(source, notes)
    return plans


def k_values_of(spec_config) -> tuple[int, ...]:
    """Every K a SpeculativeConfig can pick (one graph set each); (0,) without one."""
    return tuple(spec_config.k_values()) if spec_config is not None else (0,)
