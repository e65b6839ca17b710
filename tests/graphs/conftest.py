import pytest
import torch

from npuspec import counters


@pytest.fixture
def delta():
    """delta() -> counter changes since the test started."""
    before = counters.snapshot()
    return lambda: counters.delta(before)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ("NPUSPEC_CAPTURE_SIZES", "NPUSPEC_DEBUG", "NPUSPEC_CACHE_DIR", "NPUSPEC_DEVICE"):
        monkeypatch.delenv(name, raising=False)
    yield


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
