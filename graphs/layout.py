"""Which inputs and outputs of a Dynamo graph carry the token dimension (sympy on symbolic shapes).

Dynamo traces a step whose token dims are dynamic (`mark_token_dim`, or automatic dynamic
shapes), so placeholder shapes are sympy expressions over size symbols. We split the symbols:

- padding symbols: appear only in token dims (e.g. s0 = B, s1 = B*(K+1)); at run time they must
  all scale together, s_j = a_j * u with u = gcd of their values, and padding raises u;
- key symbols: appear anywhere else (e.g. K in drafts [B, K] once Dynamo made it dynamic); each
  distinct value gets its own graph set.

For one key (values of key symbols and the ratio vector a), every shape becomes a polynomial in
u. A token dim must be `coef*u`; an output whose shape is not linear in u, or that has no token
dim but is computed from token inputs (a reduction over the batch), makes the step
non-row-separable, so it is captured at exact sizes only. Dynamo's shape guards, the graph's
runtime asserts (unbacked token dims) and value ranges are evaluated at each candidate padded
size, and sizes that would break them are dropped.

Token dims marked with `mark_token_dim` are unbacked symbols (u0, u1, ...; one per group), so a
batch of 1 is served by the same Dynamo graph as every other size (docs/graphs.md, "Size 1").
"""
from __future__ import annotations

import dataclasses
import re
import math
import operator
from typing import Any, Optional, Sequence

import sympy
import torch

from npuspec.graphs.dispatch import CONST, COPY, INT, STATIC, TOKEN, Slot
from npuspec.graphs.rows import inplace_name, row_blockers

U = sympy.Symbol("u", integer=True, positive=True)
TOKEN_DIM_ATTR = "_npuspec_token_dim"
PAD_ATTR = "_npuspec_pad"
GROUP_ATTR = "_npuspec_token_group"
ROWS = "rows"  # the default group: per-request inputs [B, ...]
SHAPE_ID_PREFIX = "npuspec:"
# (arg index, name, pad) of the verify op's inputs whose padding rows need a specific value.
VERIFY_PADS = ((1, "draft_token_ids", -1), (5, "top_p", 1.0), (6, "uniforms", 0.5),
               (7, "exponentials", 1.0))


def mark_token_dim(tensor: torch.Tensor, dim: int = 0, pad: Any = None,
                   group: Optional[str] = ROWS) -> torch.Tensor:
    """Mark `tensor`'s dim `dim` as the token (batch) dimension of a step. Returns the tensor.

    The npuspec backend pads this dim to the capture sizes; `pad` is the value of padding rows
    (default 0; -1 for draft ids of the verify op etc. is picked automatically).

    The dim is made *unbacked* for Dynamo (`torch._dynamo.decorators.mark_unbacked`), so
    Dynamo does not specialise size 1 (or 0): one Dynamo graph serves every batch size,
    including a batch of 1, whichever size comes first. Token dims of one `group` share one
    size symbol (Dynamo's `shape_id`; Dynamo guards that they are equal); the default group
    "rows" is for per-request inputs [B, ...]. Give inputs whose token dim has another size a
    group of their own, e.g. flat tokens [B*(K+1)]: `mark_token_dim(tokens, group="tokens")`.
    Use the same group names on every call (the shape id is part of Dynamo's guards).

    The step's code must not branch on an unbacked size (`if B == 1:` cannot be traced and
    makes Dynamo break the graph). `group=None` gives the old marking instead
    (`maybe_mark_dynamic`: sizes are backed, and a batch of 1 gets its own Dynamo graph).
    """
    d = dim % tensor.dim()
    setattr(tensor, TOKEN_DIM_ATTR, d)
    setattr(tensor, GROUP_ATTR, group)
    if pad is not None:
        setattr(tensor, PAD_ATTR, pad)
    if group is None:
        torch._dynamo.maybe_mark_dynamic(tensor, d)  # no error when Dynamo specialises size 1
    else:
        torch._dynamo.decorators.mark_unbacked(tensor, d, shape_id=SHAPE_ID_PREFIX + str(group))
    return tensor


def _expr(x) -> sympy.Expr:
    if isinstance(x, torch.SymInt):
        return sympy.sympify(x.node.expr)
    return sympy.Integer(int(x))


