"""GraphSet on the CPU runner: padding correctness, static buffers, fallbacks, capture modes."""
import logging

import pytest
import torch

from npuspec import counters
from npuspec.graphs import COPY, STATIC, GraphSet, Slot, plan_capture_sizes, token
from npuspec.kernels import rejection_sample

V = 11
EMB = torch.randn(50, V, generator=torch.Generator().manual_seed(0))


def toy_step(tokens, drafts, temp):
    """Row-separable: tokens [B*(K+1)], drafts [B, K], temp [B] -> ([B, K+1, V], [B])."""
    B, K = drafts.shape
    logits = EMB[tokens].view(B, K + 1, V) * temp[:, None, None]
    score = logits.amax(-1).sum(-1) + (drafts >= 0).sum(-1)
    return logits, score


def verify_step(tokens, drafts, temp, uniforms, exps):
    """Model stand-in + the verify op, sampled with fixed draws (a pure function)."""
    B, K = drafts.shape
    logits = EMB[tokens].view(B, K + 1, V)
    return rejection_sample(logits, drafts, temperature=temp, uniforms=uniforms, exponentials=exps)


def inputs(B, K, gen, greedy=False):
    tokens = torch.randint(0, 50, (B * (K + 1),), generator=gen)
    drafts = torch.randint(0, V, (B, K), generator=gen)
    drafts[:, K - 1:] = torch.where(torch.rand(B, 1, generator=gen) < 0.3, -1, drafts[:, K - 1:])
    temp = torch.zeros(B) if greedy else torch.rand(B, generator=gen) + 0.5
    uniforms = torch.rand(B, K, generator=gen, dtype=torch.float64).float()
    exps = torch.empty(B, V).exponential_(generator=gen)
    return tokens, drafts, temp, uniforms, exps


def verify_set(K, max_num_seqs, **kw):
    units = [s // (K + 1) for s in plan_capture_sizes(K, max_num_seqs)]
    slots = [token(coef=K + 1), token(pad=-1), token(), token(pad=0.5), token(pad=1.0)]
    return GraphSet(verify_step, slots, units, k=K, tokens_per_unit=K + 1, **kw)


@pytest.mark.parametrize("K", [1, 3])
def test_padding_toy_every_batch_size(K, delta):
    gen = torch.Generator().manual_seed(K)
    units = [s // (K + 1) for s in plan_capture_sizes(K, 24)]
    gs = GraphSet(toy_step, [token(coef=K + 1), token(pad=-1), token()], units, k=K,
                  tokens_per_unit=K + 1)
    for B in range(1, units[-1] + 1):
        args = inputs(B, K, gen)[:3]
        out, ref = gs.run(*args), toy_step(*args)
        assert isinstance(out, tuple) and len(out) == 2
        assert out[0].shape == ref[0].shape and torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1]), B
    d = delta()
    assert d["graphs_captured"] == len(units) and d["graph_replays"] == units[-1]
    assert "eager_fallbacks" not in d


@pytest.mark.parametrize("greedy", [True, False])
def test_padding_with_verify_op_every_batch_size(greedy, delta):
    K, gen = 3, torch.Generator().manual_seed(7)
    gs = verify_set(K, 20)
    largest = gs.sizes[-1]
    assert largest == 20
    for B in range(1, largest + 1):
        args = inputs(B, K, gen, greedy)
        (tok, n), (rtok, rn) = gs.run(*args), verify_step(*args)
        assert torch.equal(tok, rtok) and torch.equal(n, rn), B
    assert delta()["graphs_captured"] == len(gs.sizes)


def test_padding_rows_are_inert_drafts(delta):
    """Padded rows carry draft id -1: each emits exactly one token (nothing accepted)."""
    K = 3
    gs = verify_set(K, 8)
    args = inputs(3, K, torch.Generator().manual_seed(1))
    gs.run(*args)
    e = gs.entries[4]
    assert torch.equal(e.args[1][3:], torch.full((1, K), -1))
    assert e.outs[1][3:].tolist() == [1]


