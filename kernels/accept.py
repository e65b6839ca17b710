"""Narrow verify ops: the pieces of a verify step that npuspec's passes fuse on their own.

When a user's graph holds only part of a verify step (the graph broke at `if n_matches < gamma:`,
or the user computes the emitted tokens their own way), the passes rewrite that part into one
of these ops instead of the whole `npuspec::rejection_sample`:

    greedy_accept(draft_ids, target_ids)            -> int64 [...]   accepted-prefix length
    ratio_accept(p, q, draft_ids, uniforms, mode)   -> int64 [...]   standard test, prefix length
    residual_probs(p, q, normalize, nonneg, floor)  -> float [..., V] clamp(p - q, floor) (normalised)
    residual_sample(p, q, noise, normalize, sampler, nonneg, floor, guard, fill)
                                                    -> int64 [...]   exponential race / Gumbel-max

Every op is a pure function of its tensor inputs (random draws come in as tensors, so the user's
own draws are kept) and is registered with `torch.library.custom_op` plus a fake impl, so it can
sit inside captured graphs and Inductor treats it as an opaque call. The arithmetic of each op is
written to be *bit-identical* to the PyTorch idioms it replaces (same float ops, same order, same
reductions): `*_ref` is that idiom, spelled the plainest way, and the tests compare op and
reference with `torch.equal`.

Prefix length: for a bool row a[0..K-1], the number of leading Trues. All spellings users write
(`a.cumprod(-1).sum(-1)`, `((~a).cumsum(-1) < 1).sum(-1)`, `a.int().cummin(-1).values.sum(-1)`)
compute exactly this, so one op serves them all.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from npuspec.kernels.verify_probs import ACCEPT_MODES

NORMALIZE = ("none", "row", "all")  # residual normalisation: none, r / r.sum(-1, keepdim), r / r.sum()
# argmax(r / E) ; argmax(log(r) + G) ; argmax(r * W) with W = 1 / E drawn by the user (LMDeploy
# multiplies by E.reciprocal(), which rounds differently from dividing by E)
SAMPLERS = ("race", "gumbel", "race_mul")
# how max(d, 0) is written, d = p - q: torch.clamp(d, min=0) keeps a NaN (and -0.0);
# torch.where(d > 0, d, 0.0) makes both +0.0 (gpt-fast, romsto, feifeibear write it so);
# "none": d as it is (a one-hot draft's residual, p with the draft's entry zeroed by the user,
# raced as p - 0.0, which is p bit for bit)
NONNEG = ("clamp", "where", "none")
# draws the race leaves out: "zero_inf" scores `fill` wherever E == 0 or E is infinite, as
# vllm-ascend's sample_recovered_tokens_pytorch guards its q (1e-10 divisor, then -1e10)
GUARDS = ("none", "zero_inf")


# ---------------------------------------------------------------------------------------------
# prefix length of a bool mask
# ---------------------------------------------------------------------------------------------
def _prefix_len(ok: Tensor) -> Tensor:
    """ok: bool [..., K] -> int64 [...], the number of leading Trues per row.

    Fused form: the index of the first False (argmax of the mismatch mask), or K if none.
    """
    k = ok.shape[-1]
    if k == 0:
        return torch.zeros(ok.shape[:-1], dtype=torch.int64, device=ok.device)
    bad = ~ok  # [..., K]
    first = bad.to(torch.uint8).argmax(-1)  # [...] first False (0 when none)
    return torch.where(bad.any(-1), first, torch.full_like(first, k))


def prefix_len_ref(ok: Tensor) -> Tensor:
    return ok.to(torch.int64).cumprod(-1).sum(-1)


# ---------------------------------------------------------------------------------------------
# greedy accept length
# ---------------------------------------------------------------------------------------------
def _check_ids(name: str, t: Tensor) -> None:
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"npuspec.kernels.{name}: token ids must be int32 or int64, got {t.dtype}; "
                        f"cast them with .long()")


@torch.library.custom_op("npuspec::greedy_accept", mutates_args=())
def greedy_accept(draft_ids: Tensor, target_ids: Tensor) -> Tensor:
    """draft_ids, target_ids: int [..., K] (same shape; int32 and int64 may mix, as `==`
    compares their values exactly) -> int64 [...].

    The number of leading positions where the draft equals the target's choice (a -1 draft never
    equals a token id, so it ends the prefix)."""
    _check_ids("greedy_accept", draft_ids)
    _check_ids("greedy_accept", target_ids)
    assert draft_ids.shape == target_ids.shape, (draft_ids.shape, target_ids.shape)
    return _prefix_len(draft_ids == target_ids)


@greedy_accept.register_fake
def _(draft_ids, target_ids):
    return draft_ids.new_empty(draft_ids.shape[:-1], dtype=torch.int64)


def greedy_accept_ref(draft_ids: Tensor, target_ids: Tensor) -> Tensor:
    return prefix_len_ref(draft_ids == target_ids)


# ---------------------------------------------------------------------------------------------
# standard (ratio) accept length
# ---------------------------------------------------------------------------------------------
def _at_ids(p: Tensor, ids: Tensor) -> Tensor:
    """p: [..., K, V], ids: [..., K] -> p[..., k, ids[..., k]]  [..., K]. A p of one value per
    position ([..., K, 1], broadcast over V, as the composed mode takes the test's q from a pick
    the user already made) gives that value whatever the id."""
    if p.shape[-1] == 1:
        return p[..., 0].expand(ids.shape)
    return p.gather(-1, ids.unsqueeze(-1)).squeeze(-1)


# How a position's test is written: ACCEPT_MODES, the accept predicate over (ratio, u), shared
# with the verify op's probability mode. Each is evaluated exactly as written, so NaN goes where
# it goes in eager: `u <= ratio` / `ratio >= u` rejects a NaN, while `~(u > ratio)` (code that
# keeps the rejections) accepts it.


@torch.library.custom_op("npuspec::ratio_accept", mutates_args=())
def ratio_accept(p: Tensor, q: Optional[Tensor], draft_ids: Tensor, uniforms: Tensor,
                 mode: str = "ge") -> Tensor:
    """p, q: float [..., K, V] target/draft probs (q None: one-hot drafts), draft_ids int64 [..., K],
    uniforms float [..., K] -> int64 [...] accepted-prefix length.

    Position k is accepted iff ACCEPT_MODES[mode](p(x)/q(x), u) (q None: p(x) in place of
    the ratio), evaluated exactly as the user's expression is in eager: one float division,
    one comparison. With the default "ge", NaN ratios (0/0) reject."""
    return accept_len(p, q, draft_ids, uniforms, mode)


def accept_len(p: Tensor, q: Optional[Tensor], draft_ids: Tensor, uniforms: Tensor,
               mode: str = "ge") -> Tensor:
    """`ratio_accept`'s arithmetic, callable inside other ops (rejection_sample's composed
    mode) -> int64 [...]."""
    assert draft_ids.dtype == torch.int64, draft_ids.dtype
    assert mode in ACCEPT_MODES, mode
    px = _at_ids(p, draft_ids)  # [..., K]
    ratio = px if q is None else px / _at_ids(q, draft_ids)
    return _prefix_len(ACCEPT_MODES[mode](ratio, uniforms))


@ratio_accept.register_fake
def _(p, q, draft_ids, uniforms, mode="ge"):
    return draft_ids.new_empty(draft_ids.shape[:-1], dtype=torch.int64)


def ratio_accept_ref(p: Tensor, q: Optional[Tensor], draft_ids: Tensor, uniforms: Tensor,
                     mode: str = "ge") -> Tensor:
    px = p.gather(-1, draft_ids[..., None])[..., 0]
    ratio = px if q is None else px / torch.broadcast_to(q, p.shape).gather(
        -1, draft_ids[..., None])[..., 0]
    ok = {"ge": lambda: uniforms <= ratio, "gt": lambda: uniforms < ratio,
          "not_lt": lambda: ~(uniforms > ratio), "not_le": lambda: ~(uniforms >= ratio)}[mode]()
    return prefix_len_ref(ok)


# ---------------------------------------------------------------------------------------------
# residual distribution and residual sampling
# ---------------------------------------------------------------------------------------------
def _residual(p: Tensor, q: Tensor, normalize: str, nonneg: str = "clamp",
              floor: float = 0.0) -> Tensor:
    """max(p - q, floor) [normalised], computed in one buffer: the in-place ops give the same
    values as the out-of-place idiom, without two extra [..., V] allocations. nonneg="where"
    writes +0.0 wherever d > 0 fails (NaN too), as where(d > 0, d, 0.0) does; floor is
    clamp's min (vLLM v1's forward_native clamps the residual at 1e-5), "clamp" only."""
    if normalize not in NORMALIZE:
        raise ValueError(f"npuspec.kernels.residual: normalize={normalize!r} must be one of {NORMALIZE}")
    if nonneg not in NONNEG:
        raise ValueError(f"npuspec.kernels.residual: nonneg={nonneg!r} must be one of {NONNEG}")
    if nonneg != "clamp" and floor != 0:
        raise ValueError(f"npuspec.kernels.residual: floor={floor!r} needs nonneg='clamp' (the "
                         f"{nonneg!r} form takes no floor); pass floor=0.0 or nonneg='clamp'")
    r = torch.sub(p, q)  # [..., V]
    if nonneg == "clamp":
        r.clamp_min_(floor)
    elif nonneg == "where":
        r.masked_fill_(r.gt(0).logical_not_(), 0.0)
    if normalize == "row":
        r.div_(r.sum(-1, keepdim=True))
    elif normalize == "all":
        r.div_(r.sum())
    return r


@torch.library.custom_op("npuspec::residual_probs", mutates_args=())
def residual_probs(p: Tensor, q: Tensor, normalize: str, nonneg: str = "clamp",
                   floor: float = 0.0) -> Tensor:
    """max(p - q, floor), then divided by its row sum ("row"), by its total ("all") or not
    ("none"). Feeds the user's own `torch.multinomial`, so the user's RNG stream is consumed
    unchanged. nonneg: how max(., 0) is spelled (NONNEG), which decides where NaN goes."""
    return _residual(p, q, normalize, nonneg, floor)


@residual_probs.register_fake
def _(p, q, normalize, nonneg="clamp", floor=0.0):
    return torch.empty_like(torch.broadcast_tensors(p, q)[0], dtype=torch.promote_types(p.dtype, q.dtype))


def residual_probs_ref(p: Tensor, q: Tensor, normalize: str, nonneg: str = "clamp",
                       floor: float = 0.0) -> Tensor:
    d = p - q
    r = (d.clamp(min=floor) if nonneg == "clamp" else d if nonneg == "none"
         else torch.where(d > 0, d, torch.zeros_like(d)))
    if normalize == "row":
        r = r / r.sum(dim=-1, keepdim=True)
    elif normalize == "all":
        r = r / r.sum()
    return r


def residual_score(r: Tensor, noise: Tensor, sampler: str, guard: str = "none",
                   fill: float = 0.0) -> Tensor:
    """The race's score from a residual r (consumed when the shapes allow): r / E, r * W or
    log(r) + G; guard "zero_inf": `fill` where E == 0 or isinf(E). Its argmax is the token; the
    recovered-token check (passes/residual_proof.py) compares this score with the user's."""
    if sampler not in SAMPLERS:
        raise ValueError(f"npuspec.kernels.residual_sample: sampler={sampler!r} must be one of {SAMPLERS}")
    if guard not in GUARDS:
        raise ValueError(f"npuspec.kernels.residual_sample: guard={guard!r} must be one of {GUARDS}")
    if guard != "none" and sampler != "race":
        raise ValueError(f"npuspec.kernels.residual_sample: guard={guard!r} needs sampler='race' "
                         f"(got {sampler!r}); pass guard='none'")
    if r.shape != torch.broadcast_shapes(r.shape, noise.shape) or r.dtype != torch.promote_types(
            r.dtype, noise.dtype):
        score = {"race": lambda: r / noise, "race_mul": lambda: r * noise,
                 "gumbel": lambda: torch.log(r) + noise}[sampler]()
    elif sampler == "race":
        score = r.div_(noise)
    elif sampler == "race_mul":
        score = r.mul_(noise)
    else:
        score = r.log_().add_(noise)
    if guard == "zero_inf":
        score = torch.where(noise.eq(0) | noise.isinf(), fill, score)
    return score


