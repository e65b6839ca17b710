"""What every verify-pattern family shares (passes/patterns.py lists the families): a spelling
(`Spelling`), the family base class (`VerifyPattern`, whose uuid hashes this module too), the
checks of a match's tensors, and the spellings that more than one family takes apart:

- the prefix-length tails: every spelling of "number of leading Trues" we recognise (`TAILS`)
- the ratio test's pieces: `_gather_at` (p at the drafted ids), `_bounded` (min(1, ratio) as
  gpt-fast, a clamp or vLLM v0 write it) and `MODE_SPELLINGS` (the other comparisons)

Literals (dims, slice bounds, scalars, dtypes) are checked exactly by the matcher after
`canonical.canonicalize`, and an intermediate with a user outside the pattern blocks the match,
so a near miss is left alone and still computes what the user wrote.
"""
from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
from typing import Callable

import torch
from torch import Tensor

import npuspec.kernels  # noqa: F401  (registers torch.ops.npuspec.*)
import npuspec.kernels.accept  # noqa: F401
from npuspec.passes.hashing import source_hash

npuspec_ops = torch.ops.npuspec
FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclasses.dataclass(frozen=True)
class Spelling:
    """One search function, its replacement and tiny example inputs to trace them with."""
    name: str
    search: Callable
    replace: Callable
    example: Callable[[], list]  # () -> example inputs (fresh tensors)
    # scalar parameters of search/replace matched as any literal (Inductor's scalar_workaround):
    # {name: the value they are traced with}; they follow the tensor inputs
    scalars: dict = dataclasses.field(default_factory=dict)


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
        """Hash of this family's source (its class and module, and this module of the helpers
        every family shares) and its config."""
        cfg = json.dumps(dataclasses.asdict(self.config), sort_keys=True, default=str)
        mods = {inspect.getmodule(type(self)), inspect.getmodule(VerifyPattern)}  # + shared helpers
        src = source_hash(type(self), *sorted(mods, key=lambda m: m.__name__))
        return hashlib.sha256(f"{self.name}|{src}|{cfg}".encode()).hexdigest()

    def __repr__(self):
        return f"{type(self).__name__}({self.config})"


# --------------------------------------------------------------------------------------------
# the ratio test's pieces (RatioAccept and SampleVerify)
# --------------------------------------------------------------------------------------------
def _gather_at(p, ids):          # p [B, K, V], ids [B, K] -> [B, K]
    return p.gather(-1, ids.unsqueeze(-1)).squeeze(-1)


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
