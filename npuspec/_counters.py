"""Process-wide event counters (docs/design.md, "Counters").

Tests assert on deltas, so every silent behaviour change (a recompile, a missed match, a skipped
capture, a cache fault) has to bump one of these.
"""
from __future__ import annotations

import collections
import threading

# The names the contract promises exist (reading one that never fired returns 0 anyway).
KNOWN = (
    "verify_patterns_matched",
    "graphs_captured",
    "graph_replays",
    "eager_fallbacks",
    "cache_hits",
    "cache_misses",
    "cache_rejected",
    "suffix_native_fallback",  # a SuffixProposer that runs the Python reference (no library)
)


# Events after which a wall-clock time is not a graph's time: a compile, a capture, a cache load
# or an eager fallback (the online K controller drops a step time measured across one).
DISTURBANCES = frozenset(("graphs_captured", "eager_fallbacks", "cache_misses", "cache_hits",
                          "graph_breaks", "inductor_fallbacks"))


class Counters(collections.Counter):
    """A thread-safe Counter with `clear()` and `snapshot()` for delta assertions.
    `disturbed` counts DISTURBANCES events (one int to compare around a timed region)."""

    def __init__(self):
        super().__init__()
        self._lock = threading.Lock()
        self.disturbed = 0

    def bump(self, name: str, n: int = 1) -> None:
        with self._lock:
            self[name] += n
            if name in DISTURBANCES:
                self.disturbed += 1

    def snapshot(self) -> dict:
        with self._lock:
            return dict(self)

    def delta(self, before: dict) -> dict:
        """Changes since `before` (a `snapshot()`), zeros left out."""
        now = self.snapshot()
        keys = set(now) | set(before)
        return {k: now.get(k, 0) - before.get(k, 0) for k in keys if now.get(k, 0) != before.get(k, 0)}

    def __reduce__(self):  # a Counter subclass with a lock must not be pickled into caches
        raise TypeError("npuspec.counters is process-local and cannot be pickled")


counters = Counters()


_first: set = set()
_first_lock = threading.Lock()


def first_time(key) -> bool:
    """True the first time `key` comes in this process: for events logged once and counted
    every time (a graph break's line, an unfused verify step's line)."""
    with _first_lock:
        if key in _first:
            return False
        _first.add(key)
        return True
