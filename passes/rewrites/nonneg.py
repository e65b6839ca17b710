"""max(x, 0), the residual's nonnegative part, in the two forms the families are traced with.

Codebases spell "the positive part of x = p - q" as

    clamp class   relu(x), clamp(x, min=0), clamp_min(x, 0.0), maximum(x, Z), maximum(Z, x)
    where class   where(x > 0, x, Z)           (x > 0 also as gt(x, Z), or p > q when x = p - q;
                                                Z below)

with Z a tensor of +0.0s: zeros_like / zeros / new_zeros, full(.., 0), scalar_tensor(0), or a
constant such as lmdeploy's `torch.tensor(0.0)`. Measured on NaN and -0.0 (float32, CPU;
tests/passes/test_rewrite_nonneg.py checks the classes below and the differences named here):

    spelling          eager ATen: NaN / -0.0          Inductor code: NaN / -0.0
    relu              NaN, payload kept / -0.0        NaN, payload kept / -0.0
    clamp, clamp_min  NaN, payload kept / -0.0        NaN, another payload / +0.0
    maximum(x, Z)     vectorised loop: NaN, another payload / +0.0; scalar tail: x's bits
    maximum(Z, x)     vectorised loop: NaN, another payload / -0.0; scalar tail: the NaN / +0.0
    where(x > 0,x,Z)  +0.0 / +0.0                     +0.0 / +0.0

(Inductor's maximum is eager's vectorised column everywhere.)

So the where class is another function (NaN -> 0): it is only put into one spelling,
`where(gt(x, 0), x, scalar_tensor(0.0, dtype=x.dtype))`, which is bit-equal to every member on
every input (the same comparison, x where it holds, +0.0 of x's dtype elsewhere), and the
family maps that form to the residual ops' `nonneg="where"` mode, which evaluates it as written
(kernels/accept.py). That rewrite is made wherever the form appears.

The clamp class is one function up to two things: the sign of a zero and the payload of a NaN
(NaN sits at the same places, every other value is the same bits). Even relu and clamp, equal
in eager, differ under Inductor. Its members are rewritten into what `torch.clamp(x, min=0)`
becomes, the form of the Residual and whole-step families (`clamp_min(x, 0)` in both flavours:
Inductor's table writes it so, and canonical.py turns a one-sided clamp into it), and only
where neither difference can reach anything
the graph returns: every use of the site must end, through the ops below, in an `argmax` or a
one-sample `multinomial` (the residual's race, Gumbel-max or multinomial), whose outputs depend
only on which entries are NaN and on the order of the values, in which -0.0 == +0.0. Write
A ~ A' when A and A' differ at most in zero signs and NaN payloads. If the operands that came
from the site are ~ and the others are the same tensors:

- a * c, a + c, a - c, c - a, a / c (c not from the site), log(a): ~. A zero times, plus,
  minus or over c gives a zero, c, -c, NaN or the same bits on both sides; log(+-0) = -inf.
- s = sum(a) or sum(a, dims, keepdim=True) of the site's nonnegative-or-NaN values, used only
  as a / s: every partial sum of such values is either the same bits on both sides or a zero on
  both (x + -0.0 == x + 0.0 == x for x != 0), in any summation order, so s ~ s', and s is
  nonzero unless every a it divides is a zero (a sum of positive floats is not 0): then a / s
  is NaN on both sides. Otherwise s is the same bits and a / s ~ a' / s (still >= 0 or NaN).
- argmax: the first NaN, else the first maximal value: ~ inputs give the same index.
  multinomial(a, 1): rejects NaN, inf and a < 0 (-0.0 is not < 0), rejects a zero row sum,
  then takes argmax(a / E) with E ~ Exp(1) drawn from the generator as on both sides (ATen's
  one-sample path): the same checks and the same token.
- empty_like / zeros_like / rand_like ... and sym_size read only shape, dtype and device.

A site with any other use (an output, a view, a cast, a max) is left as written, with one
exception: relu and clamp(min=0) give clamp_min(x, 0)'s bits in eager ATen (the table), and the
residual ops compute clamp_min_ in ATen, so such a site is rewritten on trial whatever reads it
(lucidrains returns relu(p - q) normalised); `undo_untaken`, after every family has run, puts
back the spelling of each trial site still read. The argument is about IEEE values, so it holds
for whichever lowering then computes the unfused ops.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch.fx import Graph, Node

from npuspec.passes.rewrites.nodes import _fake_meta, _same_shape, _val

NAME = "nonneg"
aten = torch.ops.aten
MAX_CHAIN = 24  # nodes between a site and its argmax / multinomial, at most

_ZEROS = (aten.zeros_like.default, aten.zeros.default, aten.new_zeros.default)
_FILLED = {aten.full.default: 1, aten.full_like.default: 1, aten.new_full.default: 2,
           aten.scalar_tensor.default: 0}  # op -> index of its fill value
_META_ONLY = (aten.empty_like.default, aten.zeros_like.default, aten.ones_like.default,
              aten.full_like.default, aten.rand_like.default, aten.randn_like.default,
              aten.sym_size.int, aten.sym_stride.int, aten.sym_numel.default,
              aten.sym_storage_offset.default)
_PASS = (aten.mul.Tensor, aten.add.Tensor, aten.sub.Tensor)  # ~ with one operand from the site


def _zero_literal(v, positive: bool) -> bool:
    return type(v) in (int, float) and v == 0 and not (positive and math.copysign(1.0, v) < 0)


def _constant(graph: Graph, n: Node) -> Optional[torch.Tensor]:
    """The real tensor behind a get_attr (or its lift_fresh_copy): `torch.tensor(0.0)`."""
    if n.target is aten.lift_fresh_copy.default and isinstance(n.args[0], Node):
        n = n.args[0]
    if n.op != "get_attr" or graph.owning_module is None:
        return None
    obj = graph.owning_module
    for part in n.target.split("."):
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, torch.Tensor) else None


def _is_zero(graph: Graph, n) -> bool:
    """n is a tensor of +0.0s (any shape and dtype)."""
    if not isinstance(n, Node):
        return False
    if n.target in _ZEROS:
        return True
    if n.target in _FILLED:
        i = _FILLED[n.target]
        return len(n.args) > i and _zero_literal(n.args[i], positive=True)
    t = _constant(graph, n)
    if t is None or t.numel() > 64:
        return False
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    with unset_fake_temporarily():  # a real constant; the pass may run inside a fake trace
        return bool((t == 0).all()) and not bool(t.signbit().any())


def _same_meta(a, b) -> bool:
    return _same_shape(a, b) and a.dtype == b.dtype


def _float_site(n: Node, x) -> Optional[Node]:
    """x, when n keeps x's float dtype and shape (a zero operand broadcast into it)."""
    xv = _val(x)
    return x if xv is not None and xv.is_floating_point() and _same_meta(xv, _val(n)) else None