@dataclasses.dataclass
class ArgInfo:
    kind: str                       # TOKEN / COPY / STATIC / INT / CONST
    shape: tuple = ()               # tensors: sympy exprs
    dim: Optional[int] = None       # TOKEN: token dim
    expr: Any = None                # INT: sympy expr
    pad: Any = 1
    mutated: bool = False
    stride: tuple = ()              # TOKEN/COPY tensors: sympy exprs
    restore: bool = False           # STATIC: mutated other than at declared token indices


@dataclasses.dataclass
class GraphLayout:
    args: list
    outs: list                      # per output: ("tensor", shape exprs, depends_on_tokens) or ("int", expr) or ("const", None)
    pad_syms: tuple                 # padding symbols, sorted by name
    key_syms: tuple                 # key symbols, sorted by name
    sources: dict                   # symbol -> (arg index, dim or None)
    guards: list                    # sympy booleans that must hold
    ranges: dict                    # symbol -> (lo, hi)
    verify_k: Optional[Any] = None  # sympy expr of K from the verify op, if one is in the graph
    verify_b: Optional[Any] = None  # sympy expr of the verify op's batch dim
    reason: str = ""                # why the graph cannot be padded at all ("" = it can)
    rows: str = ""                  # why padding could change a real row ("" = it cannot)


@dataclasses.dataclass
class KeyLayout:
    slots: list
    out_dims: list
    exact_only: bool
    k: Optional[int]
    tokens_per_unit: Optional[int]
    ok_units: Any                   # callable(units) -> bool (guards hold)


# -- graph facts ---------------------------------------------------------------------------------
_VIEW_METHODS = {"view", "reshape", "narrow", "select", "unsqueeze", "squeeze", "transpose",
                 "permute", "flatten", "expand", "t", "as_strided", "unflatten", "__getitem__",
                 "view_as", "unbind", "split", "chunk"}


def _target_name(n: torch.fx.Node) -> str:
    t = n.target
    return t if isinstance(t, str) else getattr(t, "__name__", str(t))


def _alias_base(gm: torch.fx.GraphModule) -> dict:
    """node -> placeholder it is a view of (views through common view ops only)."""
    base = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            base[n] = n
        elif n.op in ("call_method", "call_function") and n.args:
            name = _target_name(n)
            if (name in _VIEW_METHODS or n.target is operator.getitem) and isinstance(n.args[0], torch.fx.Node):
                if n.args[0] in base:
                    base[n] = base[n.args[0]]
    return base


def _mutated(gm: torch.fx.GraphModule) -> set:
    """Placeholders the graph writes in place (setitem, x.op_(...), mutating custom ops)."""
    base = _alias_base(gm)
    out = set()
    for n in gm.graph.nodes:
        written = []
        if n.op == "call_function" and n.target is operator.setitem:
            written.append(n.args[0])
        elif n.op in ("call_method", "call_function"):
            name = _target_name(n)
            if inplace_name(name) and n.args:
                written.append(n.args[0])  # x.div_(t), x /= t
            schema = getattr(n.target, "_schema", None)
            if schema is not None:
                for a, v in zip(schema.arguments, n.args):
                    if a.alias_info is not None and a.alias_info.is_write:
                        written.append(v)
            if "out" in n.kwargs:
                written.append(n.kwargs["out"])
        for w in written:
            if isinstance(w, torch.fx.Node) and w in base:
                out.add(base[w])
    return out


def _depends_on(gm: torch.fx.GraphModule, roots: set) -> set:
    dep = set(roots)
    for n in gm.graph.nodes:
        if n not in dep and any(a in dep for a in n.all_input_nodes):
            dep.add(n)
    return dep


def _verify_nodes(gm: torch.fx.GraphModule) -> list:
    try:
        op = torch.ops.npuspec.rejection_sample
    except (AttributeError, RuntimeError):
        return []
    targets = {op} | {getattr(op, o) for o in op.overloads()}
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in targets]


def _grapharg_example(node: torch.fx.Node):
    ga = node.meta.get("grapharg")
    if ga is None:
        return None
    try:
        return ga.example
    except Exception:  # the weak reference died
        return None


def _source_name(node: torch.fx.Node) -> str:
    src = getattr(node.meta.get("grapharg"), "source", None)
    if src is None:
        return node.name
    name = src.name if isinstance(getattr(src, "name", None), str) else src.name()
    local = re.fullmatch(r"L\['(\w+)'\]", name)  # a plain argument: its own name
    return local.group(1) if local else name


