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
