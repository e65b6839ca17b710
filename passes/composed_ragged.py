"""vllm-ascend's PyTorch rejection sampler as one `npuspec::rejection_sample` call in its ragged
mode (issue 37, point 3; docs/passes.md, "Whole steps from their pieces").

After the families and the recovered-token check, vllm-ascend's random and block-verify paths
(`rejection_sample` with `sample_recovered_tokens_pytorch`, then
`rejection_random_sample_pytorch` or its block twin) reach this pass as

    rec = residual_sample(P [N, V], Q [N, V], E[owner], ..., guard, fill)   # every flat row
    out = <the ragged layout read on a [B, M] grid, the accept test, the count, the emission
           into a -1 filled [B, M + 1] buffer, written the user's way>

Nothing of `out`'s region is fused by a family, and its spellings vary, so it is matched by
what it computes: its region (the pure nodes between out and {P, Q, E}, the residual_sample
among them) may read, besides those, only tensors that take the ragged mode's other roles:
the flat ids int64 [N], the uniforms float [N], cu_num_draft_tokens int [B], the bonus int
[B] or [B, 1] and, optionally, the greedy rows bool [B]. It is evaluated on a check set of
layouts (empty and full requests, placeholders, q(x) = 0, u = 0, u at the ratio, zero and
infinite draws, greedy rows, tokens likely accepted) against the op for each accept rule and
comparison, with the residual configuration the recovered-token check found; the first that
equals it on every case replaces `out`. The op then races one row per request where the user
raced all N. Like the other checks this is an evaluation on a finite set, not a proof.
n-gram drafts (q a constant, the race on a copy of P with the drafts zeroed by `index_put`)
take Q = None: the op's n-gram residual; vllm-ascend writes that zeroing with mask indexing,
so its n-gram step is one graph under npuspec.compile only.
"""
from __future__ import annotations

import itertools
import logging
import operator
from typing import Optional

import torch
from torch.fx import Graph, Node

from npuspec.kernels.verify_probs import ACCEPT_MODES, ACCEPT_RULES
from npuspec.kernels.verify_ragged import ragged_verify
from npuspec.passes import search_memo
from npuspec.passes.composed import (_RESIDUAL_KEYS, _bound, _constant, _descendants, _pure,
                                     _region, _run)
from npuspec.passes.rewrites.nodes import _cast, _fake_meta, _static, _val, real_eval

log = logging.getLogger("npuspec.passes")
aten = torch.ops.aten
MAX_REGION = 240
CASES = 12
SMALL_V = 13   # the vocabulary the check runs at when no literal of the region names V


def compose_ragged(graph: Graph, flavor: str) -> int:
    """Replace each ragged step the check shows to be the op's. -> replacements."""
    made = 0
    for r in [m for m in graph.nodes if m.target is torch.ops.npuspec.residual_sample.default]:
        roles = _anchor(r)
        if roles is None:
            continue
        B = _val(roles[2]).shape[0]
        after = _descendants(r, cap=2000)
        outs = [m for m in graph.nodes if m in after and _is_out(m, B)]
        pure = {m for m in graph.nodes if _pure(m)}   # the region may extend through any
        for out in reversed(outs):
            if _replace(graph, r, roles, out, pure, flavor):
                made += 1
                break
    return made


def _anchor(r: Node) -> Optional[tuple[Node, Optional[Node], Node]]:
    """(P, Q, E) of a race over flat rows whose draws are one vector per request picked per
    row (`E[owner]`), else None. An n-gram race (q a constant, p a copy of P with entries
    zeroed by `index_put`) gives Q = None: what was zeroed is left to the check."""
    b = _bound(r)
    p, q, noise = b["p"], b["q"], b["noise"]
    pv, qv = _val(p), _val(q)
    if pv is None or qv is None or pv.dim() != 2 or not _static(pv.shape):
        return None
    if qv.dim() == 0 and _constant(q) and p.target is aten.index_put.default:
        p, q = p.args[0], None                      # n-gram: P is what the user zeroed
        if _val(p) is None or tuple(_val(p).shape) != tuple(pv.shape):
            return None
    elif tuple(qv.shape) != tuple(pv.shape) or qv.dtype != pv.dtype:
        return None
    if noise.target is not aten.index.Tensor or len(noise.args[1]) != 1:
        return None
    e, idx = noise.args[0], noise.args[1][0]
    ev, iv = _val(e), _val(idx)
    if ev is None or iv is None or ev.dim() != 2 or ev.shape[1] != pv.shape[1]:
        return None
    if tuple(iv.shape) != (pv.shape[0],) or ev.dtype != pv.dtype:
        return None
    return p, q, e


