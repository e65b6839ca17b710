"""A half-precision clamp as Inductor's decompositions write it, back to the user's one op.

Inductor computes a float16 / bfloat16 pointwise op in float32: `torch.clamp(d, min=0.0)` on an
fp16 `d` (ktransformers' residual `torch.clamp(main_prob - draft_prob, min=0.0)` on fp16
probabilities) reaches the passes of the Inductor flavour as

    convert_element_type(clamp_min(convert_element_type(d, float32), 0.0), float16)

while the aten flavour (the eager lowering) keeps `clamp_min(d, 0.0)`, the form the nonneg rule
and the Residual family read. So the same step fused under `lowering="eager"` and not under the
default lowering. This rule writes the chain back as `clamp_min(d, c)` when d has the dtype
the chain returns (float16 or bfloat16) and c is exactly a value of that dtype (0.0 is).

Why the values cannot change: max(float(d), c) is either float(d) or c, and both convert back
to d's dtype exactly (float(d) round-trips; c is representable), so the chain is clamp_min in
d's own dtype value for value; eager ATen's reduced-precision kernels compute in float32 and
round too. Where a family then takes the site, its op evaluates the user's clamp in ATen, as
eager does (the nonneg rule's argument on zero signs and NaN payloads applies unchanged, since
this rule only hands it the spelling the aten flavour already has). Where no family takes it,
Inductor lowers `clamp_min(d, c)` of a half tensor through the same float32 computation it
decomposed it into; tests/passes/test_rewrite_upcast.py compares the bits on NaN, -0.0, inf
and subnormals.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.fx import Graph, Node

from npuspec.passes.rewrites.nodes import _fake_meta, _val

NAME = "upcast"
aten, prims = torch.ops.aten, torch.ops.prims
HALF = (torch.float16, torch.bfloat16)
_CVT = prims.convert_element_type.default


def _exact_in(c, dtype: torch.dtype) -> bool:
    """The literal c is a value of `dtype` (so converting it there changes nothing)."""
    if type(c) not in (int, float):
        return False
    t = torch.tensor(float(c), dtype=torch.float64)
    return bool(t.to(dtype).to(torch.float64) == t)


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
    if dv is None or dv.dtype is not n.args[1] or not _exact_in(c, dv.dtype):
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
