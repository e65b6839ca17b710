"""Row independence: may padding rows be added to a Dynamo graph's token dims?

Padding is only safe when every real row's results are what they would be without the padding
rows: no op may mix values along the token (batch) dim. `row_blockers` proves that, op by op,
over the Dynamo FX graph, or names the first op it cannot prove (file:line), and then the
graph is captured at exact sizes only (docs/graphs.md, "What is padded").

Each tensor value carries its token dim: the one dim whose size has a symbol other than the
key symbols (K and the like). An op is row-wise when it is

- elementwise (inputs broadcast, token dims aligned), or a factory / view / permutation;
- a reduction, scan or selection along dims other than the token dim;
- a matmul, linear, embedding or attention whose contracted dims are not the token dim;
- indexing whose index at the token dim is a full slice or the row ids (`arange(B)`);
- one of npuspec's own ops (every input and output row-aligned at dim 0).

Writes into a buffer that has no token dim (a KV cache) at indices computed from token
inputs are allowed only when each of those inputs declared its padding value
(`mark_token_dim(slots, pad=SCRATCH)`): the caller vouches that padding rows write scratch
space. Later reads of that buffer must gather rows by token indices. A reduction over the
batch, a flip or roll along it, the batch size used as a number, random draws sized by the
batch, or any op not known here makes the graph exact-only.
"""
from __future__ import annotations

import operator
from typing import Optional

import sympy
import torch
from torch.fx import Node

_E = """add sub rsub mul div true_divide floor_divide truediv floordiv mod remainder fmod pow
neg pos abs exp exp2 expm1 log log2 log10 log1p sqrt rsqrt sigmoid tanh sin cos tan asin acos
atan atan2 sinh cosh relu relu6 gelu silu mish softplus softsign leaky_relu elu selu celu
hardtanh hardsigmoid hardswish logsigmoid clamp clip clamp_min clamp_max maximum minimum fmax
fmin where masked_fill eq ne lt le gt ge logical_and logical_or logical_not logical_xor and_
or_ xor invert not_ bitwise_and bitwise_or bitwise_xor bitwise_not lshift rshift
bitwise_left_shift bitwise_right_shift sign signbit floor ceil round trunc frac reciprocal
square erf erfc erfinv lerp addcmul addcdiv isnan isinf isfinite isneginf isposinf nan_to_num
float half bfloat16 double int long short bool byte char to type type_as contiguous clone
detach copy fill zero logit xlogy heaviside float_power sgn positive negative
absolute multiply divide subtract""".split()
ELEMENTWISE = frozenset(_E)
# reductions: dim argument (None or absent = every dim); its position in (self, ...)
REDUCE = {n: 1 for n in """sum mean prod amax amin max min argmax argmin any all logsumexp std
var count_nonzero median nansum nanmean nanmedian mode std_mean var_mean aminmax""".split()}
REDUCE["norm"] = 2
# ops along one dim (default when absent), position of the dim argument
ALONG = {"softmax": (1, None), "log_softmax": (1, None), "cumsum": (1, None),
         "cumprod": (1, None), "cummax": (1, None), "cummin": (1, None),
         "logcumsumexp": (1, None), "sort": (1, -1), "argsort": (1, -1), "topk": (2, -1),
         "kthvalue": (2, -1), "normalize": (2, 1), "diff": (2, -1), "glu": (1, -1),
         "narrow": (1, None), "select": (1, None), "split": (2, 0), "chunk": (2, 0),
         "unbind": (1, 0), "tensor_split": (2, 0), "split_with_sizes": (2, 0),
         "index_select": (1, None), "gather": (1, None), "scatter": (1, None),
         "scatter_add": (1, None), "scatter_reduce": (1, None), "msort": (None, 0)}
STRUCTURAL = frozenset("""transpose permute t movedim moveaxis swapaxes swapdims unsqueeze
squeeze expand expand_as broadcast_to alias""".split())
RESHAPES = frozenset("view reshape flatten unflatten view_as reshape_as".split())
FACTORIES = frozenset("""arange zeros ones full empty zeros_like ones_like full_like empty_like
new_zeros new_ones new_full new_empty new_tensor tensor scalar_tensor size dim numel
stride""".split())
RANDOM = frozenset("""rand randn randint rand_like randn_like randint_like bernoulli multinomial
exponential uniform normal dropout randperm poisson""".split())
INPLACE_OPERATORS = {"iadd": "add", "isub": "sub", "imul": "mul", "itruediv": "truediv",
                     "ifloordiv": "floordiv", "imod": "mod", "ipow": "pow", "iand": "and_",
                     "ior": "or_", "ixor": "xor", "ilshift": "lshift", "irshift": "rshift",
                     "imatmul": "matmul"}
