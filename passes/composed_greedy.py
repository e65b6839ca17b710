"""The greedy step from its pieces: `greedy_accept` and the user's emission -> one
`npuspec::rejection_sample` in greedy mode (issue 37, point 3; docs/passes.md, "Whole steps
from their pieces").

vLLM v1's greedy `forward_native` never counts its accept mask and writes its output through
boolean-mask indexing (a graph break under plain `torch.compile`; one graph under
`npuspec.compile`, with data-dependent sizes). After the families it reads

    T   = logits.argmax(-1)                            # [B, K+1]
    n   = greedy_accept(drafts, T[:, :K])              # [B]
    out = <the user's emission from n and T>           # [B, K+1]

`out`'s region (the nodes between {n, T} and out, the constants they read, what the user
derives from the drafts) may read only n, T and the drafts. It is evaluated for every count
0..K in every row, with drafts equal to T before n, different at n and arbitrary after (what
a count n means), and must give T up to n and -1 after. Then out becomes the op's tokens,
which are exactly `T[:, :n+1]`: the accepted drafts equal T, and the op's greedy row takes
the first maximum as torch.argmax does (the op refuses NaN or +inf logits with a ValueError,
as the greedy family's replacement does). The runtime size checks Dynamo adds for the
region's data-dependent sizes go with the region.
"""
from __future__ import annotations

import logging
import operator
from typing import Optional

import torch
from torch.fx import Graph, Node

from npuspec.passes import composed
from npuspec.passes.composed import _bound, _descendants, _is_emission, _pure, _run, _shape_is
from npuspec.passes.patterns_common import FLOATS
from npuspec.passes.rewrites.nodes import _static, _val, real_eval

log = logging.getLogger("npuspec.passes")
aten = torch.ops.aten
_SIZE_CHECKS = {aten._assert_scalar.default, aten.sym_constrain_range_for_size.default,
                aten._assert_async.msg}
_SIZE_OPS = {aten.sym_size.int, operator.ge, operator.le, operator.lt, operator.gt, operator.eq}


def _argmax_rows(t: Node) -> Optional[Node]:
    """The logits [B, K+1, V] when t (the accept op's target ids) is argmax(logits, -1)[:, :K]."""
    if t.target is aten.slice.Tensor and len(t.args) >= 3 and t.args[1] == 1 and t.args[2] == 0:
        t = t.args[0]
    if t.target is not aten.argmax.default or len(t.args) < 2:
        return None
    lv = _val(t.args[0])
    keep = t.args[2] if len(t.args) > 2 else t.kwargs.get("keepdim", False)
    if lv is None or lv.dim() != 3 or t.args[1] not in (-1, 2) or keep or not _static(lv.shape):
        return None
    # float64 is refused, as the greedy family refuses it: the op takes the argmax of
    # logits.float(), and rounding to float32 could merge two float64 maxima into a tie
    return t if lv.dtype in FLOATS[:3] else None


def _checkable(m: Node) -> bool:
    """A node the region may hold: pure, a Python comparison of sizes, or a size check."""
    return _pure(m) or m.target in _SIZE_CHECKS or (m.op == "call_function"
                                                    and m.target in _SIZE_OPS)


def _region(out: Node, stops: set, below: set) -> Optional[tuple[list, list]]:
    """composed._region, plus the size checks on the region's values (a size read, compared,
    asserted): they are the region's too."""
    reg = composed._region(out, stops, below, _checkable)
    if reg is None:
        return None
    order, free = reg
    inside, grew = set(order), True
    while grew:
        grew = False
        for m in list(inside):
            for u in m.users:
                if (u not in inside and (u.target in _SIZE_CHECKS or u.target in _SIZE_OPS)
                        and all(x in inside for x in u.all_input_nodes)):
                    inside.add(u)
                    grew = True
    return [m for m in out.graph.nodes if m in inside], free


def _holds(order, out, n, T, drafts, B: int, K: int) -> bool:
    with real_eval():
        gen = torch.Generator().manual_seed(59)
        pos = torch.arange(K + 1)[None, :]
        for span in (1 << 20, 3):
            for t in range(K + 1):
                cnt = (torch.arange(B) + t) % (K + 1)
                tgt = torch.randint(0, span, (B, K + 1), generator=gen)
                d = torch.randint(0, span, (B, K), generator=gen)
                d = torch.where(pos[:, :K] < cnt[:, None], tgt[:, :K], d)
                miss = (pos[:, :K] == cnt[:, None]) & (d == tgt[:, :K])
                d = torch.where(miss, tgt[:, :K] + 1, d)          # rejected at n
                env = {n: cnt, T: tgt.to(_val(T).dtype)}
                if drafts is not None:
                    env[drafts] = d.to(_val(drafts).dtype)
                try:
                    _run(order, env)
                    got = env[out]
                except (RuntimeError, TypeError, ValueError, IndexError) as e:
                    log.debug("npuspec passes: a greedy emission did not evaluate: %s", e)
                    return False
                want = torch.where(pos <= cnt[:, None], tgt, -1)
                if got.shape != want.shape or got.is_floating_point() or not torch.equal(
                        got.long(), want):
                    return False
    return True


def compose_greedy(graph: Graph, flavor: str) -> int:
    """Replace each greedy emission the check shows to be the greedy step's. -> replacements."""
    made = 0
    for g in [m for m in graph.nodes if m.target is torch.ops.npuspec.greedy_accept.default]:
        a = _bound(g)
        drafts, tgt = a["draft_ids"], a["target_ids"]
        T = _argmax_rows(tgt) if isinstance(tgt, Node) else None
        dv = _val(drafts) if isinstance(drafts, Node) else None
        if (T is None or dv is None or dv.dtype != torch.int64 or dv.dim() != 2
                or not _static(dv.shape)):
            continue
        B, K = dv.shape
        if not _shape_is(_val(T), (B, K + 1)):
            continue
        below = (_descendants(g) | _descendants(drafts) | _descendants(T)) - {g}
        outs = [m for m in graph.nodes if m in below and _is_emission(m, B, K)]
        for out in reversed(outs):
            if _replace(graph, g, T, drafts, out, below, B, K, flavor):
                made += 1
                break
    return made


def _replace(graph, g, T, drafts, out, below, B, K, flavor) -> bool:
    reg = _region(out, {g, T, drafts}, below)
    if reg is None:
        return False
    order, free = reg
    if free or out not in order:
        return False
    # T read elsewhere, itself or through a region value the user's other code reads (a
    # match mask kept for later), would be computed twice (the op takes its own argmax): left
    # as the greedy family leaves it
    tgt = _bound(g)["target_ids"]
    inner = set(order)
    if any(u not in inner and u is not tgt and u is not g for u in T.users) or any(
            u is not g and u not in inner for u in tgt.users):
        return False
    from_t = _descendants(T) & inner
    if any(u not in inner and u is not g for m in from_t if m is not out for u in m.users):
        return False
    reads_drafts = any(drafts in m.all_input_nodes for m in order)
    if not _holds(order, out, g, T, drafts if reads_drafts else None, B, K):
        return False
    owned = all(u in inner for m in order if m is not out for u in m.users)
    composed.replace_with_op(graph, out, g, flavor, (T.args[0], drafts, None, None, None, None,
                                                     None, None, False, None, None, None),
                             {"checks": False})
    if owned:  # the region is dead now: its size checks would keep it alive for nothing
        for m in reversed(order):
            if m.target in _SIZE_CHECKS:
                graph.erase_node(m)
    return True
