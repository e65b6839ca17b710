import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield


@pytest.fixture
def no_fx_cache():
    """Inductor's FX graph cache would skip the passes (and their counters) on a warm cache."""
    from torch._inductor import config
    with config.patch(fx_graph_cache=False):
        yield
