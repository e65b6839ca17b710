"""Verify steps that no pattern fused, named once with their line (issue 13).

A step spelled in a way no pattern knows (a block-verification rule written as its paper
does, a count with an off-by-one, a comparison the op has no mode for) is left exactly as
written: it computes what eager does, unfused. So that this is not silent, the manager calls
`note_unmatched(graph)` on a graph in which nothing matched; a graph that looks like a verify
step is logged once per source line, naming the line of its count and where the fused
spellings are listed, and `counters["verify_patterns_unmatched"]` moves.

"Looks like a verify step": a running count (`cumprod`, `cumsum`, `cummin`, `cummax`) within
a few ops of a comparison, in a graph that also holds an argmax (the target's tokens), a
random draw (the uniforms or the race) or a gather (the drafts' probabilities). A model's
forward has none of the last three, so it is never named.
"""
from __future__ import annotations

import logging
import re
from typing import Optional

import torch

from npuspec._counters import counters, first_time

log = logging.getLogger("npuspec.passes")

_COUNTS = ("cumprod", "cumsum", "cummin", "cummax")
_CMPS = ("eq", "ne", "lt", "le", "gt", "ge")
_STEP_OPS = ("argmax", "gather", "rand", "rand_like", "uniform", "exponential", "bernoulli",
             "multinomial")
_HOPS = 4  # ops between the comparison and the count (casts, negations, products)
_LINE = re.compile(r'File "([^"]+)", line (\d+)')



def _op(n: torch.fx.Node) -> str:
    return getattr(n.target, "__name__", "").split(".")[0] if n.op == "call_function" else ""


def _near_comparison(n: torch.fx.Node) -> bool:
    """A comparison among the count's inputs (upstream) or users (downstream), within _HOPS."""
    for step in (lambda m: m.all_input_nodes, lambda m: list(m.users)):
        frontier, seen = [n], {n}
        for _ in range(_HOPS):
            frontier = [m for f in frontier for m in step(f) if m not in seen]
            seen.update(frontier)
            if any(_op(m) in _CMPS for m in frontier):
                return True
    return False


def _site(n: torch.fx.Node) -> Optional[tuple[str, int]]:
    """The user's file and line of node `n` (the innermost frame of its stack trace)."""
    found = _LINE.findall(n.meta.get("stack_trace") or "")
    return (found[-1][0], int(found[-1][1])) if found else None


def verify_like_counts(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The running counts of `graph` that make it look like a verify step (see the module)."""
    ops = {_op(n) for n in graph.nodes}
    if not ops.intersection(_STEP_OPS):
        return []
    return [n for n in graph.nodes if _op(n) in _COUNTS and _near_comparison(n)]


def note_unmatched(graph: torch.fx.Graph) -> Optional[str]:
    """Log (once per source line) and count a verify-like graph nothing matched in.
    Returns the message when one was logged."""
    counts = verify_like_counts(graph)
    if not counts:
        return None
    counters.bump("verify_patterns_unmatched")
    site = next((s for s in map(_site, counts) if s is not None), None)
    if not first_time(("unmatched_verify", *(site or ("<no source line>", 0)))):
        return None
    where = f"the count at {site[0]}:{site[1]}" if site else "a running count"
    msg = (f"npuspec: a graph with the shape of a verify step ({where}, next to a comparison) "
           f"matched no verify pattern, so it runs as written: exact, but not fused into "
           f"npuspec::rejection_sample. The spellings that fuse, and the op's modes for other "
           f"accept rules, are listed in docs/passes.md.")
    log.warning("%s", msg)
    return msg
