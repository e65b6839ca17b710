"""The eager runtime: drafters (proposers), dynamic K and the generation loop."""
from npuspec.runtime.ngram import NgramProposer
from npuspec.runtime.proposer import Proposer
from npuspec.runtime.suffix_native import SuffixProposer
from npuspec.runtime.dynamic_k import ConfidenceBudget

__all__ = ["NgramProposer", "SuffixProposer", "Proposer", "DraftModelProposer", "ConfidenceBudget"]


def __getattr__(name):
    # DraftModelProposer pulls in torch and the models; import it only when asked for
    if name == "DraftModelProposer":
        from npuspec.runtime.draft_model import DraftModelProposer
        return DraftModelProposer
    raise AttributeError(f"module 'npuspec.runtime' has no attribute {name!r}")
