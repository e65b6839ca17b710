"""A pick from the padded target, with the rows it reads made explicit.

vLLM v1's `forward_native` reads p(x) from the padded target [B, K+1, V] with a [B, K, 1]
index and no `[:, :K]`:

    target_probs.gather(-1, ids.unsqueeze(-1))          # target_probs [B, K+1, V], ids [B, K]

`gather` along the last dim only asks the index to be no larger than the input along the other
dims, and out[b, k, j] = p[b, k, idx[b, k, j]] reads rows k < K only. So it is
`target_probs[:, :K].gather(-1, ...)` element for element: the same loads, no arithmetic, every
value (NaN, -0.0) kept. The rule puts that slice in, the form the families are traced with
(`p[:, :K].gather(...)`). Only static row counts (K < R both ints) are rewritten. Dim 0 is
left alone: an index with fewer (or, under a dynamic batch, differently named) batch rows reads
the same rows of the slice as of p; the families check the batches themselves.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.fx import Graph, Node

from npuspec.passes.rewrites.nodes import _static, _val

NAME = "gather_rows"
aten = torch.ops.aten


def _rows_read(n: Node) -> Optional[int]:
    """K when n is gather(p, last dim, idx) with p [B, R, V], idx [B, K, J] and K < R."""
    if (n.op != "call_function" or n.target is not aten.gather.default or len(n.args) != 3
            or n.kwargs.get("sparse_grad", False)):
        return None
    p, dim, idx = n.args
    pv, iv = _val(p), _val(idx)
    if pv is None or iv is None or pv.dim() != 3 or iv.dim() != 3 or dim not in (2, -1):
        return None
    rows, k = pv.shape[1], iv.shape[1]
    if not (_static([rows, k]) and k < rows):
        return None
    return k


def apply(graph: Graph, flavor: str) -> int:
    done = 0
    for n in list(graph.nodes):
        k = _rows_read(n)
        if k is None:
            continue
        p = n.args[0]
        with graph.inserting_before(n):
            rows = graph.call_function(aten.slice.Tensor, (p, 1, 0, k))
        rows.meta["val"] = aten.slice.Tensor(_val(p), 1, 0, k)  # on the fake value's own mode
        n.update_arg(0, rows)
        done += 1
    return done
