"""plan_capture_sizes / plan_capture_sets: sources, rounding, dropping, the NPU limit, dynamic K."""
import itertools
import random
import warnings

import pytest

from npuspec import envs
from npuspec.config import SpeculativeConfig
from npuspec.graphs import (MAX_CAPTURE_TOKENS, CaptureSizeWarning, default_ladder,
                            plan_capture_sets, plan_capture_sizes)
from npuspec.platform import Platform

NPU = Platform("npu", "acl", False, 16, "fake-npu")
CPU = Platform("cpu", "cpu", False, float("inf"), "cpu")


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv("NPUSPEC_CAPTURE_SIZES", raising=False)


def _quiet(*a, **k):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the call
        return plan_capture_sizes(*a, **k)


def test_default_ladder_k3():
    plan = _quiet(3, 256)
    assert plan[:6] == [4, 8, 16, 32, 64, 96]
    assert plan[-1] == 256 * 4 and len(plan) == 3 + 32
    assert default_ladder(20) == [1, 2, 4, 8, 16, 20]
    assert default_ladder(1) == [1]


def test_default_ladder_is_capped():
    plan = _quiet(15, 512)  # 512*16 = 8192 > cap
    assert plan[-1] == MAX_CAPTURE_TOKENS and all(s % 16 == 0 for s in plan)
    plan = _quiet(2, 10000)  # cap not a multiple of 3: largest multiple below it
    assert plan[-1] == (MAX_CAPTURE_TOKENS // 3) * 3


def test_invariants_exhaustive():
    """Every K the NPU allows, many max_num_seqs, default and given sizes."""
    rng = random.Random(0)
    for k, mns in itertools.product(range(16), [1, 2, 3, 7, 8, 9, 63, 64, 100, 256, 257, 1000]):
        m, top = k + 1, min(mns * (k + 1), MAX_CAPTURE_TOKENS) // (k + 1) * (k + 1)
        for sizes in (None, [rng.randint(1, 3000) for _ in range(rng.randint(1, 6))]):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", CaptureSizeWarning)
                plan = plan_capture_sizes(k, mns, sizes, NPU)
            assert plan == sorted(set(plan)), plan
            assert all(s % m == 0 and m <= s <= top for s in plan), (k, mns, sizes, plan)
            if sizes is None:
                assert plan[-1] == top and plan[0] == m
            else:
                want = sorted({-(-s // m) * m for s in sizes if -(-s // m) * m <= top}) or [m]
                assert plan == want


def test_env_var_source(monkeypatch):
    monkeypatch.setenv("NPUSPEC_CAPTURE_SIZES", "4,8,16,32")
    assert _quiet(3, 256) == [4, 8, 16, 32]
    # options beat the environment
    assert _quiet(3, 256, sizes=[8, 64]) == [8, 64]


def test_rounding_warns_once_naming_sizes(monkeypatch):
    monkeypatch.setenv("NPUSPEC_CAPTURE_SIZES", "4,8,10,16")
    with pytest.warns(CaptureSizeWarning) as rec:
        plan = plan_capture_sizes(2, 256)
    assert plan == [6, 9, 12, 18]
    assert len(rec) == 1
    msg = str(rec[0].message)
    assert "NPUSPEC_CAPTURE_SIZES" in msg and "4->6" in msg and "8->9" in msg and "16->18" in msg
    assert "10->12" in msg


def test_oversized_dropped_and_empty_fallback():
    with pytest.warns(CaptureSizeWarning, match=r"2048.*dropped"):
        assert plan_capture_sizes(3, 8, sizes=[4, 2048]) == [4]
    with pytest.warns(CaptureSizeWarning):
        assert plan_capture_sizes(3, 2, sizes=[100, 200]) == [4]  # nothing left -> [K+1]


@pytest.mark.parametrize("value", ["4,x", "0", "-3", ""])
def test_bad_env_values(monkeypatch, value):
    monkeypatch.setenv("NPUSPEC_CAPTURE_SIZES", value)
    with pytest.raises(envs.EnvError, match="NPUSPEC_CAPTURE_SIZES"):
        plan_capture_sizes(3, 256)


@pytest.mark.parametrize("sizes", [[], [0], [-4], [4, "8"], [True], [2.5]])
def test_bad_option_sizes(sizes):
    with pytest.raises(ValueError, match="capture_sizes"):
        plan_capture_sizes(3, 256, sizes=sizes)


@pytest.mark.parametrize("bad", [dict(num_speculative_tokens=-1, max_num_seqs=8),
                                 dict(num_speculative_tokens=2, max_num_seqs=0),
                                 dict(num_speculative_tokens=1.0, max_num_seqs=8)])
def test_bad_arguments(bad):
    with pytest.raises(ValueError):
        plan_capture_sizes(**bad)


def test_npu_limit():
    assert plan_capture_sizes(15, 4, platform=NPU)[-1] == 64
    with pytest.raises(ValueError, match="16 query tokens per request") as e:
        plan_capture_sizes(16, 4, platform=NPU)
    assert "num_speculative_tokens" in str(e.value)
    assert plan_capture_sizes(16, 4, platform=CPU)[-1] == 68  # no limit off the NPU
    with pytest.raises(ValueError, match="fused attention"):
        plan_capture_sets([1, 20], 4, platform=NPU)


def test_platform_by_name():
    # docs/graphs.md, "Capture sizes": a name plans for that device without the device being
    # here (issue 13)
    assert plan_capture_sizes(15, 4, platform="npu") == plan_capture_sizes(15, 4, platform=NPU)
    with pytest.raises(ValueError, match="16 query tokens per request"):
        plan_capture_sizes(16, 4, platform="npu")
    assert plan_capture_sizes(16, 4, platform="cuda")[-1] == 68
    assert plan_capture_sets([1, 3], 4, platform="cpu") == plan_capture_sets([1, 3], 4)
    with pytest.raises(ValueError, match="platform='tpu': use one of 'npu', 'cuda', 'cpu'"):
        plan_capture_sizes(1, 4, platform="tpu")


def test_dynamic_k_one_ladder_per_k():
    spec = SpeculativeConfig.from_dict({
        "method": "ngram", "num_speculative_tokens": 7,
        "num_speculative_tokens_per_batch_size": [[1, 4, 7], [5, 16, 3], [17, 64, 1]]},
        device="cpu")
    plans = plan_capture_sets(spec.k_values(), 64)
    assert sorted(plans) == [1, 3, 7]
    for k, plan in plans.items():
        assert plan == plan_capture_sizes(k, 64)
        assert plan[-1] == 64 * (k + 1)


def test_dynamic_k_given_sizes_one_warning():
    with pytest.warns(CaptureSizeWarning) as rec:
        plans = plan_capture_sets([1, 3, 7], 64, sizes=[6, 16])
    assert plans == {1: [6, 16], 3: [8, 16], 7: [8, 16]}
    assert len(rec) == 1 and "K=3: 6->8" in str(rec[0].message) and "K=7: 6->8" in str(rec[0].message)
    assert "K=1" not in str(rec[0].message)
