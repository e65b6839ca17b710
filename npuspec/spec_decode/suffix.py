"""`SuffixProposer`: suffix decoding through the compiled port of the Python reference.

The algorithm, its tie-breaks and its limits are those of `SuffixProposerReference`
(suffix_reference.py over suffix_tree.py); the C++ (kernels/suffix_cpu_source.py) drafts the
same tokens with bitwise-equal probabilities for every call sequence (tests/runtime/test_suffix_native.py). This
class keeps only what Python must: the request-id maps, the FIFO order of the cached responses
(so `cached_requests` and eviction follow the reference's dict order) and the argument checks,
with the reference's messages. `propose` for a whole batch is one native call.

When the library cannot be built (no compiler, a failed compile), the constructor logs it once
(kernels/cpp_build.load_library), bumps `npuspec.counters["suffix_native_fallback"]` and
delegates every call to a `SuffixProposerReference`: the same drafts, only slower. The first
construction in a process compiles the library (1-4 s; Inductor caches it per machine) unless
`npuspec.kernels.prebuild_cpu_kernels` already did in the background.
"""
from __future__ import annotations

import sys
import weakref
from array import array
from typing import Sequence

from npuspec._counters import counters
from npuspec.spec_decode.base import (BuildContext, Proposer, duplicate_request, per_request_k,
                                      unknown_request)
from npuspec.spec_decode.suffix_reference import SuffixProposerReference
from npuspec.spec_decode.suffix_tree import (_COMPACT_MIN, _H, _LONG, _SEARCH, _WORK, _as_list,
                                             _check_ids, check_params)

assert array("I").itemsize == 4, "token buffers are uint32"
_WINDOW = dict(_SEARCH)
_NEUMAIER = sys.version_info >= (3, 12)  # sum() of floats is compensated from 3.12 on
_DELEGATED = ("start_request", "extend", "stop_request", "evict_cached_response", "propose",
              "propose_with_probs", "propose_batch_with_probs")


def _u32(where: str, toks) -> array:
    """A uint32 buffer of the token ids; out-of-range ids raise the reference's ValueError."""
    try:
        return array("I", toks)
    except OverflowError:
        _check_ids(where, list(toks))
        raise


