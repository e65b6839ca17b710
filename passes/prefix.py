"""Accepted-prefix counts proven by exhaustive evaluation (issue 13, point 6).

Codebases spell "the number of leading accepted drafts" in many ways: `cumprod().sum()`,
`(~ok).cumsum() < 1`, the argmax of the first rejection with an all-accepted special case,
`(ok.cumsum() - 1) == arange(K)`, an unrolled per-position loop, a bare `ok[:, 0]` when K = 1.
Instead of one pattern per spelling, `prove_prefix_counts` finds every sub-graph that computes
a count [B] (or [B, 1], or a scalar when B = 1) from one boolean [B, K] tensor `ok` and
constants only, evaluates it on all 2^K masks, and, when it equals the prefix length on every
one, replaces it with the canonical spelling `ok.cumprod(1).sum(1)` (cast back to the
user's dtype). A count of leading Falses (the tensor holds rejections, as lucidrains'
`find_first_true_index(r > p / q)` = `((r > p / q).cumsum(-1) == 0).sum(-1)` does) becomes
`(~ok).cumprod(1).sum(1)`. The pattern families then see one form (GreedyAccept,
GreedyVerify, RatioAccept's rejection spellings).

A proof over every mask is a proof: the sub-graph reads nothing but `ok`, and the masks are
all of its values. K is limited to MAX_K (2^K evaluations, batched); random ops, graph inputs
(but `ok`'s own batch size) and data-dependent shapes end the search for that sub-graph, which
is then left as written. Where a proven count's mask `ok.cumprod(1)` is used elsewhere too, it
is rebuilt from the count (`masks_from_counts`).
"""
from __future__ import annotations

import itertools
import logging
from typing import Optional

import torch
from torch.fx import Graph, Node
from torch.utils._pytree import tree_map

from npuspec.passes.rewrites.nodes import _cast, _fake_meta, _val, eager_op, real_eval
from npuspec.passes.rowlocal import row_local

log = logging.getLogger("npuspec.passes")
aten = torch.ops.aten

MAX_K = 12
MAX_NODES = 40  # nodes between `ok` and a count: larger sub-graphs are not verify code


def _flags(graph: Graph) -> list[Node]:
    out = []
    for n in graph.nodes:
        v = _val(n)
        if (v is not None and v.dtype == torch.bool and v.dim() == 2
                and isinstance(v.shape[1], int) and 1 <= v.shape[1] <= MAX_K):
            out.append(n)
    return out


def closure(ok: Optional[Node], n: Node, budget: int = MAX_NODES) -> Optional[list[Node]]:
    """The nodes computing `n` from `ok` and constants (from constants only when `ok` is
    None), in graph order, or None when `n` reads anything else (a graph input, a random op,
    more than `budget` nodes). The batch size of `ok` as a SymInt input (`zeros(B, 1)` under
    a dynamic batch) counts as part of `ok`: the evaluation binds it to the rows it runs."""
    seen, stack = set(), [n]
    while stack:
        m = stack.pop()
        if m is ok or m in seen:
            continue
        if m.op == "get_attr" and _attr(m) is not None:  # a lifted constant (arange(K))
            seen.add(m)
            continue
        if m.op == "placeholder" and ok is not None and _is_batch_size(m, ok):
            seen.add(m)
            continue
        if m.op != "call_function" or len(seen) >= budget:
            return None
        t = m.target
        if isinstance(t, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in t.tags:
            return None
        seen.add(m)
        stack.extend(m.all_input_nodes)
    if ok is not None and ok not in _inputs(seen):
        return None
    return [m for m in n.graph.nodes if m in seen]


def _is_batch_size(m: Node, ok: Node) -> bool:
    v, b = m.meta.get("val"), _val(ok).shape[0]
    return isinstance(v, torch.SymInt) and not isinstance(b, int) and _same(v, b)


def _attr(m: Node):
    obj = m.graph.owning_module
    for part in str(m.target).split("."):
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, torch.Tensor) else None


def _inputs(nodes) -> set:
    return {a for m in nodes for a in m.all_input_nodes}


