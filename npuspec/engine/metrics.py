"""Per-request and per-call metrics, and the accounting of each prefill and verify step."""
from __future__ import annotations

import collections
import dataclasses
import time
from typing import TYPE_CHECKING, Optional

import numpy as np

if TYPE_CHECKING:
    from npuspec.engine.request import Request

K_TRACE_MAX = 1 << 16


@dataclasses.dataclass
class RequestMetrics:
    """Counts and times for one request (times in seconds; a step's time is charged to every
    request that ran in it)."""
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_steps: int = 0              # verify steps this request took part in
    num_drafted: int = 0            # draft tokens verified (after cuts; -1 not counted)
    num_accepted: int = 0
    drafted_by_position: list[int] = dataclasses.field(default_factory=list)
    accepted_by_position: list[int] = dataclasses.field(default_factory=list)
    prefill_s: float = 0.0
    draft_s: float = 0.0
    step_s: float = 0.0
    bookkeeping_s: float = 0.0
    total_s: float = 0.0            # from its arrival (generate()'s start) to its last token
    first_token_s: Optional[float] = None   # from its arrival to its first output token

    def _grow(self, k: int) -> None:
        while len(self.accepted_by_position) < k:
            self.accepted_by_position.append(0)
            self.drafted_by_position.append(0)

    @property
    def mean_acceptance_length(self) -> Optional[float]:
        """Tokens emitted per verify step: 1 + accepted drafts per step."""
        return (self.num_steps + self.num_accepted) / self.num_steps if self.num_steps else None

    @property
    def acceptance_rate(self) -> Optional[float]:
        return self.num_accepted / self.num_drafted if self.num_drafted else None

    @property
    def acceptance_by_position(self) -> list[Optional[float]]:
        """P(draft i accepted | a draft was verified at i)."""
        return [a / d if d else None
                for a, d in zip(self.accepted_by_position, self.drafted_by_position)]

    @property
    def tokens_per_s(self) -> Optional[float]:
        return self.num_output_tokens / self.total_s if self.total_s > 0 else None


@dataclasses.dataclass
class EngineMetrics(RequestMetrics):
    """Totals over one generate() call; times are wall-clock (not summed over requests).
    `num_steps` counts request-steps (a step of B requests counts B), so
    `mean_acceptance_length` is per request; `num_engine_steps` counts batched steps."""
    num_requests: int = 0
    num_engine_steps: int = 0
    steps_by_k: dict = dataclasses.field(default_factory=dict)  # K -> verify steps run with it
    num_prefill_steps: int = 0      # chunked-prefill forwards
    num_preemptions: int = 0        # requests preempted (recomputed) for lack of KV blocks
    padded_rows: int = 0            # rows added to reach captured sizes
    # (batch size, K) of the latest verify steps, oldest first (the online K controller's
    # choices; bounded, since a server's running totals live as long as it does)
    k_trace: collections.deque = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=K_TRACE_MAX))
    # beside it, step for step: (time.perf_counter() at the step's end, tokens it emitted), for
    # K and throughput over time (`npuspec bench e2e --plot`)
    step_trace: collections.deque = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=K_TRACE_MAX))


def record_prefill(m: EngineMetrics, new: list[Request], dt: float) -> None:
    m.prefill_s += dt
    for r in new:
        r.stats.prefill_s += dt


def record_step(m: EngineMetrics, reqs: list[Request], k: int, res: np.ndarray,
                drafts: np.ndarray, rows: int, draft_s: float, step_s: float,
                book_s: float) -> None:
    """Charge one verify step to its requests and to the call's totals.

    `res` is the step's [rows, K+2] result (num_emitted in the last column), `drafts` the
    [B, K] drafts it verified (-1 = none), `rows` the rows it ran after padding."""
    B = len(reqs)
    if k:  # per request: drafts verified and accepted (a prefix), as Python ints
        nd = (drafts >= 0).sum(1)                                        # [B]
        acc = np.minimum(res[:B, k + 1] - 1, nd)                         # [B]
        nds, accs = nd.tolist(), acc.tolist()
    for b, r in enumerate(reqs):
        st = r.stats
        st.num_steps += 1
        if k:
            st._grow(k)
            n, a = nds[b], accs[b]
            st.num_drafted += n
            st.num_accepted += a
            dp, ap = st.drafted_by_position, st.accepted_by_position
            for i in range(n):
                dp[i] += 1
            for i in range(a):
                ap[i] += 1
        st.draft_s += draft_s
        st.step_s += step_s
        st.bookkeeping_s += book_s
    m.draft_s += draft_s
    m.step_s += step_s
    m.bookkeeping_s += book_s
    m.num_engine_steps += 1
    m.num_steps += B  # request-steps: mean_acceptance_length is per request
    m.padded_rows += rows - B
    m.steps_by_k[k] = m.steps_by_k.get(k, 0) + 1
    m.k_trace.append((B, k))
    m.step_trace.append((time.perf_counter(), int(res[:B, k + 1].sum())))
    if k:
        m._grow(k)
        m.num_drafted += sum(nds)
        m.num_accepted += sum(accs)
        # requests with >= i+1 drafted / accepted, from the counts per length
        dh = np.bincount(nd, minlength=k + 1)[::-1].cumsum()[::-1].tolist()   # [K+1]
        ah = np.bincount(acc, minlength=k + 1)[::-1].cumsum()[::-1].tolist()
        for i in range(k):
            m.drafted_by_position[i] += dh[i + 1]
            m.accepted_by_position[i] += ah[i + 1]
