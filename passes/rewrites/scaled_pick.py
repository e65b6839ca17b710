"""A pick scaled by a literal, as the pick of the scaled tensor (on trial).

lucidrains' prophet decoding makes its accept test lenient by scaling the draft's picked
probability,

    q = small_prob.gather(-1, ids) * lenience         ->  q = (small_prob * lenience).gather(-1, ids)

and the accept families are traced with the pick last. Each picked element is multiplied (or
divided) by the same literal either way, one IEEE operation on the same two operands, so every
value is the same bits. Moving the product before the pick costs [..., V] products where the
user paid [..., K], so the move is a trial: `undo_untaken` puts back, after every family has
run, each such pick that no family took. Only `mul` / `div` of a float gather by an int or
float literal whose gather has no other reader, with no dtype change.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.fx import Graph, Node

from npuspec.passes.rewrites.nodes import _val, call_before

NAME = "scaled_pick"
aten = torch.ops.aten
TRIAL = "npuspec_scaled_pick_trial"
_OPS = (aten.mul.Tensor, aten.div.Tensor)


def _site(n: Node) -> Optional[tuple[Node, object]]:
    """(the gather, the literal) when n is gather * c, c * gather or gather / c."""
    if n.op != "call_function" or n.target not in _OPS or n.kwargs or len(n.args) != 2:
        return None
    a, b = n.args
    if n.target is aten.mul.Tensor and not isinstance(a, Node):
        a, b = b, a
    if not isinstance(a, Node) or a.target is not aten.gather.default or type(b) not in (int, float):
        return None
    if len(a.users) != 1 or a.kwargs or len(a.args) != 3:  # sparse_grad and others: left
        return None
    va, vn = _val(a), _val(n)
    if va is None or vn is None or not va.is_floating_point() or va.dtype != vn.dtype:
        return None
    return a, b


def apply(graph: Graph, flavor: str) -> int:
    """Move each such literal before its pick; -> how many."""
    done = 0
    for n in list(graph.nodes):
        site = _site(n)
        if site is None:
            continue
        g, c = site
        x, dim, idx = g.args
        scaled = call_before(graph, n.target, (x, c), g)
        scaled.meta[TRIAL] = True  # on the product: later passes may re-spell the pick
        pick = call_before(graph, aten.gather.default, (scaled, dim, idx), n)
        n.replace_all_uses_with(pick)
        graph.erase_node(n)
        graph.erase_node(g)
        done += 1
    return done


def undo_untaken(graph: Graph) -> int:
    """Each trial product still picked from after matching is picked first again, as the
    user wrote it; -> how many picks."""
    undone = 0
    for scaled in list(graph.nodes):
        if not scaled.meta.pop(TRIAL, False):
            continue
        x, c = scaled.args
        for pick in [u for u in scaled.users if u.target is aten.gather.default]:
            _, dim, idx = pick.args
            g = call_before(graph, aten.gather.default, (x, dim, idx), pick)
            back = call_before(graph, scaled.target, (g, c), pick)
            pick.replace_all_uses_with(back)
            graph.erase_node(pick)
            undone += 1
        if not scaled.users:
            graph.erase_node(scaled)
    return undone
