"""rejection_sample's ragged mode (cu_num_draft_tokens given; kernels/verify_ragged.py): the op
equals `ragged_verify_ref` (every flat row's recovered token, then request by request) bit for
bit over layouts with empty and full requests, placeholder drafts, zero draft probabilities,
u = 0 and u at the ratio, greedy rows, both rules, n-gram drafts and every residual
configuration; it compiles whole; the standard rule is lossless (chi-square); its errors name
the value. Equality with vllm-ascend's own PyTorch path: tests/passes/test_ragged_vllm_ascend.py.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from npuspec.kernels import rejection_sample
from npuspec.kernels.accept import NONNEG, SAMPLERS
from npuspec.kernels.verify_ragged import ragged_verify, ragged_verify_ref
from verify_lossless import chi_square_pvalue

V = 23


def _case(seed: int, counts=(3, 0, 4, 1, 4), M: int = 4, ngram: bool = False):
    g = torch.Generator().manual_seed(seed)
    B, N = len(counts), sum(counts)
    cu = torch.tensor(counts).cumsum(0)
    p = torch.softmax(torch.randn(N, V, generator=g) * 2, -1)
    q = None if ngram else torch.softmax(torch.randn(N, V, generator=g) * 2, -1)
    ids = (torch.randint(0, V, (N,), generator=g) if q is None
           else torch.multinomial(q, 1, generator=g)[:, 0])
    if N > 3:
        ids[:2] = p[:2].argmax(-1)                       # likely accepted
        ids[N - 2] = -1                                  # a placeholder draft
        if q is not None:
            q[1, ids[1]] = 0.0                           # q(x) = 0: never accepted
    u = torch.rand(N, generator=g, dtype=torch.float64)
    if N > 4:
        u[2] = 0.0
        x = int(ids[3])
        ratio = p[3, x] if q is None else p[3, x] / q[3, x]
        u[3] = float(ratio)                              # u at the ratio, as float64
    e = torch.empty(B, V).exponential_(generator=g)
    e[0, 5] = 0.0                                         # guarded draws
    e[-1, 7] = float("inf")
    bonus = torch.randint(0, V, (B,), generator=g)
    return p, ids, q, u, e, bonus, cu, M


def _both(p, ids, q, u, e, bonus, cu, M, **kw):
    got = rejection_sample(p, ids, q, target_is_probs=True, uniforms=u, exponentials=e,
                           bonus_token_ids=bonus, cu_num_draft_tokens=cu, max_spec_len=M, **kw)
    return got, ragged_verify_ref(p, ids, q, u, e, bonus, cu, M, **kw)


LAYOUTS = [(3, 0, 4, 1, 4), (4, 4, 4), (0, 0, 0), (1,), (2, 3, 0, 1, 4, 4, 2, 1)]


@pytest.mark.parametrize("rule", ["prefix", "cumulative"])
@pytest.mark.parametrize("ngram", [False, True], ids=["probs", "ngram"])
@pytest.mark.parametrize("counts", LAYOUTS, ids=lambda c: "-".join(map(str, c)))
def test_op_equals_reference(counts, ngram, rule):
    for seed in range(4):
        case = _case(seed, counts, M=4 + seed % 2, ngram=ngram)   # M above the longest too
        greedy = torch.arange(len(counts)) % 3 == 1 if seed % 2 else None
        kw = dict(accept_rule=rule, is_greedy=greedy, residual_guard="zero_inf",
                  residual_fill=-1e10, residual_nonneg="none" if ngram else "clamp")
        got, want = _both(*case, **kw)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (seed, got, want)
        if greedy is not None:
            assert bool((got[0][greedy] == -1).all()) and bool((got[1][greedy] == 0).all())


CONFIGS = [(nz, s, nn, gd) for nz, s, nn in itertools.product(("none", "row"), SAMPLERS, NONNEG)
           for gd in ("none", "zero_inf") if gd == "none" or s == "race"]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(c))
def test_residual_configurations(cfg):
    nz, s, nn, gd = cfg
    for seed, ngram in itertools.product(range(3), (False, True)):
        case = _case(seed, ngram=ngram)
        kw = dict(residual_normalize=nz, residual_sampler=s, residual_nonneg=nn,
                  residual_guard=gd, residual_fill=-1e10 if gd != "none" else 0.0)
        got, want = _both(*case, **kw)
        assert torch.equal(got[0], want[0]), (seed, ngram, got, want)
        # native=False (the passes' ragged check): PyTorch's recovered tokens, the same ones
        torch_path = ragged_verify(*case, **kw, native=False)
        assert torch.equal(torch_path[0], want[0]) and torch.equal(torch_path[1], want[1])


def test_row_sums_off_the_contiguous_path():
    """A residual normalised per row whose q is a strided view: the sums are taken as the
    user's [N, V] residual takes them (the whole residual), not from the lone rows."""
    p, ids, q, u, e, bonus, cu, M = _case(0)
    q_wide = torch.zeros(q.shape[0], 2 * V)
    q_wide[:, ::2] = q
    qs = q_wide[:, ::2]                                   # same values, V-strided
    got, want = _both(p, ids, qs, u, e, bonus, cu, M, residual_normalize="row")
    assert torch.equal(got[0], want[0])