def run(order: list[Node], env: dict):
    """Evaluate `order` on the values in `env` (node -> tensor); -> the last node's value."""
    for m in order:
        if m in env:  # bound by the caller (the batch size)
            continue
        if m.op == "get_attr":
            env[m] = _attr(m)
            continue
        args = tree_map(lambda a: env[a] if isinstance(a, Node) else a, m.args)
        kwargs = tree_map(lambda a: env[a] if isinstance(a, Node) else a, m.kwargs)
        env[m] = eager_op(m.target)(*args, **kwargs)
    return env[order[-1]]


def _all_masks(k: int) -> torch.Tensor:
    return torch.tensor(list(itertools.product((False, True), repeat=k)), dtype=torch.bool)


def _prefix(masks: torch.Tensor) -> torch.Tensor:
    return masks.long().cumprod(1).sum(1)


def _same(a, b) -> bool:
    """Sizes equal without asking the shape environment (no guards)."""
    if isinstance(a, int) or isinstance(b, int):
        return isinstance(a, int) and isinstance(b, int) and a == b
    return a.node.expr == b.node.expr


def _shape_kind(n: Node, b) -> Optional[str]:
    v = _val(n)
    if v is None or v.dtype == torch.bool or v.is_complex():
        return None
    if v.dim() == 1 and _same(v.shape[0], b):
        return "rows"
    if v.dim() == 2 and _same(v.shape[0], b) and v.shape[1] == 1:
        return "keepdim"
    if v.dim() == 0 and isinstance(b, int) and b == 1:
        return "scalar"
    return None


def _proves(order, ok: Node, kind: str, b) -> Optional[bool]:
    """Evaluate on all 2^K masks (in chunks of B rows when B is baked into the graph), on real
    tensors even when the pass runs inside a fake-tensor trace. True: the count of leading
    Trues of `ok`; False: of leading Falses (`ok` holds rejections, as in
    `(reject.cumsum(-1) == 0).sum(-1)`); None: neither."""
    with real_eval():
        return _proves_real(order, ok, kind, b)


def _proves_real(order, ok: Node, kind: str, b) -> Optional[bool]:
    k = _val(ok).shape[1]
    masks = _all_masks(k)
    rows = b if isinstance(b, int) else len(masks)
    try:
        got = []
        for i in range(0, len(masks), rows):
            chunk = masks[i:i + rows]
            if len(chunk) < rows:  # repeat the last mask: the slice's shapes stay as traced
                chunk = torch.cat([chunk, chunk[-1:].expand(rows - len(chunk), k)])
            if kind == "scalar":
                r = torch.stack([run(order, {ok: chunk[j:j + 1]}).reshape(()) for j in range(rows)])
            else:
                sizes = {m: rows for m in order if m.op == "placeholder"}  # the batch size
                r = run(order, {ok: chunk, **sizes}).reshape(rows)
            got.append(r[:min(rows, len(masks) - i)])
        got = torch.cat(got)
    except Exception as e:  # an op this evaluation cannot run (shapes, device): no proof
        log.debug("npuspec passes: prefix proof not evaluable: %s", e)
        return None
    for leading, want in ((True, _prefix(masks)), (False, _prefix(~masks))):
        if got.shape == want.shape and bool((got.to(torch.float64) == want.to(torch.float64)).all()):
            return leading
    return None


def _canonical(graph: Graph, ok: Node, like: Node, kind: str, flavor: str,
               leading: bool = True) -> Node:
    """`ok.cumprod(1).sum(1)` (every family's first prefix spelling), or `(~ok).cumprod(1)
    .sum(1)` for a count of leading Falses, cast and shaped like `like`."""
    v = _val(like)
    with graph.inserting_before(like):
        root = x = ok if leading else _negated(graph, ok)
        x = graph.call_function(aten.cumprod.default, (x, 1))  # int64 from bool
        x = graph.call_function(aten.sum.dim_IntList, (x, [1]))
        if v.dtype != torch.int64:
            x = _cast(graph, x, v.dtype, flavor)
        if kind == "keepdim":
            x = graph.call_function(aten.unsqueeze.default, (x, 1))
        elif kind == "scalar":
            x = graph.call_function(aten.sum.default, (x,))
    _fill_meta(graph, root, x)
    return x


