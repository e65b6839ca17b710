"""A spelling fuzzer for verify steps (issue 37, point 5): exact source rewrites of a function.

`variants(fn, n, seed)`: fn's source (inspect.getsource), n times rewritten by a random
composition of the rewrites below, locals renamed, exec'd in a copy of fn.__globals__ with the
helpers fn reaches in its module rewritten too (an entry may only forward to one).

Every rewrite is exact: the same values bit for bit, the same draws in the same order. Python
evaluates receivers, then arguments, left to right; a rewrite moves an expression past another
only when that one is "pure" (a name, a literal, an attribute of a name: it cannot draw, write
or read tensor data early). Left out: clamp(x, min=0) -> torch.relu(x): Inductor (torch 2.13,
CPU) gives clamp(-0.0, min=0) = +0.0 but relu(-0.0) = -0.0 (eager: -0.0 for both); the clamp
forms used agree bit for bit in both (test_spelling_fuzzer.py::test_clamp_forms_*).
"""
from __future__ import annotations

import ast
import builtins
import collections
import inspect
import itertools
import linecache
import random
import textwrap
import types

import torch

# the positional arguments after `input` (after the tensors for cat), by name
ARG_NAMES = {"argmax": ("dim", "keepdim"), "argmin": ("dim", "keepdim"), "sum": ("dim", "keepdim"),
             "any": ("dim", "keepdim"), "gather": ("dim", "index"), "softmax": ("dim",),
             "log_softmax": ("dim",), "cumprod": ("dim",), "cumsum": ("dim",), "cummin": ("dim",),
             "unsqueeze": ("dim",), "squeeze": ("dim",), "cat": ("dim",),
             "clamp": ("min", "max"), "clamp_min": ("min",), "clamp_max": ("max",)}
# torch functions that are also Tensor methods taking the same arguments after `input`
METHOD_FNS = set(ARG_NAMES) - {"cat"}
CASTS = {"int": "int32", "long": "int64", "float": "float32", "bool": "bool", "double": "float64"}
UNCAST = {**{v: k for k, v in CASTS.items()}, "int": "int", "long": "long", "float": "float",
          "double": "double"}
WORDS = ("val", "tmp", "acc", "buf", "res", "out", "cur", "z", "h", "w")
FLIP = {ast.Lt: ast.Gt, ast.Gt: ast.Lt, ast.LtE: ast.GtE, ast.GtE: ast.LtE, ast.Eq: ast.Eq,
        ast.NotEq: ast.NotEq}


# ---- small AST predicates ---------------------------------------------------------------------
def _module_of(node, env):
    """The module a name or attribute chain is in env (torch, torch.nn.functional), or None."""
    m = env.get(node.id) if isinstance(node, ast.Name) else \
        getattr(_module_of(node.value, env), node.attr, None) if isinstance(node, ast.Attribute) \
        else None
    return m if isinstance(m, types.ModuleType) else None


# kind: "method" (x.name(...)), "torch" (torch.name(x, ...)) or "F" (functional); base: the
# positional arguments before the first one ARG_NAMES names (0 for a method, else 1)
Op = collections.namedtuple("Op", "kind name base")


def _op(node, env):
    """What a call is: a method on a non-module receiver, or a torch / functional function
    (None for anything else, and for calls with *args: their arguments cannot be named)."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)) or \
            any(isinstance(a, ast.Starred) for a in node.args):
        return None
    m = _module_of(node.func.value, env)
    if m is None:
        return Op("method", node.func.attr, 0)
    kind = {torch: "torch", torch.nn.functional: "F"}.get(m)
    return Op(kind, node.func.attr, 1) if kind else None


def _attr(value, name):
    return ast.Attribute(value, name, ast.Load())


def _torch(name, env):
    """`torch.name`, where the variant's globals bind `torch` to torch (else None)."""
    return _attr(ast.Name("torch", ast.Load()), name) if env.get("torch") is torch else None


