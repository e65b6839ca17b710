"""Residuals whose difference was made elsewhere: the field's `max_fn` frame and a row with its
rejected draft zeroed.

6. GivenResidual  max(d, 0) normalised, d a graph input        -> npuspec::residual_probs
                  multinomial(z / z.sum()), z a draft zeroed     -> multinomial(residual_probs)

(the manager's order, passes/patterns.py). Residual (patterns_ratio.py) matches the residual
where `p - q` is in the graph. Two spellings of the field keep it out:

- romsto's and feifeibear's whole steps call `max_fn(p[:, n] - q[:, n])` from a loop that
  breaks the graph on `if r < ...:`. Dynamo then runs the step eagerly and compiles
  `max_fn` as a frame of its own, whose input is the difference:

      x_max = torch.where(x > 0, x, torch.zeros_like(x))
      return x_max / torch.sum(x_max, dim=1, keepdim=True)

  With d a graph input this is `residual_probs(d, 0.0, "row", "where")`: d - 0.0 is d in
  every bit (NaN and -0.0 included), so the op computes the frame's values. A model's own
  `relu(h) / relu(h).sum()` computes h in its graph, so the input rule leaves it alone.
- EAGLE's sampled verify rejects candidate xi and draws from the target row with xi zeroed
  (`gtp[xi] = 0; gtp = gtp / gtp.sum(); torch.multinomial(gtp, 1)`): the residual of a
  one-hot draft, max(p - onehot(xi), 0), which for probabilities is p with xi set to 0. The
  user's zeroing stays; the normalisation becomes `residual_probs(z, 0.0, "all", "none")`
  (z - 0.0 is z; no clamp, so a negative or NaN entry stays as the user's division leaves
  it) and the multinomial stays the user's, drawing the same numbers. A plain
  `multinomial(p / p.sum())` is sampling, not a residual: z must be written by a scatter of
  zeros (select_scatter, index_put, scatter), which extra_check reads from the graph.
"""
from __future__ import annotations

import dataclasses
import itertools

import torch
from torch.fx import Node

from npuspec.passes.patterns_common import FLOATS, Spelling, VerifyPattern, _bind, _val, npuspec_ops
from npuspec.passes.rewrites import nonneg
from npuspec.passes.rowlocal import _name

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class GivenResidualConfig:
    enabled: bool = True
    normalize: tuple = ("row", "all")
    clamps: tuple = ("clamp", "clamp_min", "where")  # max_fn's max(x, 0), as Residual spells it
    zeroed: bool = True  # EAGLE's row with the rejected draft zeroed


def _positive(d, normalize, clamp):
    if clamp == "where":
        r = torch.where(d > 0, d, 0.0)
    else:
        r = torch.clamp(d, min=0) if clamp == "clamp" else d.clamp_min(0)
    return _normalised(r, normalize)


def _normalised(r, normalize):
    return r / r.sum(dim=-1, keepdim=True) if normalize == "row" else r / r.sum()


def _zero(x):
    return torch.zeros((), dtype=x.dtype, device=x.device)


# how a zeroing writes: (op name) -> index of the written value among its args
_WRITES = {"select_scatter": 1, "index_put": 2, "index_put_": 2, "_unsafe_index_put": 2,
           "scatter": 3}
# what the written value passes through on its way from a zero (`gtp[xi] = 0` becomes
# select_scatter(p, copy(select(p, 0, xi), lift_fresh_copy(c)), 0, xi)): copy reads its src
_THROUGH = {"copy": 1, "expand": 0, "_to_copy": 0, "convert_element_type": 0, "clone": 0,
            "view": 0, "reshape": 0, "unsqueeze": 0}


def _is_zero(v, graph, depth: int = 6) -> bool:
    """v is a literal 0, or a tensor of zeros (nonneg._is_zero) through copies, views, casts."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return v == 0
    while isinstance(v, Node) and depth and v.op == "call_function" and _name(v.target) in _THROUGH:
        v, depth = v.args[_THROUGH[_name(v.target)]], depth - 1
    return nonneg._is_zero(graph, v)


def _zeroed(z: Node) -> bool:
    """z writes zeros into a float tensor at indices (a rejected draft set to 0)."""
    if not isinstance(z, Node) or z.op != "call_function":
        return False
    at = _WRITES.get(_name(z.target))
    if at is None or len(z.args) <= at:
        return False
    if _name(z.target).startswith("index_put") or _name(z.target) == "_unsafe_index_put":
        accumulate = z.args[3] if len(z.args) > 3 else z.kwargs.get("accumulate", False)
        if accumulate:
            return False
    return _is_zero(z.args[at], z.graph)


class GivenResidual(VerifyPattern):
    """See the module docstring. p and the zeroed z must be float; multinomial takes 1-D/2-D."""

    name = "given_residual"
    Config = GivenResidualConfig

    def spellings(self):
        out = []
        ex = lambda: [torch.rand(2, 9) - 0.5]  # noqa: E731
        for norm, clamp in itertools.product(self.config.normalize, self.config.clamps):
            tail = ("where",) if clamp == "where" else ()

            def s(d, norm, clamp):
                return _positive(d, norm, clamp)

            def r(d, norm, tail):
                return npuspec_ops.residual_probs(d, _zero(d), norm, *tail)

            out.append(Spelling(f"max_fn_{norm}_{clamp}", _bind(s, norm=norm, clamp=clamp),
                                _bind(r, norm=norm, tail=tail), ex))
        if self.config.zeroed:
            for norm in self.config.normalize:
                def s(z, norm):
                    return torch.multinomial(_normalised(z, norm), 1)

                def r(z, norm):
                    return torch.multinomial(
                        npuspec_ops.residual_probs(z, _zero(z), norm, "none"), 1)

                out.append(Spelling(f"zeroed_multinomial_{norm}", _bind(s, norm=norm),
                                    _bind(r, norm=norm), lambda: [torch.rand(2, 9)]))
        return out

    def extra_check(self, match) -> bool:
        if not self.config.enabled:
            return False
        node = match.kwargs.get("d", match.kwargs.get("z"))
        v = _val(node)
        if v is None or v.dtype not in FLOATS or v.dim() < 1:
            return False
        if "d" in match.kwargs:  # the caller made the difference: a graph input
            return node.op == "placeholder"
        return v.dim() in (1, 2) and _zeroed(node)
