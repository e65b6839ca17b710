"""Small FX node helpers shared by the rules here and by the passes above them (prefix, picks):
kept in this package so that the dependency runs one way, passes -> passes/rewrites."""
from __future__ import annotations

import torch
from torch.fx import Graph, Node

aten = torch.ops.aten


def _val(n):
    """The fake tensor a node computes, or None (no meta, or not a tensor)."""
    v = n.meta.get("val") if isinstance(n, Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _static(shape) -> bool:
    return all(isinstance(s, int) for s in shape)


def _cast(graph: Graph, x: Node, dtype, flavor: str) -> Node:
    # what `.to(dtype)` traces to in each flavor (Inductor's decompositions: a prims cast)
    if flavor == "inductor":
        return graph.call_function(torch.ops.prims.convert_element_type.default, (x, dtype))
    return graph.call_function(aten._to_copy.default, (x,), {"dtype": dtype})
