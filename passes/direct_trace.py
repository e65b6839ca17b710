"""A replacement traced without make_fx, where it is only calls of npuspec's own ops.

Every match traces its replacement at the match's fake values (Inductor's pattern matcher
inserts that graph, metas and all). Many replacements are one `torch.ops.npuspec.*` call
(vLLM v1's step has two), yet make_fx costs 3-5 ms for one warm: its proxy mode intercepts
each of the ~100 torch calls inside the op's fake implementation. Built here it costs 1.4-2.1
ms, mostly the op's fake execution. Here the replacement runs once on the fake values under a torch-function mode that sees
only the calls the replacement itself makes: each must be an npuspec op on the inputs, earlier
results or literals, and it becomes one node, its meta computed by running the op on the fake
values (as make_fx stores it: `val`, `tensor_meta`, `original_aten`, `eager_input_vals`).
Anything else (another torch call, a tensor from outside, a tuple-returning op) gives None,
and the caller traces with make_fx as before. tests/passes/test_direct_trace.py compares
every registered replacement's graph and metas with make_fx's.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch._guards import detect_fake_mode
from torch.fx._lazy_graph_module import _make_graph_module, _use_lazy_graph_module
from torch.fx.experimental.proxy_tensor import _should_save_eager_input_vals, extract_val
from torch.fx.node import map_aggregate
from torch.fx.passes.shape_prop import _extract_tensor_metadata
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from npuspec import counters
from npuspec.passes import canonical

LITERALS = (int, float, bool, str, type(None), torch.dtype, torch.device)


class _Unsupported(Exception):
    pass


def _overload(func) -> Optional[torch._ops.OpOverload]:
    """func as an npuspec OpOverload (a packet with one overload resolves to it), or None."""
    if isinstance(func, torch._ops.OpOverloadPacket):
        if func._qualified_op_name.split("::")[0] != "npuspec" or func.overloads() != ["default"]:
            return None
        return func.default
    if isinstance(func, torch._ops.OpOverload) and func.namespace == "npuspec":
        return func
    return None


class _Recorder(TorchFunctionMode):
    def __init__(self, graph: torch.fx.Graph, nodes: dict):
        super().__init__()
        self.graph, self.nodes = graph, nodes  # nodes: id(fake value) -> (node, value)

    def _arg(self, a):
        if isinstance(a, torch.Tensor):
            got = self.nodes.get(id(a))
            if got is None or got[1] is not a:
                raise _Unsupported("a tensor the replacement did not get as an input")
            return got[0]
        if not isinstance(a, LITERALS):
            raise _Unsupported(f"argument of type {type(a).__name__}")
        return a

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = _overload(func)
        if op is None:
            raise _Unsupported(f"{func} is not an npuspec op")
        n_args, n_kwargs = tree_map(self._arg, (tuple(args), dict(kwargs)))
        with torch._C.DisableTorchFunction():
            val = op(*args, **kwargs)
        if not isinstance(val, torch.Tensor):
            raise _Unsupported(f"{op} returns {type(val).__name__}")
        node = self.graph.call_function(op, n_args, n_kwargs)
        node.meta.update(val=extract_val(val), tensor_meta=_extract_tensor_metadata(val),
                         original_aten=op)
        if _should_save_eager_input_vals(op, (n_args, n_kwargs)):
            node.meta["eager_input_vals"] = map_aggregate(  # literals as None, as make_fx
                (n_args, n_kwargs),
                lambda a: extract_val(a.meta["val"]) if isinstance(a, torch.fx.Node) else None)
        self.nodes[id(val)] = (node, val)
        return val


def direct_trace(fn, args) -> Optional[torch.fx.GraphModule]:
    """fn traced at the fake values `args` as make_fx would, when it only calls npuspec ops;
    else None (counted: `pattern_direct_trace.{direct,declined}`)."""
    leaves, _ = tree_flatten(list(args))
    tensors = [a for a in leaves if isinstance(a, torch.Tensor)]
    if not tensors or detect_fake_mode(tensors) is None \
            or len({id(t) for t in tensors}) < len(tensors):
        counters["pattern_direct_trace.declined"] += 1
        return None
    graph = torch.fx.Graph()
    nodes = {}
    for i, a in enumerate(args):
        p = graph.placeholder(f"arg{i}_1")
        if isinstance(a, torch.Tensor):
            p.meta.update(val=extract_val(a), tensor_meta=_extract_tensor_metadata(a))
            nodes[id(a)] = (p, a)
        elif not isinstance(a, LITERALS):
            counters["pattern_direct_trace.declined"] += 1
            return None
    try:
        with _Recorder(graph, nodes) as rec:
            out = fn(*args)
        if not isinstance(out, torch.Tensor):
            raise _Unsupported(f"returns {type(out).__name__}")
        graph.output(rec._arg(out))
    except _Unsupported:
        counters["pattern_direct_trace.declined"] += 1
        return None
    counters["pattern_direct_trace.direct"] += 1
    canonical.canonicalize(graph)  # as trace_store.trace_canonical does after make_fx
    with _use_lazy_graph_module(True):
        return _make_graph_module(torch.nn.Module(), graph)
