"""Fixtures for the graph-cache tests (helpers live in cache_helpers.py)."""
import logging

import pytest

from npuspec import counters
from npuspec.compilation import cache as core


class Delta:
    """Counter changes since the fixture started or since the last reset()."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.before = counters.snapshot()

    def __call__(self):
        return counters.delta(self.before)


@pytest.fixture
def fresh_counters():
    core._logged.clear()  # "logged once" is per process; each test wants to see its message
    return Delta()


@pytest.fixture
def cache_log(caplog):
    caplog.set_level(logging.WARNING, logger="npuspec.cache")
    return caplog
