"""The ratio-test and residual families: the standard rejection test and the residual resample.

4. RatioAccept    p(x)/q(x) vs u + prefix length              -> npuspec::ratio_accept
5. Residual       max(p - q, 0) (clamp or where) [normalised] + race/Gumbel/multinomial
                                                              -> npuspec::residual_sample / residual_probs

(numbers: the manager's order, passes/patterns.py). Random draws are pattern *inputs*, so the
user's own torch.rand / exponential_ / Gumbel draws are kept; multinomial stays the user's op.
"""
from __future__ import annotations

import dataclasses
import itertools

import torch

from npuspec.passes.patterns_common import (FLOATS, MODE_SPELLINGS, TAILS, Spelling,
                                            VerifyPattern, _bind, _bounded, _draw_order_ok,
                                            _eq_shape, _gather_at, _static_shape, _tail_out,
                                            _val, npuspec_ops, tail_cumprod)


# --------------------------------------------------------------------------------------------
# 4. standard rejection test -> npuspec::ratio_accept
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RatioAcceptConfig:
    enabled: bool = True
    tails: tuple = ("cumprod", "cumprod_long", "cumsum_not", "cumsum_not_all", "cummin_int")
    one_hot: bool = True  # also match p(x) >= u without draft probs
    bounded: tuple = ("min", "clamp")  # gpt-fast's u <= min(1, p/q), and u <= (p/q).clamp(max=1)
    bounded_tails: tuple = ("cumprod", "cumsum_not")
    modes: tuple = ("gt", "not_lt", "not_le")  # comparison directions besides `ratio >= u`


def _unbounded_u(u):
    """u' with (ratio >= u') == (min(1, ratio) >= u) for every float: u <= min(1, r) holds iff
    u <= 1 and u <= r, and a NaN (in u or r) is false on both sides."""
    return torch.where(u <= 1, u, float("nan"))


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
# 5. residual resample -> npuspec::residual_sample / npuspec::residual_probs
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ResidualConfig:
    enabled: bool = True
    normalize: tuple = ("none", "row", "all")
    samplers: tuple = ("race", "race_mul", "gumbel", "multinomial", "probs")
    # max(d, 0) as written: torch.clamp(d, min=0), d.clamp_min(0), torch.where(d > 0, d, 0.0).
    # passes/rewrites/nonneg.py puts relu, maximum and the other where spellings into these
    # "floor": clamp(d, min=c) for any literal c (vLLM v1's forward_native: 1e-5)
    clamps: tuple = ("clamp", "clamp_min", "where", "floor")
    # samplers whose argmax is also matched with keepdim=True (gpt-fast's race)
    keepdim: tuple = ("race",)


FLOOR_EXAMPLE = 0.3125  # the literal a "floor" spelling is traced with; it matches any


def _resid(p, q, normalize, clamp, floor=0.0):
    d = p - q
    if clamp == "where":  # NaN -> +0.0: the ops' nonneg="where"
        r = torch.where(d > 0, d, 0.0)
    elif clamp == "floor":  # clamp(d, min=c) for any literal c (vLLM v1: 1e-5)
        r = d.clamp_min(floor)
    else:
        r = torch.clamp(d, min=0) if clamp == "clamp" else d.clamp_min(0)
    if normalize == "row":
        r = r / r.sum(dim=-1, keepdim=True)
    elif normalize == "all":
        r = r / r.sum()
    return r


def _op_tail(clamp, floor) -> tuple:
    """The ops' trailing (nonneg, floor) arguments for a clamp kind (defaults left out)."""
    return ("where",) if clamp == "where" else ("clamp", floor) if clamp == "floor" else ()


