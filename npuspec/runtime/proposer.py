"""The drafter protocol (DESIGN.md §3.4) and the input checks every proposer shares.

A proposer keeps per-request state. The engine calls, per request:
    start_request(id, prompt)      once, before the first step
    propose([ids...], K)           each step; K may differ per request, and 0 gets []
    extend(id, emitted_tokens)     after each verify step (accepted drafts + 1 target token)
    stop_request(id)               once, when the request finishes
"""
from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable


@runtime_checkable
class Proposer(Protocol):
    def start_request(self, req_id: str, prompt: Sequence[int]) -> None: ...

    def extend(self, req_id: str, new_tokens: Sequence[int]) -> None: ...

    def propose(self, req_ids: Sequence[str],
                max_tokens: int | Sequence[int]) -> list[list[int]]: ...

    def stop_request(self, req_id: str) -> None: ...


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
