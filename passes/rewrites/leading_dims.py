"""An accept test over more than one leading dim, as the same test over rows of K.

EAGLE's batched tree posterior compares every candidate path of every request at once,

    mask = (candidates[:, :, 1:] == logits[:, :, :-1].argmax(-1)).int()    # [B, C, K]
    n = torch.cumprod(mask, dim=-1).sum(dim=-1)                           # [B, C]

and the families are traced on [B, K]. Every op of such a region works along the last dim,
row by row: the compare and casts elementwise, the scans (cumprod, cumsum, cummin, cummax) and
the sum over the last dim one row at a time. So running it on the inputs reshaped to [N, K]
(N = B * C, row-major, the same rows in the same order) and viewing each result back to
[B, C] gives every value as before. The region starts at an `==` / `!=` of two integer tensors
of one static shape of rank >= 3; every node it reaches must be one of those ops along the last
dim (a scalar compare or a negation too), and every node but the sums that end it must be read
only inside it: anything else (the mask returned, a reduction over another dim) leaves it as
written.
"""
from __future__ import annotations

import math
import operator
from typing import Optional

import torch
from torch.fx import Graph, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from npuspec.passes.rewrites.nodes import _static, _val, call_before, size_args

NAME = "leading_dims"
aten, prims = torch.ops.aten, torch.ops.prims
MAX_REGION = 16
_COMPARES = (aten.eq.Tensor, aten.ne.Tensor)
_POINTWISE = (aten.bitwise_not.default, aten.logical_not.default, aten.eq.Scalar, aten.ne.Scalar,
              aten.lt.Scalar, aten.le.Scalar, aten.gt.Scalar, aten.ge.Scalar)
_CASTS = (aten._to_copy.default, prims.convert_element_type.default)
_SCANS = (aten.cumprod.default, aten.cumsum.default, aten.cummin.default, aten.cummax.default)


def _last(dim, rank: int) -> bool:
    return type(dim) is int and -rank <= dim < rank and dim % rank == rank - 1


def _kind(n: Node, rank: int) -> Optional[str]:
    """How n sits in a region over rank-`rank` values: "row" (kept at rank), "end" (a sum over
    the last dim), or None (not such an op)."""
    if n.op != "call_function":
        return None
    t, a, kw = n.target, n.args, n.kwargs
    if t in _POINTWISE and not kw:
        return "row"
    if t is aten._to_copy.default and set(kw) <= {"dtype"} and len(a) == 1:
        return "row"
    if t is prims.convert_element_type.default and len(a) == 2:
        return "row"
    if t in _SCANS and len(a) == 2 and _last(a[1], rank) and set(kw) <= {"dtype"}:
        return "row"
    if t is operator.getitem and a[1] in (0, 1):  # cummin / cummax: values, indices
        return "row"
    if (t is aten.sum.dim_IntList and not kw and len(a) == 2 and isinstance(a[1], (list, tuple))
            and len(a[1]) == 1 and _last(a[1][0], rank)):
        return "end"
    return None


def _region(c: Node, rank: int) -> Optional[tuple[list, list]]:
    """(every node of c's region in graph order, the sums that end it), or None."""
    nodes, ends, todo = [c], [], [c]
    while todo:
        n = todo.pop()
        for u in n.users:
            if u in nodes or u in ends:
                continue
            kind = _kind(u, rank)
            if kind is None or len(nodes) + len(ends) >= MAX_REGION:
                return None
            (ends if kind == "end" else nodes).append(u)
            if kind == "row":
                todo.append(u)
    if not ends:
        return None
    order = {n: i for i, n in enumerate(c.graph.nodes)}
    return sorted(nodes, key=order.__getitem__), sorted(ends, key=order.__getitem__)


def _site(c: Node) -> Optional[tuple]:
    """(a, b, shape) when c compares two integer tensors of one static rank >= 3 shape."""
    if c.op != "call_function" or c.target not in _COMPARES or c.kwargs or len(c.args) != 2:
        return None
    a, b = c.args
    va, vb = _val(a), _val(b)
    if va is None or vb is None or va.is_floating_point() or vb.is_floating_point():
        return None
    if va.dim() < 3 or vb.dim() != va.dim() or not _static(va.shape[-1:]):
        return None
    if not all(statically_known_true(x == y) for x, y in zip(va.shape, vb.shape)):
        return None
    if size_args(c.graph, va.shape) is None:  # a symbolic size the graph holds no input for
        return None
    return a, b, tuple(va.shape)


def _call(graph: Graph, target, args, kwargs, before: Node) -> Node:
    if target is not operator.getitem:
        return call_before(graph, target, args, before, kwargs)
    with graph.inserting_before(before):  # a scan's (values, indices): its meta is a tuple
        n = graph.call_function(target, tuple(args))
    n.meta["val"] = args[0].meta["val"][args[1]]
    return n


def apply(graph: Graph, flavor: str) -> int:
    """Rewrite every such region; -> how many."""
    done = 0
    for c in list(graph.nodes):
        site = _site(c)
        if site is None:
            continue
        a, b, shape = site
        rank = len(shape)
        found = _region(c, rank)
        if found is None:
            continue
        nodes, ends = found
        if any(u not in nodes and u not in ends for n in nodes for u in n.users):
            continue  # a row op read outside the region (the mask returned, say)
        # a batch Dynamo made dynamic: the rows inferred (-1), the leading sizes put back from
        # the graph's own symbol inputs
        rows = [math.prod(shape[:-1]), shape[-1]] if _static(shape) else [-1, shape[-1]]
        new = {a: _call(graph, aten.reshape.default, (a, rows), {}, c)}
        new[b] = new[a] if b is a else _call(graph, aten.reshape.default, (b, rows), {}, c)
        for n in nodes + ends:
            args = [new.get(x, x) if isinstance(x, Node) else x for x in n.args]
            if n.target in _SCANS:
                args[1] = 1
            elif n.target is aten.sum.dim_IntList:
                args[1] = [1]
            new[n] = _call(graph, n.target, args, n.kwargs, n)
        for e in ends:  # back to e's shape (a symbolic size from its input): e's fake value
            with graph.inserting_before(e):
                back = graph.call_function(aten.reshape.default,
                                           (new[e], size_args(graph, shape[:-1])))
            back.meta["val"] = _val(e)
            e.replace_all_uses_with(back)
        for n in reversed(nodes + ends):
            graph.erase_node(n)
        done += 1
    return done