def check_token_groups(gm: torch.fx.GraphModule) -> None:
    """Token dims marked in one group must have one size (they share one size symbol). Two
    that differ end in Dynamo's "Guard failed on the same frame it was created" after this
    compile; name both inputs and the fix here instead (a ValueError)."""
    first: dict = {}  # group -> (input name, dim, size)
    for n in gm.graph.find_nodes(op="placeholder"):
        real = _grapharg_example(n)
        dim, group = getattr(real, TOKEN_DIM_ATTR, None), getattr(real, GROUP_ATTR, None)
        if dim is None or group is None:
            continue
        here = (_source_name(n), dim, int(real.shape[dim]))
        other = first.setdefault(group, here)
        if other[2] != here[2]:
            raise ValueError(
                f"npuspec: mark_token_dim: {other[0]} (dim {other[1]}, size {other[2]}) and "
                f"{here[0]} (dim {here[1]}, size {here[2]}) are both in token group "
                f"{group!r}, whose token dims must all have one size; give the one with "
                f"another size a group of its own, e.g. mark_token_dim(x, group='tokens') "
                f"for flat tokens [B*(K+1)] (docs/graphs.md, 'Size 1')")


def _is_static_tensor(node: torch.fx.Node, example) -> bool:
    if isinstance(example, torch.nn.Parameter) or hasattr(example, "_dynamo_static_input_type"):
        return True
    name = _source_name(node) if node.meta.get("grapharg") is not None else ""
    return "_parameters" in name or "_buffers" in name


