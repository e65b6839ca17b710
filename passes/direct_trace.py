"""A replacement traced without make_fx: the ATen ops it dispatches, recorded by a small mode.

Every match traces its replacement at the match's fake values (Inductor's pattern matcher
inserts that graph, metas and all), with `fwd_only`: make_fx under the python dispatcher, then
no-op removal and dead-code elimination. make_fx intercepts every torch call made anywhere
below the replacement, the ~100 inside an npuspec op's fake implementation included
(`TorchFunctionMetadataMode`, proxy bookkeeping): 3-5 ms for one `ratio_accept`, 15-25 ms for a
`rejection_sample` with its casts. Here a dispatch mode records only what the replacement
itself dispatches, as make_fx does without its proxies:
- an op in the decomposition table runs its decomposition, recorded op by op; an op with a
  CompositeImplicit kernel that autograd would have used is decomposed (`func.decompose()`);
  a device query is answered (make_fx's `proxy_call` and its mode, step for step);
- any other op becomes one node, its output computed by the op on the fake values with the
  mode off (the op's own fake implementation runs untraced), with make_fx's metas: `val`,
  `tensor_meta`, `original_aten` (the outermost op), `eager_input_vals` where an op needs
  exact strides, and a tuple output's elements as `getitem` nodes;
then `fwd_only`'s own post-processing (no-op removal, dead code) and the canonical literals.
Anything it cannot take declines (None: make_fx traces as before): real or unbacked values,
a tensor the replacement did not get or make, a mutating op, an argument of another kind.
tests/passes/test_direct_trace.py compares every registered replacement's graph and metas
with make_fx's, and requires a decline to be the exception.
"""
from __future__ import annotations

import operator
from typing import Optional

import torch
from torch._dispatch.python import enable_python_dispatcher
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx._lazy_graph_module import _make_graph_module, _use_lazy_graph_module
from torch.fx.experimental.proxy_tensor import _should_save_eager_input_vals, extract_val
from torch.fx.node import map_aggregate
from torch.fx.passes.shape_prop import _extract_tensor_metadata
from torch.fx.traceback import preserve_node_meta
from torch.utils._python_dispatch import TorchDispatchMode, autograd_would_have_decomposed
from torch.utils._pytree import tree_flatten, tree_map

from npuspec import counters
from npuspec.passes import canonical
from npuspec.passes.rewrites.fake_values import fake_value

LITERALS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
            torch.memory_format)


_QUERIES = (torch.ops.aten.size.default, torch.ops.aten.stride.default,
            torch.ops.aten.storage_offset.default)


class _Unsupported(Exception):
    pass


class _Recorder(TorchDispatchMode):
    def __init__(self, graph: torch.fx.Graph, nodes: dict, table: dict):
        super().__init__()
        self.graph, self.table = graph, table
        self.nodes = nodes  # id(value) -> (node, value): the value held, so its id stays its own
        self.outer = None  # the outermost op dispatching now (make_fx's `original_aten`)

    def _arg(self, a):
        if isinstance(a, torch.Tensor):
            got = self.nodes.get(id(a))
            if got is None or got[1] is not a:
                raise _Unsupported("a tensor the replacement did not get or make")
            return got[0]
        if not isinstance(a, LITERALS):
            raise _Unsupported(f"an argument of type {type(a).__name__}")
        return a

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        top = self.outer is None
        if top:
            self.outer = func
        try:
            if func is torch.ops.prim.device.default:  # a query, as make_fx answers it
                return func(*args, **kwargs)
            if func in self.table:
                with self:
                    out = self.table[func](*args, **kwargs)
                if out is not NotImplemented:  # a decomposition may decline
                    return out
            if (func not in _QUERIES
                    and autograd_would_have_decomposed(func, tree_flatten((args, kwargs))[0])):
                with self:
                    out = func.decompose(*args, **kwargs)
                if out is not NotImplemented:
                    return out
            return self._record(func, args, kwargs)
        finally:
            if top:
                self.outer = None

    def _record(self, func, args, kwargs):
        if func._schema.is_mutable or func is torch.ops.aten.detach.default:
            # a detach reaches this mode where make_fx sees none (`rand_like` with a dtype,
            # without Inductor's decompositions), so it is not recorded as one
            raise _Unsupported(f"{func}")
        n_args, n_kwargs = tree_map(self._arg, (tuple(args), dict(kwargs)))
        out = fake_value(func, args, kwargs)  # the mode is off inside its own dispatch
        node = self._node(func, n_args, n_kwargs, out)
        if _should_save_eager_input_vals(func, (n_args, n_kwargs)):
            node.meta["eager_input_vals"] = map_aggregate(  # literals as None, as make_fx
                (n_args, n_kwargs),
                lambda a: extract_val(a.meta["val"]) if isinstance(a, torch.fx.Node) else None)
        if isinstance(out, (tuple, list)):
            for i, o in enumerate(out):
                if o is not None:
                    self._node(operator.getitem, (node, i), {}, o)
        return out

    def _node(self, target, args, kwargs, out) -> torch.fx.Node:
        ok = (all(o is None or isinstance(o, FakeTensor) for o in out)
              if isinstance(out, (tuple, list)) else isinstance(out, FakeTensor))
        if not ok:
            raise _Unsupported(f"{target} returns {type(out).__name__}")
        node = self.graph.call_function(target, args, kwargs)
        node.meta.update(val=extract_val(out), original_aten=self.outer)
        if isinstance(out, torch.Tensor):
            node.meta["tensor_meta"] = _extract_tensor_metadata(out)
            self.nodes[id(out)] = (node, out)
        return node


def direct_trace(fn, args, get_decomp_fn=None) -> Optional[torch.fx.GraphModule]:
    """`trace_store.trace_canonical(fn, args)`'s graph for fake `args`, recorded without
    make_fx; None where it declines (counted: `pattern_direct_trace.{direct,declined}`)."""
    leaves, _ = tree_flatten(list(args))
    tensors = [a for a in leaves if isinstance(a, torch.Tensor)]
    if (not tensors or not all(isinstance(t, FakeTensor) for t in tensors)
            or detect_fake_mode(tensors) is None
            or len({id(t) for t in tensors}) < len(tensors)):
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
    rec = _Recorder(graph, nodes, get_decomp_fn() if get_decomp_fn is not None else {})
    try:
        with torch.no_grad(), enable_python_dispatcher(), preserve_node_meta(), rec:
            out = fn(*args)
        graph.output(tree_map(rec._arg, out))
    except _Unsupported:
        counters["pattern_direct_trace.declined"] += 1
        return None
    counters["pattern_direct_trace.direct"] += 1
    from torch._inductor.fx_passes.post_grad import remove_noop_ops  # heavy: when first used
    remove_noop_ops(graph)
    graph.eliminate_dead_code()
    canonical.canonicalize(graph)  # as trace_store.trace_canonical does after make_fx
    with _use_lazy_graph_module(True):
        return _make_graph_module(torch.nn.Module(), graph)
