"""Confidence budget and batch-size table (docs/engine.md, "Dynamic K") against hand-computed
examples."""
import numpy as np
import pytest

from npuspec.config import DynamicSpecConfig, SpeculativeConfig
from npuspec.spec_decode import dynamic_k as dk

CONF = np.array([[0.9, 0.8, 0.5], [0.6, 0.9, 0.9]])
# survival by hand: row 0: 0.9, 0.72, 0.36; row 1: 0.6, 0.54, 0.486
SURV = np.array([[0.9, 0.72, 0.36], [0.6, 0.54, 0.486]])


def cfg(**kw):
    d = {"method": "draft_model", "method_params": kw}
    return DynamicSpecConfig.from_dict(d, "draft_model", 3)


def test_survival_is_cumprod_and_clamped():
    np.testing.assert_allclose(dk.survival(CONF), SURV)
    s = dk.survival(np.array([[0.0, 2.0]]))
    np.testing.assert_allclose(s, [[1e-6, 1e-6]])


def test_update_budget_hand_examples():
    # threshold 0.5: 4 values survive, ceil(4/2) = 2, even and < K=3 -> 3
    assert dk.update_budget(SURV, 0.5, 3, 1) == 3
    # threshold 0.7: 2 survive -> ceil(2/2) = 1 (odd, kept)
    assert dk.update_budget(SURV, 0.7, 3, 1) == 1
    # threshold 0.95: none -> 0, even -> 1; clamped up to min 2
    assert dk.update_budget(SURV, 0.95, 3, 2) == 2
    # even but already K: not bumped past K
    assert dk.update_budget(np.ones((1, 4)), 0.5, 4, 0) == 4


def test_allocate_hand_examples():
    # budget 2, min 1: 2 extra slots over positions 1..2 -> 0.72 (row 0) and 0.54 (row 1)
    assert dk.allocate(SURV, 2, 1).tolist() == [2, 2]
    # budget 2, min 0: 4 slots over all positions -> 0.9, 0.72, 0.6, 0.54
    assert dk.allocate(SURV, 2, 0).tolist() == [2, 2]
    # budget 1, min 0: both slots go to the confident row
    s = dk.survival(np.array([[0.9, 0.9], [0.1, 0.1]]))
    assert dk.allocate(s, 1, 0).tolist() == [2, 0]
    # budget == min: nothing extra
    assert dk.allocate(SURV, 1, 1).tolist() == [1, 1]
    # more slots than positions: everything
    assert dk.allocate(SURV, 3, 0).tolist() == [3, 3]
    # ties keep a prefix per row
    assert dk.allocate(np.ones((2, 3)), 1, 0).tolist() == [2, 0]


def test_cut_drafts():
    d = np.array([[5, 6, 7], [8, 9, 10]])
    assert dk.cut_drafts(d, np.array([1, 3])).tolist() == [[5, -1, -1], [8, 9, 10]]


def test_budget_object_updates_every_interval():
    b = dk.ConfidenceBudget(cfg(initial_verify_budget_per_req=2, budget_update_interval=2,
                                budget_threshold=0.5, min_verify_tokens=1), 3)
    assert b.budget == 2
    assert b(CONF).tolist() == [2, 2]  # step 1: no update yet
    assert b.budget == 2
    assert b(CONF).tolist() == [2, 2]  # step 2: allocated with 2, then updated to 3
    assert b.budget == 3
    assert b(CONF).tolist() == [3, 3]


def test_initial_budget_clamps():
    assert dk.initial_budget(cfg(initial_verify_budget_per_req=10), 3) == 3
    assert dk.initial_budget(cfg(initial_verify_budget_per_req=1, min_verify_tokens=2), 3) == 2


@pytest.mark.parametrize("n,k", [(0, 0), (1, 3), (4, 3), (5, 1), (8, 1), (9, 0), (100, 0)])
def test_batch_size_table(n, k):
    spec = SpeculativeConfig.from_dict({
        "method": "ngram", "num_speculative_tokens": 3,
        "num_speculative_tokens_per_batch_size": [[1, 4, 3], [5, 8, 1], [9, 16, 0]]})
    assert dk.k_for_step(spec, n) == k
    assert dk.k_for_step(None, n) == 0