def analyse(gm: torch.fx.GraphModule, example_inputs: Sequence) -> GraphLayout:
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert len(phs) == len(example_inputs), (len(phs), len(example_inputs))
    mutated = _mutated(gm)
    verify = _verify_nodes(gm)
    # Inert padding for the verify op's per-request inputs: no draft, harmless draws.
    verify_pads = {}
    base = _alias_base(gm)
    for v in verify:
        for i, name, pad in VERIFY_PADS:
            d = v.args[i] if len(v.args) > i else v.kwargs.get(name)
            if isinstance(d, torch.fx.Node) and d in base:
                verify_pads[base[d]] = pad

    args: list[ArgInfo] = []
    declared = set()  # token inputs whose caller chose the padding value
    for n, ex in zip(phs, example_inputs):
        if isinstance(ex, torch.SymInt):
            args.append(ArgInfo(INT, expr=_expr(ex)))
        elif isinstance(ex, torch.Tensor):
            fake = n.meta.get("example_value", ex)  # example_inputs may be real tensors
            shape = tuple(_expr(s) for s in fake.shape)
            real = _grapharg_example(n)
            if real is None and not isinstance(ex, torch._subclasses.FakeTensor):
                real = ex
            dim = getattr(real, TOKEN_DIM_ATTR, None)
            if dim is None and not _is_static_tensor(n, real) and shape and shape[0].free_symbols:
                dim = 0  # unmarked but dynamic at dim 0 (automatic dynamic): the batch dim
            if dim is not None and not shape[dim].free_symbols:
                dim = None  # marked, but Dynamo specialised it (e.g. size 1): nothing to pad
            stride = tuple(_expr(s) for s in fake.stride())
            if dim is not None:
                # default padding 1: a safe divisor, finite through any arithmetic
                pad = getattr(real, PAD_ATTR, verify_pads.get(n, 1))
                if hasattr(real, PAD_ATTR):
                    declared.add(n)
                args.append(ArgInfo(TOKEN, shape, dim, pad=pad, mutated=n in mutated,
                                    stride=stride))
            elif _is_static_tensor(n, real):
                args.append(ArgInfo(STATIC, shape, mutated=n in mutated))
            else:  # copied in (and, when the step writes it, back out) at every call
                args.append(ArgInfo(COPY, shape, mutated=n in mutated, stride=stride))
        else:
            args.append(ArgInfo(CONST))

    tok_syms, other_syms = set(), set()
    for a in args:
        if a.kind == TOKEN:
            for i, e in enumerate(a.shape):
                (tok_syms if i == a.dim else other_syms).update(e.free_symbols)
        elif a.kind in (COPY, STATIC):
            for e in a.shape:
                other_syms.update(e.free_symbols)
    pad_syms = tuple(sorted(tok_syms - other_syms, key=str))
    int_syms = set()
    for a in args:
        if a.kind == INT:
            int_syms.update(a.expr.free_symbols)
    key_syms = tuple(sorted((other_syms | int_syms | tok_syms) - set(pad_syms), key=str))

    sources = {}
    for i, a in enumerate(args):
        if a.kind == INT and isinstance(a.expr, sympy.Symbol):
            sources.setdefault(a.expr, (i, None))
        elif a.shape:
            for d, e in enumerate(a.shape):
                if isinstance(e, sympy.Symbol):
                    sources.setdefault(e, (i, d))
    reason = ""
    missing = [s for s in pad_syms + key_syms if s not in sources]
    if missing:
        reason = f"size symbols {missing} are not plain input sizes"

    # outputs
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    token_phs = {phs[i] for i, a in enumerate(args) if a.kind == TOKEN}
    dep = _depends_on(gm, token_phs)
    raw_outs = out_node.args[0]
    raw_outs = list(raw_outs) if isinstance(raw_outs, (tuple, list)) else [raw_outs]
    outs = []
    for o in raw_outs:
        ev = o.meta.get("example_value") if isinstance(o, torch.fx.Node) else o
        if isinstance(ev, torch.Tensor):
            outs.append(("tensor", tuple(_expr(s) for s in ev.shape), o in dep))
        elif isinstance(ev, torch.SymInt):
            outs.append(("int", _expr(ev)))
        else:
            outs.append(("const", None))

    shape_env = None
    from torch._guards import detect_fake_mode
    fm = detect_fake_mode([n.meta.get("example_value") for n in phs] + list(example_inputs))
    if fm is not None:
        shape_env = fm.shape_env
    guards, ranges = [], {}
    if shape_env is not None:
        guards = [g.expr for g in getattr(shape_env, "guards", [])]
        # unbacked token dims: what the compiled code asserts at run time must hold at the
        # padded sizes too (e.g. tokens == (K+1) * rows from a view)
        for ras in getattr(shape_env, "deferred_runtime_asserts", {}).values():
            guards.extend(ra.expr for ra in ras)
        for s in pad_syms + key_syms:
            vr = shape_env.var_to_range.get(s)
            if vr is not None:
                ranges[s] = (vr.lower, vr.upper)

    rows = ""
    if pad_syms and not reason:
        seeds = token_phs | {phs[i] for i, a in enumerate(args)
                             if a.kind == INT and a.expr.free_symbols & set(pad_syms)}
        rows, written = row_blockers(gm, seeds, set(key_syms), declared, base)
    else:
        written = set()
    for n, a in zip(phs, args):
        if a.kind == STATIC and a.mutated:
            a.restore = n not in written or bool(rows)

    vk = vb = None
    if verify:
        d = verify[0].args[1] if len(verify[0].args) > 1 else verify[0].kwargs.get("draft_token_ids")
        dv = d.meta.get("example_value") if isinstance(d, torch.fx.Node) else None
        if isinstance(dv, torch.Tensor) and dv.dim() == 2:
            vb, vk = _expr(dv.shape[0]), _expr(dv.shape[1])
    return GraphLayout(args, outs, pad_syms, key_syms, sources, guards, ranges, vk, vb, reason,
                       rows)


# -- one key -------------------------------------------------------------------------------------
def _linear(e) -> Optional[tuple[int, int]]:
    """(a, b) with e == a*u + b for integers a, b, else None."""
    e = sympy.expand(sympy.simplify(e))
    if e.free_symbols - {U}:
        return None
    try:
        p = sympy.Poly(e, U)
    except sympy.PolynomialError:
        return None
    if p.degree() > 1:
        return None
    a, b = p.coeff_monomial(U), p.coeff_monomial(1)
    if not (a.is_integer and b.is_integer):
        return None
    return int(a), int(b)


def _strides(exprs: tuple, sub: dict) -> tuple:
    """Stride exprs at one key as (a, b) per dim (stride = a*u + b); () when not linear."""
    out = []
    for e in exprs:
        lin = _linear(sympy.sympify(e).subs(sub))
        if lin is None:
            return ()
        out.append(lin)
    return tuple(out)


