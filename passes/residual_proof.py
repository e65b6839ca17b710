"""Recovered tokens matched by what they compute (issue 37, point 2).

The residual family (patterns_ratio.Residual) matches the race by its spellings. Codebases add
things no spelling list foresees: vllm-ascend's PyTorch sampler guards its exponentials,

    safe = torch.where(q == 0, 1e-10, q); safe = torch.where(torch.isinf(q), 1e-10, safe)
    tok = torch.where((q == 0) | torch.isinf(q), -1e10, prob / safe).argmax(dim=1)

`prove_recovered` takes every `argmax` over the last dim still in the graph after the families,
walks back through the pointwise ops feeding it (the *region*: at most MAX_NODES, constants
inside it allowed) to the tensors it reads (the *leaves*: three float tensors over V, or two
of which one the user zeroed at the drafts, an n-gram draft's one-hot residual, raced with
q = 0.0), and evaluates the region on a check set: every combination of a grid of values for
the leaves (both zeros, a subnormal, values around 1, the largest finite float, both
infinities, NaN, every constant the region holds and its float neighbours) plus seeded random
draws of several magnitudes. For each assignment of the leaves to (p, q, E) and each
configuration of `npuspec::residual_sample` (sampler, nonneg, floor, guard, fill: the floors
and fills tried are the region's constants) it compares the op's score
(`kernels.accept.residual_score`) with the region's value, element by element: equal, or NaN
on both sides. The argmax of a row is a function of the order of its scores alone, so equal
scores give the same token on every row built from these values. The first configuration
that holds on the whole set replaces the argmax; a region that no configuration reproduces is
left as written.

This is a check on a finite set, not a proof over every float: a region that rounds
differently from the op on values outside the set (`r * (1 / E)` against `r / E`) is caught by
the random draws with high probability, not with certainty. The region admits only ATen
pointwise ops (`torch.Tag.pointwise`), casts between float dtypes and constants, which keeps
what it can compute close to the op's arithmetic.
"""
from __future__ import annotations

import itertools
import logging
import math
from typing import Optional

import torch
from torch.fx import Graph, Node

import npuspec.kernels.accept as accept
from npuspec.passes import search_memo
from npuspec.passes.prefix import _attr
from npuspec.passes.rewrites.nodes import _fake_meta, _val, eager_op, real_eval
from npuspec.passes.rowlocal import _name

log = logging.getLogger("npuspec.passes")
aten = torch.ops.aten

MAX_NODES = 40
_SHAPE_ONLY = {"full_like", "zeros_like", "ones_like", "empty_like"}  # read their input's shape
_CONSTANT = {"scalar_tensor", "full", "lift_fresh_copy", "zeros", "ones"}
_FILLS = {"full", "zeros", "ones"}  # a size argument first (Inductor's full_like)
_GRID = (0.0, -0.0, 1e-45, 1e-30, 1e-10, 1e-5, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 1e10,
         3.4028234663852886e38, -1e-10, -0.5, -1.0, math.inf, -math.inf, math.nan)
RANDOM_DRAWS = 40_000


def _pointwise(n: Node) -> bool:
    t = n.target
    if n.op != "call_function" or not isinstance(t, torch._ops.OpOverload):
        return False
    if torch.Tag.nondeterministic_seeded in t.tags:
        return False
    if torch.Tag.pointwise in t.tags or _name(t) in _SHAPE_ONLY:
        return True
    # a cast between float dtypes (`.float()`, `.to(torch.float32)`)
    return _name(t) == "_to_copy" and set(n.kwargs) <= {"dtype"} and len(n.args) == 1


def _constant(n: Node) -> bool:
    """A value made of literals alone (torch.tensor(0.0), scalar_tensor, a lifted attribute)."""
    if n.op == "get_attr":
        return _attr(n) is not None and _attr(n).numel() == 1
    if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
        return False
    if torch.Tag.nondeterministic_seeded in n.target.tags:
        return False
    return _name(n.target) in _CONSTANT and all(_constant(a) for a in n.all_input_nodes)


def _closure(out: Node) -> Optional[dict]:
    """{node: its distance from `out`} over the pointwise nodes and constants feeding `out`,
    or None past MAX_NODES."""
    dist, frontier = {out: 0}, [out]
    while frontier:
        nxt = []
        for m in frontier:
            for a in m.all_input_nodes:
                if a not in dist and (_constant(a) or _pointwise(a)):
                    dist[a] = dist[m] + 1
                    nxt.append(a)
        if len(dist) > MAX_NODES:
            return None
        frontier = nxt
    return dist