def test_one_request_row_sums_across_threads():
    """A single request with one draft: the user's residual is one row, summed alone (the CPU
    sum splits a lone row across threads), which the op's lone row must match."""
    prev = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            g = torch.Generator().manual_seed(threads)
            Vb = 40_000
            p = torch.softmax(torch.randn(1, Vb, generator=g), -1)
            q = torch.softmax(torch.randn(1, Vb, generator=g), -1)
            ids = torch.tensor([int(q[0].argmax())])
            u = torch.ones(1, dtype=torch.float64)        # rejected: the residual row is raced
            e = torch.empty(1, Vb).exponential_(generator=g)
            args = (p, ids, q, u, e, torch.tensor([3]), torch.tensor([1]), 1)
            got, want = _both(*args, residual_normalize="row")
            assert torch.equal(got[0], want[0])
    finally:
        torch.set_num_threads(prev)


def test_draws_made_when_not_given_and_fullgraph_compile():
    p, ids, q, u, e, bonus, cu, M = _case(1)
    torch.manual_seed(5)
    a = rejection_sample(p, ids, q, target_is_probs=True, bonus_token_ids=bonus,
                         cu_num_draft_tokens=cu, max_spec_len=M)
    torch.manual_seed(5)
    u2 = torch.rand(p.shape[0], dtype=torch.float64)   # vllm-ascend's draws, in its order
    e2 = torch.empty(cu.shape[0], V).exponential_()
    assert torch.equal(a[0], ragged_verify_ref(p, ids, q, u2, e2, bonus, cu, M)[0])

    def step(p, ids, q, u, e, bonus, cu):
        return rejection_sample(p, ids, q, target_is_probs=True, uniforms=u, exponentials=e,
                                bonus_token_ids=bonus, cu_num_draft_tokens=cu, max_spec_len=M)

    torch._dynamo.reset()
    got = torch.compile(step, fullgraph=True)(p, ids, q, u, e, bonus, cu)
    want = ragged_verify_ref(p, ids, q, u, e, bonus, cu, M)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[0].shape == (cu.shape[0], M + 1) and got[0].dtype == torch.int32


