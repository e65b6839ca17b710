"""Whole steps composed from the narrow ops: one `npuspec::rejection_sample` call (issue 37,
point 3; docs/passes.md, "Whole steps from their pieces").

vLLM v1's `forward_native` (random and n-gram drafts) reaches the end of the families as

    n   = ratio_accept(p[:, :K], q_test, ids, u)                     # [B]
    rec = residual_sample(p[:, :K], q, E, "row", "race", "clamp", 1e-5)  # [B, K]
    out = <the user's emission from n, rec, ids and their bonus tokens>  # [B, K+1]

(its padded slots write inf into the test's q only, so q_test and q differ). Nothing about the
emission is spelled the same way twice in the field, so it is matched by what it computes:
`out`'s region (the nodes between {n, rec} and out, with the constants they read) may read
only n, rec, the test's own ids and one int [B] or [B, 1] tensor (the bonus), and evaluated
on every accepted count 0..K in every row, with distinct and with colliding token values, it
must give exactly `ids before n, rec[n] (or the bonus at n = K) at n, -1 after`. Then `out`
becomes the op's tokens in composed mode (kernels/verify_composed.py), which reads the same
inputs, races only row n, and equals the narrow ops' result bit for bit; other readers of n
read num_emitted - 1. A region that reads anything else, or computes anything else, is left
as written. As with the recovered-token check, this is an evaluation on a finite set: the
region is integer indexing and selection, where the set covers every count per row.
"""
from __future__ import annotations

import logging
import operator
from typing import Optional

import torch
import torch.nn.functional as F
from torch.fx import Graph, Node

from npuspec.passes import picks, search_memo
from npuspec.passes.prefix import _attr
from npuspec.passes.residual_proof import _cpu
from npuspec.passes.rewrites.nodes import _cast, _fake_meta, _static, _val, eager_op, real_eval

log = logging.getLogger("npuspec.passes")
aten = torch.ops.aten
MAX_REGION = 80
_RESIDUAL_KEYS = ("normalize", "sampler", "nonneg", "floor", "guard", "fill")


def _bound(n: Node) -> dict:
    """An op node's arguments by schema name, defaults filled in."""
    schema = n.target._schema
    out = {}
    for i, a in enumerate(schema.arguments):
        if i < len(n.args):
            out[a.name] = n.args[i]
        elif a.name in n.kwargs:
            out[a.name] = n.kwargs[a.name]
        elif a.has_default_value():
            out[a.name] = a.default_value
    return out


def _pure(n: Node) -> bool:
    t = n.target
    if n.op != "call_function":
        return False
    if t is operator.getitem:
        return True
    return (isinstance(t, torch._ops.OpOverload) and not t._schema.is_mutable
            and torch.Tag.nondeterministic_seeded not in t.tags)


def _same_value(a, b) -> bool:
    """Two nodes that compute the same value: the same node, or the same pure op on the same
    values (the two `p[:, :K]` slices AOT makes for the test and the residual)."""
    if a is b:
        return True
    if not (isinstance(a, Node) and isinstance(b, Node)) or not (_pure(a) and _pure(b)):
        return False
    if a.target is not b.target or len(a.args) != len(b.args) or a.kwargs != b.kwargs:
        return False
    return all(_same_value(x, y) if isinstance(x, Node) else x == y
               for x, y in zip(a.args, b.args))


def _descendants(n: Node, cap: int = 400) -> set:
    seen, todo = set(), [n]
    while todo and len(seen) < cap:
        for u in todo.pop().users:
            if u not in seen:
                seen.add(u)
                todo.append(u)
    return seen


def _constant(n: Node) -> bool:
    """Made of literals alone (arange, full, scalar_tensor, a lifted attribute)."""
    if n.op == "get_attr":
        return True
    return _pure(n) and all(_constant(a) for a in n.all_input_nodes)


def _region(out: Node, stops: set, below: set, allowed=_pure,
            cap: int = MAX_REGION) -> Optional[tuple[list, list]]:
    """(the nodes computing `out` from `stops` (n, rec), from nodes in `below` and from
    constants, in graph order; the other tensors they read), or None when a node is not
    `allowed` (impure) or the region is too large."""
    inside, free, todo = {out}, set(), [out]
    while todo:
        m = todo.pop()
        if m.op == "get_attr":  # a constant: nothing to read
            continue
        if not allowed(m):
            return None
        for a in m.all_input_nodes:
            if a in inside or a in free or a in stops:
                continue
            if a in below or _constant(a):
                inside.add(a)
                todo.append(a)
            else:
                free.add(a)
        if len(inside) > cap:
            return None
    order = [m for m in out.graph.nodes if m in inside]
    return order, [m for m in out.graph.nodes if m in free]


