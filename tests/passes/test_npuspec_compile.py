"""npuspec.compile: Dynamo's capture flags for one function only (issue 37, point 4)."""
import pytest
import torch

import npuspec
from npuspec import counters

B, K, V = 6, 4, 50


def _inputs():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, K + 1, V, generator=g)
    drafts = logits.argmax(-1)[:, :K].clone()
    drafts[::2, 2] = 0  # every other request rejects its third draft
    live = torch.tensor([1, 0, 1, 1, 0, 1], dtype=torch.bool)
    return logits, drafts, live


def live_rows_step(logits, drafts, live):
    """Verify only the live requests, picked by a boolean mask: the batch is data-dependent."""
    lg, dr = logits[live], drafts[live]
    tgt = lg.argmax(-1)                       # [b, K+1]
    n = (dr == tgt[:, :-1]).cumprod(1).sum(1)  # [b]
    return n, tgt


def first_rejection(p, q, ids):
    """gpt-fast's spelling: the first rejected position, read back with .item()."""
    px = p[torch.arange(ids.shape[0]), ids]
    qx = q[torch.arange(ids.shape[0]), ids]
    rejected = (torch.rand_like(px) > torch.minimum(torch.ones(()), px / qx)).nonzero()
    n = rejected[0].item() if rejected.shape[0] > 0 else ids.shape[0]
    return ids[:n]


def _run(f, fn, args, seed=1):
    """Eager vs compiled from one RNG state. -> the npuspec counters' delta, with "graphs":
    how many graphs Dynamo handed the backend (a break makes two)."""
    torch.manual_seed(seed)
    want = fn(*args)
    before = counters.snapshot()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    torch.manual_seed(seed)
    got = f(*args)
    for a, b in zip(want if isinstance(want, tuple) else (want,),
                    got if isinstance(got, tuple) else (got,)):
        assert torch.equal(a, b), (a, b)
    delta = counters.delta(before)
    delta["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs
    return delta


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
def test_mask_indexed_batch_traces_whole_and_fuses(lowering, no_fx_cache):
    torch._dynamo.reset()
    plain = torch.compile(live_rows_step, backend="npuspec",
                          options={"capture": False, "lowering": lowering})
    assert _run(plain, live_rows_step, _inputs())["graphs"] >= 2  # split at the mask indexing
    torch._dynamo.reset()
    f = npuspec.compile(live_rows_step, options={"capture": False, "lowering": lowering})
    d = _run(f, live_rows_step, _inputs())
    assert d["graphs"] == 1, d
    # the accepted-prefix count over the unbacked batch became the fused op
    assert d.get("verify_patterns_matched.greedy_accept") == 1, d


def test_item_and_nonzero_trace_and_flags_are_restored():
    g = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(K, V, generator=g), -1)
    q = torch.softmax(torch.randn(K, V, generator=g), -1)
    ids = torch.multinomial(q, 1, generator=g).view(K)
    flags = (torch._dynamo.config.capture_scalar_outputs,
             torch._dynamo.config.capture_dynamic_output_shape_ops)
    torch._dynamo.reset()
    d = _run(npuspec.compile(first_rejection, options={"capture": False}), first_rejection,
             (p, q, ids))
    # .nonzero() and .item() are traced; the `if` on the unbacked row count still splits
    assert d["graphs"] == 2, d
    assert (torch._dynamo.config.capture_scalar_outputs,
            torch._dynamo.config.capture_dynamic_output_shape_ops) == flags
    # a plain compile in the same process still traces with the user's flags (breaks at nonzero)
    torch._dynamo.reset()
    plain = torch.compile(first_rejection, backend="npuspec", options={"capture": False})
    assert _run(plain, first_rejection, (p, q, ids))["graphs"] > d["graphs"]


def test_decorator_forms_and_a_bad_argument():
    @npuspec.compile
    def twice(x):
        return x * 2

    @npuspec.compile(options={"capture": False}, capture=False)
    def thrice(x):
        return x * 3

    x = torch.arange(4.0)
    assert torch.equal(twice(x), x * 2) and torch.equal(thrice(x), x * 3)
    with pytest.raises(TypeError, match="npuspec.compile: fn=3 is not callable"):
        npuspec.compile(3)


def pick_by_item(tp, toks):
    """A tensor indexed by `.item()` values: PyTorch 2.13's Dynamo raises IndexError on the
    unbacked SymInt with the capture flags on (flashinfer's chain-sampling reference writes
    it this way), while it compiles without them."""
    out = []
    for s in range(toks.shape[0]):
        out.append(tp[s, toks[s].item()] * 2)
    return torch.stack(out)


def test_a_frame_that_cannot_compile_with_the_flags_runs_eagerly_named_once(caplog):
    tp, toks = torch.rand(3, 10), torch.tensor([1, 4, 7])
    torch._dynamo.reset()
    f = npuspec.compile(pick_by_item, options={"capture": False})
    with caplog.at_level("WARNING", logger="npuspec.compile"):
        d = _run(f, pick_by_item, (tp, toks))
        assert d.get("npuspec_compile.eager_frames") == 1, d
        again = _run(f, pick_by_item, (tp, toks))  # the frame stays eager, named once
    assert "npuspec_compile.eager_frames" not in again, again
    named = [r for r in caplog.records if r.name == "npuspec.compile"]
    assert len(named) == 1 and "pick_by_item" in named[0].getMessage(), named
    assert "IndexError" in named[0].getMessage()
    # Dynamo's own report of it is not passed on
    assert not any("WON'T CONVERT" in r.getMessage() for r in caplog.records)
    # without the flags the same function compiles (graph breaks at .item())
    torch._dynamo.reset()
    plain = torch.compile(pick_by_item, backend="npuspec", options={"capture": False})
    assert "npuspec_compile.eager_frames" not in _run(plain, pick_by_item, (tp, toks))


def test_fullgraph_raises_instead_of_running_eagerly():
    torch._dynamo.reset()
    f = npuspec.compile(pick_by_item, fullgraph=True, options={"capture": False})
    with pytest.raises(Exception, match="SymInt"):
        f(torch.rand(3, 10), torch.tensor([1, 4, 7]))
