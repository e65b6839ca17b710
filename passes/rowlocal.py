"""Row locality: does each row of a sub-graph's result depend on the same row of `ok` only?

The prefix proof (passes/prefix.py) evaluates a candidate count on all 2^K masks, one mask per
row of one batch. That proves "f(mask) == prefix(mask)" only if row b of the result reads row b
of `ok` and nothing else: `acc - acc.min()` equals the count on the batch of all masks (its
all-False row makes the minimum 0) and differs on every real batch. `row_local` proves the
locality op by op, before any evaluation; an op it does not know ends the proof, and the
sub-graph is left as written.

A value is *local* (row b reads only row b of `ok`, dim 0 is the row dim) or *constant* (reads
no `ok`). Locality holds through pointwise ops whose local inputs share the output's rank,
reductions, scans and selections along dims other than 0, views that keep dim 0, gathers
along other dims, and cats along other dims of local and one-valued operands. A constant may
meet a local value only where it does not vary along dim 0, so every row computes the same
function. A batch of one row is trivially local.
"""
from __future__ import annotations

import operator
from typing import Optional

import torch
from torch.fx import Node

aten = torch.ops.aten

# op packet name -> position of its dim argument (a reduction/scan/selection along that dim)
_ALONG = {"sum": 1, "prod": 1, "amax": 1, "amin": 1, "any": 1, "all": 1, "argmax": 1,
          "argmin": 1, "max": 1, "min": 1, "mean": 1, "logsumexp": 1, "cumsum": 1,
          "cumprod": 1, "cummax": 1, "cummin": 1, "logcumsumexp": 1, "sort": 1, "argsort": 1,
          "topk": 2, "select": 1, "slice": 1, "flip": 1, "count_nonzero": 1}
# a dim argument left out: every dim (None) for reductions, these for the others
_DEFAULT_DIM = {"cumsum": 0, "cumprod": 0, "cummax": 0, "cummin": 0, "select": 0, "slice": 0,
                "sort": -1, "argsort": -1, "topk": -1}
_UNARY = {"_to_copy", "convert_element_type", "clone", "alias", "contiguous", "detach",
          "lift_fresh_copy", "_conj", "type_as"}
# views: local when dim 0 keeps its size and its place (row-major, so a row stays a row)
_VIEWS = {"view", "reshape", "_unsafe_view", "unsqueeze", "squeeze", "expand", "permute",
          "transpose", "t", "view_of", "squeeze_copy", "unsqueeze_copy", "view_copy",
          "expand_copy", "broadcast_in_dim", "_reshape_alias"}
# constants with one value everywhere (the *_like ones read only their input's shape)
_UNIFORM = {"full", "zeros", "ones", "scalar_tensor", "full_like", "zeros_like", "ones_like",
            "new_full", "new_zeros", "new_ones"}


def _val(n):
    return n.meta.get("val") if isinstance(n, Node) else None


def _name(t) -> str:
    if isinstance(t, torch._ops.OpOverload):
        return t.overloadpacket.__name__
    return getattr(t, "__name__", str(t))


def _dims(arg, rank: int) -> Optional[list[int]]:
    """Normalised dims of a dim argument (None, an int or a list), or None for every dim."""
    if arg is None:
        return None
    ds = list(arg) if isinstance(arg, (list, tuple)) else [arg]
    if not ds:
        return None  # sum(x, []) reduces every dim
    if not all(isinstance(d, int) for d in ds):
        return None
    return [d % max(rank, 1) for d in ds]


def _same_size(a, b) -> bool:
    if isinstance(a, int) or isinstance(b, int):
        return isinstance(a, int) and isinstance(b, int) and a == b
    return a.node.expr == b.node.expr


def row_local(order: list[Node], ok: Node, out: Node) -> bool:
    """True when every node of `order` (the sub-graph from `ok` to `out`, in graph order)
    keeps rows apart, so row b of `out` is a function of row b of `ok` alone, the same
    function for every b. Any op not known here: False."""
    b = _val(ok).shape[0]
    if isinstance(b, int) and b == 1:
        return True
    local, uniform = {ok}, set()
    for m in order:
        if m.op == "get_attr":
            continue  # a lifted constant
        name = _name(m.target)
        if name in _UNIFORM or (name in _UNARY | {"convert_element_type"}
                                and m.args[0] in uniform):
            uniform.add(m)  # one value everywhere: the same for every row, whatever its shape
            continue
        if not any(a in local for a in m.all_input_nodes):
            continue  # a constant (reads no ok)
        if not _step_local(m, local, uniform, b):
            return False
        local.add(m)
    return out in local


def _has_rows(v, b) -> bool:
    return isinstance(v, torch.Tensor) and v.dim() >= 1 and _same_size(v.shape[0], b)


def _const_flat_rows(v, rank: int) -> bool:
    """A constant input that does not vary along dim 0 of a rank-`rank` result."""
    if not isinstance(v, torch.Tensor):
        return True  # a Python number or a SymInt not from dim 0
    return v.dim() < rank or (v.dim() == rank and v.shape[0] == 1)