INDEX_WRITES = frozenset("setitem index_put index_copy index_add index_fill".split())
CONTRACT = frozenset("matmul mm bmm linear embedding scaled_dot_product_attention addmm "
                     "baddbmm layer_norm rms_norm pad cat concat concatenate stack".split())
# shape checks: they compute nothing
CHECKS = frozenset("""_assert_scalar _assert sym_constrain_range sym_constrain_range_for_size
_check_is_size _assert_tensor_metadata _check _check_with""".split())
# npuspec's ops: inputs and outputs row-aligned at dim 0; they may read a scatter-written pool
ROW_OPS = frozenset("""rejection_sample paged_attention add_rms_norm linear_packed linear_rows
greedy_accept ratio_accept residual_probs residual_sample""".split())


def inplace_name(name: str) -> bool:
    """`x.div_(t)` / `torch.Tensor.add_` or Python's `x /= t` (operator.itruediv)."""
    return (name.endswith("_") and not name.startswith("_")) or name in INPLACE_OPERATORS


def op_name(n: Node) -> str:
    t = n.target
    if isinstance(t, str):
        return t
    if isinstance(t, (torch._ops.OpOverloadPacket, torch._ops.OpOverload)):
        ns, _, rest = (getattr(t, "_qualified_op_name", None) or t.name()).partition("::")
        rest = rest.split(".")[0]
        return "npuspec." + rest if ns == "npuspec" else rest
    return getattr(t, "__name__", str(t))


def where(n: Node) -> str:
    """file:line of the user code that made `n`, from Dynamo's stack trace."""
    st = n.meta.get("stack_trace") or ""
    for ln in reversed(st.strip().splitlines()):
        ln = ln.strip()
        if ln.startswith("File "):
            parts = ln.split(",")
            return f"{parts[0][6:-1].rsplit('/', 1)[-1]}:{parts[1].strip()[5:]}"
    return "?"


def _e(s) -> sympy.Expr:
    return sympy.sympify(s.node.expr) if isinstance(s, torch.SymInt) else sympy.Integer(int(s))


_SCALE = 5040  # 2^4 * 3^2 * 5 * 7


class _Blocked(Exception):
    pass