class Residual(VerifyPattern):
    """Sampling from the residual distribution max(p - q, 0) after a rejection:

        r = torch.clamp(p - q, min=0)           # or (p - q).clamp_min(0), or with d = p - q
                                                # torch.where(d > 0, d, 0.0) (NaN -> 0)
        r = r / r.sum(-1, keepdim=True)         # optional ("row"), or r / r.sum() ("all")
        tok = (r / E).argmax(-1)                # exponential race, E ~ Exp(1) drawn by the user
                                                # (also argmax(-1, keepdim=True), as gpt-fast)
        tok = (r * W).argmax(-1)                # the race against W = 1 / E (LMDeploy)
        tok = (r.log() + G).argmax(-1)          # Gumbel-max, G drawn by the user
        tok = torch.multinomial(r, 1)           # multinomial (the user's op is kept)
        r                                       # normalised, whoever reads it ("probs")

    Race and Gumbel become `npuspec::residual_sample(p, q, noise, normalize, sampler)`;
    multinomial becomes `torch.multinomial(npuspec::residual_probs(p, q, normalize), 1)`, so
    the multinomial draws the same numbers from the same generator. A normalised residual read
    by anything else (feifeibear's max_fn returned across a graph break to its sampler) becomes
    `npuspec::residual_probs(p, q, normalize)`: the op is its idiom's arithmetic, so any reader
    sees the same bits; an unnormalised one is a single elementwise op, left to the lowering.
    The where spelling maps
    a NaN of p - q to 0 where clamp keeps it: it becomes the ops' nonneg="where", which
    evaluates that where. p, q, noise must share one float dtype; p and q one shape."""

    name = "residual"
    Config = ResidualConfig

    def spellings(self):
        out = []
        ex = lambda: [torch.rand(2, 9), torch.rand(2, 9), torch.rand(2, 9) + 0.1]  # noqa: E731
        ex2 = lambda: [torch.rand(2, 9), torch.rand(2, 9)]  # noqa: E731

        def add(name, s, r, example, clamp, **fixed):
            # a floor kind keeps `floor` as a matched scalar; the others fix it at 0
            floor = {} if clamp == "floor" else {"floor": 0.0}
            out.append(Spelling(name, _bind(s, clamp=clamp, **fixed, **floor),
                                _bind(r, clamp=clamp, **fixed, **floor), example,
                                {"floor": FLOOR_EXAMPLE} if clamp == "floor" else {}))

        for norm, sampler, clamp in itertools.product(self.config.normalize, self.config.samplers,
                                                      self.config.clamps):
            name = f"{sampler}_{norm}_{clamp}"
            if sampler == "probs":
                if norm == "none":
                    continue

                def s(p, q, floor, norm, clamp):
                    return _resid(p, q, norm, clamp, floor)

                def r(p, q, floor, norm, clamp):
                    return npuspec_ops.residual_probs(p, q, norm, *_op_tail(clamp, floor))

                add(name, s, r, ex2, clamp, norm=norm)
                continue
            if sampler == "multinomial":
                def s(p, q, floor, norm, clamp):
                    return torch.multinomial(_resid(p, q, norm, clamp, floor), 1)

                def r(p, q, floor, norm, clamp):
                    return torch.multinomial(
                        npuspec_ops.residual_probs(p, q, norm, *_op_tail(clamp, floor)), 1)

                add(name, s, r, ex2, clamp, norm=norm)
                continue

            def s(p, q, noise, floor, norm, sampler, clamp, keep):
                res = _resid(p, q, norm, clamp, floor)
                score = {"race": lambda: res / noise, "race_mul": lambda: res * noise,
                         "gumbel": lambda: res.log() + noise}[sampler]()
                return score.argmax(dim=-1, keepdim=True) if keep else score.argmax(dim=-1)

            def r(p, q, noise, floor, norm, sampler, clamp, keep):
                tok = npuspec_ops.residual_sample(p, q, noise, norm, sampler,
                                                  *_op_tail(clamp, floor))
                return tok.unsqueeze(-1) if keep else tok  # the same indices, the dim kept

            for keep in (False, True) if sampler in self.config.keepdim else (False,):
                add(name + ("_keepdim" if keep else ""), s, r, ex, clamp, norm=norm,
                    sampler=sampler, keep=keep)
        return out

    def extra_check(self, match) -> bool:
        if not self.config.enabled:
            return False
        if "floor" in match.kwargs and type(match.kwargs["floor"]) not in (int, float):
            return False  # a literal only (not a SymFloat): the op takes it as a constant
        p, q = _val(match.kwargs["p"]), _val(match.kwargs["q"])
        noise = _val(match.kwargs["noise"]) if "noise" in match.kwargs else None
        if p is None or q is None or ("noise" in match.kwargs and noise is None):
            return False
        if p.dtype not in FLOATS or q.dtype != p.dtype or not _eq_shape(p.shape, q.shape) or p.dim() < 1:
            return False
        if noise is not None and (noise.dtype != p.dtype or not _noise_fits(noise.shape, p.shape)):
            return False
        if p.dim() not in (1, 2) and any(n.target is torch.ops.aten.multinomial.default
                                         for n in match.nodes):  # multinomial takes 1-D/2-D
            return False
        return True


def _noise_fits(noise, p) -> bool:
    """noise has p's shape, or broadcasts to it without growing it (per-request noise
    [B, 1, V] for a [B, K, V] residual, as vllm-ascend's PyTorch path draws it); the op
    divides by it exactly as the user's broadcast does."""
    return len(noise) == len(p) and all(
        _eq_shape((n,), (d,)) or (isinstance(n, int) and n == 1) for n, d in zip(noise, p)) and \
        _eq_shape(noise[-1:], p[-1:])
