"""Canonical literals, so that one traced search pattern matches every spelling of a dim or a slice.

Dynamo keeps what the user wrote: `x.argmax(-1)` and `x.argmax(2)` are the same op on a
[B, K+1, V] tensor but differ as literals, and `t[:, :-1]` and `t[:, :K]` are the same slice.
Inductor's pattern matcher re-checks every literal against the search function traced at the
user's shapes (`register_replacement`'s check), so we rewrite literals into one canonical form
in both graphs first:

- dims become non-negative (`d % rank`; `unsqueeze` uses rank + 1);
- `slice(x, dim, start, end, step)` gets explicit start/end clamped into [0, size];
- `select(x, dim, index)` gets a non-negative index;
- `a <= b` becomes `b >= a` and `a < b` becomes `b > a` (tensor-tensor compares; identical
  results, NaN included), so `u <= ratio` and `ratio >= u` are one pattern;
- `a == b` and `a != b` put a position grid (an arange) first and a target token (an argmax)
  last, through views and casts, so `drafts == target[:, :-1]` and its mirror are one pattern;
- a one-sided `clamp(x, min=c)` / `clamp(x, max=c)` becomes `clamp_min(x, c)` /
  `clamp_max(x, c)` (the kernels ATen runs for them);
- repeated identical views (`slice`, `select`, `unsqueeze`, `squeeze` of the same node with the
  same literals) become one node, so `pk = p[:, :K]` used twice and `p[:, :K]` written twice
  are one pattern. Views are pure, so sharing one changes no value.

`split_views` does the opposite (one copy of a view per user). The manager runs the patterns a
second time on a graph split that way: a view the merge made shared with code outside a
pattern would otherwise count as an intermediate with an outside user and block the match.

The rewrite never changes what a node computes. Nodes whose input rank or size is unknown
(no `meta["val"]`) or symbolic are left alone.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.fx import Graph, Node

aten = torch.ops.aten

# op -> (index of the dim argument, extra rank: 1 when the dim indexes the *output* rank)
_DIM_ARG = {
    aten.argmax.default: (1, 0), aten.argmin.default: (1, 0),
    aten.cumsum.default: (1, 0), aten.cumprod.default: (1, 0),
    aten.cummin.default: (1, 0), aten.cummax.default: (1, 0),
    aten.gather.default: (1, 0), aten.scatter.value: (1, 0), aten.scatter.src: (1, 0),
    aten.squeeze.dim: (1, 0), aten.unsqueeze.default: (1, 1),
    aten._softmax.default: (1, 0), aten._log_softmax.default: (1, 0),
    aten.softmax.int: (1, 0), aten.log_softmax.int: (1, 0),
    aten.any.dim: (1, 0), aten.all.dim: (1, 0), aten.prod.dim_int: (1, 0),
    aten.max.dim: (1, 0), aten.min.dim: (1, 0), aten.index_select.default: (1, 0),
    aten.sort.default: (1, 0), aten.topk.default: (2, 0),
}
_FLIP = {aten.le.Tensor: aten.ge.Tensor, aten.lt.Tensor: aten.gt.Tensor}
# symmetric compares: operands ordered by where they come from (_side), so `drafts == target`
# and `target == drafts` are one pattern
_SYMMETRIC = (aten.eq.Tensor, aten.ne.Tensor)
# views and casts a compare operand is looked through to find what it comes from
_THROUGH = (aten.slice.Tensor, aten.select.int, aten.unsqueeze.default, aten.squeeze.dim,
            aten.squeeze.dims, aten.view.default, aten.reshape.default, aten._to_copy.default,
            torch.ops.prims.convert_element_type.default, aten.expand.default)
_IOTA = (aten.arange.default, aten.arange.start, aten.arange.start_step,
         torch.ops.prims.iota.default)
# op -> index of a list-of-dims argument
_DIMS_ARG = {
    aten.sum.dim_IntList: 1, aten.amax.default: 1, aten.amin.default: 1,
    aten.mean.dim: 1, aten.squeeze.dims: 1, aten.any.dims: 1, aten.all.dims: 1,
}


def _shape(n) -> Optional[tuple]:
    v = n.meta.get("val") if isinstance(n, Node) else None
    if not isinstance(v, torch.Tensor):
        return None
    return tuple(v.shape)


def _static(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _set_arg(node: Node, i: int, value) -> None:
    args = list(node.args)
    args[i] = value
    node.args = tuple(args)


def _canon_dim(node: Node, i: int, extra: int) -> None:
    shape = _shape(node.args[0])
    if shape is None or i >= len(node.args) or not _static(node.args[i]):
        return
    rank = max(len(shape) + extra, 1)
    d = node.args[i]
    if -rank <= d < rank:
        _set_arg(node, i, d % rank)


def _canon_dims(node: Node, i: int) -> None:
    shape = _shape(node.args[0])
    if shape is None or i >= len(node.args) or not isinstance(node.args[i], (list, tuple)):
        return
    dims = node.args[i]
    rank = max(len(shape), 1)
    if not all(_static(d) and -rank <= d < rank for d in dims):
        return
    _set_arg(node, i, [d % rank for d in dims])


def _canon_slice(node: Node) -> None:
    shape = _shape(node.args[0])
    if shape is None:
        return
    args = list(node.args) + [None] * (5 - len(node.args))
    x, dim, start, end, step = args
    dim = 0 if dim is None else dim
    step = 1 if step is None else step
    if not _static(dim) or not -len(shape) <= dim < max(len(shape), 1) or not shape:
        return
    dim %= len(shape)
    size = shape[dim]
    if not _static(size):
        return
    start = 0 if start is None else start
    end = size if end is None else end
    if not (_static(start) and _static(end) and _static(step)):
        return
    start = min(max(start + size if start < 0 else start, 0), size)
    end = min(max(end + size if end < 0 else end, 0), size)
    node.args = (x, dim, start, end) if step == 1 else (x, dim, start, end, step)


def _canon_select(node: Node) -> None:
    shape = _shape(node.args[0])
    if shape is None or not shape or not _static(node.args[1]) or not _static(node.args[2]):
        return
    dim = node.args[1] % len(shape)
    size, idx = shape[dim], node.args[2]
    if _static(size) and -size <= idx < size:
        node.args = (node.args[0], dim, idx % size)


def _side(n, depth: int = 6) -> int:
    """0: an arange (a position grid), 2: an argmax (a target token), 1: anything else."""
    for _ in range(depth):
        if not isinstance(n, Node) or n.op != "call_function":
            return 1
        if n.target in _IOTA:
            return 0
        if n.target in (aten.argmax.default, aten.max.dim):
            return 2
        if n.target not in _THROUGH:
            return 1
        n = n.args[0]
    return 1


def _canon_clamp(node: Node) -> None:
    """`clamp(x, c, None)` -> `clamp_min(x, c)`, `clamp(x, None, c)` -> `clamp_max(x, c)`: ATen
    runs the one-sided kernel for a one-sided clamp, and Inductor lowers both alike."""
    args = list(node.args) + [None] * (3 - len(node.args))
    x, lo, hi = args[:3]
    if node.kwargs or (lo is None) == (hi is None):
        return
    node.target = aten.clamp_min.default if hi is None else aten.clamp_max.default
    node.args = (x, lo if hi is None else hi)


def canonicalize(graph: Graph) -> Graph:
    """Rewrite dim/slice/select literals of `graph` in place into the canonical form."""
    for node in graph.nodes:
        if node.op != "call_function" or node.kwargs and any(k in node.kwargs for k in ("dim", "dims")):
            continue
        t = node.target
        if t in _FLIP and len(node.args) == 2 and not node.kwargs:
            node.target = _FLIP[t]
            node.args = (node.args[1], node.args[0])
        elif t in _SYMMETRIC and len(node.args) == 2 and not node.kwargs:
            a, b = node.args
            if _side(a) > _side(b):
                node.args = (b, a)
        elif t is aten.clamp.default:
            _canon_clamp(node)
        elif t is aten.slice.Tensor:
            _canon_slice(node)
        elif t is aten.select.int:
            _canon_select(node)
        elif t in _DIM_ARG:
            _canon_dim(node, *_DIM_ARG[t])
        elif t in _DIMS_ARG:
            _canon_dims(node, _DIMS_ARG[t])
    _merge_views(graph)
    return graph


_VIEWS = (aten.slice.Tensor, aten.select.int, aten.unsqueeze.default, aten.squeeze.dim)


def _merge_views(graph: Graph) -> None:
    """Replace each repeated view node by its first occurrence (same target, args, kwargs)."""
    seen: dict = {}
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _VIEWS:
            continue
        key = (node.target, tuple(tuple(a) if isinstance(a, list) else a for a in node.args),
               tuple(sorted(node.kwargs.items())))
        try:
            first = seen.setdefault(key, node)
        except TypeError:  # an unhashable literal: leave it
            continue
        if first is not node:
            node.replace_all_uses_with(first)
            graph.erase_node(node)


def split_views(graph: Graph) -> None:
    """Give each user of a view node its own copy of the view (values unchanged)."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _VIEWS or len(node.users) < 2:
            continue
        for user in list(node.users)[1:]:
            with graph.inserting_after(node):
                copy = graph.call_function(node.target, node.args, dict(node.kwargs))
            copy.meta = dict(node.meta)
            user.replace_input_with(node, copy)
