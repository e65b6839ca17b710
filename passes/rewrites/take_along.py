"""`torch.take_along_dim` picks as the plain gather the families match.

`torch.take_along_dim(p, ids[..., None], dim=-1)` (MLX ports, NumPy-minded code) traces to

    gather(expand(p, p.shape), d, remainder(expand(unsqueeze(ids, d), S), V))     V = p.shape[d]

the expands keep their input's shape, and the remainder wraps a negative id the Python way
(take_along_dim reads p[..., V + id] where gather would fail). This rule writes

    gather(p, d, unsqueeze(remainder(ids, V), d))

with one `remainder(ids, V)` per (ids, V), so that p's and q's picks read the same index node
as the families expect (their `ids` input is then that remainder). Exact: an expand to its
input's own shape is that input, and an elementwise op commutes with unsqueeze and expand;
every id the gather reads is the same. Any other index arithmetic is left as written.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.fx import Graph, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from npuspec.passes.rewrites.nodes import _fake_meta, _same_shape, _val

NAME = "take_along"
aten = torch.ops.aten


def _no_op_expand(n) -> Node:
    """n's input when n is an expand to its input's own shape; else n."""
    if (isinstance(n, Node) and n.target is aten.expand.default and not n.kwargs
            and isinstance(n.args[0], Node) and _same_shape(_val(n), _val(n.args[0]))):
        return n.args[0]
    return n


def _wrapped_ids(gather: Node) -> Optional[tuple]:
    """(p, d, ids, V) when gather is take_along_dim's decomposition of a pick along d."""
    if gather.target is not aten.gather.default or gather.kwargs or len(gather.args) != 3:
        return None
    x, d, idx = gather.args
    xv = _val(x)
    if xv is None or type(d) is not int or not isinstance(idx, Node):
        return None
    d = d % xv.dim()
    if idx.target is not aten.remainder.Scalar or len(idx.args) != 2 or idx.kwargs:
        return None
    u, size = _no_op_expand(idx.args[0]), idx.args[1]
    if type(size) is not int or not statically_known_true(xv.shape[d] == size):
        return None
    if not isinstance(u, Node) or u.target is not aten.unsqueeze.default or len(u.args) != 2:
        return None
    ids, ud = u.args
    iv = _val(ids)
    if iv is None or type(ud) is not int or ud % (iv.dim() + 1) != d:
        return None
    return _no_op_expand(x), d, ids, size


def apply(graph: Graph, flavor: str) -> int:
    done, wrapped = 0, {}
    for n in list(graph.nodes):
        if n.op != "call_function":
            continue
        site = _wrapped_ids(n)
        if site is None:
            continue
        p, d, ids, size = site
        with graph.inserting_before(n):
            if (ids, size) not in wrapped:
                wrapped[(ids, size)] = _fake_meta(
                    graph.call_function(aten.remainder.Scalar, (ids, size)))
            idx = _fake_meta(graph.call_function(aten.unsqueeze.default,
                                                 (wrapped[(ids, size)], d)))
            new = _fake_meta(graph.call_function(aten.gather.default, (p, d, idx)))
        n.replace_all_uses_with(new)
        done += 1
    return done