# --------------------------------------------------------------------------------------------
# the clamp class -> torch.clamp(x, min=0), where only argmax / multinomial(.., 1) see the result
# --------------------------------------------------------------------------------------------
# what `torch.clamp(x, min=0)` becomes in both flavours (Inductor's table writes it so; in the
# aten flavour the literal canonicaliser does, canonical.py)
_CANONICAL_CLAMP = aten.clamp_min.default


def _clamp_input(graph: Graph, n: Node, flavor: str) -> Optional[Node]:
    """x when n is a clamp-class spelling of max(x, 0) other than the canonical one."""
    t, a = n.target, n.args
    if t is _CANONICAL_CLAMP and len(a) == 2 and type(a[1]) is int and not n.kwargs:
        return None  # clamp(x, 0) / clamp_min(x, 0) already
    x = None
    if t is aten.relu.default:
        x = a[0]
    elif t is aten.clamp.default:
        lo = a[1] if len(a) > 1 else n.kwargs.get("min")
        hi = a[2] if len(a) > 2 else n.kwargs.get("max")
        x = a[0] if hi is None and _zero_literal(lo, positive=False) else None
    elif t is aten.clamp_min.default:
        x = a[0] if _zero_literal(a[1], positive=False) else None
    elif t is aten.maximum.default:
        x = a[0] if _is_zero(graph, a[1]) else a[1] if _is_zero(graph, a[0]) else None
    return _float_site(n, x) if isinstance(x, Node) else None


