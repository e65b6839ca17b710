"""The standard-sampling whole verify step -> one `npuspec::rejection_sample(target_is_probs=True)`.

The user hands in their own finished target distribution p [B, K+1, V] (softmax after whatever
temperature / top-k / top-p they apply; that stays in their graph), draft probabilities q
[B, K, V] (or none: one-hot drafts), their uniforms u [B, K] and Exp(1) draws E ([B, V], one
vector per request as vLLM draws them, or [B, K+1, V], one per row). The idiom:

    px = p[:, :K].gather(-1, ids[..., None]).squeeze(-1)       # [B, K]
    qx = q.gather(-1, ids[..., None]).squeeze(-1)
    n = (px / qx >= u).cumprod(-1).sum(-1)                     # any prefix tail; one-hot: px >= u
    rec = (torch.clamp(p[:, :K] - q, min=0) / E[:, None]).argmax(-1)      # [B, K] recovered
          # one-hot: (p[:, :K].scatter(-1, ids[..., None], 0.0) / E[:, None]).argmax(-1)
    bonus = (p[:, K] / E).argmax(-1)                           # [B]
    tok = torch.cat([rec, bonus[:, None]], 1).gather(1, n[:, None]).squeeze(1)   # [B]
    return tok, n            # or the -1 padded [B, K+1] emission (`where(pos < n, ids, -1)`,
                             #   then `where(pos == n, tok, ...)`) and n

The ratio test may also be gpt-fast's `u <= torch.minimum(torch.ones(()), px / qx)` or
`u <= (px / qx).clamp(max=1)` (the op's `ratio_cap=True`: it takes min(ratio, 1) itself; with
the other comparisons also vLLM v0's `torch.minimum(r, torch.full((1,), 1))`), and
any comparison direction the op's `accept_mode` names: `u < r` ("gt", vLLM v0), a kept
rejection `~(u > r)` ("not_lt", gpt-fast and lucidrains; a NaN ratio accepts there) or
`~(u >= r)` ("not_le"). The op evaluates that same comparison, so NaN and inf decide as in the
user's code (`~(u > min(1, inf))` rejects u = 1.5; no rewrite of u alone could say that).

The count may also be vllm-ascend's PyTorch block verify (`_block_count`: running products of
min(1, p/q) against running products of u, legal where q(x) > 0, 1 + the last legal position),
the op's `accept_rule="cumulative"`, which computes the same torch.cumprod values.

The bonus row may also come from a residual over all K+1 rows against q with a zero row appended
(`torch.cat([q, torch.zeros_like(q[:, :1])], 1)` or `F.pad(q, (0, 0, 0, 1))`, race with E [B, V],
then `.gather(1, n[:, None])`), but only when p is a softmax output in the graph: the zero row's
`clamp(p_K - 0, min=0)` equals `p_K` exactly when no entry of p is negative.

Exactness: `probs_verify` (kernels/verify.py) evaluates the same float expressions (one division
and one `>=` per draft, `max(p - q, 0)` or the zeroed draft, one division by E, first-index
argmax), only on the row it needs, and elementwise IEEE results do not depend on the tensor
they sit in. Spellings whose arithmetic differs are not matched: a residual normalised by its
sum (the sum's order), Gumbel-max (`log` is not correctly rounded), and the zero-row spelling
when p is not a softmax output in the graph (`clamp(p_K - 0, 0)` differs from `p_K` for negative
entries).
"""
from __future__ import annotations

import dataclasses
import itertools

import torch

from npuspec.passes.patterns_common import (MODE_SPELLINGS, TAILS, Spelling, VerifyPattern,
                                            _bind, _bounded, _eq_shape, _gather_at, _is_random,
                                            _static_shape, _tail_out, _val, npuspec_ops)


# the ratio test, [B, K] bool: px [B, K] target prob of the draft, qx draft prob or None; the
# ratio as written (plain, gpt-fast's min(1, r), a clamp(max=1)), then the comparison of the
# op's accept_mode as it reads after canonical.canonicalize (`u < r` is written `r > u` there)
TESTS = {"ge": lambda r, u: r >= u, **MODE_SPELLINGS}


