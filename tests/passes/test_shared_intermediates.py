"""Counts whose mask or pick the user's other code also reads (passes/shared.py).

The manager's third round gives such a count a private copy of what it is computed from, runs
the families again, and merges the copies no match took back into their originals. Each step
below is our own small spelling of a field shape (lmdeploy's greedy sampler reusing its
equality mask for the emission; Medusa's typical acceptance returning the picked
probabilities), checked three ways under both lowerings, plus the limits: a draw is never
copied, and a graph with nothing to fuse comes out as it went in."""
import pytest
import torch

from npuspec.passes import manager, shared
from passes_helpers import aten_graph, three_way

B, K, V = 4, 5, 23
LOWERINGS = ["eager", "inductor"]


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _greedy_inputs(seed=0):
    g = _gen(seed)
    logits = torch.randn(B, K, V, generator=g)
    best = logits.argmax(-1)
    cut = torch.tensor([K, 0, 2, 4])[:, None]                       # leading hits per row
    drafts = torch.where(torch.arange(K) < cut, best, (best + 1) % V)
    return logits, drafts, torch.randint(0, V, (B,), generator=g)


def greedy_mask_reused(logits, drafts, bonus):
    """The hit mask feeds the count and the emitted tokens (as lmdeploy's torch sampler)."""
    best = logits.argmax(-1)                                          # [B, K]
    hit = best == drafts
    run = hit.long().cumsum(-1) == torch.arange(1, K + 1)             # leading hits
    rejected = K - run.sum(-1)                                        # a proven count
    emit = torch.where(run, best, -1)
    extra = torch.where(run[:, -1:], bonus[:, None], -1)
    return torch.cat([emit, extra], 1), rejected


def _typical_inputs(seed=0):
    g = _gen(seed)
    probs = torch.softmax(torch.randn(B, K, V, generator=g) * 2, -1)
    cands = probs.argmax(-1)
    cands[1:, 2] = torch.randint(0, V, (B - 1,), generator=g)         # some rows stop early
    return probs, cands


def typical_pick_reused(probs, cands):
    """Typical acceptance returning the picked probabilities and the count (Medusa keeps
    both for its likelihood tie-break). probs is the caller's posterior softmax: Inductor's
    own softmax rounds differently from eager's, with or without these passes."""
    picked = torch.gather(probs, -1, cands[:, :, None]).squeeze(-1)
    ent = -(probs * torch.log(probs + 1e-5)).sum(-1)
    limit = torch.minimum(torch.full_like(ent, 0.25), 0.1 * torch.exp(-ent))
    n = (picked > limit).cumprod(1).sum(1)
    return n, picked, n.max()


def _op_count(graphs: str, op: str) -> int:
    return graphs.count(f"target={op}")


@pytest.mark.parametrize("lowering", LOWERINGS)
def test_reused_hit_mask_count_fuses(lowering, no_fx_cache):
    _, graphs = three_way(greedy_mask_reused, _greedy_inputs(1), lowering=lowering, matched=1,
                          family="greedy_accept", appear=["npuspec.greedy_accept", "aten.cumsum"])
    assert _op_count(graphs, "torch.ops.aten.argmax.default") == 1  # the copy merged back


@pytest.mark.parametrize("lowering", LOWERINGS)
def test_returned_pick_typical_count_fuses(lowering, no_fx_cache):
    _, graphs = three_way(typical_pick_reused, _typical_inputs(2), lowering=lowering, matched=1,
                          family="ratio_accept", appear=["npuspec.ratio_accept", "aten.gather"],
                          gone=["aten.cumprod"])
    assert _op_count(graphs, "torch.ops.aten.log.default") == 1     # copies merged back
    assert _op_count(graphs, "torch.ops.aten.gather.default") == 1  # the user's pick


def _ratio_inputs(seed=0):
    g = _gen(seed)
    p = torch.softmax(torch.randn(B, K, V, generator=g), -1)
    q = torch.softmax(torch.randn(B, K, V, generator=g), -1)
    return p, q, torch.randint(0, V, (B, K), generator=g)


def ratio_drawn_from_ratio(p, q, ids):
    """The uniforms drawn with `rand_like(ratio)`, the accept mask returned as well."""
    px = p.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    qx = q.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    ratio = px / qx
    ok = ratio >= torch.rand_like(ratio)
    return ok.cumprod(-1).sum(-1), ok


