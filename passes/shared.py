"""Private copies for a verify count whose intermediates the user's code also reads.

Inductor's pattern matcher refuses a match when an intermediate of the pattern has a user
outside it, because the replacement would drop a value someone else needs. Verify code often
reuses the accept mask or p(x) downstream: lmdeploy's greedy sampler builds its emission masks
from the same `drafts == target` that its count reads, and Medusa returns `cand_p` (the
candidates' probabilities) for a tie-break after the count. The count alone is a family's
match, but its mask or pick is shared.

`privatize` gives each such count a private copy of what it is computed from:

- An anchor is a count the families start from: a `sum` within a few ops of a running scan
  (`cumprod`, `cumsum`, `cummin`, `cummax`; after `prefix.prove_prefix_counts` every proven
  count is `ok.cumprod(1).sum(1)`), still in the graph after the manager's first two rounds.
- Its cone C: the nodes it is computed from, up to MAX_DEPTH ops back, through pure
  deterministic nodes only (`_cloneable`). A random op is never copied (a copy would draw
  again), nor an op whose bits may vary between runs, an in-place op, an uninitialised
  factory (`empty`), or, in a graph that holds a mutation, a view. Such a node ends the cone,
  as a graph input does.
- O, the part of C the user's other code reads: the nodes of C (the anchor aside) with a user
  outside C, and everything in C they are computed from.
- Each node of O gets one copy, made from the copies of its arguments in O, placed just after
  the original; the rest of C (the count's side) reads the copies; the originals keep only the
  users outside C. Nothing is copied if the anchor's own scan is in O (the user keeps the
  mask's scan itself, so a fused count would save one `sum` and recompute the rest), or if the
  copies would pass MAX_CLONES in the graph.

A copy computes what its original computes (same op, same arguments, deterministic), so the
graph computes the same values. The families then run once more; a match consumes the copies
it covers, while the originals stay for the user's other outputs (the fused op recomputes that
shared part: a few [B, K] ops in the cases above). `merge_back` then replaces every copy that
is left and still equals its original (same op, same arguments once earlier copies merged) by
that original, in graph order, so where nothing matched the graph is exactly as it was, and
where a match took a mask, its inputs (the target's argmax, p) are the user's nodes again.

Why copies, and why one copy of O per count: letting a match keep its shared intermediates
would need patterns that accept extra users, but `register_replacement` re-traces each match
and checks user counts exactly; and a copy per user (as `canonical.split_views` does for
views) would also split what a pattern itself uses twice (the ids under both gathers). The
copies cut every edge from the count's cone to the rest (graph inputs aside), so a whole-step
pattern that reads a node on both sides (a greedy step's target feeds the emission too) does
not match here; the count's own family does, and it consumes [B, K] work, not the
vocab-sized tensors it reads (those stay inputs, and their copies merge back).
"""
from __future__ import annotations

import operator

import torch
from torch.fx import Graph, Node

aten = torch.ops.aten

MAX_DEPTH = 10    # ops back from a count: the deepest family (a bounded ratio test) has 8
MAX_CLONES = 64   # copies per graph; a cone needing more is left as written
_SCANS = (aten.cumprod.default, aten.cumsum.default, aten.cummin.default, aten.cummax.default)
_SUMS = (aten.sum.dim_IntList, aten.sum.default)
_SCAN_HOPS = 3    # ops between a scan and its count: `< 1`, a cast, `.values`
_UNINIT = ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided")
# a draw (a copy would draw again), or an op whose bits may vary run to run (atomic adds: the
# copy the fused op reads and the original the user reads could then disagree)
_NONDETERMINISTIC = (torch.Tag.nondeterministic_seeded, torch.Tag.nondeterministic_bitwise)


def _mutates(graph: Graph) -> bool:
    return any(isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable
               for n in graph.nodes if n.op == "call_function")


