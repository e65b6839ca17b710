"""Picks from the padded target (passes/rewrites/gather_rows.py) and the rest of vLLM v1's
`forward_native` accept test: the pad fill moved before the pick (passes/picks.py) and the
accept mask rebuilt from the proven count (passes/prefix.py::masks_from_counts).

Three ways each: compiled equals eager (torch.equal), the npuspec op appears, the counters
moved (`verify_patterns_matched.<family>`, `canonical_rewrites.gather_rows`)."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from npuspec.passes import picks, prefix
from npuspec.passes.rewrites import gather_rows
from passes_helpers import three_way

B, K, V = 4, 5, 23
PAD = -1


def _probs(seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(B, K + 1, V, generator=g), -1)
    q = torch.softmax(torch.randn(B, K, V, generator=g), -1)
    ids = torch.randint(0, V, (B, K), generator=g)
    return g, p, q, ids


def _nasty(p):
    """NaN, infinities, -0.0 and ties at picked places: data movement keeps every bit."""
    p = p.clone()
    p[0, 0, :] = float("nan")
    p[1, 1, :] = -0.0
    p[2, 2, :] = float("inf")
    p[3, :, 3] = float("-inf")
    return p


def _graph(fn, *args):
    return make_fx(fn, tracing_mode="fake")(*args)


def padded_pick(p, idx):                      # p [B, K+1, V], idx [B, K, 1]
    return p.gather(-1, idx)


def test_slice_is_inserted_and_exact():
    _, p, _, ids = _probs(0)
    idx = ids.unsqueeze(-1)
    gm = _graph(padded_pick, p, idx)
    assert gather_rows.apply(gm.graph, "aten") == 1
    gm.recompile()
    slices = [n for n in gm.graph.nodes if n.target is torch.ops.aten.slice.Tensor]
    assert len(slices) == 1 and slices[0].args[1:] == (1, 0, K)
    for x in (p, _nasty(p)):
        want = padded_pick(x, idx)
        got = gm(x, idx)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # bits, NaN too
        assert torch.equal(got.view(torch.int32), x[:, :K].gather(-1, idx).view(torch.int32))


def test_fewer_batch_rows_are_exact_too():
    """Only dim 1 is sliced: an index with fewer batch rows reads the same rows."""
    _, p, _, ids = _probs(8)
    idx = ids[:2, :, None]
    gm = _graph(padded_pick, p, idx)
    assert gather_rows.apply(gm.graph, "aten") == 1
    gm.recompile()
    x = _nasty(p)
    assert torch.equal(gm(x, idx).view(torch.int32), padded_pick(x, idx).view(torch.int32))


@pytest.mark.parametrize("case", ["same_rows", "dim1", "rank2"])
def test_other_gathers_are_untouched(case):
    _, p, _, ids = _probs(1)
    args = {
        "same_rows": (lambda p, i: p.gather(-1, i), p[:, :K].contiguous(), ids[..., None]),
        "dim1": (lambda p, i: p.gather(1, i), p, ids[:, :, None]),
        "rank2": (lambda p, i: p.gather(-1, i), p[:, 0].contiguous(), ids),
    }[case]
    gm = _graph(*args)
    before = str(gm.graph)
    assert gather_rows.apply(gm.graph, "aten") == 0
    assert str(gm.graph) == before


def padded_ratio(target_probs, draft_probs, ids, u):
    # vLLM v1's pick: the padded target, a [B, K, 1] index, no [:, :K]
    tpx = target_probs.gather(dim=-1, index=ids.unsqueeze(-1)).squeeze(-1)
    dpx = draft_probs.gather(dim=-1, index=ids.unsqueeze(-1)).squeeze(-1)
    return (u <= tpx / dpx).cumprod(dim=1).sum(dim=1)


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
def test_padded_ratio_becomes_ratio_accept(lowering, no_fx_cache):
    g, p, q, ids = _probs(2)
    u = torch.rand(B, K, generator=g) * 0.4
    _, _ = three_way(padded_ratio, (p, q, ids, u), lowering=lowering, family="ratio_accept",
                     appear=["npuspec.ratio_accept"])
    assert three_way.last_delta.get("canonical_rewrites.gather_rows", 0) == 1


def padded_sample_step(p, q, drafts):
    # the docs' whole sampling step, p(x) read from the padded target
    u = torch.rand(drafts.shape, device=p.device)
    e = torch.empty(p.shape[0], p.shape[2], device=p.device).exponential_()
    px = p.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    qx = q.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    n = (px / qx >= u).cumprod(dim=-1).sum(dim=-1)
    rec = (torch.clamp(p[:, :K] - q, min=0) / e[:, None, :]).argmax(dim=-1)
    bonus = (p[:, K] / e).argmax(dim=-1)
    return torch.cat([rec, bonus[:, None]], 1).gather(1, n[:, None]).squeeze(1), n


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
def test_padded_whole_step_is_one_verify_op(lowering, no_fx_cache):
    _, p, q, ids = _probs(3)
    three_way(padded_sample_step, (p, q, ids), lowering=lowering, family="sample_verify",
              appear=["npuspec.rejection_sample"], seed=5)
    assert three_way.last_delta.get("canonical_rewrites.gather_rows", 0) == 1


def v1_accept(ids, draft_probs, target_probs):
    # vLLM v1 forward_native's accept test: pads read id 0, their q(x) set to inf afterwards,
    # the mask kept for the emitted ids and its first zero (after a False column) the count
    ids = ids.clone()
    pad = ids == PAD
    ids[pad] = 0
    draft_px = draft_probs.gather(dim=-1, index=ids.unsqueeze(-1)).squeeze(-1)
    target_px = target_probs.gather(dim=-1, index=ids.unsqueeze(-1)).squeeze(-1)
    draft_px[pad] = float("inf")
    u = torch.rand(ids.shape)
    accept_mask = (u <= target_px / draft_px).cumprod(dim=1)
    kept = ids * accept_mask + PAD * (1 - accept_mask)
    gen = torch.cat([accept_mask, torch.zeros(ids.shape[0], 1)], dim=1).to(torch.bool)
    first_zero = (gen == 0).float().argmax(dim=1)
    return kept, first_zero


def v1_accept_index0(ids, draft_probs, target_probs):
    # the same with the draft pick spelled `[..., 0]`: the write into that view functionalizes
    # to select(select_scatter(gather, filled, 2, 0), 2, 0), read back as `filled`
    ids = ids.clone()
    pad = ids == PAD
    ids[pad] = 0
    draft_px = draft_probs.gather(dim=-1, index=ids.unsqueeze(-1))[..., 0]
    target_px = target_probs.gather(dim=-1, index=ids.unsqueeze(-1)).squeeze(-1)
    draft_px[pad] = float("inf")
    u = torch.rand(ids.shape)
    return (u <= target_px / draft_px).cumprod(dim=1).sum(dim=1)


def _v1_inputs(seed):
    g, p, q, ids = _probs(seed)
    ids[0, 3:] = PAD
    ids[2, 1:] = PAD
    ids[1] = p[1, :K].argmax(-1)  # likely accepted far
    q[:, :, 0] = 0.0  # a pad's q(0) = 0: the inf fill decides, not q
    return ids, q, p


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
def test_v1_accept_test_fuses(lowering, no_fx_cache):
    for seed in (4, 5, 6):
        torch._dynamo.reset()
        # the user's chain (ratio, compare, cumprod) is gone: the kept mask reads the count
        three_way(v1_accept, _v1_inputs(seed), lowering=lowering, family="ratio_accept",
                  appear=["npuspec.ratio_accept"], gone=["cumprod", "aten.div"], seed=seed)


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
def test_v1_accept_with_an_index0_pick_fuses(lowering, no_fx_cache):
    three_way(v1_accept_index0, _v1_inputs(4), lowering=lowering, family="ratio_accept",
              appear=["npuspec.ratio_accept"], gone=["cumprod", "select_scatter"], seed=4)


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
def test_v1_accept_test_fuses_under_a_dynamic_batch(lowering, no_fx_cache):
    """The recompile with a symbolic batch fuses too: the pick's batch and the ids' are
    separate symbols, `zeros(B, 1)` in the count reads B (bound by the proof)."""
    from npuspec import counters
    f = torch.compile(v1_accept, backend="npuspec", options={"lowering": lowering,
                                                             "capture": False})
    before = counters.snapshot()
    for b in (4, 3, 2):
        ids, q, p = _v1_inputs(b)
        args = (ids[:b], q[:b], p[:b])
        torch.manual_seed(b)
        want = v1_accept(*args)
        torch.manual_seed(b)
        got = f(*args)
        assert all(torch.equal(w, g) for w, g in zip(want, got)), b
    delta = counters.delta(before)
    assert delta.get("verify_patterns_matched.ratio_accept", 0) == 2, delta  # both compiles
    assert delta.get("canonical_rewrites.gather_rows", 0) == 2, delta


@pytest.mark.parametrize("spelling", ["squeeze", "index0"])
def test_pad_fill_moves_before_the_pick_bit_exact(spelling):
    """index_put(q.gather(...).squeeze(2), [pad], c) == index_put(q, [pad], c).gather(...):
    every c, every q (NaN, -0.0), every mask; the pick spelled `.squeeze(2)` or `[..., 0]` (its
    write functionalizes into a select_scatter that is read back)."""
    def fill_after(q, ids, pad, c):
        g = q.gather(2, ids.unsqueeze(2))
        x = g.squeeze(2) if spelling == "squeeze" else g[..., 0]
        x[pad] = c
        return x.clone()  # read by an op, as in a verify step (a returned view stays as it is)

    g, _, q, ids = _probs(7)
    pad = torch.rand(B, K, generator=g) < 0.5
    for c in (float("inf"), float("nan"), -0.0, 0.0, 3.5):
        cq = _nasty(torch.cat([q, q[:, :1]], 1))[:, :K].contiguous()
        gm = _graph(torch.func.functionalize(lambda q, i, m: fill_after(q, i, m, c)), cq, ids, pad)
        assert picks.canonical_picks(gm.graph) >= 1
        gm.recompile()
        targets = [n.target for n in gm.graph.nodes]
        # the fill now writes q, before the gather
        put = targets.index(torch.ops.aten.index_put.default)
        assert put < targets.index(torch.ops.aten.gather.default)
        want = fill_after(cq, ids, pad, c)
        assert torch.equal(gm(cq, ids, pad).view(torch.int32), want.view(torch.int32)), c


def test_mask_from_count_only_for_proven_counts():
    """The user's `mask.sum(1)` beside a kept mask is left as written (a near miss); a count
    the proof wrote frees the mask, rebuilt as arange(K) < n with the same int64 values."""
    def proven(ok):
        mask = ok.cumprod(dim=1)
        gen = torch.cat([mask, torch.zeros_like(mask[:, :1])], dim=1)
        return mask * 7, (gen == 0).int().argmax(dim=1)

    def written(ok):
        mask = ok.cumprod(dim=1)
        return mask * 7, mask.sum(1)

    ok = torch.tensor([[1, 1, 0, 1], [1, 1, 1, 1], [0, 0, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    gm = _graph(lambda x: proven(~x), ~ok)
    assert prefix.prove_prefix_counts(gm.graph) >= 1
    gm.recompile()
    assert any(n.target is torch.ops.aten.lt.Tensor for n in gm.graph.nodes)
    assert all(torch.equal(a, b) for a, b in zip(gm(~ok), proven(ok)))
    gm = _graph(lambda x: written(~x), ~ok)
    before = str(gm.graph)
    assert prefix.prove_prefix_counts(gm.graph) == 0
    assert str(gm.graph) == before


@pytest.mark.parametrize("spelling", ["masked_fill", "where", "where_tensor"])
def test_pad_fill_written_otherwise_moves_too(spelling):
    """x.masked_fill(pad, c) and torch.where(pad, c, x) over the picks, x = q.gather(...)[..., 0]:
    moved onto q's rows in the same spelling, bit for bit (every c, NaN and -0.0 in q)."""
    def fill_after(q, ids, pad, c):
        x = q.gather(2, ids.unsqueeze(2)).squeeze(2)
        if spelling == "masked_fill":
            return x.masked_fill(pad, c)
        if spelling == "where":
            return torch.where(pad, c, x)
        return torch.where(pad, torch.tensor(c, dtype=x.dtype), x)

    g, _, q, ids = _probs(8)
    pad = torch.rand(B, K, generator=g) < 0.5
    for c in (float("inf"), float("nan"), -0.0, 0.0, 3.5):
        cq = _nasty(torch.cat([q, q[:, :1]], 1))[:, :K].contiguous()
        gm = _graph(lambda q, i, m: fill_after(q, i, m, c), cq, ids, pad)
        assert picks.canonical_picks(gm.graph) >= 1, gm.graph
        gm.recompile()
        targets = [n.target for n in gm.graph.nodes]
        assert targets.index(torch.ops.aten.gather.default) > max(
            i for i, t in enumerate(targets) if t in (torch.ops.aten.masked_fill.Scalar,
                                                      torch.ops.aten.masked_fill.Tensor,
                                                      torch.ops.aten.where.self))
        want = fill_after(cq, ids, pad, c)
        assert torch.equal(gm(cq, ids, pad).view(torch.int32), want.view(torch.int32)), c


