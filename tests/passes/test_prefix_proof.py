"""Accepted-prefix counts in the spellings codebases use, proven by exhaustive evaluation over
all 2^K masks (passes/prefix.py) and then matched as one greedy accept (issue 13, point 6).

Each step is our own transcription of an idiom; the comment names where it is seen. Three-way
rule: eager-equal outputs, the npuspec op in the graph, the family counter moved."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from npuspec.passes import prefix
from passes_helpers import three_way

B, K, V = 4, 5, 29


def _inputs(seed, b=B, k=K):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, k + 1, V, generator=g)
    t = logits.argmax(-1)[:, :k]
    keep = torch.rand(b, k, generator=g) < 0.75
    drafts = torch.where(keep, t, torch.randint(0, V, (b, k), generator=g))
    drafts[0] = t[0]  # one row accepts everything
    return logits, drafts


def _ok(logits, drafts):
    return drafts == logits.argmax(-1)[:, :drafts.shape[1]]


def first_reject_argmax(logits, drafts):
    # the index of the first rejection, K when there is none (EAGLE / SGLang-style)
    ok = _ok(logits, drafts)
    return torch.where(ok.all(dim=1), drafts.shape[1], (~ok).int().argmax(dim=1))


def first_reject_max_indices(logits, drafts):
    ok = _ok(logits, drafts)
    return torch.where(ok.all(1), drafts.shape[1], (~ok).long().max(dim=1).indices)


def where_min(logits, drafts):
    # first rejected position via where + min (MLX-LM-style)
    ok = _ok(logits, drafts)
    pos = torch.arange(drafts.shape[1])
    return torch.where(~ok, pos, drafts.shape[1]).min(dim=1).values


def cumsum_eq_arange(logits, drafts):
    # prefix positions i where the running count of accepts equals i + 1
    ok = _ok(logits, drafts)
    return (ok.int().cumsum(1) == torch.arange(1, drafts.shape[1] + 1)).sum(1)


def unrolled_loop(logits, drafts):
    # a per-position loop with an "alive" mask (LMDeploy / hand-written engines)
    ok = _ok(logits, drafts)
    alive = torch.ones_like(ok[:, 0])
    n = torch.zeros_like(ok[:, 0], dtype=torch.long)
    for i in range(drafts.shape[1]):
        alive = alive & ok[:, i]
        n = n + alive.long()
    return n


def float_cumprod_keepdim(logits, drafts):
    # float mask, keepdim sum, cast back (lucidrains-style). A float count of 0/1 flags is
    # exact, so it is the prefix count (test_near_miss.py used to list it as a near miss)
    ok = _ok(logits, drafts)
    return ok.float().cumprod(dim=-1).sum(dim=-1, keepdim=True).long()


def not_cumsum_int32(logits, drafts):
    ok = _ok(logits, drafts)
    return ((~ok).int().cumsum(-1) == 0).int().sum(-1).int()


def float_count(logits, drafts):
    ok = _ok(logits, drafts)
    return ok.float().cumprod(dim=-1).sum(dim=-1)  # stays float


def reject_cumsum_eq0(logits, drafts):
    # lucidrains' find_first_true_index over the rejections: the count of leading Falses of
    # `drafts != target`; `~(a != b)` is `a == b` for every value, so it is the accept count
    rej = drafts != logits.argmax(-1)[:, :drafts.shape[1]]
    return (rej.cumsum(dim=-1) == 0).sum(dim=-1)


def vllm_v0_limits(logits, drafts):
    # vLLM v0 rejection sampler's output limits: first zero of `accepted`, K when none
    accepted = _ok(logits, drafts)
    limits = (accepted == 0).max(1).indices
    limits[~(accepted == 0).any(1)] = drafts.shape[1]
    return limits


SPELLINGS = [reject_cumsum_eq0, vllm_v0_limits, float_count, first_reject_argmax, first_reject_max_indices, where_min, cumsum_eq_arange,
             unrolled_loop, float_cumprod_keepdim, not_cumsum_int32]


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
@pytest.mark.parametrize("fn", SPELLINGS, ids=[f.__name__ for f in SPELLINGS])
def test_spelling_becomes_greedy_accept(fn, lowering, no_fx_cache):
    three_way(fn, _inputs(3), family="greedy_accept", appear=["npuspec.greedy_accept"], seed=1,
              lowering=lowering)


def test_k1_bare_compare():
    # K = 1: the count is the one accept flag
    def step(logits, drafts):
        return _ok(logits, drafts)[:, 0].long()
    three_way(step, _inputs(4, k=1), family="greedy_accept", appear=["npuspec.greedy_accept"])


def test_a_near_miss_is_not_rewritten():
    """The number of accepts (not the prefix) differs on some mask: left as written."""
    def step(logits, drafts):
        return _ok(logits, drafts).long().sum(1)
    three_way(step, _inputs(5), matched=0, gone=["npuspec.greedy_accept"])


def test_leading_false_counts_are_proven_over_the_negated_mask():
    """`(r.cumsum(1) == 0).sum(1)` counts leading Falses: proven, rewritten over `~r`; an
    order comparison stays negated (its complement differs for NaN)."""
    def step(u, ratio):
        return ((u > ratio).cumsum(dim=-1) == 0).sum(dim=-1)

    u, r = torch.rand(3, 4), torch.rand(3, 4)
    gm = make_fx(step, tracing_mode="fake")(u, r)
    assert prefix.prove_prefix_counts(gm.graph) == 1
    gm.recompile()
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.bitwise_not.default in targets and torch.ops.aten.cumsum.default not in targets
    u[0, 1] = float("nan")
    assert torch.equal(gm(u, r), step(u, r))


def test_proof_checks_every_mask():
    """A count equal to the prefix on all masks but one is refused."""
    def almost(ok):
        n = ok.cumprod(1).sum(1)  # the canonical spelling: nothing to rewrite
        bad = ok[:, 0] & ~ok[:, 1] & ok[:, 2] & ok[:, 3] & ~ok[:, 4]  # one mask of 32
        return torch.where(bad, n + 1, n)

    def exact(ok):
        return torch.where(ok.all(1), 5, (~ok).int().argmax(1))

    ok = torch.ones(3, 5, dtype=torch.bool)
    for fn, want in ((almost, 0), (exact, 1)):
        gm = make_fx(fn, tracing_mode="fake")(ok)
        assert prefix.prove_prefix_counts(gm.graph) == want, fn.__name__


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
def test_whole_step_with_a_proven_count_is_one_verify_op(lowering, no_fx_cache):
    """The count proven, the rest of the greedy step (bonus token) matches the whole-step
    family: one `rejection_sample` call."""
    def step(logits, drafts):
        target = logits.argmax(-1)
        ok = drafts == target[:, :-1]
        n = torch.where(ok.all(dim=1), drafts.shape[1], (~ok).int().argmax(dim=1))
        bonus = target.gather(1, n[:, None]).squeeze(1)
        return n, bonus
    three_way(step, _inputs(6), family="greedy_verify", appear=["npuspec.rejection_sample"],
              lowering=lowering)