def _ok(px, qx, u, ratio, mode):
    r = px if qx is None else px / qx
    return TESTS[mode](r if ratio == "plain" else _bounded(r, ratio), u)


aten = torch.ops.aten


def _race_rows(p, q, ids, e, per_row):
    """[B, K] recovered token per row, and [B] bonus token, exponential race with the user's E."""
    pk = p[:, :-1]                                                  # [B, K, V]
    r = pk.scatter(-1, ids.unsqueeze(-1), 0.0) if q is None else torch.clamp(pk - q, min=0)
    if per_row:                                                     # E [B, K+1, V]
        return (r / e[:, :-1]).argmax(dim=-1), (p[:, -1] / e[:, -1]).argmax(dim=-1)
    return (r / e[:, None, :]).argmax(dim=-1), (p[:, -1] / e).argmax(dim=-1)


def _step(p, q, ids, u, e, ratio, mode, tail, per_row, out):
    ok = _ok(_gather_at(p[:, :-1], ids), None if q is None else _gather_at(q, ids), u, ratio, mode)
    return _token_at(p, q, ids, e, tail(ok), per_row, out)


def _token_at(p, q, ids, e, n, per_row, out):
    """The race's token at row n [B] (recovered, or the bonus at n = K), in the `out` form."""
    rec, bonus = _race_rows(p, q, ids, e, per_row)
    tok = torch.cat([rec, bonus[:, None]], dim=1).gather(1, n[:, None]).squeeze(1)   # [B]
    return _emitted(p, ids, n, tok, out)


def _step_zero_row(p, q, ids, u, e, ratio, mode, tail, pad, out):
    """The residual over all K+1 rows against q with a zero row appended (the bonus row's
    residual is then p_K itself), and the row at n picked out."""
    n = tail(_ok(_gather_at(p[:, :-1], ids), _gather_at(q, ids), u, ratio, mode))   # [B]
    qz = (torch.cat([q, torch.zeros_like(q[:, :1])], dim=1) if pad == "cat"
          else torch.nn.functional.pad(q, (0, 0, 0, 1)))                         # [B, K+1, V]
    race = (torch.clamp(p - qz, min=0) / e[:, None, :]).argmax(dim=-1)            # [B, K+1]
    return _emitted(p, ids, n, race.gather(1, n[:, None]).squeeze(1), out)


def _block_count(px, qx, u, cap):
    """vllm-ascend's PyTorch block verify (`rejection_random_sample_block_verify_pytorch`),
    on [B, K]: running products of min(1, p/q) against running products of u, a position
    legal only where q(x) > 0, and the count 1 + the last legal position (0 if none)."""
    pi = px / qx
    if cap:
        pi = pi.clamp(max=1.0)
    pi = torch.cumprod(pi, dim=-1)
    uc = torch.cumprod(u, dim=-1)
    legal = (qx > 0) & (pi >= uc)
    k = legal.shape[-1]
    last = torch.where(legal.any(dim=-1, keepdim=True),
                       k - legal.flip(dims=[-1]).float().argmax(dim=-1, keepdim=True) - 1, -1)
    return (last + 1).squeeze(-1)                                   # [B]


def _step_block(p, q, ids, u, e, cap, per_row, out):
    n = _block_count(_gather_at(p[:, :-1], ids), _gather_at(q, ids), u, cap)
    return _token_at(p, q, ids, e, n, per_row, out)


def _emitted(p, ids, n, tok, out):
    if out == "token":
        return tok, n
    pos = torch.arange(p.shape[1], device=p.device)[None, :]      # [1, K+1]
    emitted = torch.where(pos < n[:, None], torch.nn.functional.pad(ids, (0, 1), value=-1), -1)
    return torch.where(pos == n[:, None], tok[:, None], emitted), n


