"""kernels/race_rows_cpu.py against the PyTorch path it replaces in the composed mode: the race
scores of row n bit for bit (NaN, signed zeros, infinities, zero draws included), over every
mode it takes, the layouts the op meets, 1 and 2 threads and a V that is no multiple of the
vector width; and None (the PyTorch path) for what it does not take."""
import itertools

import pytest
import torch

from npuspec.kernels import race_rows_cpu
from npuspec.kernels.accept import _residual, residual_score
from npuspec.kernels.verify_composed import _row_n, _row_sums

pytestmark = pytest.mark.skipif(not race_rows_cpu.available(), reason="no C++ toolchain")

B, K, V = 5, 3, 101


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(B, K + 1, V, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(B, K, V, generator=g) * 2, -1)
    q[0, :, :7] = p[0, :K, :7]                          # p - q = +0.0 exactly
    q[1, 0, 3] = float("nan")
    p[2, 1, 4] = float("inf")
    q[3, 2, 5] = float("inf")
    p[4, 0, 6] = -0.0
    for v in (12, V - 4):                               # -0.0 - +0.0 = -0.0 (vector, tail)
        p[:, :K, v], q[:, :, v] = -0.0, 0.0
    q[:, :, V - 1] = float("nan")                       # the scalar tail too
    e = torch.empty(B, K, V).exponential_(generator=g)
    e[0, :, 9] = 0.0
    e[1, :, 10] = float("inf")
    e[:, :, V - 2] = float("inf")
    e[:, :, V - 3] = 0.0
    nk = torch.tensor([0, 1, 2, 0, 2])
    return p, q, e, nk


def _bits(t):
    return t.contiguous().view(torch.int32)


def _reference(pk, q, e, nk, nonneg, floor, normalize, sampler, guard, fill):
    b = torch.arange(B)
    r = _residual(_row_n(pk, b, nk, K, V), _row_n(q, b, nk, K, V), "none", nonneg, floor)
    if normalize == "row":
        r.div_(_row_sums(r, B * K))
    return residual_score(r, _row_n(e, b, nk, K, V), sampler, guard, fill)


MODES = [(nn, fl, nz, s, gd)
         for nn, nz, s, gd in itertools.product(("clamp", "where", "none"), ("none", "row"),
                                                ("race", "race_mul"), ("none", "zero_inf"))
         for fl in ((0.0, 1e-5) if nn == "clamp" else (0.0,))
         if gd == "none" or s == "race"]


@pytest.mark.parametrize("mode", MODES, ids=lambda m: "-".join(map(str, m)))
@pytest.mark.parametrize("threads", [1, 2])
def test_scores_equal_the_pytorch_path_bit_for_bit(mode, threads):
    nonneg, floor, normalize, sampler, guard = mode
    fill = -1e10
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for seed in range(2):
            p, q, e, nk = _inputs(seed)
            for e_layout in (e, e[:, :1]):                # one draw vector per row, or per request
                pk = p[:, :K]                             # sliced: rows K + 1 apart
                sums = None if normalize == "none" else (lambda r: _row_sums(r, B * K))
                got = race_rows_cpu.race_scores(pk, q, e_layout, nk, K, nonneg, floor, sums,
                                                sampler, guard, fill)
                want = _reference(pk, q, e_layout, nk, nonneg, floor, normalize, sampler,
                                  guard, fill)
                assert got is not None
                assert torch.equal(_bits(got[0]), _bits(want)), (mode, seed)
                assert torch.equal(got[1], want.argmax(-1)), (mode, seed, got[1])
    finally:
        torch.set_num_threads(before)


def test_what_it_does_not_take_goes_the_pytorch_way():
    p, q, e, nk = _inputs(0)
    pk = p[:, :K]
    args = ("clamp", 0.0, None, "race", "none", 0.0)
    assert race_rows_cpu.race_scores(pk.bfloat16(), q, e, nk, K, *args) is None   # dtype
    assert race_rows_cpu.race_scores(pk, q, e, nk, K, "clamp", 0.0, None, "gumbel", "none",
                                     0.0) is None                                   # log
    v_outer = q.transpose(1, 2).contiguous().transpose(1, 2)                       # V not inner
    assert race_rows_cpu.race_scores(pk, v_outer, e, nk, K, *args) is None


