"""The embedded tiny target and a small stdlib corpus, shared by this folder's modules."""
import pytest
import torch

from npuspec import train as td
from npuspec.models import load_model, load_tokenizer


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return load_model("tiny")


@pytest.fixture(scope="module")
def corpus():
    return td.stdlib_corpus(load_tokenizer("tiny"), max_files=12)