def _is_out(m: Node, B: int) -> bool:
    v = _val(m)
    return (v is not None and v.dim() == 2 and _static(v.shape) and v.shape[0] == B
            and v.shape[1] >= 1 and not v.is_floating_point() and v.dtype != torch.bool)


def _roles(free: list, N: int, B: int) -> list[dict]:
    """Every assignment of the region's other inputs to the ragged roles their shapes allow:
    three integer tensors (ids int64 [N], cu [B], bonus [B] or [B, 1]), one float [N] (u)
    and at most one bool [B] (the greedy rows)."""
    vals = [_val(f) for f in free]
    if any(v is None or not _static(v.shape) for v in vals):
        return []
    ints = [f for f, v in zip(free, vals) if not v.is_floating_point() and v.dtype != torch.bool]
    floats = [f for f, v in zip(free, vals) if v.is_floating_point()]
    bools = [f for f, v in zip(free, vals) if v.dtype == torch.bool]
    if len(ints) != 3 or len(floats) != 1 or len(bools) > 1:
        return []
    u, greedy = floats[0], (bools[0] if bools else None)
    if tuple(_val(u).shape) != (N,) or (greedy is not None and tuple(_val(greedy).shape) != (B,)):
        return []
    out = []
    for ids, cu, bonus in itertools.permutations(ints):
        if (tuple(_val(ids).shape) == (N,) and _val(ids).dtype == torch.int64
                and tuple(_val(cu).shape) == (B,)
                and tuple(_val(bonus).shape) in ((B,), (B, 1))):
            roles = {"ids": ids, "u": u, "cu": cu, "bonus": bonus}
            if greedy is not None:
                roles["greedy"] = greedy
            out.append(roles)
    return out


def _replace(graph: Graph, r: Node, roles: tuple, out: Node, pure: set, flavor: str) -> bool:
    P, Q, E = roles
    N, V = _val(P).shape
    B, M = _val(out).shape[0], _val(out).shape[1] - 1
    if N > B * M:
        return False
    stops = {P, E} | ({Q} if Q is not None else set())
    reg = _region(out, stops, pure, cap=MAX_REGION)
    if reg is None:
        return False
    order, free = reg
    if r not in order:
        return False
    kw = {f"residual_{k}": v for k, v in _bound(r).items() if k in _RESIDUAL_KEYS}
    assigns = _roles(free, N, B)
    key = _key(order, P, Q, E, free, N, B, M, V)
    hit = _HELD.get(key) if key is not None else None
    if hit is not None:  # the same region held at other sizes (see _HELD)
        by_index, rule, mode = hit
        assign = {role: free[i] for role, i in by_index.items()}
        if assign in assigns:
            _insert(graph, out, P, Q, E, assign, M, rule, mode, kw, flavor)
            return True
    if key is not None and (key, N, B) in _FAILED:
        return False
    for assign in assigns:
        for rule, mode in itertools.product(ACCEPT_RULES, ACCEPT_MODES):
            if _holds(order, P, Q, E, assign, N, B, M, V, rule, mode, kw):
                if key is not None:
                    search_memo.remember(_HELD, key, ({k: free.index(v)
                                                       for k, v in assign.items()}, rule, mode))
                _insert(graph, out, P, Q, E, assign, M, rule, mode, kw, flavor)
                return True
    if key is not None:
        search_memo.remember(_FAILED, (key, N, B), True)
    return False


# Checks made, by region (_key). A region that held is taken at other batch sizes without
# evaluating it again when its nodes and literals are equal once the literals equal to B or N
# (and their neighbours) are written by name: the same code run at another size. One that
# failed is remembered for its sizes only. Like the check itself, this is evidence on finite
# cases (the layouts of the first batch size checked), not a proof.
_HELD: dict = {}
_FAILED: dict = {}


def _key(order, P, Q, E, free, N, B, M, V) -> Optional[tuple]:
    """The region's nodes with the literals that equal a size of the batch (B, N and their
    neighbours) written by name, as vllm-ascend writes `full((B, M + 1), -1)` and
    `clamp(.., N - 1)`; M, the vocabulary checked and the inputs' dtypes as they are."""
    inputs = [P, E] + ([Q] if Q is not None else []) + list(free)
    nodes = search_memo.nodes_key(order, inputs, symbols=search_memo.size_names(N=N, B=B))
    if nodes is None:
        return None
    return (nodes, Q is None, M, _small_v(order, V),
            tuple((_val(x).dtype, _val(x).dim()) for x in inputs))


def _small_v(order: list, V: int) -> int:
    """The vocabulary to check at: SMALL_V unless an integer literal of the region could be
    about V (within 64 below it, or a multiple of it: `clamp(ids, 0, V - 1)`, a flat index)."""
    if V <= SMALL_V:
        return V
    for m in order:
        for a in torch.utils._pytree.tree_leaves((m.args, m.kwargs)):
            if isinstance(a, int) and not isinstance(a, bool) and (
                    abs(a) >= V - 64 or (a != 0 and a % V == 0)):
                return V
    return SMALL_V


