"""The drafter interface: every hook the engine calls, with no-op defaults, and what passes
between the engine and a drafter (the batch it drafts for, the drafts it returns, a read-only
view of the target's runner).

The engine calls, per request:
    start_request(id, prompt)      once, before the first step
    draft_batch(batch) -> Drafts   each step (token-only drafters: propose())
    extend(id, emitted_tokens)     after each verify step (accepted drafts + 1 target token),
                                   the request's last step included; the engine calls it
                                   through extend_batch, once per step for the whole batch
    stop_request(id)               once, when the request finishes or is aborted
and per engine step or call the optional hooks below. A subclass overrides what it uses;
tests/spec_decode checks that the engine calls nothing but these hooks and that every
drafter's overrides keep their signatures.
"""
from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

CONF_MIN = 1e-6  # the confidence of "no draft": the budget then never keeps it


@dataclasses.dataclass
class Drafts:
    tokens: np.ndarray             # int64 [B, K], -1 = none
    probs: Optional[torch.Tensor]  # float32 [B, K, V] (q_i), None when not asked for
    conf: Optional[np.ndarray]     # float64 [B, K] in [1e-6, 1]; None: no confidences


@dataclasses.dataclass(frozen=True)
class DraftBatch:
    """One step's drafting request: the running requests in batch order and their K."""
    reqs: list                     # engine Requests: req_id, tokens, blocks, params, generator
    k: int                         # drafts per request this step (the step's K)
    caps: list[int]                # per request, at most this many (never past max_tokens)
    temps: Optional[np.ndarray]    # float64 [B] when the step samples; None: all greedy

    @property
    def req_ids(self) -> list[str]:
        return [r.req_id for r in self.reqs]

    @property
    def want_probs(self) -> bool:
        """Sampled steps verify against the draft distribution q, so drafters return it."""
        return self.temps is not None

    @property
    def generators(self) -> list:
        return [r.generator for r in self.reqs]


@dataclasses.dataclass(frozen=True)
class RunnerView:
    """What a drafter may read of the target's model runner (it never writes to it)."""
    device: torch.device
    enforce_eager: bool
    backend_options: dict          # torch.compile(backend="npuspec") options of the target's steps
    max_num_seqs: int
    max_prefill_rows: int          # rows of a prefill step, each `chunk` tokens
    prefill_sizes: list            # the prefill row counts captured
    chunk: int
    max_blocks: int                # block-table width
    model: torch.nn.Module         # the target (this rank's shard)
    model_config: Any
    slots: Callable[[list, np.ndarray], np.ndarray]  # (blocks, positions) -> KV slots
    table: Callable[[list, int], np.ndarray]         # (requests, rows) -> block table [rows, W]

    def options(self, **override) -> dict:
        """The target's backend options with `override` applied, for a drafter's own graphs."""
        return dict(self.backend_options, **override)


@dataclasses.dataclass(frozen=True)
class BuildContext:
    """Everything a method's `build(ctx)` may use to make its proposer."""
    spec: Any                      # the SpeculativeConfig
    dtype: torch.dtype
    device: torch.device
    vocab_size: int
    max_num_seqs: int
    cache_len: int                 # max_model_len + K + 1: positions a draft may write
    target: Optional[torch.nn.Module] = None
    target_path: Optional[str] = None
    num_blocks: int = 0            # the target's paged pool geometry (heads share it)
    block_size: int = 0
    kv_transfer_config: Any = None
    shard: Optional[tuple[int, int]] = None  # (rank, world): sharded with the target


_REQUIRED = ("start_request", "extend", "propose", "stop_request")


