"""One draft per request on flat ids: the bare compare as the accepted-prefix count at K = 1.

With one draft the verify step needs no [B, K] mask and no count: vllm-ascend's
`rejection_greedy_sample_spec_len_1` and SGLang's two-token chain compare flat [B] ids,

    same = draft_ids == target_logits.argmax(-1).view(-1)      # [B] bool
    out[:, 1] = torch.where(same, bonus, out[:, 1])            # or same.long() as the count

Seen as [B, 1], that compare is the whole accept mask, and its one 0/1 value per row is the
prefix length. So `a == b` becomes

    n = (a[:, None] == b[:, None]).cumprod(1).sum(1)            # int64 [B], 0 or 1

(the GreedyAccept family's form, which matches it as `npuspec::greedy_accept`), its integer
casts read `n` (cast when not int64) and a `where` reads `n.bool()`. Every value is the same:
n is 1 exactly where the ids are equal.

Only an accept decision is rewritten, never any compare: one side comes (through views,
selects and integer casts) from an argmax over the last dim of a float tensor, the other is an
integer [B] tensor (int32 or int64, either beside the int64 argmax) not read from that argmax,
and the result is used only as a `where` condition choosing between integer tensors or cast to
int32/int64, with no reduction over the batch (`.sum()`, `.mean()`, ...) within MAX_WALK nodes
downstream (an accuracy metric `(logits.argmax(-1) == labels).long().sum()` is left alone).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.fx import Graph, Node

from npuspec.passes.rewrites.nodes import _cast, _fake_meta, _val

NAME = "k_one"
aten, prims = torch.ops.aten, torch.ops.prims
MAX_WALK = 32  # downstream nodes searched for a batch reduction; more: left alone
IDS = (torch.int32, torch.int64)
_ID_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default,
             aten.select.int, aten.slice.Tensor, aten.squeeze.dim, aten.squeeze.default,
             aten.alias.default, aten.clone.default}
_CASTS = {aten._to_copy.default, prims.convert_element_type.default}
_REDUCE = {"sum", "mean", "prod", "amax", "amin", "any", "all", "max", "min", "argmax",
           "argmin", "count_nonzero", "cumsum", "cumprod", "std", "var", "nansum",
           "logsumexp", "_local_scalar_dense", "histc", "bincount", "sort", "topk"}


def _cast_dtype(n: Node):
    if n.target is prims.convert_element_type.default:
        return n.args[1]
    return n.kwargs.get("dtype") if set(n.kwargs) <= {"dtype"} and len(n.args) == 1 else None


def _argmax_source(n: Node) -> Optional[Node]:
    """The argmax node `n` reads through views, selects and integer casts, if any."""
    while isinstance(n, Node) and n.op == "call_function":
        if n.target is aten.argmax.default:
            x, dim = _val(n.args[0]), n.args[1] if len(n.args) > 1 else None
            keep = n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False)
            ok = (x is not None and x.is_floating_point() and isinstance(dim, int)
                  and x.dim() >= 1 and dim % x.dim() == x.dim() - 1 and not keep)
            return n if ok else None
        if n.target in _CASTS and _cast_dtype(n) in IDS:
            n = n.args[0]
        elif n.target in _ID_VIEWS:
            n = n.args[0]
        else:
            return None
    return None


def _ids_compare(n: Node) -> Optional[tuple]:
    """(a, b) when n is a flat [B] ids compare of a draft with a target argmax."""
    if n.op != "call_function" or n.target is not aten.eq.Tensor or n.kwargs:
        return None
    a, b = n.args
    va, vb, out = _val(a), _val(b), _val(n)
    if any(v is None for v in (va, vb, out)) or out.dim() != 1:
        return None
    if va.dim() != 1 or vb.dim() != 1 or va.dtype not in IDS or vb.dtype not in IDS:
        return None  # int32 drafts against the int64 argmax too (vllm-ascend): == compares values
    sa, sb = _argmax_source(a), _argmax_source(b)
    if (sa is None) == (sb is None):  # neither is a target argmax, or both
        return None
    return a, b


def _accept_uses(n: Node) -> bool:
    """Every use is an accept decision: a where choosing between ids, or an id cast."""
    for u in n.users:
        v = _val(u)
        if u.target is aten.where.self and u.args[0] is n and n not in u.args[1:]:
            if v is None or v.dtype not in IDS or v.dim() != 1:
                return False
        elif not (u.target in _CASTS and u.args[0] is n and _cast_dtype(u) in IDS):
            return False
    return _per_request(n)


def _per_request(n: Node) -> bool:
    """No reduction over the batch downstream of n (within MAX_WALK nodes)."""
    seen, stack = set(), list(n.users)
    while stack:
        m = stack.pop()
        if m in seen or m.op == "output":
            continue
        seen.add(m)
        t = m.target
        name = t.overloadpacket.__name__ if isinstance(t, torch._ops.OpOverload) else ""
        if len(seen) > MAX_WALK or name in _REDUCE or m.op != "call_function":
            return False
        stack.extend(m.users)
    return True


def _count(graph: Graph, n: Node, a: Node, b: Node, flavor: str) -> Node:
    """(a[:, None] == b[:, None]).cumprod(1).sum(1), inserted before n."""
    with graph.inserting_before(n):
        a1 = graph.call_function(aten.unsqueeze.default, (a, 1))
        b1 = graph.call_function(aten.unsqueeze.default, (b, 1))
        ok = graph.call_function(aten.eq.Tensor, (a1, b1))
        c = graph.call_function(aten.cumprod.default, (ok, 1))
        s = graph.call_function(aten.sum.dim_IntList, (c, [1]))
    for m in (a1, b1, ok, c, s):
        _fake_meta(m)
    return s


def _reuse(graph: Graph, n: Node, s: Node, flavor: str) -> None:
    for u in list(n.users):
        if u.target is aten.where.self:
            with graph.inserting_before(u):
                flag = _cast(graph, s, torch.bool, flavor)
            _fake_meta(flag)
            u.replace_input_with(n, flag)
        elif _cast_dtype(u) == torch.int64:
            u.replace_all_uses_with(s)
        else:
            with graph.inserting_before(u):
                x = _cast(graph, s, _cast_dtype(u), flavor)
            _fake_meta(x)
            u.replace_all_uses_with(x)


def apply(graph: Graph, flavor: str) -> int:
    done = 0
    for n in list(graph.nodes):
        ab = _ids_compare(n)
        if ab is None or not _accept_uses(n):
            continue
        s = _count(graph, n, *ab, flavor)
        _reuse(graph, n, s, flavor)
        done += 1
    return done