def _const(node):
    """A literal number (a negative one parses as a unary minus)."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        node = node.operand
    return isinstance(node, ast.Constant) and type(node.value) in (int, float, bool)


def _minus_one(node):
    return node is not None and ast.unparse(node) == "-1"


def _pure(node):
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, (ast.Name, ast.Constant)) or _const(node)


def _call_free(node):
    return not any(isinstance(n, (ast.Call, ast.Lambda, ast.comprehension, ast.Await, ast.Yield,
                                  ast.YieldFrom)) for n in ast.walk(node))


def _index(node, last):
    """x for `x[..., last]` (a load), else None."""
    return node.value if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) \
        and ast.unparse(node.slice).strip("()") == f"..., {last}" else None


def _arg(call, op, name):
    """The argument `name` of a call (keyword or positional), or None."""
    kw, names = [k.value for k in call.keywords if k.arg == name], ARG_NAMES.get(op.name, ())
    i = op.base + names.index(name) if name in names else len(call.args)
    return kw[0] if kw else call.args[i] if i < len(call.args) else None


def _last_is_one(node, env):
    """Whether the last dim is statically 1: x[..., None], x.unsqueeze(-1), a gather by such an
    index (the output has the index's shape), x.view(..., 1) / x.reshape(..., 1)."""
    if _index(node, None) is not None:
        return True
    op = _op(node, env)
    if op is None:
        return False
    if op.name == "unsqueeze":
        return _minus_one(_arg(node, op, "dim"))
    if op.name == "gather":
        idx = _arg(node, op, "index")
        return idx is not None and _last_is_one(idx, env)
    return op.kind == "method" and op.name in ("view", "reshape") and len(node.args) > 1 and \
        not node.keywords and ast.unparse(node.args[-1]) == "1"


# ---- expression rewrites: node -> its rewrite, or None (the node itself is never mutated) -----
def method_function(node, env):
    """x.op(a) <-> torch.op(x, a), one ATen op either way in the same evaluation order; for
    softmax a cycle x.softmax(d) -> torch.softmax(x, d) -> torch.nn.functional.softmax(x, dim=d)
    -> x.softmax(dim=d) (F.softmax calls input.softmax(dim[, dtype=dtype]); only with a dim)."""
    op, c = _op(node, env), node
    if op is None or op.name not in METHOD_FNS or (op.kind == "F" and op.name != "softmax") or \
            any(k.arg in ("input", "out") for k in c.keywords) or \
            len(c.args) > op.base + len(ARG_NAMES[op.name]):
        return None                             # Tensor.squeeze(0, 1) has no torch form
    if op.kind == "method":
        fn = _torch(op.name, env)
        return fn and ast.Call(fn, [c.func.value, *c.args], c.keywords)
    dim, fn = _arg(c, op, "dim"), _torch("nn", env)
    if not c.args or (op.name == "softmax" and dim is None):
        return None
    if op.kind == "F" or op.name != "softmax":
        return ast.Call(_attr(c.args[0], op.name), c.args[1:], c.keywords)
    if fn is None:
        return None
    kws = [ast.keyword("dim", dim)] + [k for k in c.keywords if k.arg != "dim"]
    return ast.Call(_attr(_attr(fn, "functional"), "softmax"), c.args[:1], kws)


def dim_keyword(node, env):
    """Positional dim (and the arguments after it) <-> keywords, in the same order."""
    op, c = _op(node, env), node
    names = op and ARG_NAMES.get(op.name)
    if not names or (op.kind == "F" and op.name != "softmax"):
        return None
    rest = c.args[op.base:]
    if 0 < len(rest) <= len(names):     # the new keywords go first: still evaluated first
        kws = [ast.keyword(n, a) for n, a in zip(names, rest)]
        return ast.Call(c.func, c.args[:op.base], kws + c.keywords)
    lead = list(itertools.takewhile(lambda p: p[0] == p[1].arg, zip(names, c.keywords)))
    if rest or len(c.args) != op.base or not lead:
        return None
    return ast.Call(c.func, c.args + [kw.value for _, kw in lead], c.keywords[len(lead):])


def flip_compare(node, env):
    """a < b <-> b > a, a <= b <-> b >= a, a == b <-> b == a, a != b <-> b != a: one operator,
    both sides call-free or one side pure, so swapping their order changes nothing."""
    if not isinstance(node, ast.Compare) or len(node.ops) != 1 or type(node.ops[0]) not in FLIP:
        return None
    a, b = node.left, node.comparators[0]
    if any(isinstance(s, ast.Constant) and s.value is None for s in (a, b)) or \
            any(isinstance(n, ast.NamedExpr) for n in ast.walk(node)) or \
            not ((_call_free(a) and _call_free(b)) or _pure(a) or _pure(b)):
        return None
    return ast.Compare(b, [FLIP[type(node.ops[0])]()], [a])


def cast(node, env):
    """x.int() <-> x.to(torch.int32) (long/int64, float/float32, bool, double/float64; also
    from .to(dtype=torch.long) and the other aliases): Tensor.int() is self.to(torch.int32)."""
    op, c = _op(node, env), node
    if op is None or op.kind != "method":
        return None
    if op.name in CASTS and not c.args and not c.keywords:
        fn = _torch(CASTS[op.name], env)
        return fn and ast.Call(_attr(c.func.value, "to"), [fn], [])
    a = (c.args + [k.value for k in c.keywords if k.arg == "dtype"])[:1]
    if op.name != "to" or len(c.args) + len(c.keywords) != 1 or not a or \
            not isinstance(a[0], ast.Attribute) or _module_of(a[0].value, env) is not torch:
        return None
    back = UNCAST.get(a[0].attr)
    return back and ast.Call(_attr(c.func.value, back), [], [])


def _index_forms(node, env, method, last, fits):
    """x.method(-1) <-> x[..., last] where fits(x)."""
    op, c = _op(node, env), node
    if op and op.kind == "method" and op.name == method and \
            len(c.args) + len(c.keywords) == 1 and _minus_one(_arg(c, op, "dim")) and \
            fits(c.func.value):
        ell = ast.Tuple([ast.Constant(Ellipsis), ast.Constant(last)], ast.Load())
        return ast.Subscript(c.func.value, ell, ast.Load())
    x = _index(node, last)
    if x is not None and fits(x):
        return ast.Call(_attr(x, method), [ast.UnaryOp(ast.USub(), ast.Constant(1))], [])
    return None


def unsqueeze_index(node, env):
    """x.unsqueeze(-1) <-> x[..., None]: the same view (the last dim only)."""
    return _index_forms(node, env, "unsqueeze", None, lambda x: True)


def squeeze_index(node, env):
    """x.squeeze(-1) <-> x[..., 0], only where x's last dim is statically 1 (elsewhere they
    differ)."""
    return _index_forms(node, env, "squeeze", 0, lambda x: _last_is_one(x, env))


def clamp_forms(node, env):
    """clamp(x, min=c) <-> clamp_min(x, c), clamp(x, max=c) <-> clamp_max(x, c), c a literal
    (bit-equal in eager and Inductor; relu is left out: see the module docstring)."""
    op, c = _op(node, env), node
    if op is None or op.kind == "F" or op.name not in ("clamp", "clamp_min", "clamp_max") or \
            len(c.args) + len(c.keywords) != op.base + 1 or len(c.args) < op.base:
        return None
    given = dict(zip(ARG_NAMES[op.name], c.args[op.base:]))
    given.update({k.arg: k.value for k in c.keywords})
    (arg, val), = given.items()
    if arg not in ("min", "max") or not _const(val):
        return None
    to_min_max = op.name == "clamp"
    return ast.Call(_attr(c.func.value, f"clamp_{arg}" if to_min_max else "clamp"),
                    c.args[:op.base] + [val] * to_min_max,
                    [] if to_min_max else [ast.keyword(arg, val)])


class _Take:
    """Asked once per applicable site, in source order; `choose(i)` says whether site i is
    rewritten (a coin, one chosen site, or all)."""

    def __init__(self, choose):
        self.choose, self.sites, self.applied = choose, 0, 0

    def __call__(self):
        ok = bool(self.choose(self.sites))
        self.sites, self.applied = self.sites + 1, self.applied + ok
        return ok


def _expr_rewrite(rule):
    """An expression rewrite as a pass over the tree: bottom-up (children first), rewriting
    each site where take() says so."""
    class Sites(ast.NodeTransformer):
        def visit(self, node):
            node = self.generic_visit(node)
            new = rule(node, self.env) if isinstance(node, ast.expr) else None
            return new if new is not None and self.take() else node

    def run(tree, env, take, rng):
        sites = Sites()
        sites.env, sites.take = env, take
        return ast.fix_missing_locations(sites.visit(tree))
    run.__name__, run.__doc__ = rule.__name__, rule.__doc__
    return run


# ---- statement rewrites: temporaries and names ------------------------------------------------
def _ordered(node, after_pure=True):
    """(sub-expression, evaluated only after pure ones) in evaluation order, through calls,
    operators, subscripts and displays; never into lazy or conditional parts."""
    yield node, after_pure
    if isinstance(node, (ast.Call, ast.BinOp, ast.Compare, ast.Subscript, ast.Attribute,
                         ast.UnaryOp, ast.Tuple, ast.List, ast.Starred, ast.keyword)):
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, (ast.expr_context, ast.operator, ast.cmpop, ast.unaryop)):
                yield from _ordered(child, after_pure)
                after_pure = after_pure and _pure(child)


