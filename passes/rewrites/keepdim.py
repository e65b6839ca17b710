"""argmax / argmin with keepdim=True whose every use squeezes that dim away: the plain reduction.

    argmax(x, d, keepdim=True).squeeze(d)  -> argmax(x, d)          (argmin alike)

The families end in the plain `argmax(x, d)`. keepdim only decides whether the reduced dim is
kept as size 1: the same kernel picks the same indices, and the squeeze drops that dim again,
so every value, the dtype (int64) and the shape are the same. Only a literal dim, and only when
every user is such a squeeze: a kept dim that is read (vllm-ascend's block count subtracts
from `argmax(dim=-1, keepdim=True)`, and the sampling family is traced with that form) is left
as written, and so is gpt-fast's `argmax(probs / E, dim=-1, keepdim=True)`, which the Residual
family matches as written (passes/patterns_ratio.py).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.fx import Graph, Node

from npuspec.passes.rewrites.nodes import call_before

NAME = "keepdim"
aten = torch.ops.aten
_ARG = (aten.argmax.default, aten.argmin.default)


def _keepdim_dim(n: Node) -> Optional[int]:
    """d >= 0 when n is argmax/argmin(x, d, keepdim=True) with a literal d."""
    if n.op != "call_function" or n.target not in _ARG:
        return None
    a, kw = n.args, n.kwargs
    dim = a[1] if len(a) > 1 else kw.get("dim")
    keep = a[2] if len(a) > 2 else kw.get("keepdim", False)
    xv = n.args[0].meta.get("val") if isinstance(n.args[0], Node) else None
    if keep is not True or type(dim) is not int or not isinstance(xv, torch.Tensor):
        return None
    rank = xv.dim()
    return dim % rank if rank and -rank <= dim < rank else None


def _squeezes(u: Node, d: int, rank: int) -> bool:
    """u is a squeeze of exactly dim d of a rank-`rank` tensor."""
    if u.target is aten.squeeze.dim and len(u.args) == 2:
        dims = [u.args[1]]
    elif u.target is aten.squeeze.dims and len(u.args) == 2:
        dims = list(u.args[1])
    else:
        return False
    return (not u.kwargs and len(dims) == 1 and type(dims[0]) is int
            and -rank <= dims[0] < rank and dims[0] % rank == d)


def apply(graph: Graph, flavor: str) -> int:
    """Rewrite every argmax/argmin(keepdim=True) whose users all squeeze that dim; returns
    how many."""
    done = 0
    for n in list(graph.nodes):
        d = _keepdim_dim(n)
        v = n.meta.get("val")
        if d is None or not isinstance(v, torch.Tensor) or not n.users:
            continue
        if not all(_squeezes(u, d, v.dim()) for u in n.users):
            continue
        plain = call_before(graph, n.target, (n.args[0], d), n)
        for u in list(n.users):
            u.replace_all_uses_with(plain)
            graph.erase_node(u)
        graph.erase_node(n)
        done += 1
    return done
