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
  dropped) and the host's bookkeeping around it, plus the drafter's seconds per request for
  each K and batch-size bucket, plus, while prompts wait for the step's token budget, the
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

The state is a few [slots, K_max] float arrays and the step costs' flat arrays (StepCosts,
npuspec/spec_decode/k_costs.py). The engine's two per-step calls (`choose_after_drafts`,
`after_step`) run in C (kernels/k_controller_cpu.py) where it builds, bit for bit the Python
reference here, which runs otherwise (tests/spec_decode/test_k_controller.py checks the choices
against synthetic costs and acceptances whose optimum is known).
"""
from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
from typing import Sequence

import numpy as np

from npuspec.config_fields import candidate_ks
from npuspec.kernels import k_controller_cpu
from npuspec.spec_decode.k_costs import MAX_KS, StepCosts, bucket as _bucket
from npuspec.spec_decode.k_costs import ALPHA_TIME, REFRESH_EVERY, VERIFY_WINDOW  # noqa: F401
#   (the controller's constants, read from here by tests and docs)

__all__ = ["KController", "Choice", "candidate_ks", "lengths_of", "cut"]

ALPHA_REQUEST = 0.25   # a request's own estimate: its text drifts, recent steps weigh most
ALPHA_POOL = 0.1       # the pooled estimate new requests start from ...
POOL_EVERY = 4         # ... moved toward the running requests' mean every few steps
PRIOR_P = 1.0          # before anything is measured: drafts are there ...
PRIOR_C = 0.6          # ... and accepted often enough that speculating is tried
EXPLORE_EVERY = 16     # one step in this many at K_max while a smaller K is chosen
PRIOR_STEPS = 32       # steps that follow a prior policy (a tuned batch-size table), if given
# a token drafter is skipped only when drafting costs more than this share of the rate: on a
# model whose step dwarfs the drafter, steps without drafts cost it ~0.05 %, and skipping
# then would only miss the drafts that come later
DRAFT_SKIP_BELOW = 0.98
assert DRAFT_SKIP_BELOW <= 1.0, DRAFT_SKIP_BELOW  # an unmeasured value (1) drafts


@dataclasses.dataclass(frozen=True)
class Choice:
    """One step's decision: the K to draft for, the K verified, whether it explores (verifies
    K_max to measure every position) or probes (keeps its K_max drafts to compare with the
    tokens the target emits next; OnlineK)."""
    k_draft: int
    k: int = 0
    explore: bool = False
    probe: bool = False


_SKIP = Choice(0, 0)   # a step that does not draft (choices are shared: frozen)


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
        engine's per-step calls (`choose_after_drafts`, `after_step`) run in C
        (kernels/k_controller_cpu.py) where it builds; the same state and choices as the
        Python reference, which runs otherwise."""
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
        self._p = np.zeros((0, km))   # [slots, K_max], every request's row
        self._c = np.zeros((0, km))
        # the batch last seen and its slots array, returned while the batch stays the same
        self._ids: list = []
        self._bslots = np.zeros(0, dtype=np.int64)
        self.slot: dict[str, int] = {}
        self.free: list[int] = []
        self.costs = StepCosts(self.ks, rows_for, ALPHA_REQUEST)
        self._w: dict[int, np.ndarray] = {}
        self._observed = 0
        # the pools are updated in place only, so the C step keeps their addresses
        self._pool_addrs = (_addr(self.pool_p) if availability else None, _addr(self.pool_c))
        self._steps = 0
        # see choose_before_cheap; kept per batch size (`_bucket`): whether drafting pays
        # depends on the load, and one figure learnt at 32 requests would hold a lone request
        # back from drafting for many steps after the others finished
        self._last_bucket = 1
        self._cheap_batch = 0   # the batch size _last_bucket was computed for
        # the draft values where the C step writes them: a memoryview reads a float without
        # numpy's indexing (choose_before_cheap runs each step right after a model step)
        self._dv = memoryview(self.costs.draft_values)
        self.last_k = self.k_max
        # the last step's largest useful K from its drafts (-1: not drafted), where C writes it
        self._cap = np.full(1, -1, dtype=np.int64)
        self.availability = availability
        self.since_explore = 0
        self.prior = prior
        self.probes = probes
        self._lib = k_controller_cpu.library() if native and len(ks) <= MAX_KS else None
        self._lengths = np.zeros(0, dtype=np.int64)   # native scratch: drafted lengths [B]
        self._per_pos = np.zeros(km)                   # ... and per-position sums [K_max]
        # the C step's array addresses, read when each array is made: right after a model
        # step one read (`__array_interface__`) costs a few µs, and a changed batch needed six
        self._table_addrs = self._tables_at()
        self._bslots_addr = _addr(self._bslots)
        self._none = np.zeros(0, dtype=np.int64)   # [B] no drafts (never written)
        self._choose_args = None   # the native choose's arguments (`_bind_choose`)
        self._draft_all = Choice(self.k_max, self.k_max)

    # -- requests ------------------------------------------------------------------------------
    def slots(self, req_ids: Sequence[str]) -> np.ndarray:
        """Each request's row of the state [B]; a new one starts from the pooled estimate.
        The same batch as last time gets the same array back (the C step keeps what it read
        from it). The C step reads and updates the batch's rows where they lie in the tables,
        so a changed batch costs this lookup only (no gather, no write-back: in a serving
        load the batch changes most steps)."""
        if req_ids == self._ids:
            return self._bslots
        get = self.slot.get
        found = [get(rid) for rid in req_ids]
        if None in found:
            for i, rid in enumerate(req_ids):
                if found[i] is None:
                    s = found[i] = self.slot[rid] = self._new_slot()
                    self._p[s], self._c[s] = self.pool_p, self.pool_c
        self._ids = list(req_ids)
        self._bslots = np.array(found, dtype=np.int64)
        self._bslots_addr = _addr(self._bslots)
        return self._bslots

    def _rows_of(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(p, c) rows [B, K_max] of these slots, gathered (the reference's copies; written
        back by `_store`)."""
        return self._p[slots], self._c[slots]

    def _store(self, slots: np.ndarray, p: np.ndarray, c: np.ndarray) -> None:
        self._p[slots], self._c[slots] = p, c

    def _unbind(self) -> None:
        self._ids, self._bslots = [], np.zeros(0, dtype=np.int64)
        self._bslots_addr = _addr(self._bslots)

    def _tables_at(self) -> tuple:
        """The addresses of p (None without availability), c and the native scratch
        (lengths, per-position sums, cap)."""
        return (_addr(self._p) if self.availability else None, _addr(self._c),
                _addr(self._lengths), _addr(self._per_pos), _addr(self._cap))

    def _slots_at(self, slots: np.ndarray) -> tuple[np.ndarray, int]:
        """(slots as the C step reads them, contiguous int64, and their address): the bound
        batch's own array (`slots()` makes it so), any other converted where it is not."""
        if slots is self._bslots:
            return slots, self._bslots_addr
        slots = np.ascontiguousarray(slots, dtype=np.int64)
        return slots, _addr(slots)

    @property
    def p(self) -> np.ndarray:
        """[slots, K_max] P(at least i drafted) per request row (read-only use)."""
        return self._p

    @property
    def c(self) -> np.ndarray:
        """[slots, K_max] P(the first i accepted | at least i drafted) per request row."""
        return self._c

    def _new_slot(self) -> int:
        if self.free:
            return self.free.pop()
        n = len(self._p)
        grow = max(n, 8)
        self._p = np.concatenate([self._p, np.zeros((grow, self._p.shape[1]))])
        self._c = np.concatenate([self._c, np.zeros((grow, self._c.shape[1]))])
        self._table_addrs = self._tables_at()
        self.free.extend(range(n + grow - 1, n, -1))
        return n

    def forget(self, req_id: str) -> None:
        s = self.slot.pop(req_id, None)
        if s is not None:
            if req_id in self._ids:  # the bound slots hold its row, which a new owner may take
                self._unbind()
            self.free.append(s)

    # -- costs (StepCosts) ---------------------------------------------------------------------
    def step_time(self, rows: int, k: int) -> float:
        """Seconds a verify step of `rows` rows at K takes; NaN until that graph has run (with
        graph capture, warm-up runs every pair; without it, the first step of each pair is
        its measurement)."""
        return self.costs.step_time(rows, k)

    def record_verify(self, rows: int, k: int, seconds: float) -> None:
        """A verify step's seconds: the estimate is the lower median of the pair's last
        VERIFY_WINDOW measurements."""
        self.costs.record_verify(rows, k, seconds, self._steps)

    def record_draft(self, k: int, batch: int, seconds: float) -> None:
        """The drafter's seconds for a batch drafted at K (kept per request)."""
        assert k in self.ks, (k, self.ks)
        self.costs.record_draft(k, batch, seconds)

    def record_book(self, rows: int, k: int, batch: int, seconds: float) -> None:
        """The host's seconds around a verify step of `rows` rows at K: its inputs, the tokens'
        bookkeeping (on a small model a real part of a step). Kept per (rows, K) and per
        request at K, the stand-in for a (rows, K) whose host time is not measured yet (part
        of it is fixed per step, so a figure per request from other batch sizes is only
        that)."""
        assert k in self.ks, (k, self.ks)
        self.costs.record_book(rows, k, batch, seconds)

    def record_prefill(self, seconds_per_token: float) -> None:
        """A prefill chunk's seconds per token. The engine's step budget leaves K + 1 tokens
        to each running request, so while prompts wait for budget (`prefill_pending`) each
        verify token of a K > 0 step pushes one prefill token to a later step: the cost
        charges K tokens per request at this rate then. Without it a large batch still being
        admitted speculates at a K that is cheap for the step and slows admission."""
        self.costs.record_prefill(seconds_per_token)

    @property
    def prefill_tok_s(self) -> float:
        return float(self.costs.scalars[0])

    @property
    def prefill_pending(self) -> bool:
        """Whether prompts wait for the step's token budget (the engine sets it each step)."""
        return bool(self.costs.scalars[1])

    @prefill_pending.setter
    def prefill_pending(self, pending: bool) -> None:
        self.costs.scalars[1] = 1.0 if pending else 0.0

    @property
    def verify_s(self) -> dict[tuple[int, int], float]:
        """{(rows, K): seconds} measured so far (a copy)."""
        return self.costs.verify_table()

    @property
    def book_s(self) -> dict[tuple[int, int], float]:
        return self.costs.book_table()

    @property
    def draft_s(self) -> dict[tuple[int, int], float]:
        """{(batch-size bucket, K): the drafter's seconds per request} (a copy)."""
        return self.costs.draft_table()

    @property
    def draft_values(self) -> dict[int, float]:
        """{batch-size bucket: value of drafting} (a copy)."""
        return {b: float(v) for b, v in enumerate(self.costs.draft_values) if v == v}

    @property
    def last_cap(self) -> int:
        return int(self._cap[0])

    @last_cap.setter
    def last_cap(self, k: int) -> None:
        self._cap[0] = k

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
        k = self.ks[self._best(self._gains(B, u, n), self.costs.cost(B, n, draft=True))]
        if k < self.k_max:
            self.since_explore += 1
            if self.since_explore >= self.explore_every:
                self.since_explore = 0
                return Choice(self.k_max, self.k_max, explore=True)
        return Choice(k, k)

    @property
    def draft_value(self) -> float:
        """The value of drafting (`_value_of_drafting`) at the last batch size seen."""
        return self.costs.draft_value(self._last_bucket)

    def choose_before_cheap(self, batch: int) -> Choice:
        """For a drafter that drafts at K_max whatever K (ngram, suffix): draft, unless
        drafting has stopped paying for itself lately at this batch size (`draft_value` <
        DRAFT_SKIP_BELOW: the steps' best choice after drafting, with the drafter's time, got
        fewer tokens per second than a K = 0 step without it); then K = 0 without drafting,
        except every EXPLORE_EVERY-th step, which drafts and runs K_max (with `probes`:
        drafts, chooses K as any step, and is a probe). A batch size not seen yet starts
        from 1 (draft)."""
        if batch != self._cheap_batch:
            self._cheap_batch, self._last_bucket = batch, _bucket(batch)
        # `draft_value`, read in place: NaN (not measured) compares False, as its 1 does
        skip = self._dv[self._last_bucket] < DRAFT_SKIP_BELOW
        if skip or self.last_k < self.k_max:
            self.since_explore += 1
            if self.since_explore >= self.explore_every:
                self.since_explore = 0
                return Choice(self.k_max, self.k_max, explore=not self.probes,
                              probe=self.probes)
        return _SKIP if skip else self._draft_all

    def choose_after(self, choice: Choice, slots: np.ndarray, lengths: np.ndarray) -> int:
        """The K to verify, <= the K drafted, given each request's drafted length [B]."""
        lengths = np.asarray(lengths, dtype=np.int64)
        return self._after(choice, slots, int(lengths.max(initial=0)),
                           lambda: (self._rows_of(slots)[1] * self._upto[lengths]).sum(0))

    def choose_after_drafts(self, choice: Choice, slots: np.ndarray,
                            drafts: np.ndarray) -> tuple[int, np.ndarray]:
        """`choose_after` from the drafts [B, K_draft] themselves (-1 = none) -> (K, each
        request's drafted length [B], valid until the next step). With the C library, one
        call computes the lengths, the per-position sums and the decision."""
        lib, B = self._lib, len(slots)
        if not choice.k_draft:  # nothing drafted: K = 0 (`_after`), without numpy calls
            self._steps += 1
            self.last_k, self.last_cap = 0, -1
            if len(self._none) < B:
                self._none = np.zeros(2 * B, dtype=np.int64)
            return 0, self._none[:B]
        if lib is not None and B >= NATIVE_MIN_BATCH and not self._prior_on():
            if len(self._lengths) < B:
                self._lengths = np.zeros(2 * B, dtype=np.int64)
                self._table_addrs = self._tables_at()
            a = self._choose_args
            if (a is None or a[0] is not slots or a[1] is not self.costs.ctx
                    or a[2] is not self._c or a[3] is not self._lengths):
                a = self._bind_choose(slots, B)
            k = lib.choose(a[4], drafts, B, a[5], a[6], a[7], a[8], a[9], choice.k_draft,
                           choice.explore, self._steps + 1, a[10])
            if k != -2:  # -2: drafts laid out otherwise (not int64 rows), nothing changed
                assert k >= 0, (k, self.ks)
                self._steps += 1
                self.last_k = k
                return k, a[11]
        lengths = lengths_of(drafts)
        return self.choose_after(choice, slots, lengths), lengths

    def _bind_choose(self, slots: np.ndarray, B: int) -> tuple:
        """The native `choose`'s arguments for this batch: (the objects they were read from:
        slots, the cost tables' ctx, the acceptance table c, the lengths scratch; then the
        addresses of ctx, c, the slots, the lengths, the per-position sums, the batch's pair
        indices and the cap; then the lengths' [B] view). Kept while those objects stay the
        same, the common case: reading them again cost ~7 µs a step after a model step."""
        idx_at = self.costs.of_batch_at(B)  # may grow the cost tables: before ctx is read
        slots, slots_at = self._slots_at(slots)
        _, c_at, lengths_at, per_pos_at, cap_at = self._table_addrs
        args = (slots, self.costs.ctx, self._c, self._lengths, self.costs.ctx_addr, c_at,
                slots_at, lengths_at, per_pos_at, idx_at, cap_at, self._lengths[:B])
        self._choose_args = args
        return args

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
                self.costs.value_of_drafting(B, [float(B)], self.costs.cost(B, 1, draft=False), 0)
            self.last_k = 0
            return 0
        # request b gets 1 + sum of c[i] over i <= min(K, L_b)
        gain, cost = self._gains(B, per_pos_of(), n), self.costs.cost(B, n, draft=False)
        best = self._best(gain, cost)
        if choice.k_draft == self.k_max:
            self.costs.value_of_drafting(B, gain, cost, best)
        if not choice.explore:
            best = self.costs.stale(B, n, best, self._steps)
        self.last_k = self.ks[n - 1] if choice.explore else self.ks[best]
        return self.last_k

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
        [>= B, K+2] (num_emitted - 1 at column K + 1)."""
        nan = math.nan
        self.after_step(slots, k_draft, drafted, k, res, True, 0, nan, nan, nan, nan)

    def after_step(self, slots: np.ndarray, k_draft: int, drafted: np.ndarray, k: int,
                   res: np.ndarray, observe: bool, rows: int, t_draft: float, t_run: float,
                   book_s: float, prefill_tok_s: float) -> None:
        """The engine's call after a verify step: `observe_result` if `observe`, then the
        step's times, each NaN where not measured (record_prefill, record_draft at K_draft,
        record_verify and record_book at (rows, K)). With the C library, one call does it all
        where res is int32 and the lengths int64 (the engine's; others take the reference)."""
        B, lib = len(slots), self._lib
        learn = observe and k_draft != 0 and B != 0 and (k != 0 or self.availability)
        if lib is not None and B >= NATIVE_MIN_BATCH:
            assert t_draft != t_draft or k_draft in self.ks, (k_draft, self.ks)
            ix = self.costs.index(rows, k) if t_run == t_run else -1  # may grow the tables
            pool_due = learn and (self._observed + 1) % POOL_EVERY == 0   # `_pool`, in C
            slots, slots_at = self._slots_at(slots)
            p_at, c_at = self._table_addrs[:2]
            # the batch's rows updated in place in the [slots, K_max] tables
            if lib.verified(self.costs.ctx_addr, p_at, c_at, slots_at, B, drafted, k_draft, k,
                            res, learn, ix, t_draft, t_run, book_s, prefill_tok_s,
                            self._steps, *self._pool_addrs,
                            ALPHA_POOL if pool_due else 0.0) == 0:
                if learn:
                    self._observed += 1
                return
            # -2: the lengths or res laid out otherwise (not int64 / int32 rows), nothing done
        if learn:
            self.observe(slots, k_draft, drafted, k, res[:B, k + 1] - 1)
        self._record(rows, k, k_draft, B, t_draft, t_run, book_s, prefill_tok_s)

    def _record(self, rows: int, k: int, k_draft: int, batch: int, t_draft: float,
                t_run: float, book_s: float, prefill_tok_s: float) -> None:
        if prefill_tok_s == prefill_tok_s:
            self.record_prefill(prefill_tok_s)
        if t_draft == t_draft:
            self.record_draft(k_draft, batch, t_draft)
        if t_run == t_run:
            self.record_verify(rows, k, t_run)
            self.record_book(rows, k, batch, book_s)

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



# below this many requests the Python reference runs. 1: with the decision and the records in
# C the C step costs less at every batch size (embedded model, ngram, in the engine: 38
# against 57 µs a step at one request, 81 against 245 at 64); before that, with only the
# arithmetic in C, the reference cost less at one request (44 against 53 µs)
NATIVE_MIN_BATCH = 1


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

