"""Per-column compares of two tensors, as one compare and its columns.

An accept loop unrolled over draft positions (MLX-LM's `while n < num_draft: if tokens[n] !=
draft_tokens[n]: break`, batched) compares column by column:

    matching = matching & (tokens[:, i] == draft_tokens[:, i])      for i in 0..m-1

so the graph holds m compares of [B] columns and no [B, m] mask for the prefix proof
(passes/prefix.py) to start from. When the same compare (`eq` or `ne`) of the same two tensors
A, C is taken at every column 0..m-1 of the same dim d (m >= 2), this rule writes

    ok = A[:, :m] == C[:, :m]          # one [.., m, ..] compare (the slice only where A is wider)

and makes the i-th compare read `ok.select(d, i)`. Exact: each column of a compare is the
compare of the columns, bit for bit (bools), whatever the values (NaN != NaN in both). The
prefix proof then sees a count computed from ok alone and proves it like any other.
A partial set of columns (a loop that stops early, a gap) is left as written.
"""
from __future__ import annotations

from collections import defaultdict

import torch
from torch.fx import Graph, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from npuspec.passes.rewrites.nodes import _fake_meta, _same_shape, _val

NAME = "columns"
aten = torch.ops.aten
_COMPARES = (aten.eq.Tensor, aten.ne.Tensor)


def _column(n) -> tuple | None:
    """(tensor, dim, index) when n = select(tensor, dim, index) with literal dim and index."""
    if not isinstance(n, Node) or n.target is not aten.select.int or n.kwargs or len(n.args) != 3:
        return None
    x, d, i = n.args
    v = _val(x)
    if not isinstance(x, Node) or v is None or type(d) is not int or type(i) is not int:
        return None
    d = d % v.dim() if v.dim() else d
    return (x, d, i) if 0 <= i else None


def _sites(graph: Graph) -> dict:
    """(op, A, C, dim) -> {column index: compare node} over the graph's column compares."""
    groups: dict = defaultdict(dict)
    for n in graph.nodes:
        if n.op != "call_function" or n.target not in _COMPARES or n.kwargs or len(n.args) != 2:
            continue
        a, c = _column(n.args[0]), _column(n.args[1])
        if a is None or c is None or a[1] != c[1] or a[2] != c[2]:
            continue
        groups[(n.target, a[0], c[0], a[1])].setdefault(a[2], n)
    return groups


def _narrow(graph: Graph, x: Node, d: int, m: int, before: Node) -> Node:
    v = _val(x)
    if statically_known_true(v.shape[d] == m):
        return x
    with graph.inserting_before(before):
        return _fake_meta(graph.call_function(aten.slice.Tensor, (x, d, 0, m)))


def apply(graph: Graph, flavor: str) -> int:
    """Rewrite every complete set of column compares; -> how many sets."""
    done = 0
    for (op, a, c, d), cols in _sites(graph).items():
        m = len(cols)
        if m < 2 or set(cols) != set(range(m)):
            continue
        va, vc = _val(a), _val(c)
        if va.dim() != vc.dim() or not all(
                isinstance(v.shape[d], int) and v.shape[d] >= m for v in (va, vc)):
            continue
        pos = {n: i for i, n in enumerate(graph.nodes)}
        first = min(cols.values(), key=pos.__getitem__)
        sa, sc = _narrow(graph, a, d, m, first), _narrow(graph, c, d, m, first)
        if not _same_shape(_val(sa), _val(sc)):  # a broadcast compare: left as written
            for s in {sa, sc} - {a, c}:
                graph.erase_node(s)
            continue
        with graph.inserting_before(first):
            ok = _fake_meta(graph.call_function(op, (sa, sc)))
        for i, n in cols.items():
            with graph.inserting_before(n):
                col = _fake_meta(graph.call_function(aten.select.int, (ok, d, i)))
            n.replace_all_uses_with(col)
        done += 1
    return done