def regions(out: Node):
    """Each cut of the pointwise sub-graph computing `out`, nearest first: (the region's nodes
    in graph order, the tensors it reads). The region at depth d holds the nodes within d
    steps of `out` whose every user is in it too (a value the user's other code reads, such as
    a softmax that is also gathered, is a leaf); constants are always inside."""
    dist = _closure(out)
    if dist is None:
        return
    order = [m for m in out.graph.nodes if m in dist]
    seen = set()
    for d in range(1, max(dist.values()) + 2):
        inside = set()
        for m in reversed(order):  # users before what they read
            if (m is out or _constant(m) and any(u in inside for u in m.users)
                    or dist[m] <= d and all(u in inside for u in m.users)):
                inside.add(m)
        leaves = {a for m in inside for a in m.all_input_nodes if a not in inside}
        key = frozenset(leaves)
        if key in seen:
            continue
        seen.add(key)
        yield [m for m in order if m in inside], [m for m in out.graph.nodes if m in leaves]


def _constants(order: list[Node]) -> list[float]:
    """The finite float literals a region holds (candidate floors and fills)."""
    vals = set()
    for m in order:
        for a in list(m.args) + list(m.kwargs.values()):
            if isinstance(a, float) and math.isfinite(a):
                vals.add(a)
        if m.op == "get_attr" and _attr(m).is_floating_point():
            vals.add(float(_attr(m).reshape(())))
    return sorted(vals)


def _check_set(consts: list[float], dtypes: list[torch.dtype]) -> list[torch.Tensor]:
    """Three columns: the grid's every combination, then seeded random draws."""
    g = list(_GRID)
    for c in consts:
        t = torch.tensor(c, dtype=torch.float32)
        g += [c, -c, float(torch.nextafter(t, torch.tensor(math.inf))),
              float(torch.nextafter(t, torch.tensor(-math.inf)))]
    grid = torch.tensor(g, dtype=torch.float64)
    combos = torch.cartesian_prod(grid, grid, grid)  # [G^3, 3]
    gen = torch.Generator().manual_seed(37)
    scale = torch.tensor([1e-8, 1e-3, 1.0, 1e3])[torch.randint(0, 4, (RANDOM_DRAWS, 3),
                                                               generator=gen)]
    draws = torch.rand(RANDOM_DRAWS, 3, generator=gen, dtype=torch.float64) * scale
    cols = torch.cat([combos, draws]).unbind(1)
    return [c.to(d) for c, d in zip(cols, dtypes)]


def _cpu(a):
    return torch.device("cpu") if isinstance(a, torch.device) else a


def _evaluate(order: list[Node], env: dict) -> torch.Tensor:
    """Run the region on real CPU tensors (also inside a fake-tensor trace)."""
    for m in order:
        if m.op == "get_attr":
            env[m] = _attr(m).detach().cpu()
            continue
        args = torch.utils._pytree.tree_map(lambda a: env[a] if isinstance(a, Node) else _cpu(a),
                                            m.args)
        if _name(m.target) in _FILLS:  # one value everywhere: a 0-d one broadcasts alike
            args = ([],) + tuple(args[1:])
        kwargs = {k: env[v] if isinstance(v, Node) else _cpu(v) for k, v in m.kwargs.items()}
        env[m] = eager_op(m.target)(*args, **kwargs)
    return env[order[-1]]


def _configs(consts: list[float], one_hot: bool):
    """residual_sample's (sampler, nonneg, floor, guard, fill), the plainest first. Only a
    one-hot residual (p zeroed at the draft by the user) may skip max(., 0): with three leaves
    a region without it is a difference raced, not a residual."""
    kinds = [("clamp", 0.0), ("where", 0.0)] + [("clamp", c) for c in consts if c]
    for nonneg, floor in kinds + ([("none", 0.0)] if one_hot else []):
        for sampler in accept.SAMPLERS:
            yield sampler, nonneg, floor, "none", 0.0
            if sampler == "race":
                for fill in consts:
                    yield sampler, nonneg, floor, "zero_inf", fill


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(
        ((a == b) | (a.isnan() & b.isnan())).all())


def _zeroed(x: Node) -> bool:
    return x.op == "call_function" and _name(x.target) in _ZEROING


def _roles(leaves: list[Node]) -> list[tuple]:
    """(p, q, E) as indices into the leaves; with two leaves p is the zeroed one and q is 0.0
    (p - 0.0 is p exactly: a one-hot draft's residual raced against E)."""
    if len(leaves) == 3:
        return list(itertools.permutations(range(3)))
    return [(i, None, 1 - i) for i in range(2) if _zeroed(leaves[i])]


# _find's answers by region: the evaluation reads only the region's nodes and literals and its
# leaves' dtypes (and which leaf was zeroed), so an equal key gives the same answer; a graph
# compiled again at other shapes (a new batch size) asks again for the same region
_FOUND: dict = {}


