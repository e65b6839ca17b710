"""KV-cache slots and continuous batching for the offline engine.

Each running request owns one slot of the static KV cache (slot = row of the cache, position =
token index), so a request's tokens never move. Slot `num_slots - 1` is a scratch slot that
padding rows write into. When a request finishes its slot is freed and the next waiting request
takes it at the start of the next step (continuous batching); the scheduler admits in arrival
order.
"""
from __future__ import annotations

import collections
from typing import Optional

import numpy as np

from npuspec.engine.request import Request


class Scheduler:
    """FIFO admission into a fixed pool of cache slots (the last one is scratch)."""

    def __init__(self, max_num_seqs: int):
        self.max_num_seqs = max_num_seqs
        self.scratch_slot = max_num_seqs
        self.free = list(range(max_num_seqs - 1, -1, -1))  # pop() hands out slot 0 first
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []

    @property
    def num_slots(self) -> int:
        return self.max_num_seqs + 1

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def admit(self) -> list[Request]:
        """Move waiting requests into free slots; returns the newly admitted ones."""
        new = []
        while self.waiting and self.free:
            req = self.waiting.popleft()
            req.slot = self.free.pop()
            self.running.append(req)
            new.append(req)
        return new

    def retire(self) -> list[Request]:
        """Remove finished requests from the running set, freeing their slots."""
        done = [r for r in self.running if r.finished]
        if done:
            self.running = [r for r in self.running if not r.finished]
            for r in done:
                self.free.append(r.slot)
                r.slot = -1
        return done


def pad_rows(n: int, sizes: Optional[list[int]], k: int) -> int:
    """Rows to run for `n` real requests: the smallest capture size (in tokens, a multiple of
    K+1) that holds n*(K+1) tokens, in rows; n itself when there is no plan or n is too big
    (that batch runs uncaptured)."""
    if not sizes:
        return n
    need = n * (k + 1)
    for s in sizes:
        if s >= need:
            assert s % (k + 1) == 0, (s, k)
            return s // (k + 1)
    return n


def fill_drafts(drafts: list[list[int]], rows: int, k: int) -> np.ndarray:
    """Ragged proposals -> int64 [rows, K], -1 where there is no draft."""
    out = np.full((rows, k), -1, dtype=np.int64)
    if k:
        for b, d in enumerate(drafts):
            if d:
                out[b, :len(d)] = d[:k]
    return out
