"""The fused verify op `npuspec::rejection_sample` and its PyTorch reference (docs/verify.md;
the contract: docs/design.md, "The verify op").

One call verifies K drafted tokens per request against the target logits and emits the
accepted prefix plus one recovered/bonus token. Every mode is here: greedy, standard
(Leviathan et al.), exact block verification (Sun et al., ICLR 2025), entropy verify (lossy,
opt-in) and synthetic acceptance (benchmarking). `target_is_probs=True` takes the caller's
probabilities instead of logits and runs standard verify with the eager idiom's arithmetic
(`probs_verify` in verify_probs.py, plain PyTorch on every device; docs/verify.md).

The op is split in two so that every implementation shares the same decisions:

1. *Row statistics* — the only part that touches [B, K+1, V] data. For every row (request b,
   position j) it computes the greedy argmax, p_j(x_j), q_j(x_j), the exponential races, the
   block residual mass and the entropy. Three implementations compute them:
   `reference_row_stats` (verify_rows.py: readable PyTorch, the specification, with the draws
   every implementation shares), the Triton kernels in `npuspec.kernels.verify_triton`
   (CUDA/Ascend, and the interpreter on CPU) and the fused CPU lowering in
   `npuspec.kernels.verify_cpu`.
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
from typing import Mapping, Optional, Sequence

import torch
from torch import Tensor

from npuspec.kernels import verify_cpu
from npuspec.kernels.verify_checks import _check_finite, _check_values, _validate
from npuspec.kernels.verify_composed import RESIDUAL_DEFAULTS, check_composed, composed_verify
from npuspec.kernels.verify_ragged import check_max_spec_len, check_ragged, ragged_verify
from npuspec.kernels.verify_probs import (ACCEPT_MODES, _check_accept_mode, _check_probs_mode,
                                          probs_verify)
from npuspec.kernels.verify_rows import (RowStats, _leading, _padded_drafts, draw_exponentials,
                                         draw_uniforms, filter_thresholds, reference_row_stats)
from npuspec.platform import triton_available

__all__ = ["rejection_sample", "rejection_sample_reference", "probs_verify",
           "synthetic_rates_from_length", "conditional_rates", "draw_uniforms",
           "draw_exponentials", "use_impl", "RowStats", "reference_row_stats", "filter_thresholds",
           "ACCEPT_MODES"]


# --------------------------------------------------------------------------------------------
# Synthetic rates
# --------------------------------------------------------------------------------------------

def synthetic_rates_from_length(length: float, k: int) -> list[float]:
    """Unconditional per-position rates for a mean emitted length L (docs/verify.md, "Modes").

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
# Decisions: one function per mode, on [B, K] tensors (shared by every implementation)
# --------------------------------------------------------------------------------------------

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
# The op
# --------------------------------------------------------------------------------------------

_FORCED_IMPL: list[Optional[str]] = [None]
IMPLS = ("reference", "triton", "cpu")
# Called with True while `use_impl` forces an implementation, False after (the native CPU
# kernel of kernels/native_cpu.py then passes every call to the Python op, which honours it).
FORCE_HOOKS: list = []


@contextlib.contextmanager
def use_impl(name: Optional[str]):
    """Force the row-statistics implementation ('reference', 'triton', 'cpu') in a block."""
    if name is not None and name not in IMPLS:
        raise ValueError(f"use_impl({name!r}): choose one of {', '.join(IMPLS)} or None")
    old = _FORCED_IMPL[0]
    _FORCED_IMPL[0] = name
    for hook in FORCE_HOOKS:
        hook(name is not None)
    try:
        yield
    finally:
        _FORCED_IMPL[0] = old
        for hook in FORCE_HOOKS:
            hook(old is not None)


def _pick_impl(device: torch.device) -> str:
    if _FORCED_IMPL[0] is not None:
        return _FORCED_IMPL[0]
    if device.type == "cpu":
        return "cpu"
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
        # optional: Triton (CUDA, or triton-ascend) is imported only where a kernel runs on it
        from npuspec.kernels.verify_triton import triton_row_stats
        return triton_row_stats
    return verify_cpu.cpu_row_stats


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


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
        fused = verify_cpu.cpu_standard_verify(target_logits, xpad, draft_probs, t, thr, exponentials, early)
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
    B, K1, V = target_logits.shape
    greedy = (torch.ones(B, K1 - 1), torch.ones(B, dtype=torch.bool))
    return verify_cpu.cpu_standard_verify(target_logits, xpad, None, torch.ones(B), None,
                               torch.empty(B, V), greedy)


