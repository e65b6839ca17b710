"""Per-column compares as one compare (passes/rewrites/columns.py): an accept loop unrolled
over draft positions becomes a [B, K] mask whose count is proven and fused
(`npuspec::greedy_accept`, or the whole greedy step as `npuspec::rejection_sample`); partial
sets of columns and broadcast compares are left alone.

Three ways: compiled equals eager (torch.equal), the op appears and the compares are gone, the
counters moved (`verify_patterns_matched.<family>`, `canonical_rewrites.columns`)."""
import pytest
import torch

from npuspec.passes.rewrites import columns
from passes_helpers import aten_graph, compile_npuspec, three_way

B, K, V = 5, 4, 19
aten = torch.ops.aten


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, K + 1, V, generator=g)
    drafts = logits.argmax(-1)[:, :K].clone()
    for b in range(B):  # rejections at every position, and one row all accepted
        if b < K:
            drafts[b, b] = (drafts[b, b] + 1) % V
    return logits, drafts


def unrolled_eq(logits, drafts):
    # MLX-LM's accept loop, batched: a running flag per request, one column per step
    tokens = logits.argmax(-1)
    n = torch.zeros(tokens.shape[0], dtype=torch.long)
    matching = torch.ones(tokens.shape[0], dtype=torch.bool)
    for i in range(drafts.shape[1]):
        matching = matching & (tokens[:, i] == drafts[:, i])
        n = n + matching
    return tokens.gather(1, n[:, None]).squeeze(1), n


def unrolled_ne(logits, drafts):
    # the same loop spelled on mismatches: stop at the first `!=`
    tokens = logits.argmax(-1)
    n = torch.zeros(tokens.shape[0], dtype=torch.long)
    stopped = torch.zeros(tokens.shape[0], dtype=torch.bool)
    for i in range(drafts.shape[1]):
        stopped = stopped | (drafts[:, i] != tokens[:, i])
        n = n + (~stopped).long()
    return n


# the eq loop also takes the target's token after the prefix: the whole greedy step fuses
FUSES = {"eq": (unrolled_eq, "greedy_verify", "npuspec.rejection_sample"),
         "ne": (unrolled_ne, "greedy_accept", "npuspec.greedy_accept")}


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
@pytest.mark.parametrize("name", sorted(FUSES))
def test_unrolled_accept_loop_fuses(name, lowering, no_fx_cache):
    fn, family, op = FUSES[name]
    cf = compile_npuspec(fn, lowering)  # one compile; the second inputs run it again
    three_way(fn, _inputs(0), lowering=lowering, family=family, appear=(op,),
              gone=("aten.eq", "aten.ne"), compiled=cf, fresh=True)
    assert three_way.last_delta.get("canonical_rewrites.columns", 0) == 1
    three_way(fn, _inputs(1), compiled=cf, fresh=False)


def _rewrite(fn, *args):
    gm = aten_graph(fn, *args)
    n = columns.apply(gm.graph, "aten")
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return n, gm


def test_rewrite_is_exact_with_nan_and_a_wider_operand():
    a = torch.tensor([[1.0, float("nan"), 3.0, 7.0], [0.0, -0.0, 2.0, 5.0]])
    c = torch.tensor([[1.0, float("nan"), 4.0], [-0.0, 0.0, 2.0]])  # c has 3 columns, a 4

    def per_column(a, c):
        return torch.stack([a[:, i] == c[:, i] for i in range(3)], 1), a[:, 1] != c[:, 1]

    n, gm = _rewrite(per_column, a, c)
    assert n == 1
    want, got = per_column(a, c), gm(a, c)
    assert all(torch.equal(w, g) for w, g in zip(want, got))
    eqs = [x for x in gm.graph.nodes if x.target is aten.eq.Tensor]
    assert len(eqs) == 1 and list(eqs[0].meta["val"].shape) == [2, 3]  # one [B, 3] compare


@pytest.mark.parametrize("name", ["gap", "one_column", "other_tensor", "broadcast", "mixed_dims"])
def test_incomplete_or_unlike_sets_are_left_alone(name):
    a, c = torch.randint(0, 3, (4, 3)), torch.randint(0, 3, (4, 3))
    fns = {
        "gap": lambda a, c: (a[:, 0] == c[:, 0]) & (a[:, 2] == c[:, 2]),
        "one_column": lambda a, c: a[:, 0] == c[:, 0],
        "other_tensor": lambda a, c: (a[:, 0] == c[:, 0]) & (a[:, 1] == a[:, 1] * 2),
        "broadcast": lambda a, c: (a[:, None, 0] == c[None, :, 0]) & (a[:, None, 1] == c[None, :, 1]),
        "mixed_dims": lambda a, c: (a[:, 0] == c[:, 0]) & (a[0, :] == c[1, :]).any(),
    }
    n, gm = _rewrite(fns[name], a, c)
    assert n == 0
    assert torch.equal(gm(a, c), fns[name](a, c))


def test_a_dynamic_batch_fuses_too():
    from npuspec import counters
    f = compile_npuspec(unrolled_ne)
    before = counters.snapshot()
    for b in (5, 4, 3):
        args = tuple(x[:b] for x in _inputs(b))
        assert torch.equal(f(*args), unrolled_ne(*args)), b
    delta = counters.delta(before)
    assert delta.get("verify_patterns_matched.greedy_accept", 0) == 2, delta  # both compiles
    assert delta.get("canonical_rewrites.columns", 0) == 2, delta