def _bodies(fdef):
    """Every statement list in the function (a nested def's too: the same rules hold there)."""
    lists = (getattr(n, f, None) for n in ast.walk(fdef) for f in ("body", "orelse", "finalbody"))
    return [b for b in lists if isinstance(b, list) and b and isinstance(b[0], ast.stmt)]


def _value_stmt(s):
    return isinstance(s, (ast.Assign, ast.Return, ast.Expr)) and s.value is not None


def _fresh(tree, env, rng, taken=()):
    """A name in use nowhere: not in the source, its globals or the builtins."""
    used = {getattr(n, "id", getattr(n, "arg", None)) for n in ast.walk(tree)}
    while True:
        name = f"{rng.choice(WORDS)}_{rng.randrange(100)}"
        if name not in used and name not in taken and name not in env \
                and not hasattr(builtins, name):
            return name


def _replace(root, old, new):
    for node in ast.walk(root):
        for field, value in ast.iter_fields(node):
            if value is old:
                setattr(node, field, new)
            elif isinstance(value, list):
                value[:] = [new if v is old else v for v in value]


def split_temp(tree, env, take, rng):
    """`y = f(g(x))` -> `t = g(x); y = f(t)` for a sub-expression evaluated only after pure
    ones (hoisting it moves no draw or write past another); at most one per statement."""
    kinds = (ast.Call, ast.BinOp, ast.Compare, ast.Subscript, ast.UnaryOp)
    for body in _bodies(tree.body[0]):
        i = 0
        while i < len(body):
            s = body[i]
            picks = [e for e, ok in _ordered(s.value) if ok and e is not s.value and
                     isinstance(e, kinds) and not _const(e)] if _value_stmt(s) else []
            chosen = [e for e in picks if take()]
            if chosen:
                name = _fresh(tree, env, rng)
                body.insert(i, ast.Assign([ast.Name(name, ast.Store())], chosen[0]))
                _replace(s, chosen[0], ast.Name(name, ast.Load()))
                i += 1
            i += 1
    return ast.fix_missing_locations(tree)


