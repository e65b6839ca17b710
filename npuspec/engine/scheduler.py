"""Continuous batching over a paged KV pool: admission, chunked prefill, preemption.

A request moves waiting -> prefilling -> running -> finished (or back to waiting when it is
preempted). Each engine iteration the scheduler
- admits waiting requests in arrival order while a seat (max_num_seqs) and the blocks for their
  whole context plus one verify step are free;
- picks this iteration's prefill rows: chunks of at most `chunk` tokens of the prefilling
  requests' contexts, within the token budget left after the decode step
  (`max_num_batched_tokens`, vLLM's knob), so a long prompt is written over several
  iterations while running requests keep decoding;
- before a verify step, grows every running request's block table to hold the step's K+1
  writes; when the pool is short it preempts the newest requests (prefilling ones first) like
  vLLM's recompute preemption: their blocks are freed, their tokens kept, and they go back to
  the front of the queue to be prefilled again (prompt and output), so nothing is lost and
  greedy output is unchanged.

Prefill stops one token short of a request's context: the last token is the first input of
its next verify step, so every output token comes out of the verify op.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Optional

import numpy as np

from npuspec.engine.block_manager import BlockManager
from npuspec.engine.request import Request


@dataclasses.dataclass
class PrefillRow:
    req: Request
    start: int   # first context position written by this row
    end: int     # one past the last (end - start <= chunk)


class Scheduler:
    def __init__(self, max_num_seqs: int, blocks: Optional[BlockManager] = None, *,
                 lookahead: int = 0, chunk: int = 32, max_num_batched_tokens: int = 1 << 30):
        self.max_num_seqs = max_num_seqs
        self.blocks = blocks
        self.lookahead = lookahead           # K_max: draft positions a verify step writes
        self.chunk = chunk
        self.budget = max_num_batched_tokens
        self.waiting: collections.deque[Request] = collections.deque()
        self.prefilling: list[Request] = []
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    # -- admission and prefill -------------------------------------------------------------
    def admit(self) -> list[Request]:
        """Waiting -> prefilling, in order, while seats and blocks allow; the admitted ones."""
        new = []
        while self.waiting and len(self.prefilling) + len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            need = len(req.tokens) + self.lookahead  # its context and its first verify step
            if self.blocks is not None and not self.blocks.grow(req.blocks, need):
                break  # FIFO: nobody overtakes the head of the queue
            self.waiting.popleft()
            self.prefilling.append(req)
            new.append(req)
        return new

    def prefill_rows(self, decode_tokens: int, sizes: Optional[list[int]] = None
                     ) -> list[PrefillRow]:
        """This iteration's prefill chunks, within the budget the decode step leaves (at least
        one row, so prefill always progresses), cut to the largest of `sizes` (the captured
        row counts) that they fill, so the rest waits for the next iteration instead of
        running beside padding rows."""
        rows_left = max(1, (self.budget - decode_tokens) // self.chunk)
        rows = []
        for req in self.prefilling:
            pos, end = req.num_cached, len(req.tokens) - 1
            first = (end - pos) % self.chunk or self.chunk  # the partial chunk goes first
            while pos < end and rows_left:
                rows.append(PrefillRow(req, pos, pos + first))
                pos += first
                first = self.chunk
                rows_left -= 1
            if not rows_left:
                break
        fit = [n for n in sizes or () if n <= len(rows)]
        return rows[:fit[-1]] if fit else rows

    def prefilled(self, rows: list[PrefillRow]) -> list[Request]:
        """Record written rows; requests whose context is complete move to running."""
        for r in rows:
            r.req.num_cached = max(r.req.num_cached, r.end)
        done = [q for q in self.prefilling if q.num_to_prefill <= 0]
        if done:
            self.prefilling = [q for q in self.prefilling if q.num_to_prefill > 0]
            self.running += done
        return done

    # -- decode ------------------------------------------------------------------------------
    def reserve(self, k: int) -> list[Request]:
        """Give every running request the blocks for a verify step of K drafts, preempting the
        newest requests while the pool is short; returns the preempted ones."""
        preempted = []
        if self.blocks is None:
            return preempted
        i = 0
        while i < len(self.running):
            req = self.running[i]
            if self.blocks.grow(req.blocks, len(req.tokens) + k):
                i += 1
                continue
            victim = self.prefilling[-1] if self.prefilling else self.running[-1]
            assert victim is not req or len(self.running) > 1 or self.prefilling, (
                "the pool cannot hold one request's verify step", len(req.tokens), k)
            self._preempt(victim)
            preempted.append(victim)
        return preempted

    def _preempt(self, req: Request) -> None:
        (self.prefilling if req in self.prefilling else self.running).remove(req)
        self.blocks.release(req.blocks)
        req.num_cached = 0
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def remove(self, req: Request) -> bool:
        """Take an unfinished request out (an abort), freeing its blocks; False if absent."""
        for q in (self.running, self.prefilling, self.waiting):
            i = next((i for i, x in enumerate(q) if x is req), None)  # identity, not __eq__
            if i is not None:
                del q[i]
                if self.blocks is not None:
                    self.blocks.release(req.blocks)
                return True
        return False

    def retire(self) -> list[Request]:
        """Remove finished requests from the running set, freeing their blocks."""
        done = [r for r in self.running if r.finished]
        if done:
            self.running = [r for r in self.running if not r.finished]
            for r in done:
                if self.blocks is not None:
                    self.blocks.release(r.blocks)
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