def _run(order: list, env: dict) -> torch.Tensor:
    """The region on real CPU tensors (also inside a fake-tensor trace)."""
    for m in order:
        if m.op == "get_attr":
            env[m] = _attr(m).detach().cpu()
            continue
        args = tuple(_arg(a, env) for a in m.args)
        kwargs = {k: _arg(a, env) for k, a in m.kwargs.items()}
        env[m] = eager_op(m.target)(*args, **kwargs)
    return env[order[-1]]


def _arg(a, env: dict):
    """A node argument's value: nodes from env, devices as the CPU (lists and tuples kept;
    a plain recursion: pytree's tree_map was most of a region's evaluation time)."""
    if isinstance(a, Node):
        return env[a]
    if isinstance(a, (list, tuple)):
        return type(a)(_arg(x, env) for x in a)
    return _cpu(a)


def _emission_holds(order, n, rec, ids, bonus, B: int, K: int) -> bool:
    """Evaluate the region for every count in every row, tokens distinct per source and then
    colliding; compare with ids before n, rec[n] or the bonus at n, -1 after."""
    bshape = tuple(_val(bonus).shape)
    with real_eval():
        gen = torch.Generator().manual_seed(53)
        pos = torch.arange(K + 1)[None, None, :]
        cnts = (torch.arange(B)[None, :] + torch.arange(K + 1)[:, None]) % (K + 1)  # [K+1, B]
        for span, apart in ((1 << 20, True), (3, False)):  # distinct per source, then colliding
            x = torch.randint(0, span, (B, K), generator=gen)
            r = torch.randint(0, span, (B, K), generator=gen) + (span if apart else 0)
            bo = torch.randint(0, span, (B,), generator=gen) + (2 * span if apart else 0)
            # every count in every row: run t gives row b the count (b + t) % (K + 1)
            tok = torch.where(cnts < K, r.T.gather(0, cnts.clamp_max(K - 1))
                              if K else bo.expand(K + 1, B), bo)             # [K+1, B]
            wants = torch.where(pos < cnts[..., None], F.pad(x, (0, 1), value=-1), -1)
            wants = torch.where(pos == cnts[..., None], tok[..., None], wants)  # [K+1, B, K+1]
            env0 = {rec: r.to(_val(rec).dtype), ids: x.to(_val(ids).dtype),
                    bonus: bo.reshape(bshape).to(_val(bonus).dtype)}
            for cnt, want in zip(cnts, wants):
                try:
                    got = _run(order, {n: cnt, **env0})
                except (RuntimeError, TypeError, ValueError, IndexError) as e:
                    log.debug("npuspec passes: an emission region did not evaluate: %s", e)
                    return False
                if got.shape != want.shape or got.is_floating_point() or not torch.equal(
                        got.long(), want):
                    return False
    return True


def _pairs(graph: Graph):
    """(ratio_accept node, residual_sample node) reading the same p."""
    tests = [m for m in graph.nodes if m.target is torch.ops.npuspec.ratio_accept.default]
    races = [m for m in graph.nodes if m.target is torch.ops.npuspec.residual_sample.default]
    for t in tests:
        a = _bound(t)
        for r in races:
            if _same_value(_bound(r)["p"], a["p"]):
                yield t, r


def _shapes_ok(t: Node, r: Node) -> Optional[tuple[int, int]]:
    """(B, K) when the test is over ids [B, K] with q given and the race gives [B, K] from
    inputs broadcasting to p's [B, K, V]; else None."""
    a, b = _bound(t), _bound(r)
    ids, p = _val(a["draft_ids"]), _val(a["p"])
    if a["q"] is None or ids is None or p is None or ids.dim() != 2 or not _static(p.shape):
        return None
    B, K = ids.shape
    V = p.shape[-1]
    if not _static(ids.shape) or not _shape_is(p, (B, K, V)) or not _shape_is(_val(r), (B, K)):
        return None
    try:
        for x in (b["q"], b["noise"], a["q"]):
            if (not isinstance(x, Node) or _val(x) is None or not _static(_val(x).shape)
                    or torch.broadcast_shapes(_val(x).shape, (B, K, V)) != (B, K, V)):
                return None
    except RuntimeError:
        return None
    return B, K


def compose_steps(graph: Graph, flavor: str) -> int:
    """Replace each emission the check shows to be the composed step's. -> replacements."""
    made = 0
    for t, r in list(_pairs(graph)):
        bk = _shapes_ok(t, r)
        if bk is None:
            continue
        B, K = bk
        below = _descendants(t) | _descendants(r)
        outs = [m for m in graph.nodes if m in below and _is_emission(m, B, K)]
        for out in reversed(outs):
            if _replace(graph, t, r, out, below, B, K, flavor):
                made += 1
                break
    return made


