"""Picking each draft's probability, in one spelling (issue 13, point 6).

Codebases read p(x) at the drafted ids in several ways that move the same data:

    p.gather(-1, ids.unsqueeze(-1)).squeeze(-1)             # the form the families match
    p[batch_idx, pos_idx, ids]    # vLLM v0, vllm-ascend: arange(B)[:, None], arange(K), int32 too
                                  # (on p [B, K+1, V] it reads p[:, :K]: a slice is put first)
    p.view(-1, V)[torch.arange(B * K), ids.view(-1)].view(B, K)   # flat rows, one id per row
    p.gather(-1, ids3).reshape(B, K)                         # lucidrains: ids3 [B, K, 1], einops
    p.gather(-1, ids3)[..., 0]                               # also p.gather(-1, ids[..., None])[..., 0]

`canonical_picks` rewrites the others into the first. It also removes two things that hide a
pick from the families without changing any value: `x * 1` on a float (a lenience factor at its
default), and `zeros_like(x)` (or ones/empty/rand/randn) of a contiguous x, remade from x's
shape, so a draw `zeros_like(q).uniform_()` or `rand_like(ratio)` no longer counts as a second
user of q or of the ratio. A fill written over the picks afterwards (vLLM v1's `draft_px[pad] =
inf`, a bool [B, K] mask) moves before the pick, onto the rows of q, and the
`squeeze(unsqueeze(x, d), d)` that functionalizing that write leaves is x (or, for a pick
spelled `[..., 0]`, the `select(select_scatter(base, x, d, i), d, i)` it leaves). Each rewrite
is pure data movement with the same values: advanced indexing with `arange` rows and columns reads p[b,
k, ids[b, k]], which is what gather reads; int32 ids are widened to int64 (gather's index type),
which changes no id; a reshape that drops a trailing 1, or `[..., 0]` on it, is that squeeze.
The arange operands are checked by evaluating them (they are computed from constants only), so
any spelling of arange(B)[:, None] / arange(K) is recognised and nothing else is.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
from torch.fx import Graph, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from npuspec.passes import prefix
from npuspec.passes.rewrites.nodes import _static, _val, call_before, size_args

log = logging.getLogger("npuspec.passes")
aten = torch.ops.aten

MAX_CONST_NODES = 12  # an index operand built from more nodes than this is not an arange
_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def _const_value(n: Node) -> Optional[torch.Tensor]:
    """The value of `n` when it is computed from constants only (no inputs, no random ops)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    order = prefix.closure(None, n, MAX_CONST_NODES)
    if not order:
        return None
    try:
        with unset_fake_temporarily():
            v = prefix.run(order, {})
    except Exception as e:  # not evaluable here (device, shapes): not recognised
        log.debug("npuspec passes: index operand not evaluable: %s", e)
        return None
    return v if isinstance(v, torch.Tensor) else None


