"""`NgramProposer`: prompt-lookup (n-gram) drafting through the compiled port of the Python
reference (ngram_reference.py has the rule, its tie-breaks and the index; kernels/ngram_cpu.py
the C++). The port drafts the same tokens for every call sequence
(tests/runtime/test_ngram_native.py); this class keeps the request-id -> slot map and the
reference's argument checks and messages. A step's drafts are one native call, and so is
its upkeep (`extend_batch`).

When the library cannot be built, the constructor bumps
`npuspec.counters["ngram_native_fallback"]` (the loader logs why, once) and every call goes
to an `NgramProposerReference`: the same drafts, more host time.
"""
from __future__ import annotations

import weakref
from typing import Sequence

import numpy as np

from npuspec._counters import counters
from npuspec.kernels import ngram_cpu
from npuspec.spec_decode.base import (BuildContext, DraftBatch, Drafts, Proposer,
                                      duplicate_request, per_request_k, unknown_request)
from npuspec.spec_decode.ngram_reference import NgramProposerReference, _as_list, check_params

_DELEGATED = ("start_request", "extend", "extend_batch", "stop_request", "propose",
              "draft_batch", "context")


class NgramProposer(Proposer):
    """Prompt lookup (see NgramProposerReference for what it computes): the compiled port, or
    the reference itself when the library cannot be built (`.native` says which)."""

    def __init__(self, prompt_lookup_min: int = 5, prompt_lookup_max: int = 5):
        check_params(prompt_lookup_min, prompt_lookup_max)
        self.nmin, self.nmax = prompt_lookup_min, prompt_lookup_max
        lib = ngram_cpu.library()
        self._ref = None
        self._slots: dict[str, int] = {}   # active req_id -> native slot
        if lib is None:
            counters.bump("ngram_native_fallback")
            self._ref = NgramProposerReference(prompt_lookup_min, prompt_lookup_max)
            for name in _DELEGATED:  # instance attributes: no per-call indirection
                setattr(self, name, getattr(self._ref, name))
            return
        self._lib = lib
        self._h = lib.new(prompt_lookup_min, prompt_lookup_max)
        weakref.finalize(self, lib.free, self._h)

    @property
    def native(self) -> bool:
        """False when the library could not be built and the Python reference runs."""
        return self._ref is None

    # -- request lifecycle -------------------------------------------------------------------
    def start_request(self, req_id: str, prompt: Sequence[int]) -> None:
        if req_id in self._slots:
            raise duplicate_request("NgramProposer.start_request", req_id)
        slot = self._lib.start(self._h, prompt)
        if slot is None:  # not a list or tuple: numpy, torch, a generator
            slot = self._lib.start(self._h, _as_list(prompt))
        self._slots[req_id] = slot

    def extend(self, req_id: str, new_tokens: Sequence[int]) -> None:
        self.extend_batch([req_id], [new_tokens])

    def extend_batch(self, req_ids: Sequence[str], tokens: Sequence[Sequence[int]]) -> None:
        """One native call for the step's requests; nothing changes when it raises."""
        req_ids = req_ids if type(req_ids) is list else list(req_ids)
        tokens = tokens if type(tokens) is list else list(tokens)
        b = self._lib.extend(self._h, self._slots, req_ids, tokens)
        if b <= -2:  # a request's tokens are not a list or tuple
            b = self._lib.extend(self._h, self._slots, req_ids, [_as_list(t) for t in tokens])
        if b >= 0:
            raise unknown_request("NgramProposer.extend", req_ids[b])

    def stop_request(self, req_id: str) -> None:
        slot = self._slots.pop(req_id, None)
        if slot is None:
            raise unknown_request("NgramProposer.stop_request", req_id)
        self._lib.stop(self._h, slot)

    # -- drafting ----------------------------------------------------------------------------
    def propose(self, req_ids: Sequence[str], max_tokens: int | Sequence[int]) -> list[list[int]]:
        ks = per_request_k(req_ids, max_tokens)
        out = []
        for rid, k in zip(req_ids, ks):
            slot = self._slots.get(rid)
            if slot is None:
                raise unknown_request("NgramProposer.propose", rid)
            out.append(self._lib.propose(self._h, slot, k))
        return out

    def draft_batch(self, batch: DraftBatch) -> Drafts:
        """The step's drafts [B, K], -1 padded, in one native call (no probabilities: the
        verify step treats them as one-hot; no confidences)."""
        reqs = batch.reqs if type(batch.reqs) is list else list(batch.reqs)
        caps = batch.caps if type(batch.caps) is list else list(batch.caps)
        out = np.empty((len(reqs), batch.k), dtype=np.int64)
        b = self._lib.draft(self._h, self._slots, reqs, caps, batch.k, out)
        if b >= 0:
            raise unknown_request("NgramProposer.propose", reqs[b].req_id)
        return Drafts(out, None, None)

    # -- introspection -----------------------------------------------------------------------
    def context(self, req_id: str) -> list[int]:
        """The request's tokens so far (prompt + extensions); a copy."""
        slot = self._slots.get(req_id)
        if slot is None:
            raise unknown_request("NgramProposer.context", req_id)
        return self._lib.context(self._h, slot)

    @property
    def active_requests(self) -> list[str]:
        return list(self._ref._tokens if self._ref is not None else self._slots)


def build(ctx: BuildContext) -> NgramProposer:
    return NgramProposer(prompt_lookup_min=ctx.spec.prompt_lookup_min,
                         prompt_lookup_max=ctx.spec.prompt_lookup_max)
