"""`npuspec bench dynk`'s pure parts: the settle count of the load-change trace, the flags."""
import argparse

import pytest

from npuspec.bench import dynk


def test_settle_counts_steps_until_the_phase_keeps_its_most_common_k():
    # phase 1 (steps 0-5): K=4 from step 2 on; phase 2 (steps 6-11): K=0 from its step 3 on
    trace = [(1, 0), (1, 2), (1, 4), (1, 4), (1, 4), (1, 4),
             (32, 4), (32, 2), (32, 1), (32, 0), (32, 0), (32, 0)]
    assert dynk.settle(trace, [0, 6]) == [2, 3]
    # 80% is enough: one exploring step in the tail does not move the count
    trace = [(1, 0)] + [(1, 4)] * 8 + [(1, 0)] + [(1, 4)]
    assert dynk.settle(trace, [0]) == [1]
    assert dynk.settle([], [0]) == [0]


def test_batches_flag():
    assert dynk._ints("1,4,16") == [1, 4, 16]
    for bad in ("", "1,x", "0,4"):
        with pytest.raises(argparse.ArgumentTypeError):
            dynk._ints(bad)


def test_host_time_runs():
    assert 0 < dynk.host_time_us(batch=8, steps=50) < 1e6


def test_engine_host_time_is_measured_inside_an_online_engine():
    from npuspec.engine import LLM
    llm = LLM("tiny", speculative_config={"method": "ngram", "num_speculative_tokens": "auto"},
              enforce_eager=True, max_model_len=128, max_num_seqs=4)
    us, mean, n = dynk.engine_host_us(llm, ["def f(x):", "import os\n"], batch=4,
                                      max_tokens=12)
    assert n >= 5 and 0 < us < 1e6 and 0 < mean < 1e6, (us, mean, n)
    assert "draft" not in vars(llm.online)  # the wrappers are gone again


def test_k_over_time_pairs_each_step_with_its_time_and_tokens():
    from npuspec.bench.common import k_over_time
    from npuspec.engine.metrics import EngineMetrics
    m = EngineMetrics()
    m.k_trace.extend([(2, 4), (2, 0), (1, 2)])
    m.step_trace.extend([(10.0, 5), (10.5, 2), (11.25, 3)])
    assert k_over_time(m) == [[0.0, 2, 4, 5], [0.5, 2, 0, 2], [1.25, 1, 2, 3]]
    assert k_over_time(EngineMetrics()) == []


def test_k_over_time_plots(tmp_path):
    pytest.importorskip("matplotlib")
    from npuspec.bench.plots import plot_e2e
    rows = [{"system": "npuspec", "method": "ngram", "tokens_per_s": 10.0, "identical": True,
             "k_over_time": [[0.1 * i, 1, (0, 2, 4)[i % 3], 1 + i % 3] for i in range(40)]},
            {"system": "hf", "method": "greedy", "tokens_per_s": 5.0, "identical": True}]
    plot_e2e(str(tmp_path / "e2e.png"), rows, {"npuspec ngram": [0.5, 0.3]})
    assert (tmp_path / "e2e.png").stat().st_size > 1000


def test_follow_counts_from_the_step_the_load_arrived():
    # a burst admitted over 4 steps (batch 1 -> 8), K chosen for the batch in hand: settle
    # counts the ramp, follow starts once the batch is at its level
    ramp = [(2, 4), (4, 2), (6, 1), (8, 0)] + [(8, 0)] * 6 + [(7, 0), (3, 1)]
    trace = [(1, 4)] * 5 + ramp
    assert dynk.settle(trace, [0, 5]) == [0, 3]
    assert dynk.follow(trace, [0, 5]) == [0, 0]
    # K that keeps changing after the batch settled is counted
    late = [(2, 4), (8, 4), (8, 2), (8, 0), (8, 0), (8, 0), (8, 0)]
    assert dynk.follow(late, [0]) == [2]
    assert dynk.follow([], [0]) == [0]


def test_decisions_leave_out_steps_without_drafts():
    """K = 0 because the drafter found nothing says nothing about the load: `decisions` leaves
    such steps out, so a lone request whose drafts come and go, each verified in full, has
    followed at once, where K itself never settles."""
    trace = [(1, 4), (1, 0), (1, 0), (1, 2), (1, 0), (1, 4), (1, 1), (1, 0)]
    caps = [4, 0, 0, 2, 0, 4, 1, 0]
    assert dynk.decisions(trace, caps) == ["all", None, None, "all", None, "all", "all", None]
    assert dynk.follow(trace, [0]) == [7]   # K itself: only its last step
    assert dynk.follow(trace, [0], dynk.decisions(trace, caps)) == [0]
    assert dynk.decisions([(1, 1), (1, 0)], [4, -1]) == [1, "skip"]   # cut to 1; skipped
    # skipping the drafter for the first steps after the change is counted
    trace, caps = [(1, 0)] * 4 + [(1, 4)] * 6, [-1] * 4 + [4] * 6
    assert dynk.follow(trace, [0], dynk.decisions(trace, caps)) == [4]
    # counted from the first step with evidence
    trace, caps = [(1, 0)] * 3 + [(1, 0), (1, 4), (1, 4)], [0] * 3 + [-1, 4, 4]
    assert dynk.follow(trace, [0], dynk.decisions(trace, caps)) == [1]
    # a phase with no evidence at all
    assert dynk.follow([(1, 0)] * 3, [0], [None] * 3) == [None]