def _single_use(tree, s, nxt):
    """The one read of s's target in nxt, if s binds it once and nxt reads it once, after pure
    expressions only."""
    if not (isinstance(s, ast.Assign) and len(s.targets) == 1 and
            isinstance(s.targets[0], ast.Name) and _value_stmt(nxt)) or \
            any(isinstance(n, ast.NamedExpr) for n in ast.walk(s.value)):
        return None
    t = s.targets[0].id
    nodes = list(ast.walk(tree))
    if any(isinstance(n, (ast.Global, ast.Nonlocal)) and t in n.names for n in nodes) or \
            sum(getattr(n, "id" if isinstance(n, ast.Name) else "arg", None) == t
                for n in nodes if isinstance(n, (ast.Name, ast.arg))) != 2:
        return None
    hits = [e for e, ok in _ordered(nxt.value) if ok and isinstance(e, ast.Name) and
            e.id == t and isinstance(e.ctx, ast.Load)]
    return hits[0] if hits else None


def inline_temp(tree, env, take, rng):
    """`t = E; y = f(t)` -> `y = f(E)`: t bound once and read once, in the next statement,
    where only pure expressions are evaluated before it (no draw or write moves)."""
    for body in _bodies(tree.body[0]):
        i = 0
        while i + 1 < len(body):
            use = _single_use(tree, body[i], body[i + 1])
            if use is not None and take():
                _replace(body[i + 1], use, body[i].value)
                del body[i]
            else:
                i += 1
    return ast.fix_missing_locations(tree)


def rename_locals(tree, env, take, rng):
    """Renames local variables. Parameters keep their names (callers may pass them by keyword);
    keyword-argument names are strings of ast.keyword, never touched."""
    fdef = tree.body[0]
    fixed = {n.arg for n in ast.walk(fdef) if isinstance(n, ast.arg)}
    for n in ast.walk(fdef):        # names bound otherwise than by assignment stay
        if isinstance(n, (ast.Global, ast.Nonlocal, ast.Import, ast.ImportFrom)):
            fixed |= {(getattr(x, "asname", None) or getattr(x, "name", x)).split(".")[0]
                      for x in n.names}
        elif isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.ExceptHandler)):
            fixed.add(n.name)
    stored = sorted({n.id for n in ast.walk(fdef) if isinstance(n, ast.Name) and
                     isinstance(n.ctx, ast.Store)})
    mapping = {}
    for name in stored:
        # a name that is also a global or a builtin may be local to a comprehension only
        if name not in fixed and name not in env and not hasattr(builtins, name) and take():
            mapping[name] = _fresh(tree, env, rng, set(mapping.values()))
    for n in ast.walk(fdef):
        if isinstance(n, ast.Name) and n.id in mapping:
            n.id = mapping[n.id]
    return ast.fix_missing_locations(tree)