class Proposer(metaclass=abc.ABCMeta):
    """Base class of every drafter. The four request hooks are required; the rest default to
    doing nothing. As the protocol `npuspec.runtime.Proposer` was before, isinstance() also
    accepts an object of any class that defines the four request hooks."""

    @classmethod
    def __subclasshook__(cls, other):
        if cls is Proposer and all(callable(getattr(other, n, None)) for n in _REQUIRED):
            return True
        return NotImplemented

    # (aux layer ids, final hidden?) the target's steps must return for this drafter, or None
    features: Optional[tuple[tuple, bool]] = None
    # the drafter's nn.Module when it has one (tensor parallelism binds it to the target)
    module: Optional[torch.nn.Module] = None
    # on_verify(..., defer=True) keeps the step's rows for a later first pass (EAGLE family)
    defers_first_pass: bool = False

    # -- per request (required) ---------------------------------------------------------------
    def start_request(self, req_id: str, prompt: Sequence[int]) -> None:
        raise NotImplementedError(f"{type(self).__name__}.start_request")

    def extend(self, req_id: str, new_tokens: Sequence[int]) -> None:
        raise NotImplementedError(f"{type(self).__name__}.extend")

    def propose(self, req_ids: Sequence[str],
                max_tokens: int | Sequence[int]) -> list[list[int]]:
        raise NotImplementedError(f"{type(self).__name__}.propose")

    def stop_request(self, req_id: str) -> None:
        raise NotImplementedError(f"{type(self).__name__}.stop_request")

    # -- per step -----------------------------------------------------------------------------
    def extend_batch(self, req_ids: Sequence[str], tokens: Sequence[Sequence[int]]) -> None:
        """`extend` for each request of a step, in batch order. Default: one call each; a
        drafter whose call has a fixed cost (a native library) overrides it with one."""
        for rid, toks in zip(req_ids, tokens):
            self.extend(rid, toks)

    def draft_batch(self, batch: DraftBatch) -> Drafts:
        """The step's drafts. Default: propose() up to each cap, -1 padded, no probabilities
        (the verify step then treats the drafts as one-hot) and no confidences."""
        rows, k = self.propose(batch.req_ids, batch.caps), batch.k
        assert max(map(len, rows), default=0) <= k, (k, [len(r) for r in rows])
        # -1 padded in one flat list, converted once: a numpy write per row cost more
        # (16 rows: 9 µs against 3, hot)
        flat = [-1] * (len(rows) * k)
        for b, row in enumerate(rows):
            flat[b * k:b * k + len(row)] = row
        return Drafts(np.array(flat, dtype=np.int64).reshape(len(rows), k), None, None)

    def on_prefill(self, rows: list, pre: dict) -> None:
        """After a prefill step of `rows` (PrefillRow), when `features` is set: `pre` holds
        the step's device inputs and "features" [n, C, F]."""

    def on_verify(self, reqs: list, k: int, drafts: np.ndarray, res: np.ndarray, inp: dict,
                  feats: torch.Tensor) -> None:
        """After a verify step, when `features` is set: its inputs, its result res [rows, K+2]
        (tokens, num_emitted; the first len(reqs) rows are the requests', the rest padding)
        and the target's features [rows, K+1, F]."""

    # -- per engine ---------------------------------------------------------------------------
    def attach(self, runner: RunnerView) -> None:
        """Called once the target's runner exists."""

    def warm_up(self, k_values: Sequence[int], top_rows) -> None:
        """Compile and capture the drafter's graphs before the first request (capture on)."""

    def bind_target(self, target: torch.nn.Module) -> bool:
        """Tensor parallelism, every rank drafting: use the target's shard for the pieces the
        drafter shares with it (embedding, norm, head). True when it did; False: it keeps
        sharing the whole target's."""
        return False

    def agree_with(self, agree: Callable[[Any], Any]) -> None:
        """Tensor parallelism, every rank drafting: `agree(x)` returns rank 0's x on every rank.
        A drafter that decides anything from wall-clock time (the hybrid's "does the head pay")
        must pass that decision through it, or the ranks' collectives part ways."""

    # -- per request's end and per generate() call ---------------------------------------------
    def take_path(self, req_id: str) -> Optional[str]:
        """A file the finished request's output points to (extract_hidden_states), or None."""
        return None

    def finish_call(self, outputs: list) -> None:
        """After a generate() call's requests all finished, with their outputs."""

    def forget_responses(self) -> None:
        """Drop what finished requests taught the drafter (suffix decoding's cached responses).
        Benchmarks call it before each pass, so a pass over prompts the engine has answered
        before measures them as new requests, not as copies of their earlier answers."""


def hooks() -> frozenset[str]:
    """The names the engine may call on a proposer (checked against subclasses' overrides)."""
    return frozenset(n for n in vars(Proposer) if not n.startswith("_"))


def per_request_k(req_ids: Sequence[str], max_tokens: int | Sequence[int]) -> list[int]:
    """Broadcast `max_tokens` to one non-negative int per request, or raise naming the value."""
    if isinstance(max_tokens, int):
        ks = [max_tokens] * len(req_ids)
    else:
        ks = list(max_tokens)
        if len(ks) != len(req_ids):
            raise ValueError(
                f"propose: max_tokens has {len(ks)} entries but req_ids has {len(req_ids)}; "
                "pass one K per request or a single int for all")
    for k in ks:
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise ValueError(f"propose: max_tokens entry {k!r} must be an int >= 0 "
                             "(0 means: draft nothing for this request)")
    return ks


def unknown_request(kind: str, req_id) -> KeyError:
    return KeyError(f"{kind}: unknown request {req_id!r}; call start_request({req_id!r}, prompt) "
                    "first (or it was already stopped)")


def duplicate_request(kind: str, req_id) -> ValueError:
    return ValueError(f"{kind}: request {req_id!r} is already active; call "
                      f"stop_request({req_id!r}) before starting it again, or use a new id")
