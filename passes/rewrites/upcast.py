"""A half-precision clamp as Inductor's decompositions write it, back to the user's one op.

Inductor computes a float16 / bfloat16 pointwise op in float32: `torch.clamp(d, min=0.0)` on an
fp16 `d` (ktransformers' residual `torch.clamp(main_prob - draft_prob, min=0.0)` on fp16
probabilities) reaches the passes of the Inductor flavour as

    convert_element_type(clamp_min(convert_element_type(d, float32), 0.0), float16)

while the aten flavour (the eager lowering) keeps `clamp_min(d, 0.0)`, the form the nonneg rule
and the Residual family read. So the same step fused under `lowering="eager"` and not under the
default lowering. This rule writes the chain back as `clamp_min(d, c)` when d has the dtype the
chain returns (float16 or bfloat16) and c is a finite literal within that dtype's range (vLLM
v0's floor `torch.finfo(torch.float32).tiny` on fp16 probabilities included).

Why the values cannot change: max(float(d), c) is float(d) or c; float(d) converts back to d
exactly, and c to the dtype's nearest value, which is what eager's `clamp_min(d, c)` compares
with (no value of the dtype lies between c and its rounding, so the comparisons agree).
tests/passes/test_rewrite_upcast.py checks it on every fp16 and bf16 value for several c: the
same values and NaN places; zero signs may differ (the nonneg rule's table, whose argument
then decides, as for the aten flavour's spelling this rule hands it). Where a family takes the
site, its op evaluates the user's clamp in ATen, as eager does. Where no family takes it,
Inductor lowers `clamp_min(d, c)` of a half tensor through the same float32 computation it had
decomposed it into: the test compares those bits with stock Inductor's on NaN, -0.0, inf and
subnormals.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch.fx import Graph, Node

from npuspec.passes.rewrites.nodes import _fake_meta, _val

NAME = "upcast"
aten, prims = torch.ops.aten, torch.ops.prims
HALF = (torch.float16, torch.bfloat16)
_CVT = prims.convert_element_type.default


def _in_range(c, dtype: torch.dtype) -> bool:
    """The literal c is finite and within `dtype`'s range (eager refuses a clamp past it)."""
    return type(c) in (int, float) and math.isfinite(c) and abs(c) <= torch.finfo(dtype).max


def _chain(n: Node) -> Optional[tuple]:
    """(d, c) when n = convert(clamp_min(convert(d, float32), c), dtype of d), d half."""
    if n.target is not _CVT or len(n.args) != 2 or n.kwargs or n.args[1] not in HALF:
        return None
    m = n.args[0]
    if not (isinstance(m, Node) and m.target is aten.clamp_min.default and len(m.args) == 2
            and not m.kwargs):
        return None
    up, c = m.args
    if not (isinstance(up, Node) and up.target is _CVT and len(up.args) == 2 and not up.kwargs
            and up.args[1] is torch.float32):
        return None
    d = up.args[0]
    dv = _val(d) if isinstance(d, Node) else None
    if dv is None or dv.dtype is not n.args[1] or not _in_range(c, dv.dtype):
        return None
    return d, c


def apply(graph: Graph, flavor: str) -> int:
    """Rewrite every chain above into clamp_min(d, c); -> how many. Only Inductor's
    decompositions write the chain, so the aten flavour has none to find."""
    done = 0
    for n in list(graph.nodes):
        got = _chain(n) if n.op == "call_function" else None
        if got is None:
            continue
        d, c = got
        with graph.inserting_before(n):
            new = _fake_meta(graph.call_function(aten.clamp_min.default, (d, c)), _val(d))
        n.replace_all_uses_with(new)
        done += 1
    return done