def test_standard_rule_is_lossless():
    """Each request's first emitted token follows p, whatever q drafted it (chi-square over
    40,000 one-draft requests sharing p and q rows)."""
    Vs, R = 6, 40_000
    g = torch.Generator().manual_seed(11)
    p_row = torch.softmax(torch.randn(Vs, generator=g) * 1.5, -1)
    q_row = torch.softmax(torch.randn(Vs, generator=g) * 1.5, -1)
    p, q = p_row.expand(R, Vs).contiguous(), q_row.expand(R, Vs).contiguous()
    ids = torch.multinomial(q_row, R, replacement=True, generator=g)
    u = torch.rand(R, generator=g, dtype=torch.float64)
    e = torch.empty(R, Vs).exponential_(generator=g)
    cu = torch.arange(1, R + 1)
    out, _ = rejection_sample(p, ids, q, target_is_probs=True, uniforms=u, exponentials=e,
                              bonus_token_ids=torch.zeros(R, dtype=torch.long),
                              cu_num_draft_tokens=cu, max_spec_len=1)
    counts = torch.bincount(out[:, 0].long(), minlength=Vs)
    pval, stat, df = chi_square_pvalue(counts, p_row.double())
    assert pval > 1e-3, (pval, stat, df, counts)


@pytest.mark.parametrize("bad, match", [
    (dict(target_is_probs=False), "target_is_probs=False"),
    (dict(bonus_token_ids=None), "without bonus_token_ids"),
    (dict(max_spec_len=None), "without max_spec_len"),
    (dict(max_spec_len=-2), "max_spec_len=-2"),
    (dict(max_spec_len=2.0), "max_spec_len=2.0"),
    (dict(ratio_cap=True), "ratio_cap=True"),
    (dict(block_verify=True), "accept_rule='cumulative'"),
    (dict(temperature=torch.ones(5)), "temperature given"),
    (dict(is_greedy=torch.zeros(5, dtype=torch.int64)), "is_greedy: expected bool"),
    (dict(residual_normalize="all"), "residual_normalize='all'"),
    (dict(residual_sampler="bogus"), "residual_sampler='bogus'"),
    (dict(uniforms=torch.rand(3)), r"uniforms: the ragged mode expects \[12\]"),
    (dict(exponentials=torch.rand(5, 3)), r"exponentials: the ragged mode expects \[5, 23\]"),
    (dict(uniforms=None, generators={0: torch.Generator()}), "generators given with"),
])
def test_errors_name_the_value(bad, match):
    p, ids, q, u, e, bonus, cu, M = _case(0)
    kw = dict(target_is_probs=True, uniforms=u, exponentials=e, bonus_token_ids=bonus,
              cu_num_draft_tokens=cu, max_spec_len=M)
    kw.update(bad)
    with pytest.raises(ValueError, match=match):
        rejection_sample(p, ids, q, **kw)


def test_shape_errors():
    p, ids, q, u, e, bonus, cu, M = _case(0)
    kw = dict(target_is_probs=True, uniforms=u, exponentials=e, bonus_token_ids=bonus,
              cu_num_draft_tokens=cu, max_spec_len=M)
    with pytest.raises(ValueError, match=r"takes flat probabilities \[N, V\]"):
        rejection_sample(p[None], ids, q, **kw)
    with pytest.raises(ValueError, match="draft_token_ids: expected int64"):
        rejection_sample(p, ids.int(), q, **kw)
    with pytest.raises(ValueError, match="bonus_token_ids: expected int"):
        rejection_sample(p, ids, q, **{**kw, "bonus_token_ids": bonus[:2]})
    with pytest.raises(ValueError, match="cu_num_draft_tokens: expected int"):
        rejection_sample(p, ids, q, **{**kw, "cu_num_draft_tokens": cu.float()})
    with pytest.raises(ValueError, match="belong to the ragged mode"):
        rejection_sample(p[None], ids[None], q[None], target_is_probs=True, max_spec_len=3)


def test_native_false_never_reaches_the_cpu_kernel(monkeypatch):
    """The passes' ragged check calls ragged_verify(native=False): the CPU race kernel (and
    its library) is never asked, and the tokens are the reference's."""
    from npuspec.kernels import race_rows_cpu

    def refuse(*a, **k):
        raise AssertionError("race_flat_rows called with native=False")
    monkeypatch.setattr(race_rows_cpu, "race_flat_rows", refuse)
    case = _case(1)
    got = ragged_verify(*case, native=False)
    want = ragged_verify_ref(*case)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(AssertionError, match="native=False"):
        ragged_verify(*case)
