"""One draft per request on flat [B] ids (passes/rewrites/k_one.py): `draft == argmax` as the
accepted-prefix count at K = 1, matched as `npuspec::greedy_accept`; every other compare left
alone.

Three ways: compiled equals eager (torch.equal), the op appears, the counters moved
(`verify_patterns_matched.greedy_accept`, `canonical_rewrites.k_one`)."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from npuspec.passes.rewrites import k_one
from passes_helpers import three_way

B, V = 6, 17


def _inputs(seed, dtype=torch.int64):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, V, generator=g)
    drafts = logits.argmax(-1).to(dtype)
    drafts[::2] = torch.randint(0, V, (B // 2,), generator=g, dtype=dtype)
    drafts[1] = -1  # a placeholder never equals an id
    return drafts, logits


def spec_len_1(drafts, logits, bonus):
    # vllm-ascend's rejection_greedy_sample_spec_len_1: the bonus where the draft is accepted
    out = torch.full((drafts.shape[0], 2), -1, dtype=bonus.dtype)
    target = logits.argmax(dim=-1).view(-1)
    same = drafts == target
    out[:, 0] = target.to(bonus.dtype)
    out[:, 1] = torch.where(same, bonus, out[:, 1])
    return out


def chain_of_two(cands, logits):
    # SGLang's two-token chain: the draft is cands[:, 1], the target the first argmax row
    bs = cands.shape[0]
    target = logits.argmax(dim=-1).reshape(bs, 2)
    hit = cands[:, 1] == target[:, 0]
    return target.flatten(), hit.long() + 1, hit.int()


def spec_len_1_int32(drafts, logits, bonus):
    # the same with int32 ids: the target cast alike, so the compare is int32 == int32
    target = logits.argmax(dim=-1).int()
    return torch.stack([target, torch.where(drafts == target, bonus, -1)], 1)


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
@pytest.mark.parametrize("fn,dtype", [(spec_len_1, torch.int64), (spec_len_1_int32, torch.int32),
                                      (spec_len_1, torch.int32)],
                         ids=["int64", "int32", "int32_drafts_int64_argmax"])
def test_spec_len_1_becomes_greedy_accept(lowering, fn, dtype, no_fx_cache):
    """int32_drafts_int64_argmax: vllm-ascend hands int32 drafts to the int64 argmax."""
    drafts, logits = _inputs(1, dtype)
    bonus = torch.arange(100, 100 + B, dtype=dtype)
    three_way(fn, (drafts, logits, bonus), lowering=lowering, family="greedy_accept",
              appear=["npuspec.greedy_accept"])
    assert three_way.last_delta.get("canonical_rewrites.k_one", 0) == 1


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
def test_chain_of_two_becomes_greedy_accept(lowering, no_fx_cache):
    drafts, logits = _inputs(2)
    logits2 = torch.stack([logits, torch.randn(B, V)], 1).reshape(B * 2, V)
    cands = torch.stack([torch.zeros(B, dtype=torch.long), drafts], 1)
    three_way(chain_of_two, (cands, logits2), lowering=lowering, family="greedy_accept",
              appear=["npuspec.greedy_accept"])
    assert three_way.last_delta.get("canonical_rewrites.k_one", 0) == 1


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
def test_spec_len_1_under_a_dynamic_batch(lowering, no_fx_cache):
    from npuspec import counters
    f = torch.compile(spec_len_1, backend="npuspec", options={"lowering": lowering,
                                                              "capture": False})
    before = counters.snapshot()
    for b in (6, 5, 4):
        drafts, logits = _inputs(b)
        args = (drafts[:b], logits[:b], torch.arange(b))
        assert torch.equal(f(*args), spec_len_1(*args)), b
    assert counters.delta(before).get("verify_patterns_matched.greedy_accept", 0) == 2


def test_values_on_every_case():
    """n = (a[:, None] == b[:, None]).cumprod(1).sum(1) is `a == b` as 0/1 for any ids."""
    a = torch.tensor([0, 1, -1, 2**40, -(2**62), 5])
    b = torch.tensor([0, 2, -1, 2**40, 2**62, 4])
    n = (a[:, None] == b[:, None]).cumprod(1).sum(1)
    assert torch.equal(n, (a == b).long()) and torch.equal(n.bool(), a == b)


# ordinary compares: not a K = 1 verify step ---------------------------------------------------
def plain_eq(a, b):
    return torch.where(a == b, a, b)


def accuracy(ids, logits):
    return (logits.argmax(-1) == ids).float().mean()


def accuracy_long_sum(ids, logits):
    return (logits.argmax(-1) == ids).long().sum()


def count_bool_sum(ids, logits):
    return (logits.argmax(-1) == ids).sum()


def float_where(ids, logits):
    return torch.where(logits.argmax(-1) == ids, 1.0, 0.0)


def two_argmaxes(ids, logits):
    return (logits.argmax(-1) == (logits * 2).argmax(-1)).long()


def argmax_over_batch(ids, logits):
    return (logits.t().argmax(0) == ids).long()


def float_values(ids, logits):
    return (logits.amax(-1) == ids.float()).long()


def mask_feeds_logic(ids, logits):
    return ((logits.argmax(-1) == ids) & (ids > 3)).long()


ORDINARY = [plain_eq, accuracy, accuracy_long_sum, count_bool_sum, float_where, two_argmaxes,
            argmax_over_batch, float_values, mask_feeds_logic]


@pytest.mark.parametrize("fn", ORDINARY, ids=[f.__name__ for f in ORDINARY])
def test_ordinary_compares_are_untouched(fn):
    ids, logits = _inputs(3)
    args = (ids, ids.flip(0)) if fn is plain_eq else (ids, logits)
    gm = make_fx(fn, tracing_mode="fake")(*args)
    before = str(gm.graph)
    assert k_one.apply(gm.graph, "aten") == 0
    assert str(gm.graph) == before
    three_way(fn, args, matched=0, gone=["npuspec."])


def test_two_dim_compare_is_left_to_the_prefix_proof():
    """A [B, 1] mask is not flat: k_one leaves it, the prefix proof takes it (K = 1)."""
    def step(ids, logits):
        return (ids[:, None] == logits.argmax(-1)[:, None]).long().cumprod(1).sum(1)
    ids, logits = _inputs(4)
    gm = make_fx(step, tracing_mode="fake")(ids, logits)
    assert k_one.apply(gm.graph, "aten") == 0
    three_way(step, (ids, logits), family="greedy_accept", appear=["npuspec.greedy_accept"])
    assert three_way.last_delta.get("canonical_rewrites.k_one", 0) == 0