# Spellings whose eager ATen result is clamp_min(x, 0)'s bits on every input (NaN payload and
# -0.0 kept: the table above). Read by anything, such a site is rewritten on trial: the
# residual ops evaluate clamp_min_ in ATen, so a site a family takes gives the bits the user's
# op gives in eager, and `undo_untaken` puts back the spelling of a site no family took (under
# Inductor a clamp_min left in the graph would compute other zero signs than the user's relu).
_EAGER_CLAMP = (aten.relu.default, aten.clamp.default, aten.clamp_min.default)
TRIAL = "npuspec_nonneg_trial"


def _cut(u: Node) -> bool:
    """u's value is the same whatever the zero signs and NaN payloads of its input."""
    if u.target in _META_ONLY or u.target is aten.argmax.default:
        return True
    return (u.target is aten.multinomial.default and len(u.args) > 1 and u.args[1] == 1
            and type(u.args[1]) is int)


def _reached(site: Node) -> Optional[list]:
    """The nodes whose values may change with the site's (site first, in graph order), or
    None when one is not an op or there are more than MAX_CHAIN."""
    seen, todo = {site}, [site]
    while todo:
        for u in todo.pop().users:
            if u in seen or (u.op == "call_function" and _cut(u)):
                continue
            if u.op != "call_function" or len(seen) >= MAX_CHAIN:
                return None
            seen.add(u)
            todo.append(u)
    return [n for n in site.graph.nodes if n in seen]


def _sum_of(s, a: Node) -> bool:
    """s = a.sum() or a.sum(dims, keepdim=True): every a / s divides by a sum holding a."""
    if not isinstance(s, Node) or s.kwargs or not s.args or s.args[0] is not a:
        return False
    if s.target is aten.sum.default:
        return len(s.args) == 1
    return (s.target is aten.sum.dim_IntList and len(s.args) == 3 and s.args[2] is True)


def _step(n: Node, reach: set, nonneg: set) -> Optional[str]:
    """How n keeps `~` (module docstring): "pass", "nonneg" (>= 0 or NaN too), or None."""
    if n.kwargs:  # alpha, rounding_mode, dtype: none of them is in the argument
        return None
    a = n.args
    inside = [x for x in a if isinstance(x, Node) and x in reach]
    if n.target is aten.log.default:
        return "pass"
    if n.target in _PASS:
        return "pass" if len(inside) == 1 else None
    if n.target is aten.div.Tensor and a[0] in reach:
        if a[1] not in reach:
            return "pass"
        return "nonneg" if a[0] in nonneg and _sum_of(a[1], a[0]) else None
    if _sum_of(n, a[0]) and a[0] in nonneg and all(
            u.target is aten.div.Tensor and u.args == (a[0], n) and not u.kwargs for u in n.users):
        return "pass"
    return None


def _token_chain(site: Node) -> bool:
    """Every use of site ends in an argmax or multinomial(.., 1) through ~-keeping ops."""
    nodes = _reached(site)
    if nodes is None:
        return False
    reach, nonneg = set(nodes), {site}
    for n in nodes[1:]:
        how = _step(n, reach, nonneg)
        if how is None:
            return False
        if how == "nonneg":
            nonneg.add(n)
    return True


