"""A prefix-count candidate that mixes rows is never proven (issue 34, item 1).

The prefix proof evaluates a candidate on a batch holding every mask once. `acc - acc.min()`
equals the count on that batch (its all-False row makes the minimum 0) and differs on real
batches; before `passes/rowlocal.py` it was rewritten into the bare count, and the README's
greedy step followed by a batch reduction returned [3, 1, 1] where eager gave [2, 0, 0]."""
import pytest
import torch

from npuspec import counters
from npuspec.passes import prefix


def greedy_verify(target_logits, draft_ids):  # the README's step
    target = target_logits.argmax(-1)
    accepted = (target[:, :-1] == draft_ids).int().cumprod(-1).sum(-1)
    bonus = target.gather(1, accepted[:, None].long()).squeeze(1)
    return accepted, bonus


def rel_min(logits, drafts):
    acc, _ = greedy_verify(logits, drafts)
    return acc - acc.min()


def _batch(b, seed, k=3, v=50):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, k + 1, v, generator=g)
    drafts = logits.argmax(-1)[:, :k].clone()
    for i in range(b):  # every request accepts at least one draft
        j = int(torch.randint(1, k + 1, (), generator=g))
        if j < k:
            drafts[i, j] = (drafts[i, j] + 1) % v
    return logits, drafts


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
def test_readme_step_then_batch_min_equals_eager(lowering):
    f = torch.compile(rel_min, backend="npuspec",
                      options={"capture": False, "lowering": lowering})
    before = counters.snapshot()
    for b in (4, 3, 5):  # the second call recompiles with a symbolic batch
        logits, drafts = _batch(b, b)
        assert torch.equal(f(logits, drafts), rel_min(logits, drafts)), b
    # the count itself is still fused, in both graphs
    assert counters.delta(before).get("verify_patterns_matched.greedy_accept", 0) == 2


def aten_graph(fn, ok):
    """The ATen graph AOT autograd traces for fn(ok) with a symbolic batch (what the passes
    see inside the backend); its first bool [B, K] node computed from the input is `ok`."""
    from torch._functorch.aot_autograd import aot_module_simplified
    graphs = []

    def backend(gm, example):
        return aot_module_simplified(gm, example, fw_compiler=lambda g, _: graphs.append(g) or g)

    x = ~ok
    torch._dynamo.mark_dynamic(x, 0)
    torch.compile(lambda x: fn(~x), backend=backend, fullgraph=True)(x)
    return graphs[-1]


def _count(ok):
    return ok.int().cumprod(1).sum(1)


CROSS_ROW = {
    "minus_min": lambda ok: _count(ok) - _count(ok).min(),
    "minus_first_row": lambda ok: _count(ok) - _count(ok)[0],
    "minus_sorted_first": lambda ok: _count(ok) - _count(ok).sort(0).values[0],
    "minus_amin_keepdim": lambda ok: (_count(ok)[:, None] - _count(ok)[:, None].amin(0)).squeeze(1),
    "times_any_full": lambda ok: _count(ok) * (_count(ok).max() == ok.shape[1]),
}


@pytest.mark.parametrize("name", sorted(CROSS_ROW))
def test_cross_row_candidates_are_left_as_written(name):
    fn = CROSS_ROW[name]
    gm = aten_graph(fn, torch.ones(6, 4, dtype=torch.bool))
    assert not isinstance(_flag(gm).meta["val"].shape[0], int)  # the batch is symbolic
    prefix.prove_prefix_counts(gm.graph)  # the inner counts may be proven; the result not
    gm.recompile()
    ok = torch.tensor([[1, 1, 0, 1], [1, 0, 0, 0], [1, 0, 1, 1]], dtype=torch.bool)
    want = fn(ok)
    assert not torch.equal(want, _count(ok))  # the batch tells the two apart
    assert torch.equal(run_graph(gm, ~ok), want), name


def test_row_local_accepts_row_wise_spellings():
    """The proof's own spellings stay provable under a symbolic batch."""
    def where_min(ok):
        pos = torch.arange(ok.shape[1])
        return torch.where(~ok, pos, ok.shape[1]).min(dim=1).values

    def masked(ok):
        limits = (ok == 0).max(1).indices
        limits[~(ok == 0).any(1)] = ok.shape[1]
        return limits

    def ones_loop(ok):
        alive, n = torch.ones_like(ok[:, 0]), torch.zeros_like(ok[:, 0], dtype=torch.long)
        for i in range(ok.shape[1]):
            alive = alive & ok[:, i]
            n = n + alive.long()
        return n

    ok = torch.tensor([[1, 1, 0, 1], [1, 1, 1, 1], [0, 0, 1, 1]], dtype=torch.bool)
    for fn in (where_min, masked, ones_loop):
        gm = aten_graph(fn, torch.ones(6, 4, dtype=torch.bool))
        assert prefix.prove_prefix_counts(gm.graph) >= 1, fn.__name__
        gm.recompile()
        assert torch.equal(run_graph(gm, ~ok), _count(ok)), fn.__name__


def _flag(gm):
    return next(n for n in gm.graph.nodes if n.target is torch.ops.aten.bitwise_not.default)


def run_graph(gm, x):
    """Call an AOT forward graph: SymInt placeholders get the batch size, the tensor x."""
    args = [x.shape[0] if not isinstance(n.meta.get("val"), torch.Tensor) else x
            for n in gm.graph.nodes if n.op == "placeholder"]
    out = gm(*args)
    return out[0] if isinstance(out, (tuple, list)) else out
