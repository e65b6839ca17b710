"""torch.compile(step, backend="npuspec"): the dispatcher inside the backend's callable."""
import random

import pytest
import torch

from npuspec.graphs import CaptureSizeWarning, live_dispatchers, mark_token_dim
from npuspec.kernels import rejection_sample

V = 13
EMB = torch.randn(40, V, generator=torch.Generator().manual_seed(0))


def verify_step(tokens, drafts, temp, uniforms, exps):
    B, K = drafts.shape
    logits = EMB[tokens].view(B, K + 1, V) * 1.5
    return rejection_sample(logits, drafts, temperature=temp, uniforms=uniforms, exponentials=exps)


def make_inputs(B, K, gen, mark=True):
    tokens = torch.randint(0, 40, (B * (K + 1),), generator=gen)
    drafts = torch.randint(0, V, (B, K), generator=gen)
    drafts[0, -1] = -1
    temp = torch.rand(B, generator=gen) * (torch.rand(B, generator=gen) < 0.5)
    uniforms = torch.rand(B, K, generator=gen, dtype=torch.float64).float()
    exps = torch.empty(B, V).exponential_(generator=gen)
    args = (tokens, drafts, temp, uniforms, exps)
    if mark:
        mark_token_dim(tokens, group="tokens")  # flat [B*(K+1)]: a size of its own
        for a in args[1:]:
            mark_token_dim(a)
    return args


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def compile_step(fn=verify_step, **options):
    opts = {"lowering": "eager", "max_num_seqs": 16,
            "speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}
    opts.update(options)
    return torch.compile(fn, backend="npuspec", options=opts)


def _new_dispatchers(before):
    return [d for d in live_dispatchers() if id(d) not in before]


def toy_step(tokens, drafts, temp):
    """Cheap row-separable stand-in for a model + verify step (the 1000-step test)."""
    B, K = drafts.shape
    logits = EMB[tokens].view(B, K + 1, V) * temp[:, None, None]
    return logits.argmax(-1), (drafts >= 0).sum(-1) + logits.amax(-1).sum(-1)


DYNAMIC_K = {"method": "ngram", "num_speculative_tokens": 3,
             "num_speculative_tokens_per_batch_size": [[1, 4, 3], [5, 8, 2], [9, 16, 1]]}


def test_random_batches_and_k_swaps_capture_once(fresh_dynamo, delta):
    """1000 steps, random B and K: after one warm-up per K, nothing is captured or compiled
    again, every replay matches eager, and captures = one per size per K (B=1 included: the
    unbacked batch dim gives Dynamo no size-1 graph)."""
    before = {id(d) for d in live_dispatchers()}
    stats = torch._dynamo.utils.counters["stats"]
    f = compile_step(toy_step, speculative_config=DYNAMIC_K)
    gen, rng = torch.Generator().manual_seed(1), random.Random(1)
    ks = (1, 2, 3)
    for K in ks:  # warm-up: the Dynamo graphs for dynamic B (and K)
        for B in (2, 1):
            args = make_inputs(B, K, gen)[:3]
            assert same(f(*args), toy_step(*args))
    graphs0, warm = stats["unique_graphs"], delta()
    for _ in range(1000):
        B, K = rng.randint(1, 16), rng.choice(ks)
        args = make_inputs(B, K, gen)[:3]
        assert same(f(*args), toy_step(*args)), (B, K)
    d = delta()
    assert stats["unique_graphs"] == graphs0  # no recompiles
    assert d["graphs_captured"] == warm["graphs_captured"]  # no captures after warm-up
    assert d["graph_replays"] == warm["graph_replays"] + 1000 and "eager_fallbacks" not in d
    sets = [gs for disp in _new_dispatchers(before) for gs in disp.sets.values()]
    assert sum(len(gs.entries) for gs in sets) == d["graphs_captured"]
    padded = {}
    for gs in sets:
        assert sorted(gs.entries) == gs.sizes  # capture=True: every planned size, once
        assert any(s.kind == "token" for s in gs.slots)  # no graph specialised to B=1
        assert gs.k not in padded  # one padded set per K
        padded[gs.k] = gs.captured_sizes
    # the K+1 ladder up to max_num_seqs=16 requests, 1 request included
    assert padded == {K: [r * (K + 1) for r in (1, 2, 4, 8, 16)] for K in ks}


def test_capture_off_and_lazy(fresh_dynamo, delta):
    gen = torch.Generator().manual_seed(2)
    off = compile_step(toy_step, capture=False)
    for B in (3, 5):
        args = make_inputs(B, 3, gen)[:3]
        assert same(off(*args), toy_step(*args))
    assert "graphs_captured" not in delta() and "graph_replays" not in delta()
    torch._dynamo.reset()
    lazy = compile_step(toy_step, capture="lazy")
    for B in (3, 3, 7):
        args = make_inputs(B, 3, gen)[:3]
        assert same(lazy(*args), toy_step(*args))
    assert delta() == {"graphs_captured": 2, "graph_replays": 3}  # 4 and 8 requests only


def test_verify_inputs_get_inert_pads(fresh_dynamo):
    before = {id(d) for d in live_dispatchers()}
    f = compile_step()
    args = make_inputs(3, 3, torch.Generator().manual_seed(3))
    f(*args)
    (disp,) = _new_dispatchers(before)
    (gs,) = disp.sets.values()
    toks = [s for s in gs.slots if s.kind == "token"]
    # the verify op's inputs get its inert pads; the others 1 (a safe divisor, e.g. temperature)
    assert sorted((s.coef, s.pad) for s in toks) == [(1, -1), (1, 0.5), (1, 1), (1, 1.0), (4, 1)]
    assert gs.k == 3 and gs.tokens_per_unit == 4


def test_beyond_largest_runs_eagerly(fresh_dynamo, delta):
    f = compile_step(max_num_seqs=4)
    gen = torch.Generator().manual_seed(4)
    for B in (2, 9, 9):
        args = make_inputs(B, 3, gen)
        assert same(f(*args), verify_step(*args))
    assert delta()["eager_fallbacks"] == 2


def test_capture_sizes_option_rounds_once(fresh_dynamo, delta):
    f = compile_step(capture_sizes=[8, 10, 16])
    args = make_inputs(3, 3, torch.Generator().manual_seed(5))
    with pytest.warns(CaptureSizeWarning, match="10->12"):
        assert same(f(*args), verify_step(*args))
    assert delta()["graphs_captured"] == 3


def test_not_row_separable_is_exact_only(fresh_dynamo, delta):
    def pooled(x):
        return x * 2, x.sum(0)  # the sum mixes rows: padding would change it

    f = compile_step(pooled, speculative_config=None)
    for B in (2, 3, 4, 3):
        x = mark_token_dim(torch.randn(B, 5))
        out = f(x)
        assert torch.equal(out[0], x * 2) and torch.allclose(out[1], x.sum(0))
    d = delta()
    # exact sizes of the K=0 ladder (1, 2, 4, 8, 16 requests) replay; B=3 runs eagerly
    assert d["eager_fallbacks"] == 2 and d["graph_replays"] == 2


def test_static_graph_runs_direct_on_cpu(fresh_dynamo, delta):
    """Nothing to pad: on CPU a replay would only add copies, so the graph is called directly
    (a device captures it on its second call: tests/graphs/test_runners.py)."""
    f = compile_step(lambda x, w: (x @ w).relu(), speculative_config=None)
    x, w = torch.randn(4, 6), torch.randn(6, 3)
    for _ in range(3):
        assert torch.equal(f(x, w), (x @ w).relu())
    assert delta() == {}


def test_inductor_lowering_pads_and_matches(fresh_dynamo, delta):
    def step(tokens, drafts):
        B, K = drafts.shape
        h = torch.tanh(EMB[tokens].view(B, K + 1, V) * 0.7)
        return h.argmax(-1), (h.amax(-1) > 0.5).sum(-1) + (drafts >= 0).sum(-1)

    f = compile_step(step, lowering="inductor")
    gen = torch.Generator().manual_seed(6)
    for B in (2, 5, 3, 8, 11):
        tokens = mark_token_dim(torch.randint(0, 40, (B * 4,), generator=gen), group="tokens")
        drafts = mark_token_dim(torch.randint(-1, V, (B, 3), generator=gen))
        out, ref = f(tokens, drafts), step(tokens, drafts)
        assert same(out, ref), B
    d = delta()
    assert d["graph_replays"] == 5 and d["graphs_captured"] == 5  # 1, 2, 4, 8, 16 requests


def test_size_oblivious_dynamo_needs_no_size1_graph(fresh_dynamo, delta):
    """Backed token dims (group=None) with backed_size_oblivious: Dynamo does not specialise
    B=1 for this step either: one graph, one ladder."""
    import torch.fx.experimental._config as fx_config
    stats = torch._dynamo.utils.counters["stats"]
    g0 = stats["unique_graphs"]
    gen = torch.Generator().manual_seed(0)
    with fx_config.patch(backed_size_oblivious=True):
        f = compile_step(toy_step)
        for B in (1, 2, 5, 1, 3, 16):
            args = make_inputs(B, 3, gen, mark=False)[:3]
            for a in args:
                mark_token_dim(a, group=None)
            assert same(f(*args), toy_step(*args))
    assert stats["unique_graphs"] == g0 + 1
    assert delta() == {"graphs_captured": 5, "graph_replays": 6}  # 1, 2, 4, 8, 16 requests


def test_dynamic_k_rounding_warns_once_across_graphs(fresh_dynamo, delta):
    import warnings
    f = compile_step(toy_step, speculative_config=DYNAMIC_K, capture_sizes=[6, 16, 30])
    gen = torch.Generator().manual_seed(11)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for K in (1, 2, 3, 1):
            args = make_inputs(2, K, gen)[:3]
            assert same(f(*args), toy_step(*args))
    msgs = [str(w.message) for w in rec if issubclass(w.category, CaptureSizeWarning)]
    assert len(msgs) == 1 and "K=2: 16->18" in msgs[0] and "K=3: 6->8" in msgs[0], msgs
    # tokens: K=1 [6, 16, 30]; K=2 [6, 18, 30]; K=3 [8, 16, 32] -> 9 graphs
    assert delta()["graphs_captured"] == 9


def draw_step(x):
    return x * 2 + torch.rand(x.shape[0], 3)


def test_the_capturing_call_sees_eagers_random_stream():
    """Capture runs draw from a forked CPU generator: the first call (the one that captures
    every size) and the later ones return exactly eager's draws from the same RNG state."""
    step = compile_step(draw_step)
    for call, B in enumerate([3, 5, 3]):
        x = torch.randn(B, 3)
        torch.manual_seed(100 + call)
        want = draw_step(x)
        torch.manual_seed(100 + call)
        got = step(x)
        assert torch.equal(got, want), (call, B)


def test_an_output_without_whole_rows_returns_whole_at_exact_sizes(fresh_dynamo, delta):
    """`(x * 2)[1:]` has B-1 rows: the step is replayed at captured sizes only (exact), and
    that output is returned whole. It used to be given a token dim whose rows per unit were
    learnt at the first replay: 0 at B=1, so B=2 silently returned an empty tensor for
    eager's one row (and a first replay at B=4 failed: 'output dim 0 of size 3 is not a
    multiple of 4 units')."""
    def step(x):
        y = x * 2
        return y, y[1:]

    f = torch.compile(step, backend="npuspec", options={"lowering": "eager", "max_num_seqs": 8})
    for B in (1, 2, 4, 3, 2):
        x = mark_token_dim(torch.randn(B, V))
        got, want = f(x), step(x)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), (B, got, want)
    d = delta()
    assert d["graph_replays"] == 4 and d["eager_fallbacks"] == 1  # B=3 is not a captured size