class SuffixProposer(Proposer):
    """Suffix decoding (see SuffixProposerReference for what it computes): the compiled port,
    or the reference itself when the library cannot be built (`.native` says which)."""

    def __init__(self, max_tree_depth: int = 24, max_cached_requests: int = 10000,
                 max_spec_factor: float = 1.0, min_token_prob: float = 0.1,
                 max_spec_offset: float = 0.0):
        args = (max_tree_depth, max_cached_requests, max_spec_factor, min_token_prob,
                max_spec_offset)
        check_params(*args)
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = float(max_spec_factor)
        self.min_token_prob = float(min_token_prob)
        self.max_spec_offset = float(max_spec_offset)
        from npuspec.kernels import suffix_cpu  # heavy: its C++ source, read only when built
        lib = suffix_cpu.library()
        self._ref = None
        if lib is None:  # load_library logged why, once
            counters.bump("suffix_native_fallback")
            self._ref = SuffixProposerReference(*args)
            for name in _DELEGATED:  # instance attributes: no per-call indirection
                setattr(self, name, getattr(self._ref, name))
        else:
            self._bind(lib)

    def _bind(self, lib) -> None:
        self._h = lib.npuspec_suffix_new(
            self.max_tree_depth, self.max_spec_factor, self.max_spec_offset,
            self.min_token_prob, _WORK, _WINDOW[_LONG], _WINDOW[_H - 1], _COMPACT_MIN,
            int(_NEUMAIER))
        weakref.finalize(self, lib.npuspec_suffix_free, self._h)
        self._start = lib.npuspec_suffix_start
        self._add = lib.npuspec_suffix_add_response
        self._remove = lib.npuspec_suffix_remove_response
        self._extend = lib.npuspec_suffix_extend
        self._extend_many = lib.npuspec_suffix_extend_many
        self._stop = lib.npuspec_suffix_stop
        self._propose = lib.npuspec_suffix_propose
        self._slots: dict[str, int] = {}   # active req_id -> native request slot
        self._cached: dict[str, int] = {}  # req_id -> its response's slot; FIFO order
        self._one = array("q", [0])
        self._one_ptr = self._one.buffer_info()[0]
        self._cap = self._ocap = 0
        self._grow(64, 2)

    @property
    def native(self) -> bool:
        """False when the library could not be built and the Python reference runs."""
        return self._ref is None

    def _grow(self, tokens: int, requests: int) -> None:
        """Output buffers for `tokens` draft tokens of `requests` requests (grown, never shrunk;
        the native side writes into them)."""
        if tokens > self._cap:
            self._cap = max(tokens, 2 * self._cap)
            self._toks = array("I", bytes(4 * self._cap))
            self._probs = array("d", bytes(8 * self._cap))
            self._toks_ptr = self._toks.buffer_info()[0]
            self._probs_ptr = self._probs.buffer_info()[0]
        if requests + 1 > self._ocap:
            self._ocap = max(requests + 1, 2 * self._ocap)
            self._offs = array("q", bytes(8 * self._ocap))
            self._offs_ptr = self._offs.buffer_info()[0]

    # -- request lifecycle (the reference's order of global-tree operations) -----------------
    def start_request(self, req_id: str, prompt: Sequence[int]) -> None:
        if req_id in self._slots:
            raise duplicate_request("SuffixProposer.start_request", req_id)
        buf = _u32("SuffixProposer.start_request",
                   prompt if type(prompt) is list else _as_list(prompt))
        r = self._start(self._h, buf.buffer_info()[0], len(buf))
        self._slots[req_id] = r
        if self.max_cached_requests == 0:
            return
        cached = self._cached
        if req_id in cached:  # a reused id replaces its old cached response
            self._remove(self._h, cached.pop(req_id))
        cached[req_id] = self._add(self._h, r)
        while len(cached) > self.max_cached_requests:  # FIFO; never the new one
            self._remove(self._h, cached.pop(next(iter(cached))))

    def extend(self, req_id: str, new_tokens: Sequence[int]) -> None:
        r = self._slots.get(req_id)
        if r is None:
            raise unknown_request("SuffixProposer.extend", req_id)
        buf = _u32("SuffixProposer.extend",
                   new_tokens if type(new_tokens) is list else _as_list(new_tokens))
        self._extend(self._h, r, buf.buffer_info()[0], len(buf))

    def extend_batch(self, req_ids: Sequence[str], tokens: Sequence[Sequence[int]]) -> None:
        """One native call for the step's requests (a call costs more than a few tokens'
        work: ~1.5 us of ctypes and buffers each, at every step of every request)."""
        if self._ref is not None:
            return super().extend_batch(req_ids, tokens)
        rs = self._slots_of(req_ids, "SuffixProposer.extend")
        flat, offs, n = [], array("q", [0]), 0
        for toks in tokens:
            t = toks if type(toks) is list else _as_list(toks)
            flat += t
            n += len(t)
            offs.append(n)
        buf = _u32("SuffixProposer.extend", flat)
        self._extend_many(self._h, rs.buffer_info()[0], len(rs), buf.buffer_info()[0],
                          offs.buffer_info()[0])

    def stop_request(self, req_id: str) -> None:
        r = self._slots.pop(req_id, None)
        if r is None:
            raise unknown_request("SuffixProposer.stop_request", req_id)
        self._stop(self._h, r)  # the response stays cached until FIFO eviction

    def evict_cached_response(self, req_id: str) -> None:
        s = self._cached.pop(req_id, None)
        if s is None:
            raise KeyError(f"SuffixProposer.evict_cached_response: {req_id!r} has no cached "
                           f"response; cached ids are listed by .cached_requests")
        self._remove(self._h, s)

    def forget_responses(self) -> None:
        for r in list(self.cached_requests):
            self.evict_cached_response(r)

    @property
    def active_requests(self) -> list[str]:
        return self._ref.active_requests if self._ref is not None else list(self._slots)

    @property
    def cached_requests(self) -> list[str]:
        return self._ref.cached_requests if self._ref is not None else list(self._cached)

    # -- drafting ----------------------------------------------------------------------------
    def propose(self, req_ids: Sequence[str], max_tokens: int | Sequence[int]) -> list[list[int]]:
        n, total = self._run(req_ids, max_tokens, with_probs=False)
        flat = self._toks[:total].tolist()
        offs = self._offs[:n + 1].tolist()
        return [flat[offs[i]:offs[i + 1]] for i in range(n)]

    def propose_batch_with_probs(self, req_ids: Sequence[str], max_tokens: int | Sequence[int]
                                 ) -> list[tuple[list[int], list[float]]]:
        """`propose_with_probs` for each request, in one native call: [(tokens, probs), ...]."""
        n, total = self._run(req_ids, max_tokens, with_probs=True)
        flat, probs = self._toks[:total].tolist(), self._probs[:total].tolist()
        offs = self._offs[:n + 1].tolist()
        return [(flat[offs[i]:offs[i + 1]], probs[offs[i]:offs[i + 1]]) for i in range(n)]

    def propose_with_probs(self, req_id: str, k: int) -> tuple[list[int], list[float]]:
        """Draft for one request plus each token's estimated probability (non-increasing;
        prob_j / prob_{j-1} is the per-position confidence a dynamic-K budget can use)."""
        r = self._slots.get(req_id)
        if r is None:
            raise unknown_request("SuffixProposer.propose", req_id)
        if k <= 0:
            return [], []
        self._grow(min(k, self.max_tree_depth), 1)
        self._one[0] = r
        total = self._propose(self._h, self._one_ptr, None, k, 1, self._toks_ptr,
                              self._probs_ptr, self._offs_ptr)
        return self._toks[:total].tolist(), self._probs[:total].tolist()

    def _slots_of(self, req_ids, where: str) -> array:
        """The requests' native slots, or the reference's error for the first unknown one."""
        slots = self._slots
        try:
            return array("q", [slots[r] for r in req_ids])
        except KeyError:
            raise unknown_request(where, next(r for r in req_ids if r not in slots)) from None

    def _run(self, req_ids, max_tokens, with_probs: bool) -> tuple[int, int]:
        """One native propose over the batch -> (requests, draft tokens written). The output
        pointers are read after `_grow`, which may replace the buffers."""
        n = len(req_ids)
        if type(max_tokens) is int and max_tokens >= 0:
            ks, k0, cap = None, max_tokens, n * max_tokens
        else:  # per_request_k raises the reference's errors
            ks = array("q", per_request_k(req_ids, max_tokens))
            k0, cap = 0, sum(ks)
        if not n:
            return 0, 0
        rs = self._slots_of(req_ids, "SuffixProposer.propose")
        self._grow(min(cap, n * self.max_tree_depth), n)
        total = self._propose(self._h, rs.buffer_info()[0],
                              None if ks is None else ks.buffer_info()[0], k0, n,
                              self._toks_ptr, self._probs_ptr if with_probs else None,
                              self._offs_ptr)
        return n, total


def build(ctx: BuildContext) -> SuffixProposer:
    s = ctx.spec
    return SuffixProposer(max_tree_depth=s.suffix_decoding_max_tree_depth,
                          max_cached_requests=s.suffix_decoding_max_cached_requests,
                          max_spec_factor=s.suffix_decoding_max_spec_factor,
                          min_token_prob=s.suffix_decoding_min_token_prob)