@pytest.mark.parametrize("V_", [1, 15, 16, 17, 40, 4000])
def test_argmax_takes_what_torch_argmax_takes(V_):
    """Ties, signed zeros, NaN first or late, -inf rows, in the vector body and the tail."""
    g = torch.Generator().manual_seed(V_)
    rows = [torch.randint(-3, 4, (V_,), generator=g).float() for _ in range(6)]  # many ties
    rows.append(torch.full((V_,), float("-inf")))
    z = torch.zeros(V_)
    z[::2] = -0.0
    rows.append(z)
    for pos in {0, V_ // 2, V_ - 1}:
        r = torch.randn(V_, generator=g)
        r[pos] = float("nan")
        rows.append(r)
    x = torch.stack(rows)                                                  # [R, V]
    R = x.shape[0]
    zero = torch.zeros(R, 1, V_)
    one = torch.ones(R, 1, V_)
    got = race_rows_cpu.race_scores(x[:, None], zero, one, torch.zeros(R, dtype=torch.int64), 1,
                                    "none", 0.0, None, "race", "none", 0.0)
    assert got is not None and torch.equal(_bits(got[0]), _bits(x))
    assert torch.equal(got[1], x.argmax(-1)), (got[1], x.argmax(-1))


@pytest.mark.parametrize("normalize", ["none", "row"])
def test_flat_rows_equal_the_pytorch_path(normalize):
    """The ragged mode's layout: row t[b] of flat p, q [N, V] against e [B, V]."""
    p, q, e, _ = _inputs(3)
    pf, qf = p[:, :K].reshape(B * K, V), q.reshape(B * K, V)             # N = B * K flat rows
    t = torch.tensor([0, 4, 8, 9, 14])
    ef = e[:, 0].contiguous()
    sums = None if normalize == "none" else (lambda r: _row_sums(r, B * K))
    got = race_rows_cpu.race_flat_rows(pf, qf, ef, t, "clamp", 1e-5, sums, "race", "none", 0.0)
    r = _residual(pf[t], qf[t], "none", "clamp", 1e-5)
    if normalize == "row":
        r.div_(_row_sums(r, B * K))
    want = residual_score(r, ef, "race")
    assert got is not None and torch.equal(_bits(got[0]), _bits(want))
    assert torch.equal(got[1], want.argmax(-1))


@pytest.mark.parametrize("one_hot", [False, True])
@pytest.mark.parametrize("e_rows", [0, K + 1])
def test_probability_mode_takes_the_same_tokens_with_and_without_it(one_hot, e_rows, monkeypatch):
    """probs_verify through race_probs_rows against its PyTorch branch (the library hidden):
    rows with and without a draft at n, the bonus row, K = 0, NaN / inf / zero draws."""
    from npuspec.kernels.verify_probs import probs_verify
    for seed in range(4):
        p, q, e, _ = _inputs(seed)
        g = torch.Generator().manual_seed(seed)
        ids = torch.multinomial(q.reshape(-1, V).nan_to_num(0.5).clamp_min(0), 1,
                                generator=g).reshape(B, K)
        ids[0] = p[0, :K].argmax(-1)                   # likely all accepted: the bonus row
        ids[1, 1:] = -1                                # a request with one draft
        u = torch.rand(B, K, generator=g)
        E = (torch.empty(B, V).exponential_(generator=g) if e_rows == 0
             else torch.empty(B, K + 1, V).exponential_(generator=g))
        E[..., 9] = 0.0
        E[..., V - 2] = float("inf")
        # request 2 rejects its first draft, p's largest entry, with flat draws: the residual
        # must drop that token (the one-hot q zeroes it) or the race picks it again
        ids[2] = p[2, :K].argmax(-1)
        u[2] = 1.0
        E[2] = 1.0
        for k in (K, 0):
            pk, ids_k = p[:, :k + 1], ids[:, :k]
            qk = None if one_hot else q[:, :k]
            Ek = E if e_rows == 0 else E[:, :k + 1]
            got = probs_verify(pk, ids_k, qk, u[:, :k], Ek)
            with monkeypatch.context() as m:
                m.setattr(race_rows_cpu, "library", lambda: None)
                want = probs_verify(pk, ids_k, qk, u[:, :k], Ek)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (seed, k)
