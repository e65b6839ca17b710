"""Losslessness of standard and block verification (docs/verify.md, "Losslessness, tested"),
statistically.

A tiny prefix-dependent "language model" (verify_lossless.py) drafts with a draft model, the op
verifies, the positions after the emitted tokens are completed by target sampling, and the
(K+1)-token sequences must follow the exact target distribution (chi-square, fixed seeds).
The slow versions use >= 10^5 draws; the default versions use fewer draws and can still fail:
`test_the_reduced_test_detects_a_biased_verifier` shows they catch a wrong residual.
"""
from __future__ import annotations

import math

import pytest
import torch

from verify_lossless import (chi_square_pvalue, make_model, run, sequence_pvalue,
                             standard_acceptance_distribution)

ALPHA = 1e-3  # fixed seeds: a pass is deterministic; the threshold only sets the power


@pytest.mark.parametrize("draft_probs", [False, True])
@pytest.mark.parametrize("block", [False, True])
def test_lossless_reduced(draft_probs, block):
    pv, _ = sequence_pvalue(5, 2, 30_000, draft_probs=draft_probs, block=block, seed=11)
    assert pv > ALPHA, pv


@pytest.mark.parametrize("block", [False, True])
def test_lossless_reduced_fused_cpu_path(block):
    """The shipped CPU lowering (not only the reference) is lossless too."""
    pv, _ = sequence_pvalue(6, 3, 30_000, draft_probs=True, block=block, seed=17, impl="cpu")
    assert pv > ALPHA, pv


@pytest.mark.slow
@pytest.mark.parametrize("V,K", [(4, 2), (6, 3), (8, 3)])
@pytest.mark.parametrize("draft_probs", [False, True])
@pytest.mark.parametrize("block", [False, True])
def test_lossless_full(V, K, draft_probs, block):
    pv, _ = sequence_pvalue(V, K, 200_000, draft_probs=draft_probs, block=block, seed=V * 10 + K)
    assert pv > ALPHA, pv


@pytest.mark.parametrize("draft_probs", [False, True])
def test_standard_acceptance_counts_match_exact(draft_probs):
    """Pre-rejection acceptance: the accepted-length histogram matches the exact enumeration."""
    V, K, N = 5, 2, 30_000
    _, acc, _ = run(V, K, N, draft_probs=draft_probs, block=False, seed=13)
    exact = standard_acceptance_distribution(V, K, 13, draft_probs)
    pv = chi_square_pvalue(torch.bincount(acc, minlength=K + 1), exact)[0]
    assert pv > ALPHA, (pv, torch.bincount(acc, minlength=K + 1), exact * N)


@pytest.mark.slow
@pytest.mark.parametrize("V,K", [(4, 2), (8, 3)])
@pytest.mark.parametrize("draft_probs", [False, True])
def test_standard_acceptance_counts_full(V, K, draft_probs):
    _, acc, _ = run(V, K, 200_000, draft_probs=draft_probs, block=False, seed=V + K)
    exact = standard_acceptance_distribution(V, K, V + K, draft_probs)
    assert chi_square_pvalue(torch.bincount(acc, minlength=K + 1), exact)[0] > ALPHA


def test_block_accepts_at_least_as_much_as_standard():
    """Same model, same drafts, same draws: block's mean accepted length >= standard's."""
    V, K, N = 8, 3, 20_000
    _, acc_s, _ = run(V, K, N, draft_probs=True, block=False, seed=21)
    _, acc_b, _ = run(V, K, N, draft_probs=True, block=True, seed=21)
    diff = (acc_b - acc_s).double()
    se = diff.std().item() / math.sqrt(N)
    print(f"mean accepted: standard {acc_s.double().mean():.4f} block {acc_b.double().mean():.4f}"
          f" diff {diff.mean():.4f} +- {se:.4f}")
    assert diff.mean().item() > -3 * se          # never worse (statistical margin)
    assert diff.mean().item() > 3 * se           # and measurably better with draft probs here


def test_the_reduced_test_detects_a_biased_verifier(monkeypatch):
    """Power check: claiming the wrong draft distribution biases the output; the reduced-draw
    chi-square must reject it (so the default tests above can fail)."""
    import verify_lossless as vl
    real = vl.rejection_sample_reference

    def lying(logits, x, q, **kw):  # verify against a flattened draft distribution
        return real(logits, x, (q + 0.5 / q.shape[-1]) / 1.5, **kw)

    monkeypatch.setattr(vl, "rejection_sample_reference", lying)
    pv, _ = sequence_pvalue(5, 2, 30_000, draft_probs=True, block=False, seed=11)
    assert pv < 1e-6, pv
    pv, _ = sequence_pvalue(5, 2, 30_000, draft_probs=True, block=True, seed=11)
    assert pv < 1e-6, pv


def test_block_with_cumulative_product_heuristic_would_fail(monkeypatch):
    """vLLM Ascend's block heuristic (accept while the cumulative product of p/q beats u, then
    sample the residual) is lossy: the same chi-square rejects it. Documents why npuspec
    implements Sun et al.'s rule instead."""
    import verify_lossless as vl
    from npuspec.kernels import verify as V_

    def heuristic(xpad, st, u, theta):  # cumprod(p/q) >= u instead of per-position p/q >= u
        K = xpad.shape[1] - 1
        ratio = torch.cumprod(V_._ratio(st, K), dim=1)
        return V_._leading((xpad[:, :K] >= 0) & (st.qx[:, :K] > 0) & (ratio >= theta * u))

    monkeypatch.setattr(V_, "_decide_standard", heuristic)
    pv, _ = vl.sequence_pvalue(5, 2, 30_000, draft_probs=True, block=False, seed=11)
    assert pv < 1e-6, pv


def test_model_tables_are_prefix_dependent():
    target, draft = make_model(4, 2, 0)
    assert target[1].shape == (4, 4) and target[2].shape == (16, 4)
    assert not torch.allclose(target[2][0], target[2][1])