def _find(order, leaves) -> Optional[tuple]:
    """The first (roles, config) under which the op's score equals the region's, or None;
    remembered by the region's key (search_memo.nodes_key)."""
    key = search_memo.nodes_key(order, leaves)
    if key is not None:
        key = (key, tuple(_val(x).dtype for x in leaves), tuple(_zeroed(x) for x in leaves))
        if key in _FOUND:
            return _FOUND[key]
    hit = _search(order, leaves)
    if key is not None:
        search_memo.remember(_FOUND, key, hit)
    return hit


def _search(order, leaves) -> Optional[tuple]:
    with real_eval():
        consts = _constants(order)
        cols = _check_set(consts, [_val(x).dtype for x in leaves])
        try:
            want = _evaluate(order, dict(zip(leaves, cols)))
        except (RuntimeError, TypeError, ValueError) as e:  # left as written
            log.debug("npuspec passes: a residual region did not evaluate: %s", e)
            return None
        if not want.is_floating_point():
            return None
        zero = torch.zeros((), dtype=cols[0].dtype)
        # every config is tried on a spread sample of the check set first (the computation is
        # elementwise, so the sample's scores are the whole set's at those entries); only one
        # that agrees there is scored on the whole set, which alone decides
        n = cols[0].shape[0]
        pick = torch.arange(0, n, max(n // SAMPLE, 1)) if want.shape == (n,) else None
        for roles in _roles(leaves):
            p, q, e = (zero if i is None else cols[i] for i in roles)
            for cfg in _configs(consts, len(leaves) == 2):
                if pick is not None and not _score_is(_sub(p, pick), _sub(q, pick), _sub(e, pick),
                                                      cfg, want[pick]):
                    continue
                if _score_is(p, q, e, cfg, want):
                    return roles, cfg
    return None


SAMPLE = 256  # entries of the check set a config must match before the whole set is scored


def _sub(t: torch.Tensor, pick: torch.Tensor) -> torch.Tensor:
    return t if t.dim() == 0 else t[pick]


def _score_is(p, q, e, cfg, want) -> bool:
    sampler, nonneg, floor, guard, fill = cfg
    try:
        r = accept._residual(p, q, "none", nonneg, floor)
        got = accept.residual_score(r, e, sampler, guard, fill)
    except (RuntimeError, ValueError):
        return False
    return _same(got, want)


def _candidate(n: Node) -> Optional[int]:
    """argmax over the last dim -> keepdim (0/1), else None."""
    if n.op != "call_function" or n.target not in (aten.argmax.default,):
        return None
    v = _val(n.args[0])
    if v is None or len(n.args) < 2 or v.dim() < 1:
        return None
    dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
    if not isinstance(dim, int) or dim % v.dim() != v.dim() - 1:
        return None
    keep = n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False)
    return int(bool(keep))


# how a one-hot draft's residual is made: p with the drafted entries set to 0
_ZEROING = {"index_put", "index_put_", "scatter", "masked_fill", "_unsafe_index_put"}


def _leaves_ok(leaves: list[Node], out: Node) -> bool:
    """Three float tensors over V, or two of which one is a one-hot residual (a tensor the
    user zeroed at the drafts): a plain race of the target (`(p / E).argmax(-1)`, the bonus
    token, vLLM's random_sample) is sampling, not a recovered token, and stays as written."""
    vals = [_val(x) for x in leaves]
    if len(vals) == 2 and not any(_zeroed(x) for x in leaves):
        return False
    if len(vals) not in (2, 3) or any(v is None or not v.is_floating_point() or v.dim() < 1 for v in vals):
        return False
    V = _val(out).shape[-1]
    return isinstance(V, int) and all(v.shape[-1] in (1, V) for v in vals)


def _zero(graph: Graph, like: Node) -> Node:
    v = _val(like)
    return _fake_meta(graph.call_function(aten.scalar_tensor.default, (0.0,),
                                          {"dtype": v.dtype, "device": v.device}), v)


def prove_recovered(graph: Graph) -> int:
    """Replace each argmax whose pointwise region the check set shows to be a residual race by
    `npuspec::residual_sample`. -> replacements made."""
    made = 0
    for n in list(graph.nodes):
        keep = _candidate(n)
        if keep is None:
            continue
        hit = None
        for order, leaves in regions(n.args[0]):
            if _leaves_ok(leaves, n.args[0]):
                hit = _find(order, leaves)
                if hit is not None:
                    break
        if hit is None:
            continue
        roles, (sampler, nonneg, floor, guard, fill) = hit
        with graph.inserting_before(n):
            p, q, e = (_zero(graph, leaves[0]) if i is None else leaves[i] for i in roles)
            tok = _fake_meta(graph.call_function(
                torch.ops.npuspec.residual_sample.default,
                (p, q, e, "none", sampler, nonneg, floor, guard, fill)))
            if keep:
                tok = _fake_meta(graph.call_function(aten.unsqueeze.default, (tok, -1)))
        n.replace_all_uses_with(tok)
        graph.erase_node(n)
        made += 1
    return made
