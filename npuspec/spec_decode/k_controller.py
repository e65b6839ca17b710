"""The online K controller (docs/engine.md, "The online K controller").

Each step it picks the K (0 included) that maximises expected tokens per second for the batch
that verifies, from two things the engine measures as it runs:

- acceptance, per request and position i = 1..K_max (running averages; a new request starts
  from the pool, a slow running average of the running requests' estimates):
      p[i] = P(the drafter drafted at least i tokens | K >= i was asked for)
      c[i] = P(the first i drafts were accepted | at least i were drafted)
  so a request expects 1 + sum_{i<=K} p[i] c[i] tokens from a step of K before drafting, and
  1 + sum_{i<=min(K, L)} c[i] once its L drafts are known;
- cost, per (rows, K) graph: the verify step's seconds (warm-up measures every captured pair
  once; later steps update it: the lower median of the last VERIFY_WINDOW; a pair the drafts
  allow but the choice has not run for REFRESH_EVERY steps is run once, its old figures
  dropped) and the host's bookkeeping around it, plus the drafter's
  seconds per request for each K, plus, while prompts wait for the step's token budget, the
  prefill that K's verify tokens push to later steps (K per request, at the measured seconds
  per prefill token: `record_prefill`).

Two choices per step: before drafting (`choose_before`: which K to draft for; 0 skips the
drafter; a token drafter, ngram or suffix, drafts at K_max unless drafting has stopped paying
for its own time lately, `choose_before_cheap`) and after it (`choose_after`: the largest useful K given the drafts in hand, never
more than was drafted). Cutting a draft to a length chosen from the drafts alone keeps
verification exact, as the confidence budget's cuts do. A step whose K is below K_max is
replaced by one at K_max every EXPLORE_EVERY steps, so positions past the chosen K keep being
measured; those steps are not cut after drafting. A token drafter verified token by token
probes instead (`probes`): that step drafts at K_max and chooses as usual, and the engine
compares its drafts with the tokens the target emits next (npuspec/engine/k_online.py).

The state is a few [slots, K_max] float arrays and a dict of step times; everything is numpy on
the host (tests/spec_decode/test_k_controller.py checks it against synthetic costs and
acceptances whose optimum is known).
"""
from __future__ import annotations

import bisect
import collections
import dataclasses
import itertools
import math
from typing import Sequence

import numpy as np

from npuspec.config_fields import candidate_ks
from npuspec.kernels import k_controller_cpu

__all__ = ["KController", "Choice", "candidate_ks", "lengths_of", "cut"]

ALPHA_REQUEST = 0.25   # a request's own estimate: its text drifts, recent steps weigh most
ALPHA_POOL = 0.1       # the pooled estimate new requests start from ...
POOL_EVERY = 4         # ... moved toward the running requests' mean every few steps
ALPHA_TIME = 0.2       # host and drafter times: a few steps settle a changed load
VERIFY_WINDOW = 5      # a verify step's time: the lower median of its last few measurements,
#                        so one stalled step (a collection, another process) moves nothing
REFRESH_EVERY = 128    # steps after which a (rows, K) the drafts allow is verified once again,
#   its old measurements dropped (the choice stops measuring a K it does not pick, so a figure
#   inflated once held forever: the embedded model at one request ran at 0.85x the best fixed
#   K with a K = 4 figure at twice that step's cost)
PRIOR_P = 1.0          # before anything is measured: drafts are there ...
PRIOR_C = 0.6          # ... and accepted often enough that speculating is tried
EXPLORE_EVERY = 16     # one step in this many at K_max while a smaller K is chosen
PRIOR_STEPS = 32       # steps that follow a prior policy (a tuned batch-size table), if given
# a token drafter is skipped only when drafting costs more than this share of the rate: on a
# model whose step dwarfs the drafter, steps without drafts cost it ~0.05 %, and skipping
# then would only miss the drafts that come later
DRAFT_SKIP_BELOW = 0.98


