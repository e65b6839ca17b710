"""Small FX node helpers shared by the rules here and by the passes above them (prefix, picks):
kept in this package so that the dependency runs one way, passes -> passes/rewrites."""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch._dispatch.python import no_python_dispatcher
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx import Graph, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.utils._pytree import tree_leaves, tree_map

# _static lives with fake_values (which needs it and may not import this module); the passes
# import it from here
from npuspec.passes.rewrites.fake_values import _from_meta_kernel, _static  # noqa: F401

aten = torch.ops.aten


def _val(n):
    """The fake tensor a node computes, or None (no meta, or not a tensor)."""
    v = n.meta.get("val") if isinstance(n, Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _same_shape(a, b) -> bool:
    """Two fake values of the same shape (sizes equal without adding a guard)."""
    return (a is not None and b is not None and a.dim() == b.dim()
            and all(statically_known_true(x == y) for x, y in zip(a.shape, b.shape)))


def size_args(graph: Graph, shape) -> Optional[list]:
    """The sizes as literals or the placeholders that hold them (a symbolic size is a graph
    input of its own in the graphs Dynamo and AOT hand over); None when one is neither."""
    out = []
    for s in shape:
        if isinstance(s, int):
            out.append(s)
            continue
        for p in graph.nodes:
            if p.op != "placeholder":
                return None  # placeholders come first: none holds s
            v = p.meta.get("val")
            if isinstance(v, torch.SymInt) and statically_known_true(v == s):
                out.append(p)
                break
    return out


def _cast(graph: Graph, x: Node, dtype, flavor: str) -> Node:
    # what `.to(dtype)` traces to in each flavor (Inductor's decompositions: a prims cast)
    if flavor == "inductor":
        return graph.call_function(torch.ops.prims.convert_element_type.default, (x, dtype))
    return graph.call_function(aten._to_copy.default, (x,), {"dtype": dtype})


def _fake_meta(n: Node, like=None) -> Node:
    """Fill n.meta["val"] by running its op on its inputs' fake values (in their fake mode,
    or like's when the inputs hold none). -> n"""
    vals = tree_map(lambda a: _val(a) if isinstance(a, Node) else a, (n.args, n.kwargs))
    fast = _from_meta_kernel(n.target, *vals)
    if fast is not None:
        n.meta["val"] = fast
        return n
    mode = detect_fake_mode(tree_leaves(vals) + ([like] if like is not None else []))
    if mode is None:
        n.meta["val"] = n.target(*vals[0], **vals[1])
    else:
        with mode:
            n.meta["val"] = n.target(*vals[0], **vals[1])
    return n


def call_before(graph: Graph, target, args, before: Node, kwargs: Optional[dict] = None) -> Node:
    """A call_function node inserted before `before`, its meta value computed on fake values."""
    with graph.inserting_before(before):
        return _fake_meta(graph.call_function(target, tuple(args), dict(kwargs or {})))


def _iota(length, *, start, step, dtype, device, requires_grad):
    return torch.arange(start, start + length * step, step, dtype=dtype, device=device,
                        requires_grad=requires_grad)


# prims ops evaluated eagerly go through Python (their meta checks and a wrapper per call):
# they were half of the composed emission check's time on vLLM v1's step (13 ops, 10
# evaluations: 5.3-7.2 against 2.8-4.1 ms). Each stand-in is what the prim's own ATen
# implementation runs (torch/_prims: `_iota_aten`, `_convert_element_type_aten`'s
# empty_like + copy_), so the values, dtypes and strides are the prim's.
_EAGER = {
    torch.ops.prims.convert_element_type.default: lambda x, dtype: x.to(dtype),
    torch.ops.prims.iota.default: _iota,
}


def eager_op(target):
    """What evaluates `target` on real tensors in a region check: its ATen stand-in for a
    prims op in `_EAGER`, else the target itself."""
    return _EAGER.get(target, target)


@contextlib.contextmanager
def real_eval():
    """For a check that evaluates a region on real CPU tensors from inside a compile: the
    graph's fake mode off, no autograd, and the Python dispatcher that Inductor's compile runs
    under off too (with it every eager op went through Python: 40-100 us an op here, ~2x that
    of the op without it; vLLM v1's emission check on a first graph 11.4 -> 5.5 ms). The ops
    are ATen's, and prims through `eager_op`, so their values are the same."""
    with unset_fake_temporarily(), torch.inference_mode(), no_python_dispatcher():
        yield