@torch.library.custom_op("npuspec::residual_sample", mutates_args=())
def residual_sample(p: Tensor, q: Tensor, noise: Tensor, normalize: str, sampler: str,
                    nonneg: str = "clamp", floor: float = 0.0, guard: str = "none",
                    fill: float = 0.0) -> Tensor:
    """One token per row from the residual max(p - q, 0) using the caller's draws:
    sampler "race": argmax(r / E) with E ~ Exp(1) [..., V]; "race_mul": argmax(r * W) with
    W = 1 / E; "gumbel": argmax(log(r) + G) with G ~ Gumbel(0, 1) [..., V]; nonneg: how
    max(., 0) is spelled (NONNEG); floor: clamp's min; guard/fill: draws scored `fill`
    (GUARDS). -> int64 [...]"""
    r = _residual(p, q, normalize, nonneg, floor)  # [..., V]
    return residual_score(r, noise, sampler, guard, fill).argmax(-1)


@residual_sample.register_fake
def _(p, q, noise, normalize, sampler, nonneg="clamp", floor=0.0, guard="none", fill=0.0):
    shape = torch.broadcast_shapes(p.shape, q.shape, noise.shape)
    return p.new_empty(shape[:-1], dtype=torch.int64)


def residual_sample_ref(p: Tensor, q: Tensor, noise: Tensor, normalize: str, sampler: str,
                        nonneg: str = "clamp", floor: float = 0.0, guard: str = "none",
                        fill: float = 0.0) -> Tensor:
    r = residual_probs_ref(p, q, normalize, nonneg, floor)
    if sampler == "race":
        score = r / noise
        if guard == "zero_inf":  # vllm-ascend's spelling: a safe divisor, then the fill
            safe = torch.where(noise == 0, 1e-10, noise)
            safe = torch.where(torch.isinf(noise), 1e-10, safe)
            score = torch.where((noise == 0) | torch.isinf(noise), fill, r / safe)
        return torch.argmax(score, dim=-1)
    if sampler == "race_mul":
        return torch.argmax(r * noise, dim=-1)
    return torch.argmax(r.log() + noise, dim=-1)


__all__ = ["greedy_accept", "ratio_accept", "residual_probs", "residual_sample", "residual_score",
           "greedy_accept_ref", "ratio_accept_ref", "residual_probs_ref", "residual_sample_ref",
           "prefix_len_ref"]