def _rejection_sample_impl(target_logits: Tensor, draft_token_ids: Tensor,
                         draft_probs: Optional[Tensor], temperature: Optional[Tensor],
                         top_k: Optional[Tensor], top_p: Optional[Tensor],
                         uniforms: Optional[Tensor], exponentials: Optional[Tensor],
                         block_verify: bool, posterior_threshold: Optional[float],
                         posterior_alpha: Optional[float], synthetic_rates: Optional[Tensor],
                         bonus_token_ids: Optional[Tensor] = None,
                         accept_draft_probs: Optional[Tensor] = None,
                         cu_num_draft_tokens: Optional[Tensor] = None,
                         is_greedy: Optional[Tensor] = None,
                         *, target_is_probs: bool = False, accept_mode: str = "ge",
                         ratio_cap: bool = False, accept_rule: str = "prefix",
                         residual_normalize: str = "none", residual_sampler: str = "race",
                         residual_nonneg: str = "clamp", residual_floor: float = 0.0,
                         residual_guard: str = "none", residual_fill: float = 0.0,
                         checks: bool = True, max_spec_len: int = -1) -> tuple[Tensor, Tensor]:
    """torch.ops.npuspec.rejection_sample: see `rejection_sample` for the arguments.

    Pure when `uniforms`/`exponentials` are given (and always for greedy-only, non-synthetic
    calls); missing draws come from the default generator."""
    _check_accept_mode(accept_mode, ratio_cap, target_is_probs, accept_rule)
    residual = dict(residual_normalize=residual_normalize, residual_sampler=residual_sampler,
                    residual_nonneg=residual_nonneg, residual_floor=residual_floor,
                    residual_guard=residual_guard, residual_fill=residual_fill)
    if cu_num_draft_tokens is not None:  # the ragged mode (kernels/verify_ragged.py)
        _check_ragged_call(target_logits, draft_token_ids, draft_probs, temperature, top_k,
                           top_p, uniforms, exponentials, block_verify, posterior_threshold,
                           synthetic_rates, bonus_token_ids, accept_draft_probs,
                           cu_num_draft_tokens, is_greedy, max_spec_len, residual,
                           target_is_probs, ratio_cap)
        if uniforms is None or exponentials is None:
            raise ValueError("the ragged mode needs its draws as tensors (uniforms [N], "
                             "exponentials [B, V]); rejection_sample() draws them for you")
        return ragged_verify(target_logits, draft_token_ids, draft_probs, uniforms,
                             exponentials, bonus_token_ids, cu_num_draft_tokens, max_spec_len,
                             is_greedy, accept_mode, accept_rule, **residual)
    if is_greedy is not None or max_spec_len != -1:
        raise ValueError("is_greedy and max_spec_len belong to the ragged mode; pass "
                         "cu_num_draft_tokens (vLLM's layout) or leave them out")
    if bonus_token_ids is not None:  # the composed mode (kernels/verify_composed.py)
        _check_composed_call(target_logits, draft_token_ids, draft_probs, temperature, top_k,
                             top_p, uniforms, exponentials, block_verify, posterior_threshold,
                             synthetic_rates, bonus_token_ids, accept_draft_probs, residual,
                             target_is_probs, ratio_cap, accept_rule)
        return composed_verify(target_logits, draft_token_ids, draft_probs, uniforms,
                               exponentials, bonus_token_ids, accept_draft_probs, accept_mode,
                               **residual)
    if accept_draft_probs is not None or residual != RESIDUAL_DEFAULTS:
        raise ValueError("accept_draft_probs and the residual_* arguments belong to the "
                         "composed mode; pass bonus_token_ids (with target_is_probs=True) or "
                         "leave them at their defaults")
    if not checks:
        _check_unchecked_call(draft_probs, temperature, block_verify, posterior_threshold,
                              synthetic_rates, target_is_probs, top_k, top_p)
        return _greedy_as_written(target_logits, draft_token_ids)
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


