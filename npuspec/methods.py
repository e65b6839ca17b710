"""The registry of speculative methods: one row per method, with what the config checks and the
engine need to know about it, and the function that builds its proposer.

It imports nothing from the project, so the config (which validates method names and keys) and
the engine (which builds proposers) both read it without depending on each other or on the
drafters. Adding a method is one file in npuspec/spec_decode/ with a `build(ctx)` function and
one row here; docs/design.md ("Adding a drafter") has the checklist.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Callable


@dataclasses.dataclass(frozen=True)
class SpecMethod:
    name: str
    builder: str                  # "module:function", called with a spec_decode.BuildContext
    needs_model: bool = False     # speculative_config.model names a draft checkpoint
    hidden_states: bool = False   # a head on the target's features, sharing its embedding,
                                  # final norm and LM head
    host_only: bool = False       # runs whole on rank 0, never sharded with the target
    draft_kv: bool = False        # keeps K/V of its own (counted by the memory check)
    confidence: bool = False      # reports per-position confidences (the confidence budget)
    padded_batch: bool = False    # takes disable_padded_drafter_batch
    adaptive_verify: bool = False  # takes enable_adaptive_verification

    def build_fn(self) -> Callable:
        module, fn = self.builder.split(":")
        return getattr(importlib.import_module(module), fn)


_HEAD = dict(needs_model=True, hidden_states=True, draft_kv=True, confidence=True)

METHODS: dict[str, SpecMethod] = {m.name: m for m in (
    SpecMethod("ngram", "npuspec.spec_decode.ngram:build", host_only=True),
    SpecMethod("suffix", "npuspec.spec_decode.suffix:build", host_only=True),
    SpecMethod("medusa", "npuspec.spec_decode.medusa:build", needs_model=True,
               hidden_states=True),
    SpecMethod("eagle", "npuspec.spec_decode.eagle:build", padded_batch=True, **_HEAD),
    SpecMethod("eagle3", "npuspec.spec_decode.eagle:build", padded_batch=True, **_HEAD),
    # MTP's layers ship inside the target's checkpoint: no model key
    SpecMethod("mtp", "npuspec.spec_decode.eagle:build", padded_batch=True,
               **dict(_HEAD, needs_model=False)),
    SpecMethod("dflash", "npuspec.spec_decode.dflash:build", padded_batch=True,
               adaptive_verify=True, **_HEAD),
    SpecMethod("dspark", "npuspec.spec_decode.dflash:build", adaptive_verify=True, **_HEAD),
    SpecMethod("draft_model", "npuspec.spec_decode.draft_model:build", needs_model=True,
               draft_kv=True, confidence=True, padded_batch=True),
    SpecMethod("extract_hidden_states", "npuspec.spec_decode.extract:build", host_only=True,
               padded_batch=True),
)}


def names(**flags: bool) -> tuple[str, ...]:
    """The methods whose flags all equal `flags`, in registry order, e.g. names(needs_model=True)."""
    return tuple(m.name for m in METHODS.values()
                 if all(getattr(m, k) == v for k, v in flags.items()))
