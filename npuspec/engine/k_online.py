"""The engine's side of the online K controller (npuspec/spec_decode/k_controller.py).

Per step: choose the K to draft for, draft, choose the K to verify from the drafts in hand and
cut them to it; after the verify step, feed back each request's drafted and accepted tokens and
the step's times. A time measured across a compile, a capture, a cache load or an eager
fallback is dropped (`counters.disturbed` moved).

Probes (a token drafter verified token by token): every EXPLORE_EVERY-th step that would not
verify K_max keeps its K_max drafts, and K_max steps later compares them with the tokens the
target emitted meanwhile. Under greedy verification a draft is accepted exactly when it is the
target's next token; under rejection sampling of a one-hot draft d it is accepted with
probability p(d), the probability the target emits d. So the leading matches are distributed as
the accepted count of a K_max step, measured without running one: where K = 0 is best (a large
batch, a model whose step grows with its rows) positions are still learnt for the cost of
drafting once. The probe step's own verify result is not observed (the comparison counts it).

Tensor parallelism: every rank runs its own controller on the same observations (rank 0's
drafts and results are every rank's), so they choose the same K as long as they are fed the
same times. `agree_with` makes every rank record rank 0's: its warm-up table once, and its
four times per step (drafting, the verify step, the host's bookkeeping, the prefill's seconds
per token; NaN where dropped).
"""
from __future__ import annotations

import collections
import dataclasses
import math
import time
from typing import Callable, Optional

import numpy as np

from npuspec._counters import counters
from npuspec.spec_decode.k_controller import KController, cut


@dataclasses.dataclass
class Probe:
    """A probe step's drafts, kept until the target has emitted K_max tokens past them."""
    step: int
    reqs: list                # the engine's Requests (their output grows)
    slots: np.ndarray         # [B] the controller's rows: its own array (never written)
    starts: list              # [B] len(output) when drafted
    drafts: np.ndarray        # [B, K_max], -1 = none
    lengths: np.ndarray       # [B] int64


