"""Drafting (vLLM's v1/spec_decode is the model): the proposer interface every drafter
implements (base.py), one file per method with its `build(ctx)`, and dynamic K.

Which file builds which method, and each method's traits, is the registry npuspec/methods.py.
The drafters depend on this interface, the models and the compile side, never on the engine.
"""
from npuspec.spec_decode.base import (BuildContext, DraftBatch, Drafts, Proposer, RunnerView)

__all__ = ["BuildContext", "DraftBatch", "Drafts", "Proposer", "RunnerView"]