# `~(a != b)` is `a == b` for every value, NaN included (IEEE `!=` is exactly "not equal"), so
# a rejection mask spelled with `!=` becomes the accept mask the families match. Order
# comparisons have no such twin (`~(u > r)` is not `u <= r` for NaN): those stay negated.
_NEGATION = {aten.ne.Tensor: aten.eq.Tensor, aten.ne.Scalar: aten.eq.Scalar,
             aten.eq.Tensor: aten.ne.Tensor, aten.eq.Scalar: aten.ne.Scalar}


def _negated(graph: Graph, ok: Node) -> Node:
    if ok.op == "call_function" and ok.target in _NEGATION and not ok.kwargs:
        x = graph.call_function(_NEGATION[ok.target], ok.args)
    else:
        x = graph.call_function(aten.bitwise_not.default, (ok,))
    x.meta["val"] = _val(ok)  # same shape and dtype (bool)
    return x


def _fill_meta(graph: Graph, root: Node, last: Node) -> None:
    """meta['val'] for the new nodes after `root` (the pattern matcher's checks read it): the
    ops run on the fake value of `root`, which dispatches through its own fake mode."""
    new, m = [], last
    while m is not root:
        new.append(m)
        m = m.args[0]
    for n in reversed(new):
        _fake_meta(n)


def prove_prefix_counts(graph: Graph, flavor: str = "aten") -> int:
    """Replace every proven prefix-count sub-graph by the canonical spelling. Returns how many."""
    done, made = 0, []
    for ok in _flags(graph):
        b = _val(ok).shape[0]
        proven: set = set()
        # innermost first: the count itself, before the views and casts of it downstream
        for n in list(graph.nodes):
            if n in proven or n.op != "call_function" or n is ok:
                continue
            kind = _shape_kind(n, b)
            if kind is None:
                continue
            order = closure(ok, n)
            if order is None or _is_canonical(order, ok) or not row_local(order, ok, n):
                continue
            leading = _proves(order, ok, kind, b)
            if leading is None:
                continue
            new = _canonical(graph, ok, n, kind, flavor, leading)
            n.replace_all_uses_with(new)
            proven.update(order)
            made.append(new)
            done += 1
    masks = masks_from_counts(graph, flavor, made)
    if done or masks:
        graph.eliminate_dead_code()
        log.info("npuspec passes: %d accepted-prefix counts proven and canonicalised, %d masks "
                 "rebuilt from them", done, masks)
    return done


def masks_from_counts(graph: Graph, flavor: str, made: list) -> int:
    """For each count the proof wrote (`made`: its final nodes), `n = ok.cumprod(1).sum(1)`,
    the users of the user's own `ok.cumprod(1)` (the accept mask, vLLM v1's kept tokens, when
    the count was spelled from it another way) read `(arange(K) < n[:, None])` as int64
    instead. For a bool ok the cumprod is 1 exactly at the positions before the first False,
    which is that comparison: the same int64 values. Without it the family still matches the
    count, but the user's whole accept chain (picks, ratio, compare, cumprod) stays in the graph
    beside the fused op to feed the mask; with it, that chain is gone. A mask beside a count
    written `mask.sum(1)` is left as written (test_near_miss.py: an extra use blocks that
    match)."""
    done = 0
    for s in filter(None, map(_sum_of, made)):
        ok = _counted_flags(s)
        pos = {m: i for i, m in enumerate(graph.nodes)}
        cs = sorted(_mask_cumprods(ok), key=pos.__getitem__)
        others = [(c, u) for c in cs for u in c.users if u is not s]
        if not others:
            continue
        # s moves up to the earliest cumprod, reading it when it is ok's own (else s's own
        # cumprod moves with it: both read only ok), so the mask made right after s comes
        # before every user it takes over
        if _cumprod_of(cs[0], ok):
            s.replace_input_with(s.args[0], cs[0])
        elif s.args[0] is not cs[0]:
            cs[0].append(s.args[0])
            cs = [s.args[0]] + cs
        cs[0].append(s)
        mask = _mask_from_count(graph, s, _val(ok).shape[1], flavor)
        for c, u in others:
            u.replace_input_with(c, mask)
        done += 1
    return done