def _layouts(N: int, B: int, M: int, gen) -> list[list[int]]:
    """Draft counts per request summing to N, each at most M: spread, packed to the front,
    packed to the back, and random ones."""
    def fill(order):
        counts, left = [0] * B, N
        for b in order:
            counts[b] = min(M, left)
            left -= counts[b]
        return counts
    outs = [fill(range(B)), fill(reversed(range(B)))]
    for _ in range(CASES):
        counts, left = [0] * B, N
        for b in torch.randperm(B, generator=gen).tolist():
            counts[b] = min(M, left, int(torch.randint(0, M + 1, (1,), generator=gen)))
            left -= counts[b]
        for b in itertools.cycle(range(B)):
            if left == 0:
                break
            take = min(M - counts[b], left)
            counts[b] += take
            left -= take
        outs.append(counts)
    return outs


def _holds(order, P, Q, E, assign, N, B, M, V, rule, mode, kw) -> bool:
    Vc = _small_v(order, V)
    dt = {k: _val(n).dtype for k, n in assign.items()}
    bshape = tuple(_val(assign["bonus"]).shape)
    with real_eval():
        gen = torch.Generator().manual_seed(71)
        for i, counts in enumerate(_layouts(N, B, M, gen)):
            p = torch.softmax(torch.randn(N, Vc, generator=gen) * 2, -1).to(_val(P).dtype)
            q = (None if Q is None else
                 torch.softmax(torch.randn(N, Vc, generator=gen) * 2, -1).to(_val(Q).dtype))
            ids = torch.randint(0, Vc, (N,), generator=gen)
            likely = torch.rand(N, generator=gen) < 0.5
            ids = torch.where(likely, p.argmax(-1), ids)
            ids[torch.rand(N, generator=gen) < 0.08] = -1            # placeholders
            rows, safe = torch.arange(N), ids.clamp_min(0)
            zero = torch.rand(N, generator=gen) < 0.08
            if q is not None:
                q[rows[zero], safe[zero]] = 0.0                      # q(x) = 0
            u = torch.rand(N, generator=gen, dtype=torch.float64).to(dt["u"])
            at_ratio = torch.rand(N, generator=gen) < 0.15
            ratio = p[rows, safe] if q is None else p[rows, safe] / q[rows, safe]
            u = torch.where(at_ratio, ratio.to(u.dtype), u)
            u[torch.rand(N, generator=gen) < 0.05] = 0.0
            e = torch.empty(B, Vc).exponential_(generator=gen).to(_val(E).dtype)
            e[torch.rand(B, Vc, generator=gen) < 0.03] = 0.0
            e[torch.rand(B, Vc, generator=gen) < 0.03] = float("inf")
            cu = torch.tensor(counts).cumsum(0).to(dt["cu"])
            bonus = torch.randint(0, Vc, bshape, generator=gen).to(dt["bonus"])
            greedy = (torch.rand(B, generator=gen) < (0.3 if i % 2 else 0.0)) \
                if "greedy" in assign else None
            env = {P: p, E: e, assign["ids"]: ids.to(dt["ids"]), assign["u"]: u,
                   assign["cu"]: cu, assign["bonus"]: bonus}
            if Q is not None:
                env[Q] = q
            if greedy is not None:
                env[assign["greedy"]] = greedy
            try:
                got = _run(order, env)
                want, _ = ragged_verify(p, ids, q, u, e, bonus, cu, M, greedy, mode, rule,
                                        **kw, native=False)
            except (RuntimeError, TypeError, ValueError, IndexError) as err:
                log.debug("npuspec passes: a ragged region did not evaluate: %s", err)
                return False
            if got.shape != want.shape or not torch.equal(got.long(), want.long()):
                return False
    return True


def _insert(graph, out, P, Q, E, assign, M, rule, mode, kw, flavor) -> None:
    args = (P, assign["ids"], Q, None, None, None, assign["u"], E, False, None, None, None,
            assign["bonus"], None, assign["cu"], assign.get("greedy"))
    kwargs = {"target_is_probs": True, "accept_mode": mode, "accept_rule": rule,
              "max_spec_len": M, **kw}
    with graph.inserting_before(out):
        op = _fake_meta(graph.call_function(torch.ops.npuspec.rejection_sample.default, args,
                                            kwargs))
        tok = graph.call_function(operator.getitem, (op, 0))
        tok.meta["val"] = op.meta["val"][0]
        new = _fake_meta(_cast(graph, tok, _val(out).dtype, flavor))
    out.replace_all_uses_with(new)