REWRITES = tuple(_expr_rewrite(r) for r in (
    method_function, dim_keyword, flip_compare, cast, unsqueeze_index, squeeze_index,
    clamp_forms)) + (split_temp, inline_temp, rename_locals)
BY_NAME = {r.__name__: r for r in REWRITES}


# ---- sources, helpers, execution --------------------------------------------------------------
# fn: the entry, rewritten; sources / originals: function name -> the variant's source / the
# source as written (unparsed: no comments), the entry's and its helpers'; steps: (rewrite,
# function name, sites rewritten, sites) per pass
Variant = collections.namedtuple("Variant", "fn sources originals steps")


def _tree(fn, source=None):
    tree = ast.parse(textwrap.dedent(source if source is not None else inspect.getsource(fn)))
    fdef = tree.body[0]
    fdef.decorator_list, fdef.returns = [], None   # annotations: the module may defer them
    for a in ast.walk(fdef.args):
        if isinstance(a, ast.arg):
            a.annotation = None
    return tree


def _code_names(code):
    """The names a code object and the ones nested in it (comprehensions, lambdas) load."""
    return set(code.co_names).union(*(_code_names(c) for c in code.co_consts
                                       if isinstance(c, types.CodeType)))


def helpers_of(fn):
    """Plain functions of fn's module that fn reaches by name (transitively)."""
    found, todo = {}, [fn]
    while todo:
        f = todo.pop()
        for name in sorted(_code_names(f.__code__)):
            g = f.__globals__.get(name)
            if isinstance(g, types.FunctionType) and g.__module__ == fn.__module__ and \
                    g.__closure__ is None and g is not fn and name not in found and \
                    linecache.getlines(g.__code__.co_filename):      # it has a source file
                found[name] = g
                todo.append(g)
    return found


class Fuzzer:
    """Parses fn (and its helpers) once; builds variants in a copy of fn's globals."""

    def __init__(self, fn, source=None):
        if fn.__closure__:
            raise ValueError(f"{fn.__name__} closes over locals: its source cannot be re-run")
        self.fn, self.name = fn, fn.__name__
        funcs = {self.name: (fn, source), **{k: (g, None) for k, g in helpers_of(fn).items()}}
        self.trees = {k: _tree(f, s) for k, (f, s) in funcs.items()}
        self.originals = {k: ast.unparse(t) for k, t in self.trees.items()}

    def sites(self, rewrite):
        """Per function name, how many sites `rewrite` has in the source as written."""
        plan = {k: [(rewrite, lambda i: False, random.Random(0))] for k in self.trees}
        return {k: n for _, k, _, n in self.build(plan, "count").steps}

    def build(self, plan, tag):
        """plan: function name -> [(rewrite class, choose, rng)]; returns the Variant."""
        env = dict(self.fn.__globals__)
        sources, steps = {}, []
        for k, t in self.trees.items():
            t = ast.parse(ast.unparse(t))              # a fresh copy
            for rewrite, choose, rng in plan.get(k, ()):
                take = _Take(choose)
                t = rewrite(t, env, take, rng)
                steps.append((rewrite.__name__, k, take.applied, take.sites))
            sources[k] = ast.unparse(t)
        for k, src in sources.items():
            filename = f"<spelling_fuzz {tag} {k}>"  # tracebacks and Dynamo read it back
            linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
            exec(compile(src, filename, "exec"), env)
        return Variant(env[self.name], sources, self.originals, tuple(steps))

    def random(self, rng, tag):
        """One variant: 2..5 random rewrite passes per function (each site taken with one
        probability per pass), then renamed locals; drawn again if nothing changed."""
        def coin(p):
            return lambda i: rng.random() < p
        for _ in range(20):
            plan = {}
            for k in self.trees:
                steps = [rng.choice(REWRITES[:-1]) for _ in range(rng.randint(2, 5))]
                plan[k] = [(r, coin(rng.choice((0.3, 0.6, 1.0))), random.Random(rng.random()))
                           for r in steps + [rename_locals]]
            v = self.build(plan, tag)
            if v.sources != self.originals:
                break
        return v

    def one(self, rewrite, function=None, site=None, tag="one"):
        """`rewrite` alone on one function (default: the entry), at one site (default: all)."""
        choose = (lambda i: True) if site is None else (lambda i: i == site)
        return self.build({function or self.name: [(rewrite, choose, random.Random(0))]}, tag)


def variants(fn, n, seed=0, source=None):
    """n variants of fn, each a random composition of the exact rewrites (seeded)."""
    fz = Fuzzer(fn, source)
    rng = random.Random(f"{fn.__name__}:{seed}")
    return [fz.random(rng, f"{fn.__name__}#{i}") for i in range(n)]