def _is_arange(n, size: int, shapes: tuple) -> bool:
    """n evaluates to arange(size), int32 or int64, in one of `shapes`."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    v = _const_value(n) if isinstance(n, Node) else None
    if v is None or v.dtype not in (torch.int32, torch.int64) or tuple(v.shape) not in shapes:
        return False
    with unset_fake_temporarily():  # v is a real tensor; the pass may run inside a fake trace
        return bool((v.reshape(-1).cpu() == torch.arange(size)).all())


def _long(graph: Graph, ids: Node, like: Node, flavor: str) -> Node:
    if _val(ids).dtype == torch.int64:
        return ids
    if flavor == "inductor":
        return call_before(graph, torch.ops.prims.convert_element_type.default,
                           (ids, torch.int64), like)
    with graph.inserting_before(like):
        n = graph.call_function(aten._to_copy.default, (ids,), {"dtype": torch.int64})
    n.meta["val"] = _val(ids).to(torch.int64)
    return n


def _gather_pick(graph: Graph, p: Node, ids: Node, like: Node, flavor: str) -> Node:
    """p.gather(2, ids.unsqueeze(2)).squeeze(2), inserted before `like`."""
    ids = _long(graph, ids, like, flavor)
    u = call_before(graph, aten.unsqueeze.default, (ids, 2), like)
    g = call_before(graph, aten.gather.default, (p, 2, u), like)
    return call_before(graph, aten.squeeze.dim, (g, 2), like)


def _index_pick(n: Node) -> Optional[tuple]:
    """(p, ids) when n is p[arange(B)[:, None], arange(K), ids] (or arange(K)[None, :]) with
    ids [B, K] on p [B, K, V], or on p [B, rows, V] with rows > K (the target's K+1 rows: the
    first K are picked, as from p[:, :K])."""
    if n.target is not aten.index.Tensor or len(n.args) != 2 or len(n.args[1]) != 3:
        return None
    p, (i0, i1, ids) = n.args[0], n.args[1]
    pv, iv = _val(p), _val(ids) if isinstance(ids, Node) else None
    # static K and V; the batch may be symbolic (Dynamo made it dynamic), compared without
    # adding a guard
    if (pv is None or iv is None or pv.dim() != 3 or iv.dim() != 2 or not _static(pv.shape[1:])
            or not _static(iv.shape[1:])):
        return None
    B, K = iv.shape
    if (iv.dtype not in (torch.int32, torch.int64) or not statically_known_true(pv.shape[0] == B)
            or pv.shape[1] < K):
        return None
    rows = _is_arange(i0, B, ((B, 1),)) if isinstance(B, int) else _symbolic_rows(i0, B)
    # the columns broadcast alike as arange(K) or arange(K)[None, :]
    if not (rows and _is_arange(i1, K, ((K,), (1, K)))):
        return None
    return p, ids


_ARANGES = {aten.arange.default: (), aten.arange.start: (0,), aten.arange.start_step: (0, 1)}


def _symbolic_rows(n, B) -> bool:
    """n is arange(B)[:, None] for a symbolic B. An arange of a symbolic size cannot be
    evaluated, so the structure itself is required: an unsqueeze at dim 1 of arange(B),
    arange(0, B) or arange(0, B, 1) (Inductor's decompositions: iota(B, start=0, step=1)), B
    the graph's own symbol for the batch."""
    if (not isinstance(n, Node) or n.target is not aten.unsqueeze.default
            or n.args[1] not in (1, -1) or not isinstance(n.args[0], Node)):
        return False
    a = n.args[0]
    if a.target is torch.ops.prims.iota.default:  # Inductor's arange
        kw = a.kwargs
        return (len(a.args) == 1 and _is_symbol(a.args[0], B)
                and all(type(kw.get(k)) is int for k in ("start", "step"))
                and (kw["start"], kw["step"]) == (0, 1)
                and kw.get("dtype") in (torch.int32, torch.int64))
    if (a.target not in _ARANGES or not set(a.kwargs) <= {"dtype", "device", "pin_memory", "layout"}
            or a.kwargs.get("dtype") not in (None, torch.int32, torch.int64)):
        return False
    fixed = _ARANGES[a.target]  # start (and step) as literals
    if len(a.args) != len(fixed) + 1:
        return False
    end = a.args[1] if fixed else a.args[0]
    parts = (a.args[0], a.args[2]) if len(fixed) == 2 else tuple(a.args[:len(fixed)])
    return (all(type(x) is int and x == f for x, f in zip(parts, fixed))
            and _is_symbol(end, B))


def _is_symbol(x, B) -> bool:
    """x is a node holding a symbolic size equal to B without a guard."""
    v = x.meta.get("val") if isinstance(x, Node) else None
    return isinstance(v, torch.SymInt) and statically_known_true(v == B)


def _flat_pick(n: Node) -> Optional[tuple]:
    """(p, ids) when n is p.view(-1, V)[arange(B * K), ids.view(-1)].view(B, K) with p
    [B, K, V] and ids [B, K]: row b * K + k of the flat view is p[b, k], and ids.view(-1) holds
    ids[b, k] at that row, so it reads what the gather reads."""
    if n.target not in _VIEWS or not isinstance(n.args[0], Node):
        return None
    ix, out = n.args[0], _val(n)
    if ix.target is not aten.index.Tensor or len(ix.args) != 2 or len(ix.args[1]) != 2:
        return None
    flat, (rows, fids) = ix.args[0], ix.args[1]
    if not (isinstance(flat, Node) and flat.target in _VIEWS and isinstance(fids, Node)
            and fids.target in _VIEWS):
        return None
    p, ids = flat.args[0], fids.args[0]
    pv, iv, fv = _val(p), _val(ids), _val(flat)
    if (out is None or pv is None or iv is None or fv is None or pv.dim() != 3 or iv.dim() != 2
            or out.dim() != 2 or not all(map(_static, (pv.shape, iv.shape, out.shape, fv.shape)))):
        return None
    B, K, V = pv.shape
    if (tuple(iv.shape) != (B, K) or tuple(out.shape) != (B, K) or tuple(fv.shape) != (B * K, V)
            or tuple(_val(fids).shape) != (B * K,) or iv.dtype not in (torch.int32, torch.int64)):
        return None
    return (p, ids) if _is_arange(rows, B * K, ((B * K,),)) else None


def _trailing_one_view(n: Node) -> bool:
    """A view/reshape of a [B, K, 1] gather to [B, K], or its `[..., 0]` (select of index 0
    on the last dim): the squeeze of its last dim."""
    select0 = n.target is aten.select.int and len(n.args) == 3 and n.args[1:] in ((2, 0), (-1, 0))
    if not select0 and n.target not in _VIEWS:
        return False
    x, out = n.args[0], _val(n)
    xv = _val(x)
    # symbolic sizes too where they are equal without a guard (a batch Dynamo made dynamic)
    return (isinstance(x, Node) and x.target is aten.gather.default and xv is not None
            and out is not None and xv.dim() == 3 and out.dim() == 2
            and statically_known_true(xv.shape[2] == 1)
            and all(statically_known_true(a == b) for a, b in zip(out.shape, xv.shape[:2])))


def _bare_index(n: Node) -> bool:
    """gather(p, 2, idx) with idx [B, K, 1] not already `ids.unsqueeze(2)`."""
    if n.target is not aten.gather.default or len(n.args) != 3 or n.args[1] not in (2, -1):
        return False
    idx = n.args[2]
    iv, pv = _val(idx), _val(n.args[0])
    return (isinstance(idx, Node) and iv is not None and pv is not None and pv.dim() == 3
            and iv.dim() == 3 and statically_known_true(iv.shape[2] == 1)
            and not (idx.target is aten.unsqueeze.default and idx.args[1] in (2, -1)))


def _unit_scale(n: Node) -> bool:
    """x * 1 or x / 1 on a float x (lucidrains' `* lenience` at its default): x, bit for bit."""
    if n.target not in (aten.mul.Tensor, aten.div.Tensor) or len(n.args) != 2 or n.kwargs:
        return False
    x, y = n.args
    xv, out = _val(x), _val(n)
    return (type(y) in (int, float) and y == 1 and xv is not None and out is not None
            and xv.is_floating_point() and out.dtype == xv.dtype and _static(xv.shape)
            and _static(out.shape) and tuple(out.shape) == tuple(xv.shape))


# rand_like / randn_like too: `empty_like(x).uniform_()` and `empty(shape).uniform_()` draw the
# same numbers from the same generator state for a contiguous x (gpt-fast draws its uniforms
# as `torch.rand_like(accept_draft_prob)`, which would otherwise block the ratio's match)
_LIKE = {aten.zeros_like.default: aten.zeros.default, aten.ones_like.default: aten.ones.default,
         aten.empty_like.default: aten.empty.memory_format,
         aten.rand_like.default: aten.rand.default, aten.randn_like.default: aten.randn.default}


def _shape_only_user(n: Node) -> bool:
    """zeros_like / ones_like / empty_like of a contiguous tensor whose sizes the graph has
    (literals, or a batch Dynamo made dynamic: its symbol is a graph input): a fresh tensor
    that reads only x's shape, dtype and device. Made from those it no longer counts as a user
    of x (which would block a pattern that has x inside)."""
    if n.target not in _LIKE or len(n.args) != 1:
        return False
    xv = _val(n.args[0])
    return (xv is not None and xv.is_contiguous() and size_args(n.graph, xv.shape) is not None
            and set(n.kwargs) <= {"pin_memory", "dtype", "layout", "device", "memory_format"}
            and n.kwargs.get("memory_format") in (None, torch.preserve_format, torch.contiguous_format))


def _fresh_like(graph: Graph, n: Node) -> Node:
    out = _val(n)
    with graph.inserting_before(n):
        new = graph.call_function(_LIKE[n.target], (size_args(graph, out.shape),),
                                  {"dtype": out.dtype, "device": out.device, "pin_memory": False})
    new.meta["val"] = out
    return new


# how a fill over the masked picks is written: index_put(x, [mask], c) (vLLM v1's
# `draft_px[pad] = inf`), x.masked_fill(mask, c), torch.where(mask, c, x)
_FILLS = {aten.index_put.default: "index_put", aten.masked_fill.Scalar: "masked_fill",
          aten.masked_fill.Tensor: "masked_fill", aten.where.self: "where"}


def _fill_parts(n: Node) -> Optional[tuple]:
    """(x, mask, c, kind) of a fill of x where mask holds, in one of the _FILLS spellings."""
    kind = _FILLS.get(n.target)
    if kind is None or len(n.args) != 3 or n.kwargs:
        return None
    if kind == "index_put":
        x, indices, c = n.args
        if len(indices) != 1:
            return None
        return x, indices[0], c, kind
    if kind == "masked_fill":
        x, mask, c = n.args
        return x, mask, c, kind
    mask, c, x = n.args
    return x, mask, c, kind


def _filled_pick(n: Node) -> Optional[tuple]:
    """(q, U, mask, c, kind) when n fills squeeze(gather(q, 2, U), 2) with a one-element c
    where the bool [B, K] mask holds (vLLM v1's `draft_px[pad] = inf`: padded slots never
    accepted), as index_put, masked_fill or where (_FILLS)."""
    parts = _fill_parts(n)
    if parts is None:
        return None
    x, mask, c, kind = parts
    if (not isinstance(x, Node) or x.target is not aten.squeeze.dim or x.args[1] != 2
            or not isinstance(mask, Node)):
        return None
    g = x.args[0]
    if g.target is not aten.gather.default or len(g.args) != 3 or g.args[1] != 2 or g.kwargs:
        return None
    q, U = g.args[0], g.args[2]
    qv, xv, mv, nv = _val(q), _val(x), _val(mask), _val(n)
    cv = _val(c) if isinstance(c, Node) else c
    if any(v is None for v in (qv, xv, mv, nv, cv)) or qv.dim() != 3 or xv.dim() != 2:
        return None
    if isinstance(cv, torch.Tensor) and (cv.dim() != 0 or cv.dtype != qv.dtype):
        return None
    if not isinstance(cv, (torch.Tensor, float, int)) or isinstance(cv, bool):
        return None
    if (mv.dtype != torch.bool or mv.dim() != 2 or nv.dtype != qv.dtype
            or not all(prefix._same(a, b) for a, b in zip(mv.shape, xv.shape))):
        return None
    return q, U, mask, c, kind


def _fill_before_pick(graph: Graph, n: Node) -> Optional[Node]:
    """fill(q.gather(2, U).squeeze(2), mask, c) -> fill(q, mask, c).gather(2, U).squeeze(2),
    the fill spelled as the user spelled it. The bool [B, K] mask selects whole [V] rows of q,
    so every id picked from a masked row reads c and every other pick reads q: the same
    values, bit for bit (the result's dtype is q's, checked), with q's pick in the families'
    form. It costs a [B, K, V] copy of q where the fill was [B, K]."""
    found = _filled_pick(n)
    if found is None:
        return None
    q, U, mask, c, kind = found
    if kind == "index_put":
        filled = call_before(graph, aten.index_put.default, (q, [mask], c), n)
    else:
        rows = call_before(graph, aten.unsqueeze.default, (mask, 2), n)            # [B, K, 1]
        filled = call_before(graph, n.target,
                             (q, rows, c) if kind == "masked_fill" else (rows, c, q), n)
    g = call_before(graph, aten.gather.default, (filled, 2, U), n)
    return call_before(graph, aten.squeeze.dim, (g, 2), n)


def picked_fill(graph: Graph, f: Node, q: Node, ids: Node) -> Optional[Node]:
    """The inverse of `_fill_before_pick` where only the picks are read: for f = fill(q, mask
    rows, c) (a bool [B, K] mask over whole [V] rows of q, spelled as _FILLS), ->
    fill(q.gather(2, ids[..., None]), mask rows, c), [B, K, 1]: at every id the values f gives,
    bit for bit, without f's [B, K, V] copy of q. c a scalar or a 0-d tensor of q's dtype (a
    lifted `torch.tensor(inf)`). Inserted before f. None when f is not that fill of q, or ids
    are not int64 [B, K]."""
    parts = _fill_parts(f)
    if parts is None:
        return None
    x, mask, c, kind = parts
    if x is not q or not isinstance(mask, Node):
        return None
    if kind != "index_put":
        if mask.target is not aten.unsqueeze.default or mask.args[1] != 2:
            return None
        mask = mask.args[0]
    qv, mv, iv = _val(q), _val(mask), _val(ids)
    cv = _val(c) if isinstance(c, Node) else c
    if isinstance(cv, torch.Tensor) and (cv.dim() != 0 or qv is None or cv.dtype != qv.dtype):
        return None
    if (any(v is None for v in (qv, mv, iv)) or qv.dim() != 3 or mv.dtype != torch.bool
            or mv.dim() != 2 or iv.dtype != torch.int64 or tuple(iv.shape) != tuple(mv.shape)
            or not isinstance(cv, (float, int, torch.Tensor)) or isinstance(cv, bool)):
        return None
    u = call_before(graph, aten.unsqueeze.default, (ids, 2), f)                       # [B, K, 1]
    g = call_before(graph, aten.gather.default, (q, 2, u), f)                         # [B, K, 1]
    if kind == "index_put":
        return call_before(graph, aten.index_put.default, (g, [mask], c), f)
    rows = call_before(graph, aten.unsqueeze.default, (mask, 2), f)
    return call_before(graph, f.target, (g, rows, c) if kind == "masked_fill" else (rows, c, g), f)


def _read_back(n: Node) -> bool:
    """select(select_scatter(base, x, d, i), d, i): x itself (what functionalizing a write into
    a `[..., 0]` view leaves behind: vLLM v1's `draft_px[pad] = inf` on a pick spelled
    `gather(...)[..., 0]`); reading back the scattered slice gives x's values exactly."""
    if n.target is not aten.select.int or len(n.args) != 3 or n.kwargs:
        return False
    ss = n.args[0]
    if not (isinstance(ss, Node) and ss.target is aten.select_scatter.default
            and len(ss.args) == 4 and not ss.kwargs):
        return False
    sv, xv = _val(ss), _val(ss.args[1])
    if (sv is None or xv is None or not isinstance(n.args[1], int)
            or not isinstance(ss.args[2], int)):
        return False
    same_dim = n.args[1] % sv.dim() == ss.args[2] % sv.dim()
    return same_dim and n.args[2] == ss.args[3] and xv.dtype == sv.dtype and all(
        m.op != "output" for m in n.users)


def _undone_unsqueeze(n: Node) -> bool:
    """squeeze(unsqueeze(x, d), d): x itself (what functionalizing a write into a squeezed view
    leaves behind); not when it is a graph output, which must not become x."""
    if n.target is not aten.squeeze.dim or len(n.args) != 2:
        return False
    u = n.args[0]
    return (isinstance(u, Node) and u.target is aten.unsqueeze.default and len(u.args) == 2
            and u.args[1] == n.args[1] and isinstance(u.args[1], int) and u.args[1] >= 0
            and all(m.op != "output" for m in n.users))


def canonical_picks(graph: Graph, flavor: str = "aten") -> int:
    """Rewrite the pick spellings above into gather/unsqueeze/squeeze (and drop the exact
    no-ops and shape-only uses that would hide one). Returns how many."""
    done = 0
    for n in list(graph.nodes):
        if n.op != "call_function":
            continue
        if _unit_scale(n):
            n.replace_all_uses_with(n.args[0])
            done += 1
            continue
        if _shape_only_user(n):
            n.replace_all_uses_with(_fresh_like(graph, n))
            graph.erase_node(n)  # a random op is impure: dead code elimination could keep it
            done += 1
            continue
        pick = _index_pick(n) or _flat_pick(n)
        if pick is not None:
            p, ids = pick
            K = _val(ids).shape[1]
            if _val(p).shape[1] > K:  # the slice canonical.canonicalize writes for p[:, :K]
                p = call_before(graph, aten.slice.Tensor, (p, 1, 0, K), n)
            new = _gather_pick(graph, p, ids, n, flavor)
        elif _bare_index(n):
            idx = n.args[2]
            ids = call_before(graph, aten.squeeze.dim, (idx, 2), n)
            u = call_before(graph, aten.unsqueeze.default, (ids, 2), n)
            new = call_before(graph, aten.gather.default, (n.args[0], 2, u), n)
        elif _trailing_one_view(n):
            new = call_before(graph, aten.squeeze.dim, (n.args[0], 2), n)
        elif _undone_unsqueeze(n):
            new = n.args[0].args[0]
        elif _read_back(n):
            new = n.args[0].args[1]
        elif (new := _fill_before_pick(graph, n)) is None:
            continue
        n.replace_all_uses_with(new)
        done += 1
    if done:
        graph.eliminate_dead_code()
        log.info("npuspec passes: %d probability picks put into the gather form", done)
    return done
