"""Accept masks nobody counts (passes/bare_masks.py): vLLM v1's greedy `forward_native` keeps
`(target[:, :-1] == drafts).cumprod(1)` and never sums it. The round writes a count, rebuilds
the mask from it, lets the families fuse the count, and puts back every mask no family took.

Three ways: compiled equals eager (torch.equal), greedy_accept appears and the user's cumprod
is gone, the counter moved; and a mask no family matches leaves the graph exactly as written."""
import pytest
import torch

from npuspec.passes.manager import PassManager
from passes_helpers import aten_graph, compile_npuspec, three_way

B, K, V = 6, 4, 23
PH = -1


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, K + 1, V, generator=g)
    drafts = logits.argmax(-1)[:, :K].clone()
    for b in range(K):
        drafts[b, b] = (drafts[b, b] + 3) % V  # a rejection at every position
    drafts[K, 2:] = PH                          # a shorter request, padded
    return drafts, logits


def v1_style(drafts, logits):
    # what reaches the graph of vLLM v1's greedy path before its `first_zero[has_zero]` break:
    # the accept mask, kept, and the emission built from it; no count anywhere
    target = logits.argmax(-1)
    mask = (target[:, :-1] == drafts).cumprod(dim=1)
    gen = torch.cat([mask, torch.zeros(mask.size(0), 1, dtype=mask.dtype)], 1).bool()
    return torch.where(gen, target, PH), gen == 0


def mask_twice(drafts, logits):
    # the same mask read by two users: both read the rebuilt mask
    mask = (logits.argmax(-1)[:, :-1] == drafts).cumprod(1)
    return mask * 2, mask.flip(1)


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
@pytest.mark.parametrize("fn", [v1_style, mask_twice])
def test_bare_mask_fuses_its_count(fn, lowering, no_fx_cache):
    cf = compile_npuspec(fn, lowering)  # one compile; the second inputs run it again
    three_way(fn, _inputs(0), lowering=lowering, family="greedy_accept",
              appear=("npuspec.greedy_accept",), gone=("aten.cumprod",), compiled=cf, fresh=True)
    three_way(fn, _inputs(1), compiled=cf, fresh=False)


def not_a_verify_mask(x, y):
    # a running product of flags that is not an accept test: no family matches its count
    return (x > 0).cumprod(1) + y


def counted_already(x):
    m = (x > 0).cumprod(1)
    return m.sum(1), m  # the user's own count: not a bare mask


@pytest.mark.parametrize("fn,args", [
    (not_a_verify_mask, (torch.randn(B, K), torch.ones(B, K, dtype=torch.long))),
    (counted_already, (torch.randn(B, K),)),
])
@pytest.mark.parametrize("flavor", ["aten", "inductor"])
def test_unmatched_masks_are_put_back(fn, args, flavor):
    gm = aten_graph(fn, *args)
    before = str(gm.graph)
    found = PassManager().run(gm, flavor=flavor)
    assert found == {}
    assert str(gm.graph) == before
    gm.recompile()
    want, got = fn(*args), gm(*args)
    for w, g in zip(want if isinstance(want, tuple) else (want,),
                    got if isinstance(got, tuple) else (got,)):
        assert torch.equal(w, g)


def test_a_dynamic_batch_fuses_too():
    """The recompile with a symbolic batch (the third size reuses it) fuses the count again."""
    from npuspec import counters
    f = compile_npuspec(v1_style)
    before = counters.snapshot()
    for b in (6, 4, 3):
        args = tuple(x[:b] for x in _inputs(b))
        want, got = v1_style(*args), f(*args)
        assert all(torch.equal(w, g) for w, g in zip(want, got)), b
    assert counters.delta(before).get("verify_patterns_matched.greedy_accept", 0) == 2