class _Rows:
    def __init__(self, gm, token_phs: set, key_syms: set, declared: set, alias_base: dict):
        self.key = set(key_syms)
        self.declared, self.base = declared, alias_base
        self.dep: set = set(token_phs)     # nodes whose values depend on token inputs
        self.rowid: set = set()           # arange over the token dim (row i holds i)
        self.tainted: set = set()         # token-free bases written at token indices
        self.gm = gm

    # -- facts ---------------------------------------------------------------------------
    def val(self, x):
        return x.meta.get("example_value") if isinstance(x, Node) else x

    def tdims(self, x) -> list[int]:
        v = self.val(x)
        if not isinstance(v, torch.Tensor):
            return []
        return [i for i, s in enumerate(v.shape) if self.grows(s)]

    def grows(self, s) -> bool:
        """Does size `s` scale with the batch? Batch symbols are replaced by a multiple of
        every small divisor first, so `B*4 // (B*4 // 4)` (a view's -1) folds to 4."""
        if not isinstance(s, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return False
        e = sympy.sympify(s.node.expr)
        syms = e.free_symbols - self.key
        if not syms:
            return False
        return bool(e.xreplace({t: _SCALE * t for t in syms}).free_symbols - self.key)

    def bd(self, x) -> Optional[int]:
        """The token dim of a token-dependent tensor (None for a token-free value)."""
        if not (isinstance(x, Node) and x in self.dep):
            return None
        d = self.tdims(x)
        if len(d) != 1:
            raise _Blocked(f"a value with {len(d)} token dims")
        return d[0]

    def ndim(self, x) -> int:
        v = self.val(x)
        return v.dim() if isinstance(v, torch.Tensor) else 0

    def token_sym(self, x) -> bool:
        return self.grows(self.val(x))

    def is_tainted(self, x) -> bool:
        """A token-free view of a buffer written at token indices (a gather from it is not)."""
        return isinstance(x, Node) and x not in self.dep and self.base.get(x, x) in self.tainted

    # -- the walk ------------------------------------------------------------------------
    def run(self) -> str:
        for n in self.gm.graph.nodes:
            if n.op in ("placeholder", "output", "get_attr"):
                continue
            ins = n.all_input_nodes
            if not any(a in self.dep or self.is_tainted(a) for a in ins):
                continue
            if any(a in self.dep for a in ins):
                self.dep.add(n)  # else: a view of a written buffer (still tainted)
            try:
                self.check(n, op_name(n))
            except _Blocked as e:
                return self._why(n, str(e))
        return ""

    def _why(self, n: Node, what: str) -> str:
        return f"{op_name(n)} at {where(n)}: {what}"

    def arg(self, n: Node, pos: Optional[int], name: str, default=None):
        if name in n.kwargs:
            return n.kwargs[name]
        if pos is not None and len(n.args) > pos:
            return n.args[pos]
        return default

    def check(self, n: Node, name: str) -> None:
        base = name[:-1] if name.endswith("_") and not name.startswith("_") and name[:-1] else name
        base = INPLACE_OPERATORS.get(base, base)
        if name in CHECKS:
            return
        if name.startswith("npuspec."):
            return self.row_op(n, name[8:])
        if n.target is operator.getitem:
            return self.getitem(n)
        if base in INDEX_WRITES or name in INDEX_WRITES:
            return self.index_write(n, base)
        self.no_taint(n)
        if self.writes_token_free(n, name):
            raise _Blocked(f"writes token data into {n.args[0]}, which has no token dim")
        if base in RANDOM:
            raise _Blocked("draws random numbers for the whole batch")
        if isinstance(self.val(n), (torch.SymInt, torch.SymFloat, torch.SymBool, int, float)):
            return  # size arithmetic; a batch size used as a value is caught by its consumer
        if base in ELEMENTWISE or (base in ("max", "min") and isinstance(self.arg(n, 1, "other"), Node)
                                   and isinstance(self.val(self.arg(n, 1, "other")), torch.Tensor)):
            return self.elementwise(n)
        if base in REDUCE:
            return self.reduce(n, base)
        if base in ALONG:
            return self.along(n, base)
        if base in STRUCTURAL or base in FACTORIES:
            return self.out_has_one(n)
        if base in RESHAPES:
            return self.reshape(n)
        if base in ("repeat", "tile"):
            return self.repeat(n)
        if base == "flip":
            return self.dims_not_bd(n, self.arg(n, 1, "dims"), "flips")
        if base == "roll":
            dims = self.arg(n, 2, "dims")
            if dims is None:
                raise _Blocked("rolls the flattened batch")
            return self.dims_not_bd(n, dims, "rolls")
        if base in CONTRACT:
            return self.contract(n, base)
        raise _Blocked("not known to keep rows independent")

    def out_has_one(self, n: Node) -> None:
        if isinstance(self.val(n), torch.Tensor):
            self.bd(n)

    def no_taint(self, n: Node) -> None:
        for a in n.all_input_nodes:
            if self.is_tainted(a):
                raise _Blocked(f"reads {self.base.get(a, a)} (written at token indices) other "
                               f"than by gathering rows")

    def writes_token_free(self, n: Node, name: str) -> bool:
        if not inplace_name(name) or not n.args or not isinstance(n.args[0], Node):
            return False
        return n.args[0] not in self.dep

    def sym_operands(self, n: Node) -> None:
        for a in list(n.args) + list(n.kwargs.values()):
            if isinstance(a, Node) and self.token_sym(a):
                raise _Blocked("uses the batch size as a value")

    def elementwise(self, n: Node) -> None:
        self.sym_operands(n)
        d, nd = self.bd(n), self.ndim(n)
        for a in n.all_input_nodes:
            if a in self.dep and isinstance(self.val(a), torch.Tensor):
                b = self.bd(a)
                if b + nd - self.ndim(a) != d:
                    raise _Blocked("token dims of its inputs are not aligned")

    def _dims(self, dims, nd: int) -> list[int]:
        if isinstance(dims, (list, tuple)):
            return [int(x) % nd for x in dims]
        return [int(dims) % nd]

    def dims_not_bd(self, n: Node, dims, what: str) -> None:
        x = n.args[0]
        d = self.bd(x)
        if d is not None and d in self._dims(dims, self.ndim(x)):
            raise _Blocked(f"{what} along the token dim")
        self.out_has_one(n)

    def reduce(self, n: Node, base: str) -> None:
        x = n.args[0]
        dim = self.arg(n, REDUCE[base], "dim")
        if x not in self.dep:
            raise _Blocked("reduces a token-free value with token data")
        if dim is None or isinstance(dim, Node):
            raise _Blocked("reduces over every dim, the batch included")
        self.dims_not_bd(n, dim, "reduces")

    def along(self, n: Node, base: str) -> None:
        pos, default = ALONG[base]
        x = n.args[0]
        dim = self.arg(n, pos, "dim", default)
        if base in ("index_select", "gather", "scatter", "scatter_add", "scatter_reduce"):
            if x not in self.dep:  # a lookup table indexed by token data
                return self.out_has_one(n)
        if dim is None:
            raise _Blocked("works along a dim it cannot name")
        if x not in self.dep:
            raise _Blocked("mixes token data into a token-free value")
        self.dims_not_bd(n, dim, "works")

    def reshape(self, n: Node) -> None:
        x = n.args[0]
        if x not in self.dep:  # a token-free value shaped by the batch size
            return self.out_has_one(n)
        d_in, d_out = self.bd(x), self.bd(n)
        pi = sympy.Mul(*[_e(s) for s in self.val(x).shape[:d_in]])
        po = sympy.Mul(*[_e(s) for s in self.val(n).shape[:d_out]])
        if sympy.simplify(pi - po) != 0:
            raise _Blocked("reshapes across the token dim")

    def repeat(self, n: Node) -> None:
        x = n.args[0]
        reps = n.args[1:] if len(n.args) > 2 or not isinstance(n.args[1], (list, tuple)) else n.args[1]
        d = self.bd(x)
        off = len(reps) - self.ndim(x)
        r = reps[d + off]
        if not (isinstance(r, int) and r == 1):
            raise _Blocked("repeats rows")
        self.out_has_one(n)

    def contract(self, n: Node, base: str) -> None:
        a = [x for x in n.args]
        if base in ("cat", "concat", "concatenate"):
            dim = self.arg(n, 1, "dim", 0)
            for t in a[0]:
                if t in self.dep and self.bd(t) == int(dim) % self.ndim(t):
                    raise _Blocked("concatenates along the token dim")
            return self.out_has_one(n)
        if base == "stack":
            bds = {self.bd(t) for t in a[0] if t in self.dep}
            if len(bds) != 1:
                raise _Blocked("stacks values whose token dims differ")
            return self.out_has_one(n)
        if base in ("matmul", "mm", "bmm", "baddbmm", "addmm"):
            x, y = (a[1], a[2]) if base in ("addmm", "baddbmm") else (a[0], a[1])
            nx, ny = self.ndim(x), self.ndim(y)
            if self.bd(x) == nx - 1 or self.bd(y) == (ny - 2 if ny >= 2 else 0):
                raise _Blocked("contracts the token dim")
        elif base == "linear":
            w = self.arg(n, 1, "weight")
            if w in self.dep or self.arg(n, 2, "bias") in self.dep:
                raise _Blocked("a weight that depends on token data")
            if self.bd(a[0]) == self.ndim(a[0]) - 1:
                raise _Blocked("contracts the token dim")
        elif base == "embedding":
            if self.arg(n, 1, "weight") in self.dep:
                raise _Blocked("a table that depends on token data")
        elif base == "scaled_dot_product_attention":
            for i, t in enumerate(a[:4] + [n.kwargs.get("attn_mask")]):
                if isinstance(t, Node) and t in self.dep:
                    nd, d = self.ndim(t), self.bd(t)
                    bad = {nd - 1} if i in (0, 3, 4) else {nd - 1, nd - 2}
                    if d in bad:
                        raise _Blocked("attends across the token dim")
        elif base in ("layer_norm", "rms_norm"):
            shape = self.arg(n, 1, "normalized_shape")
            k = len(shape) if isinstance(shape, (list, tuple)) else 1
            if self.bd(a[0]) >= self.ndim(a[0]) - k:
                raise _Blocked("normalises over the token dim")
        elif base == "pad":
            p = self.arg(n, 1, "pad")
            if self.bd(a[0]) >= self.ndim(a[0]) - len(p) // 2:
                raise _Blocked("pads the token dim")
        self.out_has_one(n)

    def getitem(self, n: Node) -> None:
        x, idx = n.args[0], n.args[1]
        v = self.val(x)
        if not isinstance(v, torch.Tensor):  # an item of a tuple (topk, split, size)
            return self.out_has_one(n)
        idx = list(idx) if isinstance(idx, tuple) else [idx]
        self.check_index(x, idx)
        self.out_has_one(n)

    def check_index(self, x, idx: list) -> None:
        """x[idx]: at x's token dim only a full slice or the row ids; token data as an index
        into a token-free x is a gather (fine)."""
        for t in idx:
            if isinstance(t, Node) and self.token_sym(t):
                raise _Blocked("indexes with the batch size")
        d = self.bd(x)
        if d is None:
            return
        nd = self.ndim(x)
        if any(t is Ellipsis for t in idx):
            e = idx.index(Ellipsis)
            used = sum(1 for t in idx if t is not None and t is not Ellipsis)
            idx = idx[:e] + [slice(None)] * (nd - used) + idx[e + 1:]
        dim = 0
        for t in idx:
            if t is None:
                continue
            if dim == d:
                if isinstance(t, slice):
                    full = (t.start in (None, 0) and t.stop is None and t.step in (None, 1))
                    if not full:
                        raise _Blocked("slices the token dim")
                elif not (isinstance(t, Node) and t in self.rowid):
                    raise _Blocked("indexes the token dim with something other than the row ids")
            dim += 1

    def index_write(self, n: Node, base: str) -> None:
        """x[idx] = v, x.index_put_(idx, v), ...: into a token-free buffer only at indices
        the caller vouched for (declared pads)."""
        x = n.args[0]
        if base == "setitem":
            idx, vals = n.args[1], [n.args[2]]
            idx = list(idx) if isinstance(idx, tuple) else [idx]
        else:
            idx = list(n.args[1]) if base == "index_put" else [n.args[2]]
            vals = list(n.args[2:])
        if x in self.dep and not self.is_tainted(x):
            self.check_index(x, idx)
            return
        for t in idx:
            if isinstance(t, Node) and t in self.dep:
                undeclared = [p for p in self.sources(t) if p not in self.declared]
                if undeclared:
                    raise _Blocked(f"writes {self.base.get(x, x)} at indices from "
                                   f"{', '.join(p.name for p in undeclared)}, whose padding "
                                   f"value is not declared (mark_token_dim(..., pad=...))")
            elif isinstance(t, Node) and self.is_tainted(t):
                raise _Blocked("indexes with a buffer written at token indices")
        if not any(isinstance(t, Node) and t in self.dep for t in idx):
            if any(isinstance(v, Node) and v in self.dep for v in vals):
                raise _Blocked(f"writes token data into {x} at fixed indices")
        self.tainted.add(self.base.get(x, x))

    def sources(self, t: Node) -> set:
        """Token placeholders `t` is computed from."""
        seen, out, stack = set(), set(), [t]
        while stack:
            m = stack.pop()
            if m in seen:
                continue
            seen.add(m)
            if m.op == "placeholder":
                if m in self.dep:
                    out.add(m)
            stack.extend(m.all_input_nodes)
        return out

    def row_op(self, n: Node, name: str) -> None:
        if name not in ROW_OPS:
            raise _Blocked(f"npuspec::{name} is not a row-wise op")
        for a in n.all_input_nodes:
            if a in self.dep and isinstance(self.val(a), torch.Tensor) and self.bd(a) != 0:
                raise _Blocked("an input whose token dim is not dim 0")
        self.sym_operands(n)


def _mark_rowids(r: _Rows) -> None:
    for n in r.gm.graph.nodes:
        if n.op == "call_function" and op_name(n) == "arange":
            args = [a for a in n.args]
            if len(args) == 1 and isinstance(args[0], Node) and r.token_sym(args[0]):
                r.rowid.add(n)
        elif n.op in ("call_method", "call_function") and n.args and n.args[0] in r.rowid:
            if op_name(n) in ("unsqueeze", "view", "reshape", "to", "long", "int") or (
                    n.target is operator.getitem and all(
                        t is None or (isinstance(t, slice) and t == slice(None))
                        or t is Ellipsis for t in (n.args[1] if isinstance(n.args[1], tuple)
                                                   else (n.args[1],)))):
                r.rowid.add(n)


def row_blockers(gm: torch.fx.GraphModule, token_phs: set, key_syms, declared: set,
                 alias_base: dict) -> tuple[str, set]:
    """('' when padding the token dims cannot change a real row's results, else why not;
    the placeholders written at declared token indices)."""
    r = _Rows(gm, token_phs, key_syms, declared, alias_base)
    _mark_rowids(r)
    return r.run(), r.tainted
