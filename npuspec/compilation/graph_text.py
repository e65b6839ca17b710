"""The text of an FX graph for cache keys, without generating its code.

Dynamo hands a backend a lazy GraphModule: reading `gm.code` generates and compiles its Python
source (~70 ms for SmolLM2's 2,071-node forward on two cores), and Inductor's own cache key
renames the placeholders and generates it again. Keying on `gm.code` cost two more of those
per compiled graph (the graph cache's key and the pass-count record's), about 1 s of the ~19 s
HF generate spends compiling new lengths (docs/graphs.md). One line per node (op, target,
arguments, each node named by its position) says what the code computes and costs ~9 ms.
It leaves out what the code carries beside that: its source-file comments and the names
Dynamo takes from the user's locals, so a model run from two install paths, or a step with a
local renamed, keys alike.
"""
from __future__ import annotations

import uuid

import torch
from torch.fx.node import map_aggregate


def graph_text(gm: torch.fx.GraphModule) -> str:
    """Node lines of `gm` and each nested GraphModule, in module order; a graph whose code
    generator is not the default (pytree in/out specs) says which, with its specs."""
    lines = []
    for name, mod in gm.named_modules():
        if not isinstance(mod, torch.fx.GraphModule):
            continue
        gen = mod.graph._codegen
        lines.append(f"module {name} {type(gen).__qualname__} {getattr(gen, 'pytree_info', None)}")
        index = {}
        for node in mod.graph.nodes:
            index[node] = len(index)
            lines.append(_line(node, index))
    return "\n".join(lines)


def _line(node: torch.fx.Node, index: dict) -> str:
    def leaf(a):
        if isinstance(a, torch.fx.Node):
            return f"%{index[a]}"
        return _name(a) if callable(a) else a

    target = node.target if isinstance(node.target, str) else _name(node.target)
    args, kwargs = map_aggregate(node.args, leaf), map_aggregate(node.kwargs, leaf)
    return f"{node.op} {target} {args!r} {kwargs!r}"


def _name(fn) -> str:
    """A callable by its qualified name (its repr may hold an address, new in every process)."""
    try:
        return torch.fx.node._get_qualified_name(fn)
    except Exception:  # one FX cannot name (a lambda): no name would tell two such apart, so
        # the graph keys like no other, and is compiled rather than served from a cache
        return f"unnamed {type(fn).__qualname__} {uuid.uuid4().hex}"