@pytest.mark.parametrize("cast", [torch.long, torch.int32])
def test_mask_from_count_reads_through_an_integer_cast(cast):
    """`ok.long().cumprod(1)` (or `.int()`) beside a proven count is the same int64 mask: it
    is rebuilt from the count as well."""
    def proven(ok):
        mask = ok.to(cast).cumprod(dim=1)
        gen = torch.cat([mask, torch.zeros_like(mask[:, :1])], dim=1)
        return mask * 7, (gen == 0).int().argmax(dim=1)

    ok = torch.tensor([[1, 1, 0, 1], [1, 1, 1, 1], [0, 0, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    gm = _graph(lambda x: proven(~x), ~ok)
    assert prefix.prove_prefix_counts(gm.graph) >= 1
    gm.recompile()
    assert any(n.target is torch.ops.aten.lt.Tensor for n in gm.graph.nodes), gm.graph
    got, want = gm(~ok), proven(ok)
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, want))


def v1_accept_masked_fill(ids, draft_probs, target_probs):
    # the same test written with masked_fill and a long mask (npuspec bench passes' v1 step)
    pad = ids == PAD
    x = ids.masked_fill(pad, 0)
    px = target_probs[:, :K].gather(2, x[..., None])[..., 0]
    qx = draft_probs.gather(2, x[..., None])[..., 0].masked_fill(pad, float("inf"))
    kept = (torch.rand(ids.shape) <= px / qx).long().cumprod(dim=1)
    return x * kept - (1 - kept), kept.sum(1)


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
def test_v1_accept_with_masked_fill_fuses(lowering, no_fx_cache):
    three_way(v1_accept_masked_fill, _v1_inputs(5), lowering=lowering, family="ratio_accept",
              appear=["npuspec.ratio_accept"], gone=["cumprod", "aten.div"], seed=5)
