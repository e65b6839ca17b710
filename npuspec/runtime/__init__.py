"""The public drafter names under their first home; the code lives in npuspec.spec_decode."""
from npuspec.spec_decode.base import Proposer
from npuspec.spec_decode.dynamic_k import ConfidenceBudget
from npuspec.spec_decode.ngram import NgramProposer
from npuspec.spec_decode.suffix import SuffixProposer

__all__ = ["NgramProposer", "SuffixProposer", "Proposer", "DraftModelProposer", "ConfidenceBudget"]


def __getattr__(name):
    # DraftModelProposer pulls in the models (and their kernels): import it only when asked for
    if name == "DraftModelProposer":
        from npuspec.spec_decode.draft_model import DraftModelProposer
        return DraftModelProposer
    raise AttributeError(f"module 'npuspec.runtime' has no attribute {name!r}")
