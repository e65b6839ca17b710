"""Shared settings for the ports of peers' test suites (vLLM, HF transformers)."""
import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    """The embedded model and these tensors are small: a second OpenMP thread only adds
    synchronisation (and contends with the other jobs of a 2-core CI runner)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
