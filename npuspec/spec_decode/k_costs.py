"""The K controller's step costs (npuspec/spec_decode/k_controller.py), as flat arrays.

Per (rows, K) pair: the verify step's seconds (the lower median of its last VERIFY_WINDOW
measurements), the step at which it was last measured, and the host's bookkeeping around it
(a running average); per K: the host's seconds per request; per batch-size bucket: the value
of drafting and, per K, the drafter's seconds per request (its time is partly fixed per step,
so a figure per request learnt at one request would be charged 16 times at 16 requests; the
embedded model's n-gram drafter takes ~30 µs at one request and ~45 µs at 16, and one
running figure per K had it at 165 µs there, ~13 % of the step, which kept drafting off
at 8-15 requests); a bucket not measured yet takes its K's latest figure. A pair's entries
sit at flat index `row * NK + K's index`, its rows numbered in the order first seen, so an
index stays valid as the tables grow. NaN is
"not measured". The same arrays are the state of the numpy reference below and of the C step
(kernels/k_controller_cpu.py), which reads their addresses from `ctx`, so both paths hold one
state and the tests compare them bit for bit.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

ALPHA_TIME = 0.2       # host and drafter times: a few steps settle a changed load
VERIFY_WINDOW = 5      # a verify step's time: the lower median of its last few measurements,
#                        so one stalled step (a collection, another process) moves nothing
REFRESH_EVERY = 128    # steps after which a (rows, K) the drafts allow is verified once again,
#   its old measurements dropped (the choice stops measuring a K it does not pick, so a figure
#   inflated once held forever: the embedded model at one request ran at 0.85x the best fixed
#   K with a K = 4 figure at twice that step's cost)
BUCKETS = 65           # draft values by batch-size bucket (`bucket`: bit length, <= 64)
# ctx: what the C step reads (kernels/k_controller_cpu.py, `struct Ctx`): the number of K, the
# arrays' addresses, then three sizes
CTX_FIELDS = ("nk", "ks", "verify", "book", "book_per_req", "draft_s", "draft_values",
              "measured_at", "window", "wn", "wpos", "scalars",
              "refresh_every", "window_len", "buckets")
MAX_KS = 64            # the C step's stack arrays (more K than this: the reference runs)


def bucket(batch: int) -> int:
    """Batch sizes that share a value of drafting: 1, 2-3, 4-7, 8-15, ... (at most
    BUCKETS - 1, as the C step's)."""
    return min(max(int(batch), 1).bit_length(), BUCKETS - 1)


def _ema(old: float, value: float) -> float:
    return value if old != old else old + ALPHA_TIME * (value - old)


class StepCosts:
    def __init__(self, ks: Sequence[int], rows_for, alpha_request: float):
        """`ks`: the captured K values (0 first); `rows_for(batch, k)`: a step's rows;
        `alpha_request`: the weight of a step in a request's acceptance (KController's,
        passed on to the C step)."""
        self.ks = tuple(ks)
        self.nk = len(self.ks)
        self.ki = {k: i for i, k in enumerate(self.ks)}
        self.rows_for = rows_for
        self.row_ix: dict[int, int] = {}
        self._idx: dict[int, np.ndarray] = {}     # batch -> [NK] flat index at each K
        self._idx_at: dict[int, int] = {}         # ... and its data address (the C step's)
        self.book_per_req = np.full(self.nk, math.nan)
        # [bucket * NK + K's index]; bucket 0 (no batch size's): each K's latest figure
        self.draft_s = np.full(BUCKETS * self.nk, math.nan)
        self.draft_values = np.full(BUCKETS, math.nan)
        # [prefill seconds per token (NaN: none measured), prefill waiting for budget (0/1),
        #  and for the C step: ALPHA_TIME, the request's weight]
        self.scalars = np.array([math.nan, 0.0, ALPHA_TIME, alpha_request])
        self._ks = np.array(self.ks, dtype=np.int64)
        self._cap = 0
        self._grow(8)

    def _grow(self, rows: int) -> None:
        """Room for `rows` row sizes; the entries measured so far are kept."""
        n, old = rows * self.nk, self._cap * self.nk
        for name, fill, shape, dtype in (("verify", math.nan, (n,), np.float64),
                                         ("book", math.nan, (n,), np.float64),
                                         ("measured_at", -1, (n,), np.int64),
                                         ("window", 0.0, (n, VERIFY_WINDOW), np.float64),
                                         ("wn", 0, (n,), np.int64),
                                         ("wpos", 0, (n,), np.int64)):
            new = np.full(shape, fill, dtype=dtype)
            if old:
                new[:old] = getattr(self, name)
            setattr(self, name, new)
        self._cap = rows
        arrays = [self._ks if f == "ks" else getattr(self, f) for f in CTX_FIELDS[1:12]]
        self.ctx = np.array([self.nk] + [a.__array_interface__["data"][0] for a in arrays]
                            + [REFRESH_EVERY, VERIFY_WINDOW, BUCKETS], dtype=np.int64)
        self.ctx_addr = self.ctx.__array_interface__["data"][0]

    def index(self, rows: int, k: int) -> int:
        """The flat index of (rows, K), a new row size given room."""
        r = self.row_ix.get(rows)
        if r is None:
            r = self.row_ix[rows] = len(self.row_ix)
            if r >= self._cap:
                self._grow(2 * self._cap)
        return r * self.nk + self.ki[k]

    def step_time(self, rows: int, k: int) -> float:
        """The verify figure of (rows, K); NaN for a pair not measured (no row added)."""
        r = self.row_ix.get(rows)
        return math.nan if r is None else float(self.verify[r * self.nk + self.ki[k]])

    def of_batch(self, batch: int) -> np.ndarray:
        """[NK] flat index of (rows_for(batch, K), K) for each K."""
        idx = self._idx.get(batch)
        if idx is None:
            idx = self._idx[batch] = np.array([self.index(self.rows_for(batch, k), k)
                                               for k in self.ks], dtype=np.int64)
            self._idx_at[batch] = idx.__array_interface__["data"][0]
        return idx

    def of_batch_at(self, batch: int) -> int:
        """The data address of `of_batch(batch)` (the array lives as long as this object)."""
        at = self._idx_at.get(batch)
        if at is None:
            self.of_batch(batch)
            at = self._idx_at[batch]
        return at

    # -- records -------------------------------------------------------------------------------
    def record_verify(self, rows: int, k: int, seconds: float, step: int) -> None:
        i = self.index(rows, k)
        pos, n = int(self.wpos[i]), int(self.wn[i])
        self.window[i, pos] = seconds
        self.wpos[i] = (pos + 1) % VERIFY_WINDOW
        self.wn[i] = n = min(n + 1, VERIFY_WINDOW)
        self.verify[i] = sorted(self.window[i, :n].tolist())[(n - 1) // 2]
        self.measured_at[i] = step

    def record_book(self, rows: int, k: int, batch: int, seconds: float) -> None:
        i = self.index(rows, k)
        self.book[i] = _ema(float(self.book[i]), seconds)
        ki = self.ki[k]
        self.book_per_req[ki] = _ema(float(self.book_per_req[ki]), seconds / max(batch, 1))

    def record_draft(self, k: int, batch: int, seconds: float) -> None:
        ki = self.ki[k]
        i = bucket(batch) * self.nk + ki
        self.draft_s[i] = self.draft_s[ki] = _ema(float(self.draft_s[i]), seconds / max(batch, 1))

    def record_prefill(self, seconds_per_token: float) -> None:
        self.scalars[0] = _ema(float(self.scalars[0]), seconds_per_token)

    # -- the reference's reads -----------------------------------------------------------------
    def cost(self, batch: int, n: int, draft: bool) -> list[float]:
        """Seconds of a step of `batch` requests at each of the first n K: verify, the host's
        bookkeeping and (before drafting) the drafter; unmeasured host parts count as 0, and
        while prefill waits for budget, the prefill each verify token displaces."""
        idx = self.of_batch(batch)
        displaced = float(self.scalars[0]) if self.scalars[1] else 0.0
        per_k = batch * displaced if displaced == displaced else 0.0
        out = []
        for ki in range(n):
            k, i = self.ks[ki], int(idx[ki])
            book = float(self.book[i])
            if book != book:
                per_req = float(self.book_per_req[ki])
                book = batch * (0.0 if per_req != per_req else per_req)
            drafter = batch * self.draft_per_request(ki, batch) if draft else 0.0
            out.append(float(self.verify[i]) + book + drafter + k * per_k)
        return out

    def draft_per_request(self, ki: int, batch: int) -> float:
        """The drafter's seconds per request at K index ki for `batch` requests: its batch-size
        bucket's figure, else the K's latest figure from any bucket (bucket 0, which no batch
        size has), else 0."""
        v = float(self.draft_s[bucket(batch) * self.nk + ki])
        if v != v:
            v = float(self.draft_s[ki])
        return 0.0 if v != v else v

    def draft_value(self, bkt: int) -> float:
        """The value of drafting at a batch-size bucket (1 before any is measured)."""
        v = float(self.draft_values[bkt])
        return 1.0 if v != v else v

    def value_of_drafting(self, batch: int, gain: list[float], cost: list[float],
                          best: int) -> None:
        """This batch size's draft value <- running average of (best rate after drafting,
        drafter's time included) / (rate of a K = 0 step without drafting)."""
        if cost[0] != cost[0] or cost[best] != cost[best]:
            return
        drafter = batch * self.draft_per_request(self.nk - 1, batch)
        ratio = (gain[best] / (cost[best] + drafter)) / (batch / cost[0])
        bkt = bucket(batch)
        old = self.draft_value(bkt)
        self.draft_values[bkt] = old + ALPHA_TIME * (ratio - old)

    def stale(self, batch: int, n: int, best: int, step: int) -> int:
        """Index of the largest of the first n K whose step at `batch` requests was last
        measured REFRESH_EVERY steps ago or more (verified now, to measure it again, its old
        measurements dropped); else `best`."""
        idx = self.of_batch(batch)
        for ki in range(n - 1, 0, -1):
            i = int(idx[ki])
            at = int(self.measured_at[i])
            if ki != best and at >= 0 and step - at >= REFRESH_EVERY:
                self.wn[i] = self.wpos[i] = 0   # the next measurement is the figure
                self.measured_at[i] = step      # tried once, measured or not
                return ki
        return best

    # -- views ---------------------------------------------------------------------------------
    def verify_table(self) -> dict[tuple[int, int], float]:
        """{(rows, K): seconds} of the pairs measured."""
        return self._table(self.verify)

    def book_table(self) -> dict[tuple[int, int], float]:
        return self._table(self.book)

    def _table(self, a: np.ndarray) -> dict:
        out = {}
        for rows, r in self.row_ix.items():
            for ki, k in enumerate(self.ks):
                v = float(a[r * self.nk + ki])
                if v == v:
                    out[(rows, k)] = v
        return out

    def draft_table(self) -> dict[tuple[int, int], float]:
        """{(batch-size bucket, K): the drafter's seconds per request} of those measured."""
        return {(i // self.nk, self.ks[i % self.nk]): float(v)
                for i, v in enumerate(self.draft_s) if v == v and i >= self.nk}