def _mask_cumprods(ok: Node) -> list:
    """`ok.cumprod(1)`, and `ok.long().cumprod(1)` (any integer cast of ok whose cumprod is
    int64): the same int64 values, 1 before the first False and 0 from it on."""
    out = [c for c in ok.users if _cumprod_of(c, ok)]
    for cast in ok.users:
        v = _val(cast)
        if (cast.op != "call_function" or len(cast.all_input_nodes) != 1 or v is None
                or v.dtype not in (torch.int32, torch.int64) or v.shape != _val(ok).shape
                or cast.target not in (aten._to_copy.default,
                                       torch.ops.prims.convert_element_type.default)):
            continue
        out += [c for c in cast.users if _cumprod_of(c, cast) and _val(c).dtype == torch.int64]
    return out


def _sum_of(new: Node) -> Optional[Node]:
    """The `sum(cumprod(ok, 1), [1])` under the casts and shaping `_canonical` adds, when its
    ok is a bool [B, K] (not a negation, which no user's cumprod reads)."""
    while isinstance(new, Node) and _counted_flags(new) is None:
        if new.op != "call_function" or not new.args:
            return None
        new = new.args[0]
    return new if isinstance(new, Node) else None


def _cumprod_of(c: Node, ok: Node) -> bool:
    return (c.op == "call_function" and c.target is aten.cumprod.default and not c.kwargs
            and len(c.args) == 2 and c.args[0] is ok and c.args[1] == 1)


def _counted_flags(s: Node) -> Optional[Node]:
    """ok when s is sum(cumprod(ok, 1), [1]) of a bool [B, K] ok with a static K."""
    if s.op != "call_function" or s.target is not aten.sum.dim_IntList or s.kwargs:
        return None
    if len(s.args) != 2 or list(s.args[1]) != [1] or not isinstance(s.args[0], Node):
        return None
    c = s.args[0]
    if not isinstance(c.args[0], Node) or not _cumprod_of(c, c.args[0]):
        return None
    v = _val(c.args[0])
    ok = v is not None and v.dtype == torch.bool and v.dim() == 2 and isinstance(v.shape[1], int)
    return c.args[0] if ok else None


def _mask_from_count(graph: Graph, s: Node, k: int, flavor: str) -> Node:
    """(arange(K)[None, :] < s[:, None]).long(), inserted after s."""
    dev = _val(s).device
    with graph.inserting_after(s):
        if flavor == "inductor":  # what Inductor's decompositions make of arange
            pos = graph.call_function(torch.ops.prims.iota.default, (k,), {
                "start": 0, "step": 1, "dtype": torch.int64, "device": dev,
                "requires_grad": False})
        else:
            pos = graph.call_function(aten.arange.default, (k,), {
                "dtype": torch.int64, "device": dev, "pin_memory": False})
    with graph.inserting_after(pos):
        col = graph.call_function(aten.unsqueeze.default, (s, 1))
    with graph.inserting_after(col):
        lt = graph.call_function(aten.lt.Tensor, (pos, col))
    with graph.inserting_after(lt):
        mask = _cast(graph, lt, torch.int64, flavor)
    pos.meta["val"] = _val(s).new_empty((k,), dtype=torch.int64)  # in s's own (fake) mode
    for n in (col, lt, mask):
        _fake_meta(n)
    return mask


def _is_canonical(order: list[Node], ok: Node) -> bool:
    """Already `ok.cumprod(1).sum(1)` or `(~ok).cumprod(1).sum(1)` (possibly cast or shaped):
    nothing to rewrite."""
    if order and order[0].target is aten.bitwise_not.default and order[0].args[0] is ok:
        ok, order = order[0], order[1:]
    targets = [m.target for m in order]
    if targets == [aten.cumprod.default] and any(_counted_flags(u) is ok for u in order[0].users):
        return True  # at K = 1 the canonical count's own [B, 1] mask is a "count" too
    return (targets[:2] == [aten.cumprod.default, aten.sum.dim_IntList]
            and order[0].args[0] is ok and order[0].args[1] == 1
            and len(order[1].args) == 2 and not order[1].kwargs.get("keepdim")
            and len(order) <= 3)
