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
        assert d.get("npuspec_compile.capture_dropped") == 1, d
        again = _run(f, pick_by_item, (tp, toks))  # compiled now, without the flags
    assert "npuspec_compile.eager_frames" not in again, again
    assert "npuspec_compile.capture_dropped" not in again, again
    named = [r.getMessage() for r in caplog.records if r.name == "npuspec.compile"]
    assert len(named) == 2 and all("pick_by_item" in m for m in named), named
    assert "IndexError" in named[0] and "later calls compile it without them" in named[1]
    # Dynamo's own report of it is not passed on
    assert not any("WON'T CONVERT" in r.getMessage() for r in caplog.records)
    # without the flags the same function compiles as the later calls did (it breaks at
    # .item() inside the loop, so Dynamo runs that frame as Python, with no error)
    torch._dynamo.reset()
    plain = torch.compile(pick_by_item, backend="npuspec", options={"capture": False})
    by_torch = _run(plain, pick_by_item, (tp, toks))
    assert "npuspec_compile.eager_frames" not in by_torch
    assert by_torch["graphs"] == again["graphs"], (by_torch, again)


def finished_rows_step(logits, drafts, done):
    """EAGLE's batched greedy shape: counts read back with .tolist(), then a Python loop with
    an `if` on a tensor. With the capture flags the .tolist() no longer breaks the graph, so
    the break lands inside the loop and Dynamo skips the whole frame."""
    tgt = logits.argmax(-1)                                   # [B, K+1]
    n = (drafts == tgt[:, :-1]).int().cumprod(1).sum(1)      # [B]
    counts = n.tolist()
    for b in range(len(counts)):
        if done[b]:
            counts[b] = 0
    return tgt, torch.tensor(counts)


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
def test_a_frame_skipped_with_the_flags_compiles_without_them_from_the_next_call(lowering):
    logits, drafts, _ = _inputs()
    done = torch.tensor([0, 1, 0, 0, 1, 0], dtype=torch.bool)
    torch._dynamo.reset()
    f = npuspec.compile(finished_rows_step, options={"lowering": lowering, "capture": False})
    first = _run(f, finished_rows_step, (logits, drafts, done))
    assert first.get("npuspec_compile.capture_dropped") == 1, first
    assert first["graphs"] == 0 and "verify_patterns_matched" not in first, first
    later = _run(f, finished_rows_step, (logits, drafts, done))
    assert "npuspec_compile.capture_dropped" not in later, later
    assert later.get("verify_patterns_matched", 0) >= 1, later  # as torch.compile fuses it
    assert not torch._dynamo.config.capture_scalar_outputs  # the flags stay off outside


def _one_row(logits, drafts, stop):
    """One request (a [1, ...] slice), HF assisted-decoding style: the count, one less when
    the request stops on a full match, and the kept tokens sliced by it."""
    tgt = logits.argmax(-1)                                            # [1, K+1]
    n = ((~(drafts == tgt[:, :-1])).cumsum(dim=-1) < 1).sum()
    if stop and n == drafts.shape[1]:
        n -= 1
    return tgt[:, : n + 1], n


def per_row_step(logits, drafts, stop):
    out = []
    for b in range(len(stop)):
        out += _one_row(logits[b:b + 1], drafts[b:b + 1], stop[b])
    return tuple(out)


@pytest.mark.parametrize("dynamo_logs", ["default", "silenced"])
def test_a_helper_that_fails_with_the_flags_compiles_without_them_from_the_next_call(
        dynamo_logs, caplog):
    """Also with Dynamo's logs silenced (the held-out report runs so): its WON'T CONVERT
    record, which names the failing frame, is still seen, and nothing silenced is shown."""
    import logging
    dyn = logging.getLogger("torch._dynamo")
    level = dyn.level
    if dynamo_logs == "silenced":
        dyn.setLevel(logging.ERROR)
    try:
        _helper_case(caplog)
    finally:
        dyn.setLevel(level)
    if dynamo_logs == "silenced":
        assert not [r for r in caplog.records
                    if r.name.startswith("torch._dynamo") and r.levelno < logging.ERROR]


def _helper_case(caplog):
    logits, drafts, _ = _inputs()
    stop = [True, False, False, True, False, False]  # Python bools: `n == K` is then read
    torch._dynamo.reset()                             # as a bool, which fails with the flags
    f = npuspec.compile(per_row_step, options={"capture": False})
    first = _run(f, per_row_step, (logits, drafts, stop))
    assert first.get("npuspec_compile.eager_frames", 0) >= 1, first  # _one_row, with the flags
    assert first.get("npuspec_compile.capture_dropped") == 1, first
    later = _run(f, per_row_step, (logits, drafts, stop))
    assert "npuspec_compile.eager_frames" not in later, later
    assert later.get("verify_patterns_matched", 0) >= 1, later


def test_fullgraph_raises_instead_of_running_eagerly():
    torch._dynamo.reset()
    f = npuspec.compile(pick_by_item, fullgraph=True, options={"capture": False})
    with pytest.raises(Exception, match="SymInt"):
        f(torch.rand(3, 10), torch.tensor([1, 4, 7]))
