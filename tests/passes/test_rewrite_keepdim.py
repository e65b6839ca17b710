"""passes/rewrites/keepdim.py: argmax/argmin(keepdim=True) as the plain reduction plus an
unsqueeze, and gpt-fast's residual sample then fuses, three ways under both lowerings."""
from __future__ import annotations

import pytest
import torch
from passes_helpers import aten_graph, three_way

from npuspec.passes.rewrites import keepdim

NAN = float("nan")
aten = torch.ops.aten


def _x():
    x = torch.tensor([[[1.0, 3.0, 3.0, 0.0], [NAN, 2.0, NAN, 5.0], [-0.0, 0.0, -1.0, -1.0]],
                      [[2.0, 2.0, 2.0, 2.0], [0.0, -0.0, 0.0, 1.0], [4.0, NAN, 4.0, 9.0]]])
    return x  # ties, NaN, signed zeros: [2, 3, 4]


SQUEEZED = {  # every user squeezes the kept dim: rewritten
    "argmax_squeezed": lambda x: x.argmax(-1, keepdim=True).squeeze(-1),
    "argmax_squeezed_2": lambda x: x.argmax(2, keepdim=True).squeeze(-1) + 1,
    "argmin_squeezed_dims": lambda x: torch.argmin(x, dim=0, keepdim=True).squeeze((0,)),
    "argmax_mid_twice": lambda x: (lambda a: (a.squeeze(1), a.squeeze(-2) * 2))(
        x.argmax(1, keepdim=True)),
}
KEPT = {  # the kept dim is read (or not a literal dim): left as written
    "argmax_last": lambda x: x.argmax(-1, keepdim=True),
    "argmax_other_squeeze": lambda x: x.argmax(1, keepdim=True).squeeze(0),
    "argmax_squeeze_and_cast": lambda x: (lambda a: (a.squeeze(-1), a.float()))(
        x.argmax(-1, keepdim=True)),
    "block_count": lambda x: 3 - x.flip(dims=[-1]).argmax(dim=-1, keepdim=True) - 1,
    "flattened": lambda x: x.argmax(keepdim=True),
    "no_keepdim": lambda x: x.argmax(-1),
}


def _run(fn, x):
    gm = aten_graph(fn, x)
    n = keepdim.apply(gm.graph, "aten")
    gm.graph.eliminate_dead_code()
    gm.recompile()
    want, got = fn(x), gm(x)
    for w, g in zip(want if isinstance(want, tuple) else (want,),
                    got if isinstance(got, tuple) else (got,)):
        assert w.dtype == g.dtype and w.shape == g.shape and torch.equal(w, g)
    return n, gm


@pytest.mark.parametrize("name", sorted(SQUEEZED))
def test_rewrite_is_exact(name):
    n, gm = _run(SQUEEZED[name], _x())
    assert n == 1
    for node in gm.graph.nodes:  # no keepdim reduction and no squeeze left
        assert node.target not in (aten.squeeze.dim, aten.squeeze.dims)
        assert not (node.target in (aten.argmax.default, aten.argmin.default)
                    and len(node.args) > 2 and node.args[2])


@pytest.mark.parametrize("name", sorted(KEPT))
def test_left_alone(name):
    n, _ = _run(KEPT[name], _x())
    assert n == 0


def _greedy_step(logits, drafts):
    target = logits.argmax(dim=-1, keepdim=True).squeeze(-1)
    n = (drafts == target[:, :-1]).cumprod(dim=-1).sum(dim=-1)
    pos = torch.arange(target.shape[1], device=logits.device)
    return torch.where(pos[None, :] <= n[:, None], target, -1), n


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
def test_greedy_step_with_keepdim_argmax_fuses_three_ways(lowering, no_fx_cache):
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 5, 17, generator=g)
    logits[0, 1, :4] = 9.0  # a tie: the first index wins on both sides
    drafts = logits[:, :4].argmax(-1)
    drafts[1, 2] = (drafts[1, 2] + 1) % 17
    three_way(_greedy_step, (logits, drafts), lowering=lowering, family="greedy_verify",
              appear=("npuspec.rejection_sample",), gone=("aten.argmax",))
    assert three_way.last_delta.get("canonical_rewrites.keepdim", 0) == 1
