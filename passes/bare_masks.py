"""Accept masks nobody counts: give them a count the families can fuse, for one round.

vLLM v1's `forward_native` (greedy) never sums its accept mask: it keeps
`accept_mask = (target_ids[:, :-1] == drafts).cumprod(dim=1)` and builds the emission from it.
Every family starts from a count (`ok.cumprod(1).sum(1)` after `prefix.prove_prefix_counts`),
so such a step matched nothing. For each bool [B, K] `ok` whose `cumprod(ok, 1)` has no count
among its users, `add_counts` writes one, `n = cumprod(ok, 1).sum(1)`, and makes the mask's
users read `(arange(K) < n[:, None]).long()` instead: for a bool ok the cumprod is 1 exactly
before the first False, so the values (int64) are the same (`prefix.masks_from_counts` makes
the same argument for a count the user did write). The families then run once more; a count
they fused feeds the mask from the fused op. `undo_unmatched` restores every mask whose count
no family took, so a graph where nothing matched comes out as it came in.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.fx import Graph, Node

from npuspec.passes.prefix import MAX_K, _counted_flags, _cumprod_of, _mask_from_count
from npuspec.passes.rewrites.nodes import _fake_meta, _val

aten = torch.ops.aten


def _bare_mask(c: Node) -> Optional[Node]:
    """ok when c = cumprod(ok, 1) of a bool [B, K] ok (1 <= K <= MAX_K, K static) and no user
    of c counts it."""
    if c.op != "call_function" or c.target is not aten.cumprod.default or not c.args:
        return None
    ok = c.args[0]
    if not isinstance(ok, Node) or not _cumprod_of(c, ok):
        return None
    v = _val(ok)
    if (v is None or v.dtype != torch.bool or v.dim() != 2 or not isinstance(v.shape[1], int)
            or not 1 <= v.shape[1] <= MAX_K):
        return None
    return None if any(_counted_flags(u) is ok for u in c.users) else ok


def add_counts(graph: Graph, flavor: str) -> list:
    """Count every bare accept mask; -> [(cumprod, count, mask)] for undo_unmatched."""
    made = []
    for c in list(graph.nodes):
        ok = _bare_mask(c)
        if ok is None or not c.users:
            continue
        users = list(c.users)
        with graph.inserting_after(c):
            s = graph.call_function(aten.sum.dim_IntList, (c, [1]))
        _fake_meta(s)
        mask = _mask_from_count(graph, s, _val(ok).shape[1], flavor)
        for u in users:
            u.replace_input_with(c, mask)
        made.append((c, s, mask))
    return made


def undo_unmatched(graph: Graph, made: list) -> None:
    """Put back every mask whose count no family fused (the count still reads the user's
    cumprod): its users read the cumprod again, and the count and the mask made from it, dead
    then, are dropped (so no later round takes the dead count for an anchor)."""
    restored = False
    for c, s, mask in made:
        # taken: the count (or the mask itself, by a pattern that read it) went into a match
        if any(getattr(x, "_erased", False) for x in (s, mask)) or s.args[0] is not c:
            continue
        mask.replace_all_uses_with(c)
        restored = True
    if restored:
        graph.eliminate_dead_code()