def _shape_is(v, shape: tuple) -> bool:
    """v's shape is `shape`, read without a guard (a data-dependent size is never equal)."""
    return v is not None and _static(v.shape) and tuple(v.shape) == shape


def _is_emission(m: Node, B: int, K: int) -> bool:
    v = _val(m)
    return (_shape_is(v, (B, K + 1)) and not v.is_floating_point()
            and v.dtype != torch.bool)


def _replace(graph: Graph, t: Node, r: Node, out: Node, below: set, B: int, K: int,
             flavor: str) -> bool:
    a = _bound(t)
    # what the emission derives from the ids (the pad column's `full_like(ids[:, :1], -1)`)
    # is inside too, so the ids themselves are the leaf
    reg = _region(out, {t, r}, below | (_descendants(a["draft_ids"]) - {a["draft_ids"]}))
    if reg is None:
        return False
    order, free = reg
    ids = next((f for f in free if _same_value(f, a["draft_ids"])), None)
    rest = [f for f in free if f is not ids]
    if ids is None or len(rest) != 1:
        return False
    bonus = rest[0]
    bv = _val(bonus)
    if (bv is None or bv.is_floating_point() or bv.dtype == torch.bool
            or not (_shape_is(bv, (B,)) or _shape_is(bv, (B, 1)))):
        return False
    if not _emission_checked(order, t, r, ids, bonus, B, K):
        return False
    b = _bound(r)
    kw = {f"residual_{k}": b[k] for k in _RESIDUAL_KEYS}
    q_test = None if _same_value(a["q"], b["q"]) else a["q"]
    if q_test is not None and len(q_test.users) == 1:
        # vLLM v1's pad fill, moved onto q by picks._fill_before_pick so the families could
        # read it: the op reads the test's q only at the ids, so it takes the filled picks
        # [B, K, 1] instead of a [B, K, V] copy of q (5 MB a step at B = 8, K = 4, V = 32000)
        q_test = picks.picked_fill(graph, q_test, b["q"], a["draft_ids"]) or q_test
    replace_with_op(graph, out, t, flavor,
                    (a["p"], a["draft_ids"], b["q"], None, None, None, a["uniforms"], b["noise"],
                     False, None, None, None, bonus, q_test),
                    {"target_is_probs": True, "accept_mode": a["mode"], **kw})
    return True


# Emission checks made, by region: one that held is taken at other batch sizes without
# evaluating it again when its nodes and literals are equal once the literals equal to B (and
# B +- 1) are written by name (the same code at another size); one that failed is remembered
# for its sizes only. As in composed_ragged, evidence on the cases checked, not a proof.
_HELD: dict = {}


def _emission_checked(order, t, r, ids, bonus, B: int, K: int) -> bool:
    inputs = [t, r, ids, bonus]
    nodes = search_memo.nodes_key(order, inputs, symbols=search_memo.size_names(B=B))
    key = None if nodes is None else (nodes, K, tuple((_val(x).dtype, _val(x).dim())
                                                      for x in inputs))
    if key is not None:
        for k in ((key,), (key, B)):  # held at any size, or failed at this one
            if k in _HELD:
                return _HELD[k]
    held = _emission_holds(order, t, r, ids, bonus, B, K)
    if key is not None:
        search_memo.remember(_HELD, (key,) if held else (key, B), held)
    return held


def replace_with_op(graph: Graph, out: Node, count: Node, flavor: str, args: tuple,
                    kwargs: dict) -> None:
    """One rejection_sample(*args, **kwargs) before `out`: its tokens (cast to out's dtype)
    replace out, and num_emitted - 1 replaces every reader of the count node (region nodes
    still read elsewhere read it too)."""
    with graph.inserting_before(out):
        op = _fake_meta(graph.call_function(torch.ops.npuspec.rejection_sample.default, args,
                                            kwargs))
        tok, num = (graph.call_function(operator.getitem, (op, i)) for i in (0, 1))
        tok.meta["val"], num.meta["val"] = op.meta["val"]
        new = _fake_meta(_cast(graph, tok, _val(out).dtype, flavor))
        n_new = _fake_meta(_cast(graph, num, torch.int64, flavor))
        n_new = _fake_meta(graph.call_function(aten.sub.Tensor, (n_new, 1)))
    out.replace_all_uses_with(new)
    count.replace_all_uses_with(n_new)
