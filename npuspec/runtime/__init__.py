"""The eager runtime: drafters (proposers), dynamic K and the generation loop."""
from npuspec.runtime.ngram import NgramProposer
from npuspec.runtime.proposer import Proposer
from npuspec.runtime.suffix import SuffixProposer

__all__ = ["NgramProposer", "SuffixProposer", "Proposer"]