def runtime_values(layout: GraphLayout, args: Sequence) -> dict:
    vals = {}
    for s, (i, d) in layout.sources.items():
        vals[s] = int(args[i]) if d is None else int(args[i].shape[d])
    return vals


def key_of(layout: GraphLayout, vals: dict) -> tuple[tuple, int]:
    """((ratio, key values), u) for the runtime symbol values."""
    if not layout.pad_syms:
        return ((), tuple(vals[s] for s in layout.key_syms)), 1
    pv = [vals[s] for s in layout.pad_syms]
    u = 0
    for v in pv:
        u = math.gcd(u, v)
    u = max(u, 1)
    return (tuple(v // u for v in pv), tuple(vals[s] for s in layout.key_syms)), u


def concretize(layout: GraphLayout, key: tuple) -> KeyLayout:
    ratio, kv = key
    sub = {s: a * U for s, a in zip(layout.pad_syms, ratio)}
    sub.update(dict(zip(layout.key_syms, kv)))
    exact = not layout.pad_syms or bool(layout.rows)
    slots = []
    for a in layout.args:
        stride = _strides(a.stride, sub)
        if a.kind == TOKEN and not sympy.sympify(a.shape[a.dim]).subs(sub).free_symbols:
            # its size depends on key symbols only (e.g. K+1 at B=1)
            slots.append(Slot(COPY, mutated=a.mutated, stride=stride))
        elif a.kind == TOKEN:
            lin = _linear(a.shape[a.dim].subs(sub))
            rest_ok = all(not sympy.sympify(e).subs(sub).free_symbols
                          for i, e in enumerate(a.shape) if i != a.dim)
            if lin is None or lin[1] != 0 or lin[0] < 1 or not rest_ok:
                exact = True
                lin = lin if lin is not None and lin[0] >= 1 and lin[1] == 0 else (1, 0)
            slots.append(Slot(TOKEN, a.dim, lin[0], 0, a.pad, a.mutated, stride))
        elif a.kind == INT:
            lin = _linear(a.expr.subs(sub))
            if lin is None:
                exact = True
                lin = (0, 0)
            slots.append(Slot(INT, 0, lin[0], lin[1]))
        elif a.kind == COPY:
            slots.append(Slot(COPY, mutated=a.mutated, stride=stride))
        elif a.kind == STATIC:
            slots.append(Slot(STATIC, restore=a.restore))
        else:
            slots.append(Slot(a.kind))
    out_dims = []
    for o in layout.outs:
        if o[0] != "tensor":
            out_dims.append(None)
            if o[0] == "int" and sympy.sympify(o[1]).subs(sub).free_symbols:
                exact = True  # a batch size returned as an int would need rescaling; keep exact
            continue
        dims = [i for i, e in enumerate(o[1]) if sympy.sympify(e).subs(sub).free_symbols]
        if not dims:
            out_dims.append(None)
            exact = exact or o[2]  # a batch reduction: padding rows would leak into it
            continue
        lin = _linear(o[1][dims[0]].subs(sub))
        if len(dims) > 1 or lin is None or lin[1] != 0:
            # e.g. x[1:] ([B-1]): not coef*u rows, so never sliced; exact sizes return it whole
            exact = True
            out_dims.append(None)
            continue
        out_dims.append(dims[0])
    k = tpu = None
    if layout.verify_k is not None:
        kk = sympy.sympify(layout.verify_k).subs(sub)
        lb = _linear(sympy.sympify(layout.verify_b).subs(sub))
        if kk.is_Integer:
            k = int(kk)
            if lb is not None and lb[1] == 0 and lb[0] >= 1:
                tpu = (k + 1) * lb[0]  # tokens per unit: K+1 per verified request

    guards = [sympy.sympify(g).subs(sub) for g in layout.guards]
    ranges = [(sympy.sympify(s).subs(sub), lo, hi) for s, (lo, hi) in layout.ranges.items()]

    def ok_units(units: int) -> bool:
        for g in guards:
            v = g.subs(U, units)
            if getattr(v, "free_symbols", None):
                continue  # over symbols the graph makes itself (a runtime assert on .item())
            if v is sympy.false or (v.is_Boolean and not bool(v)):
                return False
        for e, lo, hi in ranges:
            v = e.subs(U, units)
            if v.is_number and not (lo <= v <= hi):
                return False
        return True

    return KeyLayout(slots, out_dims, exact, k, tpu, ok_units)