@dataclasses.dataclass
class Choice:
    """One step's decision: the K to draft for, the K verified, whether it explores (verifies
    K_max to measure every position) or probes (keeps its K_max drafts to compare with the
    tokens the target emits next; OnlineK)."""
    k_draft: int
    k: int = 0
    explore: bool = False
    probe: bool = False


class KController:
    """Per-request acceptance by position and per-(rows, K) step times -> K per step.

    Written for a small host cost (a few µs per numpy call, so few calls; per-K figures are
    Python floats: there are at most a handful of K)."""

    def __init__(self, ks: Sequence[int], rows_for, explore_every: int = EXPLORE_EVERY,
                 availability: bool = True, prior=None, probes: bool = False,
                 native: bool = True):
        """`ks`: the captured K values (ascending, 0 first); `rows_for(batch, k)`: the rows a
        step of `batch` requests runs at K (padded to a captured size); `availability`:
        learn p (only `choose_before` reads it; a token drafter's steps never call it);
        `prior(batch)`: a K of `ks` per batch size (`npuspec tune`'s table), followed for the
        first PRIOR_STEPS steps while the acceptance estimates are still the generic prior.
        `probes`: a token drafter's periodic step measures positions past the chosen K by
        comparing its drafts with the tokens the target emits next (`Choice.probe`) instead of
        verifying K_max; only right where acceptance is the target emitting the draft (greedy,
        or rejection sampling of one-hot drafts; not block or entropy verify). `native`: the
        engine's per-step calls (`choose_after_drafts`, `observe_result`) run their arithmetic
        in C (kernels/k_controller_cpu.py) where it builds; the same state and choices as
        the numpy reference, which runs otherwise."""
        assert list(ks) == sorted(set(ks)) and ks[0] == 0, ks
        self.ks = tuple(int(k) for k in ks)
        self.k_max = self.ks[-1]
        self.rows_for = rows_for
        self.explore_every = explore_every
        km = max(self.k_max, 1)
        self.pos = np.arange(1, km + 1)                     # [K_max] positions 1..K_max
        # row m: 1 at positions 1..m  [K_max+1, K_max]; the update's factors from it
        self._upto = (np.arange(km + 1)[:, None] >= self.pos).astype(np.float64)
        self._decay = 1.0 - ALPHA_REQUEST * self._upto
        self._gain = ALPHA_REQUEST * self._upto
        self.pool_p = np.full(km, PRIOR_P)
        self.pool_c = np.full(km, PRIOR_C)
        self._p = np.zeros((0, km))   # [slots, K_max], every request's row ...
        self._c = np.zeros((0, km))
        # ... and the rows of the batch last seen, kept apart while it stays the same (the
        # common case: a step's state updates then skip a gather and a scatter)
        self._ids: list = []
        self._bslots = np.zeros(0, dtype=np.int64)
        self._bp = self._p[:0]
        self._bc = self._c[:0]
        self.slot: dict[str, int] = {}
        self.free: list[int] = []
        self.verify_s: dict[tuple[int, int], float] = {}   # (rows, K) -> seconds
        self._verify_window: dict[tuple[int, int], collections.deque] = {}
        self._measured_at: dict[tuple[int, int], int] = {}  # (rows, K) -> step
        self.draft_s: dict[int, float] = {}                 # K -> seconds per request
        self.book_s: dict[tuple[int, int], float] = {}      # (rows, K) -> the host's seconds
        self.book_per_req: dict[int, float] = {}            # K -> the same per request, for
        #   a (rows, K) whose host time is not measured yet (part of it is fixed per step, so
        #   a figure per request from other batch sizes is only a stand-in)
        self._rows: dict[int, tuple[int, ...]] = {}         # batch -> rows at each K
        self._w: dict[int, np.ndarray] = {}
        self._observed = 0
        self._steps = 0
        # see choose_before_cheap; kept per batch size (`_bucket`): whether drafting pays
        # depends on the load, and one figure learnt at 32 requests would hold a lone request
        # back from drafting for many steps after the others finished
        self.draft_values: dict[int, float] = {}
        self._last_bucket = 1
        # prefill displaced by speculation (see record_prefill): seconds per prefill token,
        # and whether prefill is waiting for budget this step
        self.prefill_tok_s = math.nan
        self.prefill_pending = False
        self.last_k = self.k_max
        self.last_cap = -1   # the last step's largest useful K from its drafts (-1: not drafted)
        self.availability = availability
        self.since_explore = 0
        self.prior = prior
        self.probes = probes
        self._lib = k_controller_cpu.library() if native else None
        self._lengths = np.zeros(0, dtype=np.int64)   # native scratch: drafted lengths [B]
        self._per_pos = np.zeros(km)                   # ... and per-position sums [K_max]
        self._addrs: dict[int, tuple[np.ndarray, int]] = {}
        self._lengths_b = self._lengths

    # -- requests ------------------------------------------------------------------------------
    def slots(self, req_ids: Sequence[str]) -> np.ndarray:
        """Each request's row of the state; a new one starts from the pooled estimate. The
        same batch as last time gets the same array back, and the methods given that array
        work on the batch's rows in place."""
        if req_ids == self._ids:
            return self._bslots
        self._flush()
        out = np.empty(len(req_ids), dtype=np.int64)
        for i, rid in enumerate(req_ids):
            s = self.slot.get(rid)
            if s is None:
                s = self._new_slot()
                self.slot[rid] = s
                self._p[s], self._c[s] = self.pool_p, self.pool_c
            out[i] = s
        self._ids = list(req_ids)
        self._bslots, self._bp, self._bc = out, self._p[out], self._c[out]
        return out

    def _flush(self) -> None:
        """The bound batch's rows back into the table."""
        if len(self._bslots):
            self._p[self._bslots], self._c[self._bslots] = self._bp, self._bc

    def _rows_of(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(p, c) rows [B, K_max] of these slots: the bound batch's own arrays (updated in
        place), or a gather of others (written back by `_store`)."""
        if slots is self._bslots:
            return self._bp, self._bc
        self._flush()
        return self._p[slots], self._c[slots]

    def _store(self, slots: np.ndarray, p: np.ndarray, c: np.ndarray) -> None:
        if slots is self._bslots:
            self._bp, self._bc = p, c
        else:
            self._p[slots], self._c[slots] = p, c
            self._unbind()

    def _unbind(self) -> None:
        self._ids, self._bslots = [], np.zeros(0, dtype=np.int64)

    @property
    def p(self) -> np.ndarray:
        """[slots, K_max] P(at least i drafted) per request row (read-only use)."""
        self._flush()
        return self._p

    @property
    def c(self) -> np.ndarray:
        """[slots, K_max] P(the first i accepted | at least i drafted) per request row."""
        self._flush()
        return self._c

    def _new_slot(self) -> int:
        if self.free:
            return self.free.pop()
        n = len(self._p)
        grow = max(n, 8)
        self._p = np.concatenate([self._p, np.zeros((grow, self._p.shape[1]))])
        self._c = np.concatenate([self._c, np.zeros((grow, self._c.shape[1]))])
        self.free.extend(range(n + grow - 1, n, -1))
        return n

    def forget(self, req_id: str) -> None:
        s = self.slot.pop(req_id, None)
        if s is not None:
            if req_id in self._ids:  # its row must not be written back over a new owner's
                self._flush()
                self._unbind()
            self.free.append(s)

    # -- costs ---------------------------------------------------------------------------------
    def step_time(self, rows: int, k: int) -> float:
        """Seconds a verify step of `rows` rows at K takes; NaN until that graph has run (with
        graph capture, warm-up runs every pair; without it, the first step of each pair is
        its measurement)."""
        return self.verify_s.get((rows, k), math.nan)

    def record_verify(self, rows: int, k: int, seconds: float) -> None:
        """A verify step's seconds: the estimate is the lower median of the pair's last
        VERIFY_WINDOW measurements."""
        key = (rows, k)
        window = self._verify_window.get(key)
        if window is None:
            window = self._verify_window[key] = collections.deque(maxlen=VERIFY_WINDOW)
        window.append(seconds)
        self.verify_s[key] = sorted(window)[(len(window) - 1) // 2]
        self._measured_at[key] = self._steps

    def record_draft(self, k: int, batch: int, seconds: float) -> None:
        """The drafter's seconds for a batch drafted at K (kept per request)."""
        assert k in self.ks, (k, self.ks)
        self._ema(self.draft_s, k, seconds / max(batch, 1))

    def record_book(self, rows: int, k: int, batch: int, seconds: float) -> None:
        """The host's seconds around a verify step of `rows` rows at K: its inputs, the tokens'
        bookkeeping (on a small model a real part of a step)."""
        assert k in self.ks, (k, self.ks)
        self._ema(self.book_s, (rows, k), seconds)
        self._ema(self.book_per_req, k, seconds / max(batch, 1))

    def record_prefill(self, seconds_per_token: float) -> None:
        """A prefill chunk's seconds per token. The engine's step budget leaves K + 1 tokens
        to each running request, so while prompts wait for budget (`prefill_pending`) each
        verify token of a K > 0 step pushes one prefill token to a later step: `_cost` charges
        K tokens per request at this rate then. Without it a large batch still being
        admitted speculates at a K that is cheap for the step and slows admission."""
        old = self.prefill_tok_s
        self.prefill_tok_s = (seconds_per_token if old != old
                              else old + ALPHA_TIME * (seconds_per_token - old))

    @staticmethod
    def _ema(table: dict, key, value: float) -> None:
        old = table.get(key)
        table[key] = value if old is None else old + ALPHA_TIME * (value - old)

    def _cost(self, B: int, n: int, draft: bool) -> list[float]:
        """Seconds of a step of B requests at each of the first n K: verify, the host's
        bookkeeping and (before drafting) the drafter; unmeasured host parts count as 0."""
        rows = self._rows.get(B)
        if rows is None:
            rows = self._rows[B] = tuple(self.rows_for(B, k) for k in self.ks)
        # the prefill each draft position displaces (nothing until a rate is measured)
        displaced = self.prefill_tok_s if self.prefill_pending else 0.0
        per_k = B * displaced if displaced == displaced else 0.0
        out = []
        for k, r in zip(self.ks[:n], rows):
            book = self.book_s.get((r, k))
            if book is None:
                book = B * self.book_per_req.get(k, 0.0)
            drafter = B * self.draft_s.get(k, 0.0) if draft else 0.0
            out.append(self.verify_s.get((r, k), math.nan) + book + drafter + k * per_k)
        return out

    # -- choices -------------------------------------------------------------------------------
    @staticmethod
    def _best(gain: Sequence[float], cost: Sequence[float]) -> int:
        """Index of the K with the most tokens per second. A K whose step has never run is
        tried first (the largest such), so every pair gets measured."""
        unknown = [i for i, c in enumerate(cost) if c != c]
        if unknown:
            return unknown[-1]
        rates = [g / c for g, c in zip(gain, cost)]
        return rates.index(max(rates))

    def _gains(self, B: int, per_position: np.ndarray, n: int) -> list[float]:
        """Expected tokens at each of the first n K: B + the per-position sums up to K."""
        cum = [0.0, *itertools.accumulate(per_position.tolist())]
        return [B + cum[k] for k in self.ks[:n]]

    def choose_before(self, slots: np.ndarray) -> Choice:
        """The K to draft for, from the expected acceptance and the full round's cost."""
        B = len(slots)
        if self._prior_on():
            k = self.prior(B)
            return Choice(k, k)
        # P(at least i accepted) = p[i] c[i], non-increasing in i whatever the noise
        p, c = self._rows_of(slots)
        u = np.minimum.accumulate(p * c, axis=1).sum(0)                        # [K_max]
        n = len(self.ks)
        k = self.ks[self._best(self._gains(B, u, n), self._cost(B, n, draft=True))]
        if k < self.k_max:
            self.since_explore += 1
            if self.since_explore >= self.explore_every:
                self.since_explore = 0
                return Choice(self.k_max, self.k_max, explore=True)
        return Choice(k, k)

    @property
    def draft_value(self) -> float:
        """The value of drafting (`_value_of_drafting`) at the last batch size seen."""
        return self.draft_values.get(self._last_bucket, 1.0)

    def choose_before_cheap(self, batch: int) -> Choice:
        """For a drafter that drafts at K_max whatever K (ngram, suffix): draft, unless
        drafting has stopped paying for itself lately at this batch size (`draft_value` <
        DRAFT_SKIP_BELOW: the steps' best choice after drafting, with the drafter's time, got
        fewer tokens per second than a K = 0 step without it); then K = 0 without drafting,
        except every EXPLORE_EVERY-th step, which drafts and runs K_max (with `probes`:
        drafts, chooses K as any step, and is a probe). A batch size not seen yet starts
        from 1 (draft)."""
        self._last_bucket = _bucket(batch)
        skip = self.draft_value < DRAFT_SKIP_BELOW
        if skip or self.last_k < self.k_max:
            self.since_explore += 1
            if self.since_explore >= self.explore_every:
                self.since_explore = 0
                return Choice(self.k_max, self.k_max, explore=not self.probes,
                              probe=self.probes)
        return Choice(0, 0) if skip else Choice(self.k_max, self.k_max)

    def _value_of_drafting(self, B: int, gain: list[float], cost: list[float], best: int) -> None:
        """This batch size's draft value <- running average of (best rate after drafting,
        drafter's time included) / (rate of a K = 0 step without drafting)."""
        if cost[0] != cost[0] or cost[best] != cost[best]:
            return
        drafter = B * self.draft_s.get(self.k_max, 0.0)
        ratio = (gain[best] / (cost[best] + drafter)) / (B / cost[0])
        key = _bucket(B)
        old = self.draft_values.get(key, 1.0)
        self.draft_values[key] = old + ALPHA_TIME * (ratio - old)

    def choose_after(self, choice: Choice, slots: np.ndarray, lengths: np.ndarray) -> int:
        """The K to verify, <= the K drafted, given each request's drafted length [B]."""
        lengths = np.asarray(lengths, dtype=np.int64)
        return self._after(choice, slots, int(lengths.max(initial=0)),
                           lambda: (self._rows_of(slots)[1] * self._upto[lengths]).sum(0))

    def choose_after_drafts(self, choice: Choice, slots: np.ndarray,
                            drafts: np.ndarray) -> tuple[int, np.ndarray]:
        """`choose_after` from the drafts [B, K_draft] themselves (-1 = none) -> (K, each
        request's drafted length [B], valid until the next step). With the C library, one
        call computes the lengths and the per-position sums."""
        lib, B = self._lib, len(slots)
        if (lib is None or B < NATIVE_MIN_BATCH or choice.k_draft == 0
                or drafts.dtype is not _I64 or (drafts.shape[1] > 1 and drafts.strides[1] != 8)):
            lengths = lengths_of(drafts)
            return self.choose_after(choice, slots, lengths), lengths
        assert drafts.shape[0] == B, (drafts.shape, B)
        if len(self._lengths) < B:
            self._lengths = np.zeros(2 * B, dtype=np.int64)
        c = self._rows_of(slots)[1]                                           # [B, K_max]
        longest = lib.npuspec_kc_after(_addr(drafts), B, drafts.shape[1],
                                       drafts.strides[0] // 8, self._addr(c), c.shape[1],
                                       self._addr(self._lengths), self._addr(self._per_pos))
        self._lengths_b = lengths = self._lengths[:B]
        return self._after(choice, slots, longest, lambda: self._per_pos), lengths

    def _after(self, choice: Choice, slots: np.ndarray, longest: int, per_pos_of) -> int:
        """choose_after's decision; `longest`: the longest draft, `per_pos_of()` -> sum over
        requests of c[i] at the positions each drafted [K_max]."""
        self._steps += 1
        if choice.k_draft == 0:
            self.last_k, self.last_cap = 0, -1
            return 0
        B = len(slots)
        # K past the smallest one that holds the longest draft verifies padding only
        longest = min(choice.k_draft, longest)
        n = bisect.bisect_left(self.ks, longest) + 1
        self.last_cap = self.ks[n - 1]
        if self._prior_on():  # the table's K, no more than the drafts need
            self.last_k = min(self.prior(len(slots)), self.ks[n - 1])
            return self.last_k
        if n == 1:  # no drafts: K = 0, and the drafting that found none is weighed
            if choice.k_draft == self.k_max:
                self._value_of_drafting(B, [float(B)], self._cost(B, 1, draft=False), 0)
            self.last_k = 0
            return 0
        # request b gets 1 + sum of c[i] over i <= min(K, L_b)
        gain, cost = self._gains(B, per_pos_of(), n), self._cost(B, n, draft=False)
        best = self._best(gain, cost)
        if choice.k_draft == self.k_max:
            self._value_of_drafting(B, gain, cost, best)
        if not choice.explore:
            best = self._stale(B, n, best)
        self.last_k = self.ks[n - 1] if choice.explore else self.ks[best]
        return self.last_k

    def _stale(self, B: int, n: int, best: int) -> int:
        """Index of the largest of the first n K whose step at B requests was last measured
        REFRESH_EVERY steps ago or more (verified now, to measure it again); else `best`."""
        rows = self._rows[B]
        for i in range(n - 1, 0, -1):
            key = (rows[i], self.ks[i])
            at = self._measured_at.get(key)
            if i != best and at is not None and self._steps - at >= REFRESH_EVERY:
                self._verify_window[key].clear()  # the next measurement is the figure
                self._measured_at[key] = self._steps  # tried once, measured or not
                return i
        return best

    def _prior_on(self) -> bool:
        return self.prior is not None and self._steps < PRIOR_STEPS

    # -- observations --------------------------------------------------------------------------
    def observe(self, slots: np.ndarray, k_draft: int, drafted: np.ndarray, k: int,
                accepted: np.ndarray) -> None:
        """One step: drafted for K_draft, each request's drafted length [B] (before any cut),
        verified at K <= K_draft, accepted drafts [B] (clamped to min(drafted, K)).
        Availability learns from the drafts before the cut (a step cut to K = 0 for lack of
        drafts still says so); acceptance from the positions verified."""
        if k_draft == 0 or len(slots) == 0 or (k == 0 and not self.availability):
            return  # nothing to learn: no position verified, and availability not kept
        L = np.asarray(drafted, dtype=np.int64)                             # [B]
        p, c = self._rows_of(slots)
        if self.availability:
            p = p + self._weights(k_draft) * (self._upto[L] - p)              # <= K_draft
        # c <- c + a (acc - c) at the verified positions (i <= min(L, K)); an accepted
        # position is verified, so that is c (1 - a [verified]) + a [accepted]: two lookups
        verified = np.minimum(L, k)
        c = (c * self._decay[verified]
             + self._gain[np.minimum(np.asarray(accepted, dtype=np.int64), verified)])
        self._store(slots, p, c)
        self._pool(p, c)

    def observe_result(self, slots: np.ndarray, k_draft: int, drafted: np.ndarray, k: int,
                       res: np.ndarray) -> None:
        """`observe` with the accepted drafts read from the verify step's result res
        [>= B, K+2] (num_emitted - 1 at column K + 1). With the C library and an int32 res
        (the engine's), one call updates the rows in place."""
        B, lib = len(slots), self._lib
        if (lib is None or B < NATIVE_MIN_BATCH or res.dtype is not _I32 or res.strides[1] != 4
                or (drafted is not self._lengths_b and (drafted.dtype is not _I64
                                                         or drafted.strides != (8,)))):
            self.observe(slots, k_draft, drafted, k, res[:B, k + 1] - 1)
            return
        if k_draft == 0 or B == 0 or (k == 0 and not self.availability):
            return
        p, c = self._rows_of(slots)                       # [B, K_max] each, updated in place
        # the lengths choose_after_drafts returned: a view at the start of the scratch, whose
        # address is kept (a view is a new object each step, and a fresh view's address cost
        # ~25 µs in the engine)
        L = self._addr(self._lengths) if drafted is self._lengths_b else _addr(drafted)
        lib.npuspec_kc_observe(self._addr(p) if self.availability else None, self._addr(c), B,
                               c.shape[1], L, k_draft, k, _addr(res),
                               res.strides[0] // 4, k + 1, ALPHA_REQUEST)
        if slots is not self._bslots:
            self._store(slots, p, c)
        self._pool(p, c)

    def _addr(self, a: np.ndarray) -> int:
        """The data address of one of the controller's own arrays, kept while the array lives
        (the bound rows and the scratch change only when the batch does). Measured in the
        engine at batch 64, three `.ctypes.data` reads right after a model step took 34 µs:
        that attribute builds a Python-level object."""
        hit = self._addrs.get(id(a))
        if hit is not None and hit[0] is a:
            return hit[1]
        if len(self._addrs) > 8:
            self._addrs.clear()
        ptr = _addr(a)
        self._addrs[id(a)] = (a, ptr)   # the array is held, so its id is not reused meanwhile
        return ptr

    def _pool(self, p: np.ndarray, c: np.ndarray) -> None:
        """Every POOL_EVERY-th observation the pool follows the live requests' estimates."""
        self._observed += 1
        if self._observed % POOL_EVERY == 0:
            if self.availability:
                self.pool_p += ALPHA_POOL * (p.mean(0) - self.pool_p)
            self.pool_c += ALPHA_POOL * (c.mean(0) - self.pool_c)

    def _weights(self, k: int) -> np.ndarray:
        """ALPHA_REQUEST at positions 1..K, 0 past them."""
        w = self._w.get(k)
        if w is None:
            w = self._w[k] = ALPHA_REQUEST * (self.pos <= k)
        return w



def _bucket(batch: int) -> int:
    """Batch sizes that share a value of drafting: 1, 2-3, 4-7, 8-15, ..."""
    return max(int(batch), 1).bit_length()


# below this many requests the numpy path costs less inside the engine than the C call's
# argument handling (embedded model, ngram, interleaved: 44 against 53 µs a step at one
# request; 106 against 85 µs at four, 117 against 87 at 16, 228-234 against 171-174 at 64)
NATIVE_MIN_BATCH = 4
# the exact dtypes the C step reads (compared by identity: `!=` with a type converts it)
_I32, _I64 = np.dtype(np.int32), np.dtype(np.int64)


def _addr(a: np.ndarray) -> int:
    """An array's data address (the C-level interface dict: `.ctypes` is Python code)."""
    return a.__array_interface__["data"][0]


def lengths_of(drafts: np.ndarray) -> np.ndarray:
    """Drafted tokens per row [B] of drafts [B, K] (-1 = none; drafts form a prefix)."""
    return (np.asarray(drafts) >= 0).sum(1)


def cut(drafts: np.ndarray, probs, k: int):
    """Drafts [B, K'] and probs [B, K', V] | None cut to K <= K' positions (a K = 0 step
    takes no probabilities, as drafting at K = 0 returns none)."""
    return drafts[:, :k], (None if probs is None or k == 0 else probs[:, :k])