def test_static_buffers_reused(delta, monkeypatch):
    monkeypatch.setenv("NPUSPEC_DEBUG", "1")  # runners assert static addresses on replay
    K, gen = 2, torch.Generator().manual_seed(3)
    gs = verify_set(K, 16)
    for B in (5, 1, 2, 3, 9):  # a replay of each size (the CPU runner's first makes its outputs)
        gs.run(*inputs(B, K, gen))
    ptrs = {u: [a.data_ptr() for a in e.args] for u, e in gs.entries.items()}
    outs = {u: [o.data_ptr() for o in e.outs] for u, e in gs.entries.items()}
    assert all(outs.values()), outs
    for B in (1, 7, 16, 3, 9, 5, 16):
        gs.run(*inputs(B, K, gen))
    assert ptrs == {u: [a.data_ptr() for a in e.args] for u, e in gs.entries.items()}
    assert outs == {u: [o.data_ptr() for o in e.outs] for u, e in gs.entries.items()}
    # all sizes share the largest size's input storage (prefix views)
    big = gs.entries[gs.sizes[-1]]
    for e in gs.entries.values():
        assert e.args[0].data_ptr() == big.args[0].data_ptr()
    # a moved static buffer is caught in debug mode
    e = gs.entries[8]
    e.runner.args[0] = e.runner.args[0].clone()
    with pytest.raises(AssertionError):
        e.runner.replay()


def test_eager_fallback_beyond_largest(delta, caplog):
    K, gen = 1, torch.Generator().manual_seed(4)
    gs = verify_set(K, 4)
    with caplog.at_level(logging.WARNING, logger="npuspec.graphs"):
        for _ in range(3):
            args = inputs(9, K, gen)
            (tok, n), (rtok, rn) = gs.run(*args), verify_step(*args)
            assert torch.equal(tok, rtok) and torch.equal(n, rn)
    d = delta()
    assert d["eager_fallbacks"] == 3 and "graph_replays" not in d
    msgs = [r.getMessage() for r in caplog.records if "running eagerly" in r.getMessage()]
    assert len(msgs) == 1 and "18 tokens" in msgs[0] and "largest captured size (8 tokens)" in msgs[0]


def test_capture_lazy_and_off(delta):
    K, gen = 1, torch.Generator().manual_seed(5)
    lazy = verify_set(K, 64, capture="lazy")
    for B in (3, 3, 5, 2):
        lazy.run(*inputs(B, K, gen))
    # B=3 pads to 4 requests (8 tokens), B=5 to 8 (16 tokens), B=2 is exact (4 tokens)
    assert lazy.captured_sizes == [4, 8, 16]
    assert delta()["graphs_captured"] == 3
    off = verify_set(K, 64, capture=False)
    args = inputs(3, K, gen)
    assert all(torch.equal(a, b) for a, b in zip(off.run(*args), verify_step(*args)))
    assert delta()["graphs_captured"] == 3 and off.entries == {}


def test_exact_only_and_disproportionate_inputs(delta):
    def batch_sum(x):  # not row-separable: padding rows would change the sum
        return x.sum(0, keepdim=True) * 2,

    gs = GraphSet(batch_sum, [token()], [2, 4], exact_only=True, out_dims=[None])
    x = torch.arange(12.).view(4, 3)
    assert torch.equal(gs.run(x)[0], batch_sum(x)[0]) and gs.captured_sizes == [2, 4]
    y = torch.arange(9.).view(3, 3)
    assert torch.equal(gs.run(y)[0], batch_sum(y)[0])
    assert delta()["eager_fallbacks"] == 1
    # token dims that do not agree on one u run eagerly too
    gs2 = GraphSet(toy_step, [token(coef=2), token(), token()], [4])
    args = inputs(3, 1, torch.Generator().manual_seed(0))[:3]
    bad = (args[0], args[1], torch.ones(2))
    with pytest.raises(RuntimeError):
        gs2.run(*bad)  # the eager call itself rejects the shapes; the dispatcher did not pad
    assert delta()["eager_fallbacks"] == 2


def test_copy_static_and_mutated_slots(delta):
    w = torch.randn(V)

    def step(x, bias, weight, acc):
        acc.add_(x)  # in-place update of a token input: must reach the caller's tensor
        return x * weight + bias,

    gs = GraphSet(step, [token(), Slot(COPY), Slot(STATIC), token(mutated=True)], [2, 4, 8])
    for B in (3, 8, 1):
        x, bias, acc = torch.randn(B, V), torch.randn(V), torch.zeros(B, V)
        (out,) = gs.run(x, bias, w, acc)
        assert torch.equal(out, x * w + bias) and torch.equal(acc, x)
    # a different parameter tensor (moved) is never silently ignored
    w2 = torch.randn(V)
    x, bias, acc = torch.randn(2, V), torch.randn(V), torch.zeros(2, V)
    (out,) = gs.run(x, bias, w2, acc)
    assert torch.equal(out, x * w2 + bias)
    assert delta()["eager_fallbacks"] == 1