def _op(p, q, ids, u, e, ratio, mode, tail, out, rule="prefix"):
    # the op evaluates the user's test itself: their comparison, and min(ratio, 1) when capped
    tokens, num = npuspec_ops.rejection_sample(p, ids, q, None, None, None, u, e, False, None,
                                               None, None, target_is_probs=True,
                                               accept_mode=mode, ratio_cap=ratio != "plain",
                                               accept_rule=rule)
    n = _tail_out(tail, num.to(torch.int64) - 1)
    tokens = tokens.to(torch.int64)
    if out == "token":
        return tokens.gather(1, n[:, None]).squeeze(1), n
    return tokens, n


@dataclasses.dataclass(frozen=True)
class SampleVerifyConfig:
    enabled: bool = True
    tails: tuple = ("cumprod", "cumprod_long", "cumsum_not")
    ratios: tuple = ("plain", "min", "clamp")   # min/clamp/full1 only with draft probs
    # the op's accept_mode: `ratio >= u` ("ge", every tail above), or the other comparisons
    # with the cumprod tail only (prefix.prove_prefix_counts rewrites the others into it);
    # default_patterns() holds one instance for "ge" and one for the others (OTHER_MODES),
    # which is compiled only for graphs that hold such a comparison (`applies`)
    modes: tuple = ("ge",)
    one_hot: bool = True
    forms: tuple = ("padded", "token")          # padded first: it contains the token form's nodes
    zero_row_q: tuple = ("cat", "pad")          # q with a zero bonus row: cat zeros_like / F.pad
    zero_row_tails: tuple = ("cumprod", "cumsum_not")
    e_shapes: tuple = ("request", "row")        # E [B, V] broadcast over rows, or E [B, K+1, V]
    block: bool = True                          # vllm-ascend's block verify count (with "ge")
    max_k: int = 64


OTHER_MODES = ("gt", "not_lt", "not_le")
_CMP = (aten.gt.Tensor, aten.ge.Tensor)