class OnlineK:
    def __init__(self, ks, rows_for, cheap_drafter: bool, prior=None, probes: bool = False):
        """`cheap_drafter`: drafting costs next to nothing whatever K (ngram, suffix), so a
        step that speculates at all drafts at K_max and lets the drafts decide. `prior`:
        K by batch size for the first steps (KController). `probes`: positions past the chosen
        K are measured by probes (module doc) instead of steps at K_max; only for a token
        drafter verified token by token."""
        assert cheap_drafter or not probes, "probes compare one-hot drafts: token drafters only"
        self.ctl = KController(ks, rows_for, availability=not cheap_drafter, prior=prior,
                               probes=probes)
        self.cheap = cheap_drafter
        self._probes: collections.deque = collections.deque()
        self._gone: set = set()   # requests retired while a probe was pending
        self._scratch: dict = {}  # (B, K_max) -> a probe's result and known arrays
        self._probing = False
        self._n = 0
        self._slots = np.zeros(0, dtype=np.int64)
        self._batch: list = []    # the requests `_slots` was looked up for
        self._lengths = np.zeros(0, dtype=np.int64)
        self._k_draft = 0
        self._t_draft = math.nan
        self._snap = 0
        self._share: Optional[Callable[[list], list]] = None
        self._share_obj: Optional[Callable] = None
        self._host = 0.0
        self.host_s = math.nan  # the last step's seconds in this object, drafting excluded

    def agree_with(self, share_floats: Callable[[list], list], share_obj: Callable) -> None:
        """Tensor parallelism: `share_floats(xs)` / `share_obj(x)` return rank 0's on every
        rank."""
        self._share, self._share_obj = share_floats, share_obj

    def seed_times(self, times: dict) -> None:
        """Warm-up's step times {(rows, K): seconds}."""
        if self._share_obj is not None:
            times = self._share_obj(times)
        for (rows, k), t in times.items():
            self.ctl.record_verify(rows, k, t)

    def draft(self, batch: list, draft_fn):
        """-> (drafts [B, K], probs [B, K, V] | None, K) for this step. `draft_fn(batch, k)`
        is the engine's drafting at a given K."""
        t_in = time.perf_counter()
        ctl = self.ctl
        # the same requests as last step (list equality: identical objects, or else equal
        # dataclasses, equal req_ids) still bound in the controller: its slots, without
        # reading 64 req_ids (several µs right after a model step)
        if batch == self._batch and self._slots is ctl._bslots:
            slots = self._slots
        else:
            slots = ctl.slots([r.req_id for r in batch])
            self._batch = list(batch)
        # a cheap drafter drafts at K_max and the drafts in hand decide
        choice = ctl.choose_before_cheap(len(batch)) if self.cheap else ctl.choose_before(slots)
        snap = counters.disturbed
        t0 = time.perf_counter()
        drafts, probs = draft_fn(batch, choice.k_draft)             # [B, Kd], [B, Kd, V]
        t_draft = time.perf_counter() - t0
        self._snap = counters.disturbed
        self._t_draft = t_draft if choice.k_draft > 0 and snap == self._snap else math.nan
        k, lengths = ctl.choose_after_drafts(choice, slots, drafts)  # lengths [B]
        self._probing = choice.probe
        if choice.probe:
            self._probes.append(Probe(self._n, list(batch), slots,
                                      [len(r.output) for r in batch], drafts.copy(),
                                      lengths.copy()))
        if k < choice.k_draft:
            drafts, probs = cut(drafts, probs, k)
        self._slots, self._lengths, self._k_draft = slots, lengths, choice.k_draft
        self._host = time.perf_counter() - t_in - t_draft
        return drafts, probs, k

    def prefill_pending(self, pending: bool) -> None:
        """Whether prompts still wait for the step's token budget after this step's prefill
        (the scheduler's state: the same on every rank)."""
        self.ctl.prefill_pending = pending

    def verified(self, rows: int, k: int, res: np.ndarray, t_run: float, book_s: float,
                 prefill_tok_s: float = math.nan) -> None:
        """After the step and its bookkeeping: res [rows, K+2] (num_emitted last), t_run the
        step's seconds, book_s the host's around it, prefill_tok_s this iteration's prefill
        seconds per token (NaN: none, or disturbed)."""
        t_in = time.perf_counter()
        times = [self._t_draft, t_run, book_s, prefill_tok_s]
        if self._snap != counters.disturbed:
            times[1:3] = [math.nan, math.nan]
        if self._share is not None:
            times = self._share(times)
        # a probe's tokens are counted when it resolves; K = 0 teaches only availability
        self.ctl.after_step(self._slots, self._k_draft, self._lengths, k, res,
                            not self._probing, rows, *times)
        self._n += 1
        while self._probes and self._n - self._probes[0].step >= self.ctl.k_max:
            self._resolve(self._probes.popleft())
        self.host_s = self._host + time.perf_counter() - t_in

    def _resolve(self, pr: Probe) -> None:
        """Observe a probe: each request's leading drafts that the target went on to emit, over
        the positions whose tokens are known (a request that stopped early, or was preempted,
        knows fewer; one retired meanwhile, whose row may be another's now, none). Written for
        a cold cache (once every EXPLORE_EVERY steps, right after a model step, where each
        numpy call costs several µs): the comparison is one C call where the library builds
        (`probe_match`; its Python loop, `_match_py`, cost ~125 µs at 64 requests), into
        scratch arrays kept per shape."""
        B, K = pr.drafts.shape                                       # [B, K_max]
        bufs = self._scratch.get((B, K))
        if bufs is None:  # as a K_max step's result (only column K+1 is read), known [B]
            bufs = self._scratch[(B, K)] = (np.zeros((B, K + 2), dtype=np.int32),
                                           np.zeros(B, dtype=np.int64))
        res, known = bufs
        lib = self.ctl._lib
        if lib is None or lib.probe_match(pr.reqs, pr.starts, pr.drafts, pr.lengths, res,
                                          known) != B:
            self._match_py(pr, res, known)
        slot_of, gone = self.ctl.slot, self._gone
        if gone:  # rows retired since: their slot may be another request's now
            for i, r in enumerate(pr.reqs):
                if slot_of.get(r.req_id) != pr.slots[i]:
                    known[i] = 0
        # the rows update in place in the controller's tables, whichever batch runs now
        self.ctl.observe_result(pr.slots, K, known, K, res)
        if not self._probes:
            gone.clear()

    @staticmethod
    def _match_py(pr: Probe, res: np.ndarray, known: np.ndarray) -> None:
        """`probe_match` in Python: res[b, K+1] <- 1 + the leading drafts the output matched,
        known[b] <- min(drafted, the output's tokens past the start, K)."""
        K = pr.drafts.shape[1]
        for b, (r, start, d, n) in enumerate(zip(pr.reqs, pr.starts, pr.drafts.tolist(),
                                                 pr.lengths.tolist())):
            out = r.output[start:start + K]
            m = 0
            for a, t in zip(out, d):  # a -1 draft matches no token
                if a != t:
                    break
                m += 1
            res[b, K + 1] = m + 1
            known[b] = min(n, len(out))

    def forget(self, req_id: str) -> None:
        self.ctl.forget(req_id)
        if self._probes:  # its row in a pending probe is checked when that probe resolves
            self._gone.add(req_id)