@pytest.mark.parametrize("lowering", LOWERINGS)
def test_draw_in_the_chain_is_read_not_copied(lowering, no_fx_cache):
    """With a varying batch `rand_like(ratio)` is remade from the batch's symbol (picks.py,
    as for static shapes). The draw is never copied: the count's side reads the user's one
    draw as its uniforms. A copied draw would shift the RNG stream, and the returned mask
    would differ from eager's."""
    args = _ratio_inputs(3)
    for t in args:
        torch._dynamo.mark_dynamic(t, 0)
    cf = torch.compile(ratio_drawn_from_ratio, backend="npuspec",
                       options={"lowering": lowering, "capture": False})
    _, graphs = three_way(ratio_drawn_from_ratio, args, lowering=lowering, matched=1,
                          family="ratio_accept", appear=["npuspec.ratio_accept"], compiled=cf,
                          fresh=True, seed=5)
    draws = (_op_count(graphs, "torch.ops.aten.rand_like.default")
             + _op_count(graphs, "torch.ops.aten.rand.default"))
    assert draws == 1, graphs


def bernoulli_mask_reused(p, q, ids):
    """Each draft accepted by a Bernoulli draw of its own; no family spells it."""
    px = p.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    qx = q.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    ok = torch.bernoulli(torch.clamp(px / qx, max=1.0)).bool()
    return ok.cumprod(-1).sum(-1), ok


@pytest.mark.parametrize("lowering", LOWERINGS)
def test_drawn_mask_reused_stays_unfused(lowering, no_fx_cache):
    _, graphs = three_way(bernoulli_mask_reused, _ratio_inputs(4), lowering=lowering,
                          matched=0, gone=["npuspec."], seed=6)
    assert _op_count(graphs, "torch.ops.aten.bernoulli.default") <= 1


def test_privatize_never_copies_a_draw():
    gm = aten_graph(bernoulli_mask_reused, *_ratio_inputs(4))
    before = str(gm.graph)
    copies = shared.privatize(gm.graph)
    assert copies, "the returned mask's cast is shared: it gets a copy"
    assert not any(getattr(c.target, "tags", None) and torch.Tag.nondeterministic_seeded
                   in c.target.tags for c in copies)
    gm.graph.lint()
    shared.merge_back(gm.graph, copies)
    assert str(gm.graph) == before


def test_reused_scan_is_not_copied():
    """The user keeps the scan itself: a fused count would only save the final sum."""
    def f(logits, drafts, bonus):
        acc = (drafts == logits.argmax(-1)).cumprod(-1)
        return acc.sum(-1), acc
    gm = aten_graph(f, *_greedy_inputs())
    assert shared.anchors(gm.graph) and not shared.privatize(gm.graph)


def no_verify_step(x, w):
    """A count of leading positives whose input the caller also reads: the third round
    copies it, but nothing any family fuses."""
    h = torch.relu(x @ w)
    return (h > 0).cumprod(-1).sum(-1), h * 3, h.cumsum(-1).amax(-1)


def _plain_inputs():
    g = _gen(7)
    return torch.randn(B, 6, generator=g), torch.randn(6, 6, generator=g)


@pytest.mark.parametrize("flavor", ["aten", "inductor"])
def test_graph_without_verify_step_is_unchanged(flavor, monkeypatch):
    made = []
    privatize = shared.privatize
    monkeypatch.setattr(shared, "privatize", lambda g: made.append(privatize(g)) or made[-1])
    gm = aten_graph(no_verify_step, *_plain_inputs())
    before = str(gm.graph)
    assert manager.PassManager().run(gm, flavor=flavor) == {}
    assert made and made[0], "the dry run made copies"
    assert str(gm.graph) == before


def test_copies_merge_back_exactly():
    """Where the families take nothing, the round trip restores the graph text."""
    gm = aten_graph(no_verify_step, *_plain_inputs())
    before = str(gm.graph)
    copies = shared.privatize(gm.graph)
    assert copies
    gm.graph.lint()
    assert shared.merge_back(gm.graph, copies) == 0
    assert str(gm.graph) == before


def test_copy_budget(monkeypatch):
    """A cone needing more copies than MAX_CLONES is left as written (and still exact)."""
    monkeypatch.setattr(shared, "MAX_CLONES", 1)
    gm = aten_graph(greedy_mask_reused, *_greedy_inputs())
    assert not shared.privatize(gm.graph)
    three_way(greedy_mask_reused, _greedy_inputs(1), matched=0, gone=["npuspec."])
