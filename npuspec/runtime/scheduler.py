"""Requests, KV-cache slots and continuous batching for the offline engine.

Each running request owns one slot of the static KV cache (slot = row of the cache, position =
token index), so a request's tokens never move. Slot `num_slots - 1` is a scratch slot that
padding rows write into. When a request finishes its slot is freed and the next waiting request
takes it at the start of the next step (continuous batching); the scheduler admits in arrival
order.

The per-request bookkeeping after a verify step (`Request.append`) applies the stop rules:
stop/eos tokens (kept in the output, like vLLM), `max_tokens` and `max_model_len`.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Any, Optional

import numpy as np
import torch


@dataclasses.dataclass
class Request:
    index: int                      # position in the generate() call's prompt list
    req_id: str
    prompt: Optional[str]
    prompt_ids: list[int]
    params: Any                     # npuspec.engine.SamplingParams
    stop_ids: frozenset             # eos (unless ignore_eos) | stop_token_ids
    max_len: int                    # max_model_len: prompt + output never exceed it
    generator: Optional[torch.Generator] = None
    slot: int = -1
    tokens: list[int] = dataclasses.field(default_factory=list)   # prompt + output
    output: list[int] = dataclasses.field(default_factory=list)
    finish_reason: Optional[str] = None
    stats: Any = None               # npuspec.engine.RequestMetrics

    def __post_init__(self):
        self.tokens = list(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def max_new(self) -> int:
        """Tokens this request may still emit."""
        return min(self.params.max_tokens - len(self.output), self.max_len - len(self.tokens))

    def append(self, toks: list[int]) -> list[int]:
        """Add the tokens a verify step emitted, cut at a stop token or the length limit.
        Returns the tokens actually kept."""
        keep = toks[:self.max_new]
        for i, t in enumerate(keep):
            if t in self.stop_ids:
                keep = keep[:i + 1]
                self.finish_reason = "stop"
                break
        self.output += keep
        self.tokens += keep
        if self.finish_reason is None and self.max_new <= 0:
            self.finish_reason = "length"
        return keep


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