# --------------------------------------------------------------------------------------------
# the where class -> where(gt(x, 0), x, scalar_tensor(0.0)), anywhere (bit-equal)
# --------------------------------------------------------------------------------------------
def _compared_operands(c: Node, x: Node) -> bool:
    """c = gt(p, q) and x = sub(p, q) of the same two float tensors of one dtype: p > q holds
    exactly where p - q > 0 in IEEE arithmetic (a positive difference of finite floats never
    rounds to 0 with subnormals, inf - inf and NaN compare False on both sides), so
    where(p > q, p - q, Z) is where(x > 0, x, Z)."""
    if c.target is not aten.gt.Tensor or x.target is not aten.sub.Tensor or c.kwargs or x.kwargs:
        return False
    if len(c.args) != 2 or tuple(c.args) != tuple(x.args):
        return False
    vals = [_val(a) for a in c.args]
    return (all(v is not None and v.is_floating_point() for v in vals)
            and vals[0].dtype == vals[1].dtype and _same_shape(_val(c), _val(x)))


def _where_input(graph: Graph, n: Node) -> Optional[Node]:
    """x when n is where(x > 0, x, Z) (or where(p > q, x, Z), x = p - q) not already in the
    canonical spelling."""
    if n.target is not aten.where.self or len(n.args) != 3 or n.kwargs:
        return None
    c, x, z = n.args
    if not (isinstance(c, Node) and isinstance(x, Node) and c.args and _is_zero(graph, z)):
        return None
    if _compared_operands(c, x):
        return _float_site(n, x)
    if c.args[0] is not x:
        return None
    gt0 = ((c.target is aten.gt.Scalar and _zero_literal(c.args[1], positive=False))
           or (c.target is aten.gt.Tensor and _is_zero(graph, c.args[1])
               and _same_shape(_val(c), _val(x))))
    if not gt0 or _canonical_where(c, z, _val(x)):
        return None
    return _float_site(n, x)


def _canonical_where(c: Node, z: Node, xv) -> bool:
    return (c.target is aten.gt.Scalar and type(c.args[1]) is int
            and z.target is aten.scalar_tensor.default and z.args == (0.0,)
            and xv is not None and z.kwargs == _zero_kwargs(xv))


def _zero_kwargs(xv) -> dict:
    """scalar_tensor's kwargs as AOT writes `torch.where(x > 0, x, 0.0)`."""
    return {"dtype": xv.dtype, "layout": torch.strided, "device": xv.device}


# --------------------------------------------------------------------------------------------
def _new(graph: Graph, target, args, kwargs, before: Node, like: torch.Tensor) -> Node:
    """A node before `before`, its meta value computed on fake values (in like's fake mode)."""
    with graph.inserting_before(before):
        return _fake_meta(graph.call_function(target, args, kwargs), like)


def _canonical_where_node(graph: Graph, n: Node, x: Node) -> Node:
    xv = _val(x)
    gt = _new(graph, aten.gt.Scalar, (x, 0), {}, n, xv)
    z = _new(graph, aten.scalar_tensor.default, (0.0,), _zero_kwargs(xv), n, xv)
    return _new(graph, aten.where.self, (gt, x, z), {}, n, xv)


def apply(graph: Graph, flavor: str) -> int:
    """Rewrite the sites above; returns how many. `flavor` picks the clamp op the families
    were traced with; the other ops are spelled alike in both flavors' graphs."""
    done = 0
    for n in list(graph.nodes):
        if n.op != "call_function":
            continue
        x = _where_input(graph, n)
        if x is None:
            x = _clamp_input(graph, n, flavor)
            if x is None:
                continue
            trial = not _token_chain(n)
            if trial and n.target not in _EAGER_CLAMP:
                continue
            new = _new(graph, _CANONICAL_CLAMP, (x, 0), {}, n, _val(x))
            if trial:  # put back unless a family takes it (undo_untaken)
                new.meta[TRIAL] = (n.target, n.args, dict(n.kwargs))
        else:
            new = _canonical_where_node(graph, n, x)
        # both keep x's dtype and shape, which _float_site checked the old node keeps
        n.replace_all_uses_with(new)
        done += 1
    return done


def undo_untaken(graph: Graph) -> int:
    """Every trial site still read after matching gets its spelling back (the lowering then
    computes what the user wrote); -> how many."""
    undone = 0
    for n in graph.nodes:
        if TRIAL in n.meta and n.users:
            n.target, n.args, n.kwargs = n.meta.pop(TRIAL)
            undone += 1
    return undone