class SampleVerify(VerifyPattern):
    """The whole standard-sampling verify step on the user's probabilities (module docstring):
    ratio test + accepted prefix + recovered/bonus exponential race + emission, replaced by
    one `npuspec::rejection_sample(p, ids, q, ..., uniforms=u, exponentials=E,
    target_is_probs=True)`. The user's draws stay in the graph as the op's inputs. p, q, u, E
    must be float32 (the op's arithmetic), ids int64 [B, K], p [B, K+1, V], q [B, K, V],
    E [B, V] or [B, K+1, V]; K and V static."""

    name = "sample_verify"
    Config = SampleVerifyConfig

    def spellings(self):
        c = self.config
        out = []
        combos = [(r, True) for r in c.ratios] + ([("plain", False)] if c.one_hot else [])
        for mode in c.modes:
            tails = c.tails if mode == "ge" else tuple(t for t in c.tails if t == "cumprod")
            out += self._race_spellings(mode, combos, tails)
            ztails = c.zero_row_tails if mode == "ge" else tuple(
                t for t in c.zero_row_tails if t == "cumprod")
            out += self._zero_row_spellings(mode, ztails)
        if c.block and "ge" in c.modes:
            out += self._block_spellings()
        return out

    def _block_spellings(self):
        """vllm-ascend's block verify count (the op's accept_rule="cumulative"), with draft
        probabilities, its clamp(max=1) or without it."""
        c = self.config
        out = []
        for cap, per_row, form in itertools.product((True, False),
                                                    [e == "row" for e in c.e_shapes], c.forms):
            def s(p, q, ids, u, e, cap, per_row, out):
                return _step_block(p, q, ids, u, e, cap, per_row, out)

            def r(p, q, ids, u, e, ratio, out):
                return _op(p, q, ids, u, e, ratio, "ge", "cumprod", out, rule="cumulative")

            eshape = (2, 5, 11) if per_row else (2, 11)
            ex = (lambda es: lambda: [torch.rand(2, 5, 11), torch.rand(2, 4, 11),  # noqa: E731
                                      torch.randint(0, 11, (2, 4)), torch.rand(2, 4),
                                      torch.rand(es) + 0.1])(eshape)
            name = f"block_{'clamp' if cap else 'plain'}_{'erow' if per_row else 'ereq'}_{form}"
            out.append(Spelling(name, _bind(s, cap=cap, per_row=per_row, out=form),
                                _bind(r, ratio="clamp" if cap else "plain", out=form), ex))
        return out

    def _race_spellings(self, mode, combos, tails):
        c = self.config
        out = []
        for (ratio, has_q), tail, per_row, form in itertools.product(
                combos, tails, [e == "row" for e in c.e_shapes], c.forms):
            e_name = "erow" if per_row else "ereq"
            m = "" if mode == "ge" else f"_{mode}"
            name = f"{'q' if has_q else 'onehot'}_{ratio}{m}_{tail}_{e_name}_{form}"
            fixed = dict(ratio=ratio, mode=mode, tail=TAILS[tail], per_row=per_row, out=form)
            rfix = dict(ratio=ratio, mode=mode, tail=tail, out=form)
            eshape = (2, 5, 11) if per_row else (2, 11)
            if has_q:
                def s(p, q, ids, u, e, ratio, mode, tail, per_row, out):
                    return _step(p, q, ids, u, e, ratio, mode, tail, per_row, out)

                def r(p, q, ids, u, e, ratio, mode, tail, out):
                    return _op(p, q, ids, u, e, ratio, mode, tail, out)

                ex = (lambda es: lambda: [torch.rand(2, 5, 11), torch.rand(2, 4, 11),  # noqa: E731
                                          torch.randint(0, 11, (2, 4)), torch.rand(2, 4),
                                          torch.rand(es) + 0.1])(eshape)
            else:
                def s(p, ids, u, e, ratio, mode, tail, per_row, out):
                    return _step(p, None, ids, u, e, ratio, mode, tail, per_row, out)

                def r(p, ids, u, e, ratio, mode, tail, out):
                    return _op(p, None, ids, u, e, ratio, mode, tail, out)

                ex = (lambda es: lambda: [torch.rand(2, 5, 11), torch.randint(0, 11, (2, 4)),  # noqa: E731
                                          torch.rand(2, 4), torch.rand(es) + 0.1])(eshape)
            out.append(Spelling(name, _bind(s, **fixed), _bind(r, **rfix), ex))
        return out

    def _zero_row_spellings(self, mode, tails):
        c = self.config
        out = []
        for ratio, tail, pad, form in itertools.product(c.ratios, tails, c.zero_row_q, c.forms):
            def s(p, q, ids, u, e, ratio, mode, tail, pad, out):
                return _step_zero_row(p, q, ids, u, e, ratio, mode, tail, pad, out)

            def r(p, q, ids, u, e, ratio, mode, tail, out):
                return _op(p, q, ids, u, e, ratio, mode, tail, out)

            ex = lambda: [torch.rand(2, 5, 11), torch.rand(2, 4, 11),  # noqa: E731
                          torch.randint(0, 11, (2, 4)), torch.rand(2, 4), torch.rand(2, 11) + 0.1]
            m = "" if mode == "ge" else f"{mode}_"
            out.append(Spelling(f"zero_row_{pad}_{ratio}_{m}{tail}_{form}",
                                _bind(s, ratio=ratio, mode=mode, tail=TAILS[tail], pad=pad,
                                      out=form),
                                _bind(r, ratio=ratio, mode=mode, tail=tail, out=form), ex))
        return out

    def applies(self, graph) -> bool:
        """Whether `graph` (canonical, prefix counts proven) can hold one of this instance's
        steps: every spelling races with an argmax of a division and counts with a cumprod
        (or, for "ge", a cumsum tail); the other modes also need a tensor `>` or a negated
        tensor `>=`.
        Trying 72 or 108 spellings over every node costs seconds on a 30-layer forward, and
        tracing the second instance's takes seconds too, so a graph that cannot hold one
        pays for neither."""
        has = lambda t: bool(graph.find_nodes(op="call_function", target=t))  # noqa: E731
        # every spelling's race divides by the user's Exp(1) draws right before an argmax; a
        # greedy step has argmax and cumprod too, and would otherwise pay ~10 s per process
        # tracing these 188 spellings
        if not any(getattr(n.args[0], "target", None) == aten.div.Tensor
                   for n in graph.find_nodes(op="call_function", target=aten.argmax.default)):
            return False
        if "ge" in self.config.modes:
            return has(aten.cumprod.default) or has(aten.cumsum.default)
        return has(aten.cumprod.default) and (has(aten.gt.Tensor) or any(
            getattr(n.args[0], "target", None) in _CMP
            for n in graph.find_nodes(op="call_function", target=aten.bitwise_not.default)))

    def extra_check(self, match) -> bool:
        if not self.config.enabled:
            return False
        kw = match.kwargs
        p, ids, u, e = (_val(kw.get(k)) for k in ("p", "ids", "u", "e"))
        q = _val(kw["q"]) if "q" in kw else None
        if p is None or ids is None or u is None or e is None or ("q" in kw and q is None):
            return False
        f32 = torch.float32
        if p.dtype != f32 or u.dtype != f32 or e.dtype != f32 or ids.dtype != torch.int64:
            return False
        if p.dim() != 3 or ids.dim() != 2 or not (_static_shape(p) and _static_shape(ids)):
            return False
        B, K = ids.shape
        V = p.shape[2]
        if not (1 <= K <= self.config.max_k and p.shape[1] == K + 1
                and _eq_shape(p.shape[:1], (B,)) and _eq_shape(u.shape, (B, K))):
            return False
        if q is not None and (q.dtype != f32 or not _eq_shape(q.shape, (B, K, V))):
            return False
        if _zero_row(match) and not _softmax_output(kw["p"]):
            return False
        return ((_eq_shape(e.shape, (B, V)) or _eq_shape(e.shape, (B, K + 1, V)))
                and _late_inputs_ok(match))


