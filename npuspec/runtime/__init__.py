"""The eager runtime: drafters (proposers), dynamic K and the generation loop."""
from npuspec.runtime.ngram import NgramProposer
from npuspec.runtime.proposer import Proposer
from npuspec.runtime.suffix import SuffixProposer
from npuspec.runtime.draft_model import DraftModelProposer
from npuspec.runtime.dynamic_k import ConfidenceBudget

__all__ = ["NgramProposer", "SuffixProposer", "Proposer", "DraftModelProposer", "ConfidenceBudget"]