def _check_composed_call(target, drafts, draft_probs, temperature, top_k, top_p, uniforms,
                         exponentials, block_verify, posterior_threshold, synthetic_rates, bonus,
                         accept_q, residual, target_is_probs, ratio_cap, accept_rule) -> None:
    for name, v in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p),
                    ("synthetic_rates", synthetic_rates), ("entropy_verify", posterior_threshold)):
        if v is not None:
            raise ValueError(f"{name} given with bonus_token_ids: the composed mode verifies on "
                             f"your finished probabilities; apply {name} to p yourself")
    if block_verify:
        raise ValueError("block_verify=True with bonus_token_ids: the composed mode runs "
                         "standard verification only; leave bonus_token_ids out")
    check_composed(target, drafts, draft_probs, uniforms, exponentials, bonus, accept_q,
                   residual, target_is_probs, ratio_cap, accept_rule)


def _check_ragged_call(target, drafts, draft_probs, temperature, top_k, top_p, uniforms,
                       exponentials, block_verify, posterior_threshold, synthetic_rates, bonus,
                       accept_q, cu, is_greedy, max_spec_len, residual, target_is_probs,
                       ratio_cap) -> None:
    for name, v in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p),
                    ("synthetic_rates", synthetic_rates), ("entropy_verify", posterior_threshold),
                    ("accept_draft_probs", accept_q)):
        if v is not None:
            raise ValueError(f"{name} given with cu_num_draft_tokens: the ragged mode verifies "
                             f"on your finished probabilities as vllm-ascend's PyTorch sampler "
                             f"does; leave {name} out")
    if block_verify:
        raise ValueError("block_verify=True with cu_num_draft_tokens: the ragged mode's block "
                         "rule is vllm-ascend's, accept_rule='cumulative'; pass that instead")
    check_ragged(target, drafts, draft_probs, uniforms, exponentials, bonus, cu, is_greedy,
                 max_spec_len, residual, target_is_probs, ratio_cap)


def _check_unchecked_call(draft_probs, temperature, block_verify, entropy, synthetic_rates,
                          target_is_probs, top_k=None, top_p=None) -> None:
    for name, v in (("draft_probs", draft_probs), ("temperature", temperature),
                    ("entropy_verify", entropy), ("synthetic_rates", synthetic_rates),
                    ("top_k", top_k), ("top_p", top_p)):
        if v is not None:
            raise ValueError(f"checks=False with {name}: the unchecked step is the greedy one "
                             f"(one-hot drafts, no temperature); leave {name} out or keep checks")
    if block_verify or target_is_probs:
        raise ValueError("checks=False applies to the greedy step only; pass block_verify=False "
                         "and target_is_probs=False, or keep checks=True")


def _greedy_as_written(logits: Tensor, drafts: Tensor) -> tuple[Tensor, Tensor]:
    """The greedy step exactly as the eager idiom computes it, for every input: the C++
    kernel's rows where they are that (finite rows, ids in [-1, V): its first maximum is
    torch.argmax's), else plain PyTorch (`greedy_as_written_ref`)."""
    B, K1, V = logits.shape
    if logits.device.type == "cpu" and drafts.dtype == torch.int64 and bool(
            ((drafts >= -1) & (drafts < V)).all()):
        fused = _cpu_greedy(logits, _padded_drafts(drafts, V))
        if fused is not None and bool(torch.isfinite(fused[2]).all()):
            return fused[0], fused[1]
    return greedy_as_written_ref(logits, drafts)


def greedy_as_written_ref(logits: Tensor, drafts: Tensor) -> tuple[Tensor, Tensor]:
    """target = logits.argmax(-1); n = leading drafts equal to it; target up to n, -1 after."""
    K = drafts.shape[1]
    target = logits.argmax(dim=-1)                                   # [B, K+1]
    n = (drafts == target[:, :K]).to(torch.int64).cumprod(dim=1).sum(dim=1)   # [B]
    pos = torch.arange(K + 1, device=logits.device)[None, :]
    out = torch.where(pos <= n[:, None], target, -1)
    return out.to(torch.int32), (n + 1).to(torch.int32)