def _zero_row(match) -> bool:
    """A zero-row spelling: `p - qz` on the whole p (the others subtract from a slice of p)."""
    p = match.kwargs["p"]
    return any(n.target is aten.sub.Tensor and n.args[0] is p for n in match.nodes)


def _softmax_output(p) -> bool:
    """p is a softmax (aten's, or Inductor's decomposition exp(x - max) / sum(exp)), so every
    entry is >= 0 or NaN. Only then is the zero row's `clamp(p_K - 0, min=0)` equal to the
    op's bonus row `p_K` (a negative entry would be clamped to 0 by the user's code only)."""
    t = getattr(p, "target", None)
    if t in (aten._softmax.default, aten.softmax.int):
        return True
    if t is not aten.div.Tensor or len(p.args) != 2:
        return False
    num, den = p.args
    return (getattr(num, "target", None) is aten.exp.default
            and getattr(den, "target", None) is aten.sum.dim_IntList and den.args[0] is num)


def _late_inputs_ok(match) -> bool:
    """The replacement is inserted before the pattern's first output (n), but users often draw
    E after the ratio test (it is only needed at a rejection). The manager's topological sort
    then moves the op, and everything that depends on it, after the draw. That keeps the
    user's RNG stream only if no random op that depends on the pattern's outputs sits between
    the two places (it would move after the draw); refuse the match in that case."""
    graph = match.nodes[0].graph
    pos = {n: i for i, n in enumerate(graph.nodes)}
    outs = [o for o in match.output_nodes() if o is not None]
    ins = [n for n in match.kwargs.values() if isinstance(n, torch.fx.Node)]
    first_out, last_in = min(pos[o] for o in outs), max(pos[n] for n in ins)
    if last_in < first_out:
        return True
    dependents, stack = set(), list(outs)
    while stack:
        for u in stack.pop().users:
            if u not in dependents:
                dependents.add(u)
                stack.append(u)
    if any(n in dependents for n in ins):  # an input made from an output: no place for one op
        return False
    between = list(graph.nodes)[first_out + 1:last_in]
    return not any(_is_random(n) and n in dependents for n in between)


__all__ = ["SampleVerify", "SampleVerifyConfig"]