def _pointwise(m: Node, name: str) -> bool:
    t = m.target
    return ((isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags)
            or name in _UNARY)


def _step_local(m: Node, local: set, uniform: set, b) -> bool:
    if m.op != "call_function":
        return False
    if m.target is operator.getitem:  # an output of max.dim / cummin / sort
        return m.args[0] in local and isinstance(m.args[1], int)
    v = _val(m)
    v = v[0] if isinstance(v, (tuple, list)) and v else v  # (values, indices)
    if not _has_rows(v, b):
        return False
    name, rank = _name(m.target), v.dim()
    tensors = [a for a in m.all_input_nodes if isinstance(_val(a), torch.Tensor)]
    const = [a for a in tensors if a not in local]
    if _pointwise(m, name):  # broadcasting: a local input of lower rank would move dim 0
        return (all(_val(a).dim() == rank and _has_rows(_val(a), b)
                    for a in tensors if a in local)
                and all(a in uniform or _const_flat_rows(_val(a), rank) for a in const))
    if name == "cat":
        return _cat_rows(m, local, uniform, b, rank)
    src = m.args[0]
    if src not in local or not _has_rows(_val(src), b):
        return False
    if name == "slice" and _full_slice(m):
        return True  # x[:] (what AOT leaves before Inductor's no-op removal)
    if name in _ALONG:
        if const:
            return False
        pos, src_rank = _ALONG[name], _val(src).dim()
        arg = m.args[pos] if len(m.args) > pos else m.kwargs.get("dim", _DEFAULT_DIM.get(name))
        dims = _dims(arg, src_rank)
        return dims is not None and 0 not in dims
    if name in _VIEWS:
        return not const and _keeps_row_dim(m, name)
    if name == "index_put":  # x[mask] = c, a where in disguise
        return _masked_fill_rows(m, local)
    if name == "gather":
        dim, idx = m.args[1], m.args[2]
        return idx in local and isinstance(dim, int) and dim % _val(src).dim() != 0
    return False


def _cat_rows(m: Node, local: set, uniform: set, b, rank: int) -> bool:
    """cat along a dim other than 0: row b of the result is row b of each operand side by side
    (a False column appended to the flags, MLX's `.index(False)`). An operand that reads no
    `ok` must be one-valued (zeros_like(ok[:, :1]), full((B, 1), c)), so every row gets the
    same columns. Along dim 0 the operands' rows are stacked, so row b moves: refused."""
    parts = m.args[0]
    dim = m.args[1] if len(m.args) > 1 else m.kwargs.get("dim", 0)
    if not isinstance(parts, (list, tuple)) or not isinstance(dim, int) or dim % rank == 0:
        return False
    for a in parts:
        if a in local:  # a lower-rank local operand cannot occur: cat wants one rank
            if not (_has_rows(_val(a), b) and _val(a).dim() == rank):
                return False
        elif not (isinstance(a, Node) and a in uniform and _has_rows(_val(a), b)):
            return False  # a constant that may vary by row, or a legacy empty operand
    return True


def _full_slice(m: Node) -> bool:
    args = list(m.args) + [None] * (5 - len(m.args))
    _, dim, start, end, step = args[:5]
    size = _val(m.args[0]).shape[dim or 0]
    return ((start or 0) == 0 and (step or 1) == 1 and isinstance(end, int)
            and (end >= 2 ** 62 or (isinstance(size, int) and end >= size)))


def _masked_fill_rows(m: Node, local: set) -> bool:
    """index_put(x, [mask], c): a boolean mask over x's leading dims (dim 0 included) and a
    one-element constant c, not accumulated, sets row b from row b alone."""
    src, indices, values = m.args[0], m.args[1], m.args[2]
    acc = m.args[3] if len(m.args) > 3 else m.kwargs.get("accumulate", False)
    if acc or len(indices) != 1 or not isinstance(indices[0], Node) or values in local:
        return False
    mask, cv, xs = _val(indices[0]), _val(values), _val(src).shape
    return (indices[0] in local and mask.dtype == torch.bool and mask.dim() <= len(xs)
            and all(_same_size(a, b) for a, b in zip(mask.shape, xs))
            and isinstance(cv, torch.Tensor) and cv.dim() == 0)


def _keeps_row_dim(m: Node, name: str) -> bool:
    """A view that leaves dim 0 as dim 0 (its size is checked by the caller)."""
    out = _val(m)
    out = out[0] if isinstance(out, (tuple, list)) else out
    src_rank, out_rank = _val(m.args[0]).dim(), out.dim()
    if name in ("unsqueeze", "unsqueeze_copy"):
        return m.args[1] % (out_rank) != 0
    if name in ("permute",):
        return list(m.args[1])[0] % src_rank == 0
    if name in ("transpose",):
        d0, d1 = (d % src_rank for d in m.args[1:3])
        return 0 not in (d0, d1) or d0 == d1
    if name == "t":
        return src_rank < 2
    if name == "broadcast_in_dim":
        return list(m.args[2])[:1] == [0]
    # view / reshape / squeeze / expand: dim 0 keeps its size (checked), and a row-major
    # reshape that keeps the leading size maps each row onto itself
    return True
