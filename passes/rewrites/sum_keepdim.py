"""A row sum whose reduced dim is put back by a view: the keepdim sum.

    x.sum(d).unsqueeze(d)            -> x.sum(d, keepdim=True)
    x.sum(d).reshape(B, K, 1)        -> x.sum(d, keepdim=True)     (d the last of 3 dims: vLLM
    x.sum(d).view(...)                                             v0's _get_recovered_probs)

The families normalise a residual by `r / r.sum(-1, keepdim=True)`. keepdim only decides
whether ATen returns the reduced dim as size 1: the same reduction kernel runs over the same
values, and the result is contiguous either way, so the view of the plain sum that puts a
size-1 dim back where d was holds the same numbers in the same shape and dtype. Only one dim, a
literal one, and a view (or reshape, or unsqueeze at d) whose shape is exactly the keepdim
shape, symbolic sizes included where they are equal without a guard (a batch Dynamo made
dynamic: `reshape(-1, k, 1)` of the sum over [s0, k, V] is [s0, k, 1]); each such view becomes
the keepdim sum (the plain sum stays for its other users, and goes if it has none).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.fx import Graph, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from npuspec.passes.rewrites.nodes import _val, call_before

NAME = "sum_keepdim"
aten = torch.ops.aten
_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default,
          aten.unsqueeze.default)


def _plain_sum_dim(n: Node) -> Optional[int]:
    """d >= 0 when n is sum(x, [d]) without keepdim or a dtype, over a static float tensor."""
    if n.op != "call_function" or n.target is not aten.sum.dim_IntList or n.kwargs:
        return None
    a = n.args
    if len(a) < 2 or len(a) > 3 or (len(a) == 3 and a[2] is not False):
        return None
    xv = _val(a[0])
    if xv is None or not xv.is_floating_point() or xv.dim() == 0:
        return None
    dims = a[1]
    if not isinstance(dims, (list, tuple)) or len(dims) != 1 or type(dims[0]) is not int:
        return None
    rank = xv.dim()
    return dims[0] % rank if -rank <= dims[0] < rank else None


def _puts_back(u: Node, kept: tuple) -> bool:
    """u views the plain sum into exactly the keepdim shape `kept`."""
    uv = _val(u)
    return (u.op == "call_function" and u.target in _VIEWS and not u.kwargs
            and uv is not None and uv.dim() == len(kept)
            and all(statically_known_true(a == b) for a, b in zip(uv.shape, kept)))


def apply(graph: Graph, flavor: str) -> int:
    """Rewrite every such view; returns how many."""
    done = 0
    for n in list(graph.nodes):
        d = _plain_sum_dim(n)
        if d is None:
            continue
        xv = _val(n.args[0])
        kept = tuple(1 if i == d else s for i, s in enumerate(xv.shape))
        for u in [u for u in n.users if _puts_back(u, kept)]:
            new = call_before(graph, aten.sum.dim_IntList, (n.args[0], [d], True), u)
            u.replace_all_uses_with(new)
            graph.erase_node(u)
            done += 1
        if not n.users:
            graph.erase_node(n)
    return done
