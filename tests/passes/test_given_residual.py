"""GivenResidual (passes/patterns_given.py): max_fn's own frame and EAGLE's zeroed row.

Each fusing case three ways: equal to eager (tokens and probabilities, bit for bit), the op in
the graph and the user's arithmetic gone, `verify_patterns_matched.given_residual` moved. The
near misses (a residual made inside the graph some other way, plain sampling, a row zeroed
with something other than 0, an accumulating index_put) stay as written and equal eager.
"""
from __future__ import annotations

import pytest
import torch

from passes_helpers import three_way

V = 37


def _diff(b=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(b, V, generator=g), -1)
    q = torch.softmax(torch.randn(b, V, generator=g), -1)
    return p - q


# -- max_fn as romsto and feifeibear write it, compiled as a frame of its own ----------------
def max_fn_where(x):
    x_max = torch.where(x > 0, x, torch.zeros_like(x))
    return x_max / torch.sum(x_max, dim=1, keepdim=True)


def max_fn_relu_sample(x):
    # relu's zero signs and NaN payloads differ from clamp's under Inductor, so it is put into
    # the clamp form only where a multinomial reads it (passes/rewrites/nonneg.py)
    r = torch.relu(x)
    return torch.multinomial(r / r.sum(-1, keepdim=True), 1)


def max_fn_clamp_all(x):
    r = x.clamp(min=0)
    return r / r.sum()


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
@pytest.mark.parametrize("fn", [max_fn_where, max_fn_clamp_all])
def test_max_fn_frame(fn, lowering, no_fx_cache):
    d = _diff()
    d[0, :3] = torch.tensor([-0.0, 0.0, -1.0])  # signed zeros as given
    if fn is max_fn_where:  # where maps NaN to 0 (relu and clamp keep it: torch.equal fails)
        d[1, 5] = float("nan")
    three_way(fn, (d,), lowering=lowering, family="given_residual",
              appear=["npuspec.residual_probs"], gone=["aten.div", "aten.sum"])


def max_fn_then_sample(x):
    return torch.multinomial(max_fn_where(x), 1)


@pytest.mark.parametrize("fn", [max_fn_then_sample, max_fn_relu_sample])
def test_max_fn_then_multinomial_keeps_the_draws(fn):
    three_way(fn, (_diff(4, seed=3),), family="given_residual",
              appear=["npuspec.residual_probs", "aten.multinomial"], gone=["aten.relu"], seed=5)


# -- EAGLE's sampled verify: the target row with the rejected candidate zeroed -----------------
def eagle_row(gt_logits, xi: int):
    gtp = torch.softmax(gt_logits, dim=0)
    gtp[xi] = 0
    gtp = gtp / gtp.sum()
    return torch.multinomial(gtp, 1)


def eagle_rows(logits, xi):
    # the batched spelling: one rejected candidate per request, zeroed with index_put
    p = torch.softmax(logits, dim=-1)
    p = p.index_put((torch.arange(p.shape[0]), xi), torch.zeros(()))
    return torch.multinomial(p / p.sum(-1, keepdim=True), 1)


def eagle_rows_scatter(logits, xi):
    p = torch.softmax(logits, dim=-1).scatter(1, xi[:, None], 0.0)
    return torch.multinomial(p / p.sum(dim=1, keepdim=True), 1)


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_eagle_row(seed, lowering, no_fx_cache):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(V, generator=g) * 3
    xi = int(logits.argmax())  # the likeliest token rejected: the draw must avoid it
    out, _ = three_way(eagle_row, (logits, xi), lowering=lowering, family="given_residual",
                       appear=["npuspec.residual_probs", "aten.multinomial"], seed=seed)
    assert int(out) != xi


@pytest.mark.parametrize("fn", [eagle_rows, eagle_rows_scatter])
def test_eagle_rows_batched(fn):
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(5, V, generator=g) * 3
    xi = logits.argmax(-1)
    out, _ = three_way(fn, (logits, xi), family="given_residual",
                       appear=["npuspec.residual_probs", "aten.multinomial"], seed=9)
    assert not bool((out[:, 0] == xi).any())


# -- near misses: left as written -------------------------------------------------------------
def relu_in_graph(h):  # a model's own normalised relu: h is made in the graph
    r = torch.relu(h * 2.0)
    return r / r.sum(-1, keepdim=True)


def plain_sampling(logits):
    p = torch.softmax(logits, dim=-1)
    return torch.multinomial(p / p.sum(-1, keepdim=True), 1)


def zeroed_with_half(gt_logits, xi: int):
    gtp = torch.softmax(gt_logits, dim=0)
    gtp[xi] = 0.5
    return torch.multinomial(gtp / gtp.sum(), 1)


def accumulated(logits, xi):
    p = torch.softmax(logits, dim=-1)
    p = p.index_put((torch.arange(p.shape[0]), xi), torch.zeros(()), accumulate=True)
    return torch.multinomial(p / p.sum(-1, keepdim=True), 1)


@pytest.mark.parametrize("case", ["relu_in_graph", "plain_sampling", "zeroed_with_half",
                                  "accumulated"])
def test_near_misses_stay(case):
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, V, generator=g)
    fn, args = {"relu_in_graph": (relu_in_graph, (logits,)),
                "plain_sampling": (plain_sampling, (logits,)),
                "zeroed_with_half": (zeroed_with_half, (logits[0], 3)),
                "accumulated": (accumulated, (logits, logits.argmax(-1)))}[case]
    three_way(fn, args, matched=0, gone=["npuspec.residual_probs"], seed=2)
