"""The verify-pattern library: one class per verify family.

Each family holds its search patterns (plain PyTorch functions, one per spelling, traced to
ATen by Inductor's pattern matcher), the replacement (a call to an `npuspec::` op), an
`extra_check` that guards shapes and dtypes, and a config whose fields change the family's
`uuid()`. Literals (dims, slice bounds, scalars, dtypes) are checked exactly by the matcher
after `canonical.canonicalize`, and an intermediate with a user outside the pattern blocks
the match, so a near miss is left alone and still computes what the user wrote.

Families, in the order the manager runs them (supersets first):

1. GreedyVerify   argmax + accepted prefix + emitted tokens   -> npuspec::rejection_sample
2. SampleVerify   ratio test + prefix + residual/bonus race + emission on the user's p
                  (patterns_sample.py)        -> npuspec::rejection_sample(target_is_probs=True)
3. GreedyAccept   eq + cumprod/cumsum/cummin prefix length    -> npuspec::greedy_accept
4. RatioAccept    p(x)/q(x) vs u + prefix length              -> npuspec::ratio_accept
5. Residual       clamp(p - q, 0) [normalised] + race/Gumbel/multinomial
                                                              -> npuspec::residual_sample / residual_probs

Exactness: every replacement is bit-identical to the eager idiom it replaces, for the same
inputs and the same RNG state (random draws are pattern *inputs*, so the user's own
torch.rand / exponential_ / Gumbel draws are kept; multinomial stays the user's op).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import itertools
import json
from typing import Callable

import torch
from torch import Tensor

import npuspec.kernels  # noqa: F401  (registers torch.ops.npuspec.*)
import npuspec.kernels.accept  # noqa: F401

npuspec_ops = torch.ops.npuspec
FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclasses.dataclass(frozen=True)
class Spelling:
    """One search function, its replacement and tiny example inputs to trace them with."""
    name: str
    search: Callable
    replace: Callable
    example: Callable[[], list]  # () -> example inputs (fresh tensors)


def _val(n):
    v = n.meta.get("val") if hasattr(n, "meta") else None
    return v if isinstance(v, Tensor) else None


def _is_random(n) -> bool:
    t = getattr(n, "target", None)
    return (getattr(n, "op", None) == "call_function" and isinstance(t, torch._ops.OpOverload)
            and torch.Tag.nondeterministic_seeded in t.tags)


def _draw_order_ok(match) -> bool:
    """A draw inside a pattern is remade where the replacement goes (before the pattern's
    output). That keeps the user's RNG stream only if no other random op runs in between."""
    draws = [n for n in match.nodes if _is_random(n)]
    if not draws:
        return True
    nodes = list(draws[0].graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    lo = min(pos[d] for d in draws)
    hi = min(pos[o] for o in match.output_nodes() if o is not None)
    inside = set(match.nodes)
    return not any(_is_random(n) and n not in inside for n in nodes[lo + 1:hi])


def _static_shape(t: Tensor, skip: int = 1) -> bool:
    """Every dim but the first `skip` (the batch, which Dynamo makes symbolic once it varies)
    is a plain int: K and V are burnt into the op calls and the matched literals."""
    return all(isinstance(s, int) for s in t.shape[skip:])


def _eq_shape(a, b) -> bool:
    """Shapes equal. Dynamo gives each input's varying batch its own symbol; equal sizes are
    then guarded equal (a later call with unequal batches recompiles), like Inductor's own
    pattern checks do."""
    from torch.fx.experimental.symbolic_shapes import guard_or_false
    a, b = tuple(a), tuple(b)
    return len(a) == len(b) and all(guard_or_false(x == y) for x, y in zip(a, b))


# --------------------------------------------------------------------------------------------
# prefix-length tails: every spelling of "number of leading Trues" we recognise
# --------------------------------------------------------------------------------------------
def tail_cumprod(ok):          # ok: bool [B, K]
    return ok.cumprod(dim=-1).sum(dim=-1)


def tail_cumprod_int(ok):      # Medusa-style: mask.int(), then torch.cumprod
    return torch.cumprod(ok.int(), dim=1).sum(dim=1)


def tail_cumprod_long(ok):
    return ok.long().cumprod(dim=1).sum(dim=1)


def tail_cumsum_not(ok):       # HF transformers / Leviathan-style
    return ((~ok).cumsum(dim=-1) < 1).sum(dim=-1)


def tail_cumsum_not_all(ok):   # HF transformers' literal spelling: .sum() over everything
    return ((~ok).cumsum(dim=-1) < 1).sum()


def tail_cummin_int(ok):
    return ok.int().cummin(dim=-1).values.sum(dim=-1)


def tail_cummin_long(ok):
    return ok.long().cummin(dim=-1).values.sum(dim=-1)


TAILS = {"cumprod": tail_cumprod, "cumprod_int": tail_cumprod_int,
         "cumprod_long": tail_cumprod_long, "cumsum_not": tail_cumsum_not,
         "cumsum_not_all": tail_cumsum_not_all, "cummin_int": tail_cummin_int,
         "cummin_long": tail_cummin_long}
# how the op's int64 [B] result maps to what each tail returns
TAIL_OUT = {"cumsum_not_all": lambda n: n.sum()}


def _tail_out(tail: str, n: Tensor) -> Tensor:
    return TAIL_OUT.get(tail, lambda x: x)(n)


def _bind(fn, **fixed):
    """fn with keyword arguments fixed; its signature keeps only the tensor inputs (the pattern
    matcher names the pattern's inputs after the signature)."""
    sig = inspect.signature(fn)

    def bound(*args):
        return fn(*args, **fixed)

    bound.__signature__ = sig.replace(
        parameters=[p for n, p in sig.parameters.items() if n not in fixed])
    bound.__name__ = fn.__name__
    return bound


@functools.lru_cache(maxsize=None)
def _source_hash(*objs) -> str:
    """sha256 of the objects' source. Cached: an engine's warm-up asks for every pass's
    uuid a few dozen times (cache keys, Inductor's FX cache), and reading the source of a
    module costs ~5 ms; a process's loaded source does not change under it."""
    h = hashlib.sha256()
    for o in objs:
        h.update(inspect.getsource(o).encode())
    return h.hexdigest()


class VerifyPattern:
    """Base: a family with a name, a config dataclass, spellings and an extra_check."""

    name = "base"
    Config = None

    def __init__(self, config=None):
        self.config = config if config is not None else self.Config()

    def spellings(self) -> list[Spelling]:
        raise NotImplementedError

    def extra_check(self, match) -> bool:
        raise NotImplementedError

    def applies(self, graph) -> bool:
        """False when no spelling can match `graph`: the manager then skips (and never
        compiles) this family for it."""
        return True

    def uuid(self) -> str:
        """Hash of this family's source (class and this module) and its config."""
        cfg = json.dumps(dataclasses.asdict(self.config), sort_keys=True, default=str)
        mods = {inspect.getmodule(type(self)), inspect.getmodule(VerifyPattern)}  # + shared helpers
        src = _source_hash(type(self), *sorted(mods, key=lambda m: m.__name__))
        return hashlib.sha256(f"{self.name}|{src}|{cfg}".encode()).hexdigest()

    def __repr__(self):
        return f"{type(self).__name__}({self.config})"


# --------------------------------------------------------------------------------------------
# 1. greedy whole verify step -> npuspec::rejection_sample
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class GreedyVerifyConfig:
    enabled: bool = True
    tails: tuple = ("cumprod", "cumprod_long", "cumsum_not", "cummin_int")
    max_k: int = 64  # the fused op handles any K; keep pathological shapes on the eager path


def _greedy_op(logits, drafts):
    out, num = npuspec_ops.rejection_sample(logits, drafts, None, None, None, None, None, None,
                                            False, None, None, None)
    return out.to(drafts.dtype), num.to(torch.int64)


class GreedyVerify(VerifyPattern):
    """The whole greedy verify step:

        target = logits.argmax(-1)                                   # [B, K+1]
        n = (drafts == target[:, :-1]).cumprod(-1).sum(-1)           # [B] (any tail spelling)
        out = torch.where(arange(K+1) <= n[:, None], target, -1)     # [B, K+1] emitted, -1 padded
    or, instead of `out`, the one token emitted after the accepted prefix:
        tok = target.gather(1, n[:, None]).squeeze(1)                # [B]

    Replaced by one `npuspec::rejection_sample` call in greedy mode, whose tokens are exactly
    `target[:, :n+1]` (accepted drafts equal the argmax, ties resolve to the lowest index in
    both). `target` and the intermediates must have no other users."""

    name = "greedy_verify"
    Config = GreedyVerifyConfig

    def spellings(self):
        out = []
        for tail in self.config.tails:
            t = TAILS[tail]

            def s_mask(logits, drafts, t):
                target = logits.argmax(dim=-1)                       # [B, K+1]
                n = t(drafts == target[:, :-1])                      # [B]
                pos = torch.arange(target.shape[1], device=logits.device)
                return torch.where(pos[None, :] <= n[:, None], target, -1), n

            def r_mask(logits, drafts):
                tok, num = _greedy_op(logits, drafts)
                return tok, num - 1

            def s_tok(logits, drafts, t):
                target = logits.argmax(dim=-1)
                n = t(drafts == target[:, :-1])
                return target.gather(1, n[:, None]).squeeze(1), n

            def s_fill(logits, drafts, t):
                target = logits.argmax(dim=-1)
                n = t(drafts == target[:, :-1])
                pos = torch.arange(target.shape[1], device=logits.device)
                return target.masked_fill(pos[None, :] > n[:, None], -1), n

            def r_tok(logits, drafts):
                tok, num = _greedy_op(logits, drafts)
                n = num - 1
                return tok.gather(1, n[:, None]).squeeze(1), n

            ex = lambda: [torch.randn(2, 5, 11), torch.randint(0, 11, (2, 4))]  # noqa: E731
            out.append(Spelling(f"mask_{tail}", _bind(s_mask, t=t), r_mask, ex))
            out.append(Spelling(f"token_{tail}", _bind(s_tok, t=t), r_tok, ex))
            out.append(Spelling(f"fill_{tail}", _bind(s_fill, t=t), r_mask, ex))
        return out

    def extra_check(self, match) -> bool:
        logits, drafts = _val(match.kwargs["logits"]), _val(match.kwargs["drafts"])
        if logits is None or drafts is None or not self.config.enabled:
            return False
        # float64 is refused: the op takes the argmax of logits.float(), and rounding to float32
        # could merge two distinct float64 maxima into a tie
        return (logits.dim() == 3 and drafts.dim() == 2 and _static_shape(logits)
                and _static_shape(drafts) and logits.dtype in FLOATS[:3]
                and drafts.dtype == torch.int64 and _eq_shape(drafts.shape[:1], logits.shape[:1])
                and drafts.shape[1] == logits.shape[1] - 1 and 1 <= drafts.shape[1] <= self.config.max_k)


# --------------------------------------------------------------------------------------------
# 2. greedy accepted length -> npuspec::greedy_accept
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class GreedyAcceptConfig:
    enabled: bool = True
    tails: tuple = tuple(TAILS)
    id_dtypes: tuple = ("int32", "int64")


class GreedyAccept(VerifyPattern):
    """The greedy accepted-prefix length of drafts against target choices:

        n = (drafts == target).cumprod(-1).sum(-1)                       # cumprod of equality
        n = ((~(drafts == target)).cumsum(-1) < 1).sum(-1)              # cumsum of inequality < 1
        n = ((~(cand == sel[:, :-1])).cumsum(dim=-1) < 1).sum()         # HF assisted generation
        n = (drafts == target).int().cummin(-1).values.sum(-1)          # cummin
        n = ((drafts != target).cumsum(-1) == 0).sum(-1)                # ne + cumsum == 0

    (either operand order of ==). Replaced by `npuspec::greedy_accept(drafts, target)` (summed
    for the `.sum()` spelling). Both id tensors must be [B, K] with the same integer dtype."""

    name = "greedy_accept"
    Config = GreedyAcceptConfig

    def spellings(self):
        out = []
        ex = lambda: [torch.randint(0, 7, (2, 4)), torch.randint(0, 7, (2, 4))]  # noqa: E731
        for tail, swap in itertools.product(self.config.tails, (False, True)):
            t = TAILS[tail]

            def s(drafts, target, t, swap):
                return t(target == drafts if swap else drafts == target)

            def r(drafts, target, tail):
                return _tail_out(tail, npuspec_ops.greedy_accept(drafts, target))

            out.append(Spelling(f"{tail}{'_swapped' if swap else ''}", _bind(s, t=t, swap=swap),
                                _bind(r, tail=tail), ex))

        def s_ne(drafts, target):
            return ((drafts != target).cumsum(dim=-1) == 0).sum(dim=-1)

        out.append(Spelling("ne_cumsum_eq0", s_ne,
                            lambda drafts, target: npuspec_ops.greedy_accept(drafts, target), ex))
        return out

    def extra_check(self, match) -> bool:
        d, t = _val(match.kwargs["drafts"]), _val(match.kwargs["target"])
        if d is None or t is None or not self.config.enabled:
            return False
        ok_dt = tuple(getattr(torch, n) for n in self.config.id_dtypes)
        return (d.dim() == 2 and _eq_shape(d.shape, t.shape) and d.dtype == t.dtype and d.dtype in ok_dt
                and d.shape[1] >= 1)


# --------------------------------------------------------------------------------------------
# 3. standard rejection test -> npuspec::ratio_accept
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RatioAcceptConfig:
    enabled: bool = True
    tails: tuple = ("cumprod", "cumprod_long", "cumsum_not", "cumsum_not_all", "cummin_int")
    one_hot: bool = True  # also match p(x) >= u without draft probs
    bounded: tuple = ("min", "clamp")  # gpt-fast's u <= min(1, p/q), and u <= (p/q).clamp(max=1)
    bounded_tails: tuple = ("cumprod", "cumsum_not")
    modes: tuple = ("gt", "not_lt", "not_le")  # comparison directions besides `ratio >= u`


def _bounded(ratio, how):        # min(1, ratio): gpt-fast, a clamp, vLLM v0's full((1,), 1)
    if how == "full1":
        return torch.minimum(ratio, torch.full((1,), 1, device=ratio.device))
    return torch.minimum(torch.ones(()), ratio) if how == "min" else ratio.clamp(max=1)


# the accept test of each ratio_accept mode but the default, as it reads after
# canonical.canonicalize (`u < r` is written `r > u` there)
MODE_SPELLINGS = {
    "gt": lambda r, u: r > u,
    "not_lt": lambda r, u: ~(u > r),
    "not_le": lambda r, u: ~(u >= r),
}


def _unbounded_u(u):
    """u' with (ratio >= u') == (min(1, ratio) >= u) for every float: u <= min(1, r) holds iff
    u <= 1 and u <= r, and a NaN (in u or r) is false on both sides."""
    return torch.where(u <= 1, u, float("nan"))


def _gather_at(p, ids):          # p [B, K, V], ids [B, K] -> [B, K]
    return p.gather(-1, ids.unsqueeze(-1)).squeeze(-1)


def _gather_at2(p, ids):         # same value, the `[..., None]` / `[..., 0]` spelling
    return torch.gather(p, 2, ids[:, :, None])[:, :, 0]


def _index_hf(p, ids):           # HF: p[:, torch.arange(K), ids].squeeze(0, 1), B == 1
    return p[:, torch.arange(ids.shape[1]), ids].squeeze(0, 1)


PICKS = {"gather": _gather_at, "gather2": _gather_at2}


class RatioAccept(VerifyPattern):
    """The standard (Leviathan et al.) acceptance test and its accepted-prefix length:

        px = p.gather(-1, ids[..., None]).squeeze(-1)   # [B, K]   p: target probs [B, K, V]
        qx = q.gather(-1, ids[..., None]).squeeze(-1)   # [B, K]   q: draft probs  [B, K, V]
        ok = px / qx >= u                               # or  u <= px / qx ;  one-hot: px >= u
        ok = u <= torch.minimum(torch.ones(()), px / qx)  # gpt-fast; or (px / qx).clamp(max=1)
        n = ok.cumprod(-1).sum(-1)                      # any prefix-length spelling

    and HF transformers' `_speculative_sampling` spelling (B = 1):
        q_i = q[:, torch.arange(K), ids].squeeze(0, 1); p_i = p[:, torch.arange(K), ids].squeeze(0, 1)
        n = ((~(r_i <= p_i / q_i)).cumsum(dim=-1) < 1).sum()

    The uniforms u are a pattern input (the user's own torch.rand draw stays in the graph).
    Replaced by `npuspec::ratio_accept(p[:, :K], q, ids, u)`, which evaluates the same
    division and comparison (for min(1, .): with u -> where(u <= 1, u, nan), the same truth
    values for every float). p, q must be same-dtype float [B, K, V]; ids int64 [B, K]."""

    name = "ratio_accept"
    Config = RatioAcceptConfig

    def spellings(self):
        out = []
        ex = lambda: [torch.rand(2, 4, 9), torch.rand(2, 4, 9), torch.randint(0, 9, (2, 4)),  # noqa: E731
                      torch.rand(2, 4)]
        # `u <= ratio` needs no spelling of its own: canonicalize() turns it into `ratio >= u`
        for (pname, pick), tail in itertools.product(PICKS.items(), self.config.tails):
            t = TAILS[tail]

            def s(p, q, ids, u, pick, t):
                return t(pick(p, ids) / pick(q, ids) >= u)

            def r(p, q, ids, u, tail):
                return _tail_out(tail, npuspec_ops.ratio_accept(p, q, ids, u))

            out.append(Spelling(f"{pname}_{tail}", _bind(s, pick=pick, t=t), _bind(r, tail=tail), ex))
            if self.config.one_hot:
                def s1(p, ids, u, pick, t):
                    return t(pick(p, ids) >= u)

                def r1(p, ids, u, tail):
                    return _tail_out(tail, npuspec_ops.ratio_accept(p, None, ids, u))

                ex1 = lambda: [torch.rand(2, 4, 9), torch.randint(0, 9, (2, 4)),  # noqa: E731
                               torch.rand(2, 4)]
                out.append(Spelling(f"onehot_{pname}_{tail}", _bind(s1, pick=pick, t=t),
                                    _bind(r1, tail=tail), ex1))

        # gpt-fast: accept iff u <= min(1, p/q) (it keeps the rejections, `u > min(1, p/q)`,
        # whose complement differs for NaN; only the accept spelling is matched)
        for how, tail in itertools.product(self.config.bounded, self.config.bounded_tails):
            def s_b(p, q, ids, u, how, t):
                return t(_bounded(_gather_at(p, ids) / _gather_at(q, ids), how) >= u)

            def r_b(p, q, ids, u, tail):
                return _tail_out(tail, npuspec_ops.ratio_accept(p, q, ids, _unbounded_u(u)))

            out.append(Spelling(f"bounded_{how}_{tail}", _bind(s_b, how=how, t=TAILS[tail]),
                                _bind(r_b, tail=tail), ex))

        # The draw made from the ratio itself, `u = torch.rand_like(ratio)`: the ratio then has
        # a second user, so the draw must be inside the pattern. The replacement makes the same
        # draw (same count, dtype and generator) right where the pattern ends; `_draw_order_ok`
        # refuses the match when another random op runs in between.
        for tail in ("cumprod", "cumsum_not"):
            def s_d(p, q, ids, t):
                ratio = _gather_at(p, ids) / _gather_at(q, ids)
                return t(ratio >= torch.rand_like(ratio))

            def r_d(p, q, ids, tail):
                u = torch.rand_like(ids, dtype=p.dtype)
                return _tail_out(tail, npuspec_ops.ratio_accept(p, q, ids, u))

            ex_d = lambda: ex()[:3]  # noqa: E731
            out.append(Spelling(f"gather_draw_{tail}", _bind(s_d, t=TAILS[tail]),
                                _bind(r_d, tail=tail), ex_d))

        # HF transformers `_speculative_sampling` (B = 1; p has K+1 rows, q has K)
        def s_hf(p, q, ids):
            q_i = _index_hf(q, ids)
            p_i = _index_hf(p, ids)
            probability_ratio = p_i / q_i
            r_i = torch.rand_like(probability_ratio)
            return ((~(r_i <= probability_ratio)).cumsum(dim=-1) < 1).sum()

        def r_hf(p, q, ids):
            k = ids.shape[1]
            u = torch.rand_like(ids[0], dtype=p.dtype)  # the K draws rand_like(ratio) made
            return npuspec_ops.ratio_accept(p[:, :k], q, ids, u.view(1, k)).sum()

        ex_hf = lambda: [torch.rand(1, 5, 9), torch.rand(1, 4, 9), torch.randint(0, 9, (1, 4))]  # noqa: E731
        out.append(Spelling("hf_speculative_sampling", s_hf, r_hf, ex_hf))

        # ... and with its draw made from literals (picks.canonical_picks turns a static-shape
        # `rand_like(ratio)` into `rand(shape)`, so the ratio has one user and u is an input)
        def s_hf_u(p, q, ids, r_i):
            probability_ratio = _index_hf(p, ids) / _index_hf(q, ids)
            return ((~(r_i <= probability_ratio)).cumsum(dim=-1) < 1).sum()

        def r_hf_u(p, q, ids, r_i):
            k = ids.shape[1]
            return npuspec_ops.ratio_accept(p[:, :k], q, ids, r_i.view(1, k)).sum()

        out.append(Spelling("hf_speculative_sampling_u", s_hf_u, r_hf_u,
                            lambda: ex_hf() + [torch.rand(4)]))
        out += self._mode_spellings(ex)
        return out

    def _mode_spellings(self, ex) -> list:
        """The other comparison directions: vLLM v0's `u < ratio` (also under
        `torch.minimum(ratio, torch.full((1,), 1))`), and code that keeps the rejections
        (lucidrains' `r > p / q`, `u >= ratio`). Only the cumprod tail: the prefix proof
        (prefix.py) has put every count into that form, a count of leading rejections as
        `(~reject).cumprod(1).sum(1)`."""
        out = []
        for mode in self.config.modes:
            cmp = MODE_SPELLINGS[mode]

            def s(p, q, ids, u, cmp):
                return tail_cumprod(cmp(_gather_at(p, ids) / _gather_at(q, ids), u))

            def s1(p, ids, u, cmp):
                return tail_cumprod(cmp(_gather_at(p, ids), u))

            def r(p, q, ids, u, mode):
                return npuspec_ops.ratio_accept(p, q, ids, u, mode)

            def r1(p, ids, u, mode):
                return npuspec_ops.ratio_accept(p, None, ids, u, mode)

            ex1 = lambda: [ex()[0], ex()[2], ex()[3]]  # noqa: E731
            out.append(Spelling(f"mode_{mode}", _bind(s, cmp=cmp), _bind(r, mode=mode), ex))
            out.append(Spelling(f"onehot_mode_{mode}", _bind(s1, cmp=cmp), _bind(r1, mode=mode), ex1))
        if "gt" in self.config.modes:
            # u < min(ratio, 1) holds iff u < 1 and u < ratio (NaN false on both sides), so
            # u -> where(u < 1, u, nan) turns it into the plain "gt" test
            for how in ("min", "full1"):
                def s_b(p, q, ids, u, how):
                    return tail_cumprod(_bounded(_gather_at(p, ids) / _gather_at(q, ids), how) > u)

                def r_b(p, q, ids, u):
                    return npuspec_ops.ratio_accept(p, q, ids, torch.where(u < 1, u, float("nan")), "gt")

                out.append(Spelling(f"bounded_{how}_gt", _bind(s_b, how=how), r_b, ex))
        return out

    def extra_check(self, match) -> bool:
        if not self.config.enabled:
            return False
        p, ids = _val(match.kwargs.get("p")), _val(match.kwargs.get("ids"))
        q = _val(match.kwargs["q"]) if "q" in match.kwargs else None
        u = _val(match.kwargs["u"]) if "u" in match.kwargs else None
        if p is None or ids is None or ("q" in match.kwargs and q is None):
            return False
        if ids.dtype != torch.int64 or p.dtype not in FLOATS:
            return False
        if p.dim() != 3 or ids.dim() != 2 or not (_static_shape(p) and _static_shape(ids)):
            return False
        B, K = ids.shape
        if q is not None and (q.dtype != p.dtype or q.dim() != 3 or q.shape[2] != p.shape[2]
                              or not _eq_shape(q.shape[:2], (B, K))):
            return False
        hf = any(n.target is torch.ops.aten.index.Tensor for n in match.nodes)
        if hf:  # HF spelling: B == 1, p carries the bonus row too, u is [K]
            u_shape, p_ok = (K,), _eq_shape((B, p.shape[0]), (1, 1)) and p.shape[1] >= K
        else:
            u_shape, p_ok = (B, K), _eq_shape(p.shape[:2], (B, K))
        if "u" not in match.kwargs:  # the draw is inside the pattern (made in p's dtype)
            return p_ok and _draw_order_ok(match)
        return (p_ok and u is not None and u.is_floating_point()
                and _eq_shape(u.shape, u_shape))


# --------------------------------------------------------------------------------------------
# 4. residual resample -> npuspec::residual_sample / npuspec::residual_probs
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ResidualConfig:
    enabled: bool = True
    normalize: tuple = ("none", "row", "all")
    samplers: tuple = ("race", "gumbel", "multinomial")


def _resid(p, q, normalize, clamp):
    r = torch.clamp(p - q, min=0) if clamp == "clamp" else (p - q).clamp_min(0)
    if normalize == "row":
        r = r / r.sum(dim=-1, keepdim=True)
    elif normalize == "all":
        r = r / r.sum()
    return r


class Residual(VerifyPattern):
    """Sampling from the residual distribution max(p - q, 0) after a rejection:

        r = torch.clamp(p - q, min=0)           # or (p - q).clamp_min(0)
        r = r / r.sum(-1, keepdim=True)         # optional ("row"), or r / r.sum() ("all")
        tok = (r / E).argmax(-1)                # exponential race, E ~ Exp(1) drawn by the user
        tok = (r.log() + G).argmax(-1)          # Gumbel-max, G drawn by the user
        tok = torch.multinomial(r, 1)           # multinomial (the user's op is kept)

    Race and Gumbel become `npuspec::residual_sample(p, q, noise, normalize, sampler)`;
    multinomial becomes `torch.multinomial(npuspec::residual_probs(p, q, normalize), 1)`, so
    the multinomial draws the same numbers from the same generator. p, q, noise must share
    one float dtype; p and q one shape."""

    name = "residual"
    Config = ResidualConfig

    def spellings(self):
        out = []
        ex = lambda: [torch.rand(2, 9), torch.rand(2, 9), torch.rand(2, 9) + 0.1]  # noqa: E731
        ex2 = lambda: [torch.rand(2, 9), torch.rand(2, 9)]  # noqa: E731
        for norm, sampler, clamp in itertools.product(self.config.normalize, self.config.samplers,
                                                      ("clamp", "clamp_min")):
            if sampler == "multinomial":
                def s(p, q, norm, clamp):
                    return torch.multinomial(_resid(p, q, norm, clamp), 1)

                def r(p, q, norm):
                    return torch.multinomial(npuspec_ops.residual_probs(p, q, norm), 1)

                out.append(Spelling(f"{sampler}_{norm}_{clamp}", _bind(s, norm=norm, clamp=clamp),
                                    _bind(r, norm=norm), ex2))
                continue

            def s(p, q, noise, norm, sampler, clamp):
                res = _resid(p, q, norm, clamp)
                score = res / noise if sampler == "race" else res.log() + noise
                return score.argmax(dim=-1)

            def r(p, q, noise, norm, sampler):
                return npuspec_ops.residual_sample(p, q, noise, norm, sampler)

            out.append(Spelling(f"{sampler}_{norm}_{clamp}",
                                _bind(s, norm=norm, sampler=sampler, clamp=clamp),
                                _bind(r, norm=norm, sampler=sampler), ex))
        return out

    def extra_check(self, match) -> bool:
        if not self.config.enabled:
            return False
        p, q = _val(match.kwargs["p"]), _val(match.kwargs["q"])
        noise = _val(match.kwargs["noise"]) if "noise" in match.kwargs else None
        if p is None or q is None or ("noise" in match.kwargs and noise is None):
            return False
        if p.dtype not in FLOATS or q.dtype != p.dtype or not _eq_shape(p.shape, q.shape) or p.dim() < 1:
            return False
        if noise is not None and (noise.dtype != p.dtype or not _noise_fits(noise.shape, p.shape)):
            return False
        if "noise" not in match.kwargs and p.dim() not in (1, 2):  # multinomial takes 1-D/2-D
            return False
        return True


def _noise_fits(noise, p) -> bool:
    """noise has p's shape, or broadcasts to it without growing it (per-request noise
    [B, 1, V] for a [B, K, V] residual, as vllm-ascend's PyTorch path draws it); the op
    divides by it exactly as the user's broadcast does."""
    return len(noise) == len(p) and all(
        _eq_shape((n,), (d,)) or (isinstance(n, int) and n == 1) for n, d in zip(noise, p)) and \
        _eq_shape(noise[-1:], p[-1:])


# The library, supersets first (the manager's order).
def default_patterns() -> list[VerifyPattern]:
    from npuspec.passes.patterns_sample import OTHER_MODES, SampleVerify, SampleVerifyConfig
    other = SampleVerifyConfig(modes=OTHER_MODES, ratios=("plain", "min", "clamp", "full1"))
    return [GreedyVerify(), SampleVerify(), SampleVerify(other), GreedyAccept(), RatioAccept(),
            Residual()]


__all__ = ["VerifyPattern", "Spelling", "GreedyVerify", "GreedyAccept", "RatioAccept", "Residual",
           "GreedyVerifyConfig", "GreedyAcceptConfig", "RatioAcceptConfig", "ResidualConfig",
           "default_patterns", "TAILS"]