def test_outputs_are_views_or_clones():
    K, gen = 1, torch.Generator().manual_seed(8)
    slots = [token(coef=2), token(pad=-1), token()]
    views = GraphSet(toy_step, slots, [4])
    a = views.run(*inputs(3, K, gen)[:3])[0]
    b = views.run(*inputs(3, K, gen)[:3])[0]
    assert a.data_ptr() == b.data_ptr()  # the next replay overwrote a (device-graph semantics)
    clones = GraphSet(toy_step, slots, [4], clone_outputs=True)
    a_args = inputs(3, K, gen)[:3]
    a = clones.run(*a_args)[0]
    clones.run(*inputs(3, K, gen)[:3])
    assert torch.equal(a, toy_step(*a_args)[0])


def test_padding_rows_hold_pad_values_after_any_sequence():
    """Pads are refilled lazily (only rows an earlier step dirtied); check every replay saw
    pad values in every padding row, across sizes that share one buffer."""
    K, gen = 1, torch.Generator().manual_seed(9)
    seen = []

    def spy(tokens, drafts, temp):
        B = drafts.shape[0]
        seen.append((tokens.clone(), drafts.clone(), temp.clone()))
        return toy_step(tokens, drafts, temp)

    gs = GraphSet(spy, [token(coef=2, pad=7), token(pad=-1), token(pad=0.25)], [2, 4, 8, 16])
    import random
    rng = random.Random(0)
    for _ in range(60):
        B = rng.randint(1, 16)
        seen.clear()
        args = inputs(B, K, gen)[:3]
        out = gs.run(*args)
        tokens, drafts, temp = seen[-1]  # the replay (capture runs come first)
        assert torch.equal(tokens[:2 * B], args[0]) and bool((tokens[2 * B:] == 7).all())
        assert torch.equal(drafts[:B], args[1]) and bool((drafts[B:] == -1).all())
        assert torch.equal(temp[:B], args[2]) and bool((temp[B:] == 0.25).all())
        assert all(torch.equal(a, b) for a, b in zip(out, toy_step(*args)))


def test_inference_mode_inputs():
    """Inference tensors have no version counter; copies still happen (and stay correct)."""
    def step(x, w):
        return x @ w,

    with torch.inference_mode():
        gs = GraphSet(step, [token(), Slot(COPY)], [2, 4])
        for B in (1, 3, 2):
            x, w = torch.randn(B, 4), torch.randn(4, 3)
            assert torch.equal(gs.run(x, w)[0], x @ w)
            w.mul_(2)  # in place, same object: must not be skipped
            assert torch.equal(gs.run(x, w)[0], x @ w)


def test_outputs_that_view_each_other_stay_views():
    """`return o, o[:, None], o[:, None].expand(-1, 2)`: in eager the three share o's memory,
    so a write into o shows in the others. The copied-out results must share one copy the
    same way (issue 34: each output used to be cloned on its own), after padded replays and
    repeated replays at one size alike."""
    def step(x):
        o = x.argmax(-1)
        return o, o[:, None], o[:, None].expand(-1, 2), o * 2

    gs = GraphSet(step, [token()], [2, 4], clone_outputs=True)
    gen = torch.Generator().manual_seed(10)
    kept = []
    for B in (3, 4, 3, 1, 4):
        x = torch.randn(B, V, generator=gen)
        out, ref = gs.run(x), step(x)
        assert all(torch.equal(a, b) for a, b in zip(out, ref)), B
        base = out[0].untyped_storage().data_ptr()
        assert [o.untyped_storage().data_ptr() == base for o in out] == [True, True, True, False]
        out[0].add_(100)  # the caller writes one output: the views see it, as in eager
        assert torch.equal(out[1][:, 0], out[0]) and torch.equal(out[2][:, 1], out[0]), B
        kept.append((out, ref[0] + 100))
    for out, want in kept:  # later replays did not write into earlier results
        assert torch.equal(out[0], want) and torch.equal(out[2][:, 0], want)