# The op. kernels/native_cpu.py adds a C++ CPU kernel for the all-greedy step, which outranks
# this Python one (custom_op registers it as CompositeExplicitAutograd) and hands it the rest.
_rejection_sample_op = torch.library.custom_op("npuspec::rejection_sample", mutates_args=())(
    _rejection_sample_impl)


@_rejection_sample_op.register_fake
def _(target_logits, draft_token_ids, draft_probs, temperature, top_k, top_p, uniforms,
      exponentials, block_verify, posterior_threshold, posterior_alpha, synthetic_rates,
      bonus_token_ids=None, accept_draft_probs=None, cu_num_draft_tokens=None, is_greedy=None, *,
      target_is_probs=False, accept_mode="ge", ratio_cap=False, accept_rule="prefix",
      residual_normalize="none",
      residual_sampler="race", residual_nonneg="clamp", residual_floor=0.0,
      residual_guard="none", residual_fill=0.0, checks=True, max_spec_len=-1):
    B, K1 = target_logits.shape[0], target_logits.shape[1]
    if cu_num_draft_tokens is not None:  # ragged: [B, max_spec_len + 1]
        B, K1 = cu_num_draft_tokens.shape[0], max_spec_len + 1
    elif bonus_token_ids is not None:  # composed: p may lack the bonus row
        K1 = draft_token_ids.shape[1] + 1
    return (target_logits.new_empty((B, K1), dtype=torch.int32),
            target_logits.new_empty((B,), dtype=torch.int32))


