"""A batch Dynamo made dynamic (a server's batch changes; Dynamo recompiles with a symbolic
batch) keeps the fusion. Four rewrites had required static sizes and so lost it on held-out
code (the batch dim marked dynamic on every input: 42 of the 47 entries fused statically
still fused; now 47): `sum_keepdim` (vLLM v0's `f / f.sum(-1).reshape(-1, k, 1)`), the picks'
trailing-one views and fresh `zeros_like` draws (lucidrains' einops picks and
`zeros_like(q).uniform_()`), and the advanced-index pick `p[arange(B)[:, None], arange(K),
ids]` (vLLM v0's sampler), whose symbolic `arange(B)` is recognised by its structure; and
`leading_dims` (EAGLE's and ReDrafter's [B, C, K] paths), whose view back to [B, C] takes the
batch's symbol input. Each:
equal to eager, the op in the graph, the counter moved, at a first batch size, at a second
(Dynamo's recompile with a symbolic batch) and at a third (the same graph); and a look-alike
stays as written."""
from __future__ import annotations

import pytest
import torch
from passes_helpers import three_way

from npuspec import counters


def v0_recovered(target_probs, draft_probs):
    k = draft_probs.shape[1]
    f = torch.clamp(target_probs - draft_probs, min=torch.finfo(torch.float32).tiny)
    return f / torch.sum(f, dim=-1).reshape(-1, k, 1)


def lucidrains_ratio(p, q, ids3):
    B, K = ids3.shape[:2]
    px = p[:, :K].gather(-1, ids3).reshape(B, K)
    qx = q.gather(-1, ids3).reshape(B, K)
    u = torch.zeros_like(qx).uniform_()
    return ((u > px / qx).cumsum(-1) == 0).sum(-1)


def v0_index_ratio(p, q, ids, u):
    # as vLLM v0's sampler: the batch from the draft probs, the target's first K rows beside
    # them (which ties the two batches together for Dynamo)
    B, K, _ = q.shape
    target = p[:, :K]
    rows, cols = torch.arange(B)[:, None], torch.arange(K)
    px, qx = target[rows, cols, ids], q[rows, cols, ids]
    return (u < px / qx).cumprod(-1).sum(-1), (target - q).amax(-1)


def eagle_batched_greedy(logits, candidates):  # [B, C, K+1, V], [B, C, K+1]: every path
    mask = (candidates[:, :, 1:] == torch.argmax(logits[:, :, :-1], dim=-1)).int()
    accept = torch.cumprod(mask, dim=-1).sum(dim=-1)                          # [B, C]
    return accept.max(dim=1).values, torch.argmax(accept, dim=-1)


def flipped_rows(p, q, ids, u):  # rows reversed: not the pick, must stay as written
    B, K, _ = q.shape
    target = p[:, :K]
    rows, cols = torch.arange(B).flip(0)[:, None], torch.arange(K)
    px, qx = target[rows, cols, ids], q[rows, cols, ids]
    return (u < px / qx).cumprod(-1).sum(-1), (target - q).amax(-1)


def _args(name: str, B: int):
    g = torch.Generator().manual_seed(B)
    K, V = 4, 32
    p = torch.softmax(torch.randn(B, K + 1, V, generator=g), -1)
    q = torch.softmax(torch.randn(B, K, V, generator=g), -1)
    ids = torch.randint(0, V, (B, K), generator=g)
    u = torch.rand(B, K, generator=g)
    if name == "v0_recovered":
        return p[:, :K].contiguous(), q
    if name == "lucidrains_ratio":
        return p, q, ids[..., None]
    if name == "eagle_batched_greedy":  # 3 paths per request, some drafts the argmax
        logits = torch.randn(B, 3, K + 1, V, generator=g)
        cand = torch.cat([torch.zeros(B, 3, 1, dtype=torch.long), logits.argmax(-1)[..., :-1]], -1)
        cand[0, 1, 2] += 1
        cand[:, 2, 1] += 1
        return logits, cand
    return p, q, ids, u


CASES = {"v0_recovered": (v0_recovered, "residual", "npuspec.residual_probs"),
         "lucidrains_ratio": (lucidrains_ratio, "ratio_accept", "npuspec.ratio_accept"),
         "v0_index_ratio": (v0_index_ratio, "ratio_accept", "npuspec.ratio_accept"),
         "eagle_batched_greedy": (eagle_batched_greedy, "greedy_accept", "npuspec.greedy_accept")}


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
@pytest.mark.parametrize("name", list(CASES))
def test_a_symbolic_batch_keeps_the_fusion(name, lowering, no_fx_cache):
    fn, family, op = CASES[name]
    torch._dynamo.reset()
    cf = torch.compile(fn, backend="npuspec", options={"lowering": lowering, "capture": False})
    three_way(fn, _args(name, 5), compiled=cf, fresh=True, family=family, appear=(op,),
              lowering=lowering)                       # the first graph: static sizes
    args = _args(name, 3)
    _, text = three_way(fn, args, compiled=cf, fresh=True, family=family, appear=(op,),
                        lowering=lowering)  # Dynamo recompiles: a symbolic batch
    assert text.count("placeholder") > len(args)  # the batch's symbol is a graph input now
    before = counters.snapshot()
    three_way(fn, _args(name, 7), compiled=cf, fresh=False)  # a third batch, the same graph
    assert counters.delta(before).get("verify_patterns_matched", 0) == 0  # no recompile


def test_a_look_alike_of_the_rows_stays(no_fx_cache):
    torch._dynamo.reset()
    cf = torch.compile(flipped_rows, backend="npuspec",
                       options={"lowering": "eager", "capture": False})
    for B in (5, 3):
        three_way(flipped_rows, _args("flipped_rows", B), compiled=cf, fresh=True, matched=0,
                  gone=("npuspec.ratio_accept",))