def _cloneable(n: Node, views_ok: bool) -> bool:
    """Pure and deterministic: a copy of `n` placed beside it computes the same value."""
    if n.op != "call_function":
        return False
    t = n.target
    if t is operator.getitem:  # an output of a multi-output op (cummin's values)
        return True
    if not isinstance(t, torch._ops.OpOverload) or t.overloadpacket.__name__ in _UNINIT:
        return False
    if t._schema.is_mutable or any(tag in t.tags for tag in _NONDETERMINISTIC):
        return False
    return views_ok or all(r.alias_info is None for r in t._schema.returns)


def _scans_of(count: Node) -> list[Node]:
    """The scans a count reads within _SCAN_HOPS ops."""
    seen, frontier = {count}, [count]
    for _ in range(_SCAN_HOPS):
        frontier = [m for n in frontier for m in n.all_input_nodes if m not in seen]
        seen.update(frontier)
    return [n for n in seen if n.op == "call_function" and n.target in _SCANS]


def anchors(graph: Graph) -> list[Node]:
    """The counts (a sum of a scan) in `graph`, in graph order."""
    return [n for n in graph.nodes
            if n.op == "call_function" and n.target in _SUMS and _scans_of(n)]


def _cone(anchor: Node, ok) -> dict:
    """Nodes `anchor` is computed from through `ok` nodes, MAX_DEPTH ops back (breadth first,
    so each gets its shortest distance), in insertion order."""
    depth = {anchor: 0}
    queue = [anchor]
    for n in queue:
        if depth[n] == MAX_DEPTH:
            continue
        for m in n.all_input_nodes:
            if m not in depth and ok(m):
                depth[m] = depth[n] + 1
                queue.append(m)
    return depth


def _shared_part(anchor: Node, cone) -> set:
    """O: the nodes of the cone read outside it, and what they are computed from."""
    seeds = [n for n in cone if n is not anchor and any(u not in cone for u in n.users)]
    shared, stack = set(seeds), list(seeds)
    while stack:
        for m in stack.pop().all_input_nodes:
            if m in cone and m not in shared:
                shared.add(m)
                stack.append(m)
    return shared


def _copy_for(graph: Graph, cone, shared: set, order: dict) -> dict:
    """Copy the shared nodes (graph order) and point the count's side at the copies."""
    copies = {}
    for n in sorted(shared, key=order.__getitem__):
        with graph.inserting_after(n):
            copies[n] = graph.node_copy(n, lambda m: copies.get(m, m))
    for n, c in copies.items():
        for user in list(n.users):
            if user in cone and user not in shared:
                user.replace_input_with(n, c)
    return copies


def privatize(graph: Graph) -> dict:
    """Give every count whose cone is read elsewhere a private copy of it (module docstring).
    Returns {copy: original}, in graph order of the originals; empty when nothing was copied
    (the graph is then unchanged)."""
    views_ok = not _mutates(graph)
    ok = lambda n: _cloneable(n, views_ok)  # noqa: E731
    out: dict = {}
    for a in anchors(graph):
        if not ok(a):
            continue
        cone = _cone(a, ok)
        shared = _shared_part(a, cone)
        if not shared or any(s in shared for s in _scans_of(a)):
            continue
        if len(out) + len(shared) > MAX_CLONES:
            break
        order = {n: i for i, n in enumerate(graph.nodes)}
        out.update({c: n for n, c in _copy_for(graph, cone, shared, order).items()})
    return out


def merge_back(graph: Graph, copies: dict) -> int:
    """Replace each remaining copy that still equals its original by the original, in graph
    order (arguments first, so a copy whose argument copies merged compares equal; a copy of a
    copy compares with the node its original merged into). Returns how many copies are left:
    those whose arguments a replacement changed (a fused op's output in place of a copied
    node: the same value) or whose original a match consumed."""
    merged: dict = {}
    left = 0
    for c in [n for n in graph.nodes if n in copies]:
        o = copies[c]
        while o in merged:
            o = merged[o]
        if not o._erased and c.target == o.target and c.args == o.args and c.kwargs == o.kwargs:
            c.replace_all_uses_with(o)
            graph.erase_node(c)
            merged[c] = o
        else:
            left += 1
    return left