def rejection_sample(target_logits: Tensor, draft_token_ids: Tensor,
                     draft_probs: Optional[Tensor] = None, *, temperature: Optional[Tensor] = None,
                     top_k: Optional[Tensor] = None, top_p: Optional[Tensor] = None,
                     generators: Optional[Mapping[int, torch.Generator]] = None,
                     block_verify: bool = False,
                     entropy_verify: Optional[Sequence[float]] = None,
                     synthetic_rates: Optional[Tensor] = None,
                     uniforms: Optional[Tensor] = None, exponentials: Optional[Tensor] = None,
                     target_is_probs: bool = False, accept_mode: str = "ge",
                     ratio_cap: bool = False, accept_rule: str = "prefix",
                     bonus_token_ids: Optional[Tensor] = None,
                     accept_draft_probs: Optional[Tensor] = None, checks: bool = True,
                     cu_num_draft_tokens: Optional[Tensor] = None,
                     max_spec_len: Optional[int] = None, is_greedy: Optional[Tensor] = None,
                     **residual) -> tuple[Tensor, Tensor]:
    """Verify K drafts per request (docs/verify.md). Returns (tokens int32 [B, K+1] -1 padded,
    num_emitted int32 [B]).

    bonus_token_ids int [B] (with target_is_probs=True): the composed mode
    (kernels/verify_composed.py), vLLM v1's step as one call: your bonus tokens are emitted
    when every draft is accepted (row K of p is not read; p may be [B, K, V]), the test reads
    `accept_draft_probs` if given (else draft_probs), and the recovered token at the first
    rejection is `residual_sample`'s under the `residual_*` keywords (normalize, sampler,
    nonneg, floor, guard, fill). Draws not given: uniforms [B, K], exponentials [B, 1, V].

    cu_num_draft_tokens int [B] (with target_is_probs=True, bonus_token_ids and max_spec_len):
    the ragged mode (kernels/verify_ragged.py), vLLM's layout as vllm-ascend's PyTorch sampler
    verifies it: p [N, V], flat draft ids [N] (-1 = placeholder), draft_probs [N, V] or None
    (n-gram), request b owning the rows from cu[b-1] to cu[b]; tokens [B, max_spec_len + 1];
    `accept_rule="cumulative"` is its block verify; rows of `is_greedy` [B] are left -1 with
    num_emitted 0 (vllm-ascend's greedy pass writes them). Draws not given: uniforms [N]
    (float64, as vllm-ascend draws them), exponentials [B, V].

    checks=False (greedy calls only: no temperature, draft_probs or other mode): no value
    checks; the step is then exactly the eager greedy idiom on every input (`target =
    logits.argmax(-1)`, accept while drafts equal it, emit target up to the count), so a row
    with NaN, +inf or only -inf logits, or a draft id outside [-1, V), gives what
    torch.argmax and `==` give instead of a ValueError. The passes use it for the greedy
    steps they replace; the engine keeps the checks.

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
    unknown = set(residual) - set(RESIDUAL_DEFAULTS)
    if unknown:
        raise TypeError(f"rejection_sample: unknown keyword(s) {sorted(unknown)}; the residual's "
                        f"are {sorted(RESIDUAL_DEFAULTS)}")
    if cu_num_draft_tokens is not None:
        return _ragged_call(target_logits, draft_token_ids, draft_probs, uniforms, exponentials,
                            bonus_token_ids, accept_draft_probs, cu_num_draft_tokens,
                            max_spec_len, is_greedy, temperature, top_k, top_p, block_verify,
                            entropy_verify, synthetic_rates, target_is_probs, accept_mode,
                            ratio_cap, accept_rule, residual, generators)
    if max_spec_len is not None or is_greedy is not None:
        raise ValueError("max_spec_len and is_greedy belong to the ragged mode; pass "
                         "cu_num_draft_tokens (vLLM's layout) or leave them out")
    if bonus_token_ids is not None:
        B, K = draft_token_ids.shape
        dev = target_logits.device
        if uniforms is None:
            uniforms = draw_uniforms(B, K, dev, generators)
        if exponentials is None:
            exponentials = draw_exponentials(B, target_logits.shape[-1], dev, generators)[:, None]
        thr, alpha = (None, None) if entropy_verify is None else entropy_verify
        return torch.ops.npuspec.rejection_sample(
            target_logits, draft_token_ids, draft_probs, temperature, top_k, top_p, uniforms,
            exponentials, bool(block_verify), thr, alpha, synthetic_rates, bonus_token_ids,
            accept_draft_probs, target_is_probs=bool(target_is_probs), accept_mode=accept_mode,
            ratio_cap=bool(ratio_cap), accept_rule=accept_rule, **{**RESIDUAL_DEFAULTS, **residual})
    if accept_draft_probs is not None or residual:
        raise ValueError("accept_draft_probs and the residual_* keywords belong to the composed "
                         "mode; pass bonus_token_ids (with target_is_probs=True) or leave them out")
    if not checks:
        _check_unchecked_call(draft_probs, temperature, block_verify, entropy_verify,
                              synthetic_rates, target_is_probs, top_k, top_p)
        return torch.ops.npuspec.rejection_sample(
            target_logits, draft_token_ids, None, None, None, None, None, None, False, None,
            None, None, checks=False)
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


def _ragged_call(p, ids, q, uniforms, exponentials, bonus, accept_q, cu, max_spec_len,
                 is_greedy, temperature, top_k, top_p, block_verify, entropy_verify,
                 synthetic_rates, target_is_probs, accept_mode, ratio_cap, accept_rule,
                 residual, generators=None) -> tuple[Tensor, Tensor]:
    if max_spec_len is None:
        raise ValueError("cu_num_draft_tokens given without max_spec_len: the ragged mode's "
                         "output is [B, max_spec_len + 1]; pass the longest draft a request "
                         "may have")
    check_max_spec_len(max_spec_len)
    if generators and (uniforms is None or exponentials is None):
        raise ValueError("generators given with cu_num_draft_tokens: the ragged mode draws "
                         "what is not given from the default generator, as vllm-ascend does; "
                         "draw uniforms [N] and exponentials [B, V] with your generators and "
                         "pass them, or leave generators out")
    if p.dim() == 2 and uniforms is None:  # vllm-ascend's generate_uniform_probs: float64
        uniforms = torch.rand(p.shape[0], dtype=torch.float64, device=p.device)
    if p.dim() == 2 and exponentials is None and cu.dim() == 1:
        exponentials = torch.empty(cu.shape[0], p.shape[1], device=p.device).exponential_()
    thr, alpha = (None, None) if entropy_verify is None else entropy_verify
    return torch.ops.npuspec.rejection_sample(
        p, ids, q, temperature, top_k, top_p, uniforms, exponentials, bool(block_verify), thr,
        alpha, synthetic_rates, bonus, accept_q, cu, is_greedy,
        target_is_probs=bool(target_is_probs), accept_mode=accept_mode, ratio_cap=bool(ratio_cap),
        accept_rule=accept_rule, max_spec_len=max_spec_len, **{**RESIDUAL_DEFAULTS, **residual})


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
