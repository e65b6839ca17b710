"""The narrow verify ops of npuspec.kernels.accept: op == reference (torch.equal), fake impls."""
import pytest
import torch

from npuspec.kernels import accept


def _ids(shape, v, gen):
    return torch.randint(0, v, shape, generator=gen)


@pytest.mark.parametrize("B,K", [(1, 1), (3, 4), (17, 7), (5, 15)])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_greedy_accept_matches_reference(B, K, dtype):
    g = torch.Generator().manual_seed(B * 100 + K)
    t = _ids((B, K), 3, g).to(dtype)
    d = torch.where(torch.rand(B, K, generator=g) < 0.8, t, _ids((B, K), 3, g).to(dtype))
    d[0, -1] = -1  # a -1 draft ends the prefix
    got = torch.ops.npuspec.greedy_accept(d, t)
    assert got.dtype == torch.int64
    assert torch.equal(got, accept.greedy_accept_ref(d, t))
    # every spelling users write computes the same prefix length
    eq = d == t
    assert torch.equal(got, ((~eq).cumsum(-1) < 1).sum(-1))
    assert torch.equal(got, eq.int().cummin(-1).values.sum(-1))


def test_greedy_accept_mixed_id_dtypes():
    """int32 drafts against int64 argmax ids (TensorRT-LLM's MTP): `==` compares the values."""
    t = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2 ** 31 + 3, 3]])
    d = torch.tensor([[1, 2, 3], [0, 2, 3], [1, 3, 0]], dtype=torch.int32)
    assert torch.ops.npuspec.greedy_accept(d, t).tolist() == [3, 0, 1]
    assert torch.equal(torch.ops.npuspec.greedy_accept(d, t), accept.greedy_accept_ref(d, t))
    with pytest.raises(TypeError, match="int32 or int64"):
        accept.greedy_accept(d, t.float())


def test_greedy_accept_edges():
    t = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    d = torch.tensor([[1, 2, 3], [0, 2, 3], [1, 2, 0]])
    assert torch.ops.npuspec.greedy_accept(d, t).tolist() == [3, 0, 2]
    with pytest.raises(TypeError, match="int32 or int64"):
        accept.greedy_accept(d.float(), t.float())


@pytest.mark.parametrize("onehot", [False, True])
@pytest.mark.parametrize("B,K,V", [(1, 1, 5), (4, 3, 7), (9, 6, 33)])
def test_ratio_accept_matches_reference(onehot, B, K, V):
    g = torch.Generator().manual_seed(V)
    p = torch.softmax(torch.randn(B, K, V, generator=g), -1)
    q = None if onehot else torch.softmax(torch.randn(B, K, V, generator=g), -1)
    ids = _ids((B, K), V, g)
    u = torch.rand(B, K, generator=g)
    got = torch.ops.npuspec.ratio_accept(p, q, ids, u)
    assert torch.equal(got, accept.ratio_accept_ref(p, q, ids, u))
    # boundary: u equal to the ratio is accepted (>=), exactly as the eager idiom says
    px = p.gather(-1, ids[..., None])[..., 0]
    r = px if onehot else px / q.gather(-1, ids[..., None])[..., 0]
    assert torch.equal(torch.ops.npuspec.ratio_accept(p, q, ids, r), torch.full((B,), K))


@pytest.mark.parametrize("mode", list(accept.ACCEPT_MODES))
def test_ratio_accept_modes_match_their_spelling_at_ties_and_nan(mode):
    """Each comparison mode equals its eager spelling on ties (u == ratio) and NaN (0/0
    ratios, NaN draws): "gt" rejects a tie, "not_lt" accepts a NaN."""
    g = torch.Generator().manual_seed(7)
    B, K, V = 6, 4, 9
    p = torch.softmax(torch.randn(B, K, V, generator=g), -1)
    q = torch.softmax(torch.randn(B, K, V, generator=g), -1)
    ids = _ids((B, K), V, g)
    r = p.gather(-1, ids[..., None])[..., 0] / q.gather(-1, ids[..., None])[..., 0]
    u = torch.rand(B, K, generator=g)
    u[0] = r[0]                                   # ties
    u[1, 1] = float("nan")                        # a NaN draw
    p[2, 0, ids[2, 0]] = q[2, 0, ids[2, 0]] = 0   # a 0/0 ratio
    got = torch.ops.npuspec.ratio_accept(p, q, ids, u, mode)
    assert torch.equal(got, accept.ratio_accept_ref(p, q, ids, u, mode))
    r = p.gather(-1, ids[..., None])[..., 0] / q.gather(-1, ids[..., None])[..., 0]
    spelled = {"ge": u <= r, "gt": u < r, "not_lt": ~(u > r), "not_le": ~(u >= r)}[mode]
    assert torch.equal(got, spelled.long().cumprod(-1).sum(-1))
    assert got[0].item() == (K if mode in ("ge", "not_lt") else 0)  # the row of ties


def test_ratio_accept_zero_q_nan_rejects():
    p = torch.tensor([[[0.0, 1.0]]])
    q = torch.tensor([[[0.0, 1.0]]])
    ids = torch.tensor([[0]])  # 0/0 = nan -> rejected, like `nan >= u` in eager
    assert torch.ops.npuspec.ratio_accept(p, q, ids, torch.tensor([[0.5]])).tolist() == [0]


@pytest.mark.parametrize("normalize", accept.NORMALIZE)
@pytest.mark.parametrize("sampler", accept.SAMPLERS)
@pytest.mark.parametrize("shape", [(7,), (3, 11), (2, 3, 13)])
def test_residual_sample_matches_reference(normalize, sampler, shape):
    g = torch.Generator().manual_seed(len(shape))
    p = torch.softmax(torch.randn(shape, generator=g), -1)
    q = torch.softmax(torch.randn(shape, generator=g), -1)
    if sampler == "race":
        noise = torch.empty(shape).exponential_(generator=g)
    elif sampler == "race_mul":  # LMDeploy's 1 / E
        noise = torch.empty(shape).exponential_(generator=g).reciprocal()
    else:
        noise = -torch.log(-torch.log(torch.rand(shape, generator=g)))
    got = torch.ops.npuspec.residual_sample(p, q, noise, normalize, sampler)
    assert torch.equal(got, accept.residual_sample_ref(p, q, noise, normalize, sampler))
    probs = torch.ops.npuspec.residual_probs(p, q, normalize)
    assert torch.equal(probs, accept.residual_probs_ref(p, q, normalize))


@pytest.mark.parametrize("floor", [1e-5, 0.25, 0])
def test_residual_floor_is_clamps_min(floor):
    g = torch.Generator().manual_seed(5)
    p, q = torch.rand(3, 11, generator=g), torch.rand(3, 11, generator=g)
    e = torch.empty(3, 11).exponential_(generator=g)
    for normalize in accept.NORMALIZE:
        got = torch.ops.npuspec.residual_probs(p, q, normalize, "clamp", floor)
        assert torch.equal(got, accept.residual_probs_ref(p, q, normalize, "clamp", floor))
        want = (p - q).clamp(min=floor)
        if normalize == "none":
            assert torch.equal(got, want)
        tok = torch.ops.npuspec.residual_sample(p, q, e, normalize, "race", "clamp", floor)
        assert torch.equal(tok, accept.residual_sample_ref(p, q, e, normalize, "race", "clamp", floor))


def test_residual_bad_mode_names_the_value():
    p = torch.rand(2, 3)
    with pytest.raises(ValueError, match="normalize='sum'"):
        accept.residual_probs(p, p, "sum")
    with pytest.raises(ValueError, match="sampler='topk'"):
        accept.residual_sample(p, p, p, "none", "topk")
    with pytest.raises(ValueError, match=r"floor=1e-05 needs nonneg='clamp'"):
        accept.residual_probs(p, p, "none", "where", 1e-5)


def test_opcheck_fake_impls():
    """torch.library.opcheck: schema, fake impl and dispatcher registrations agree."""
    g = torch.Generator().manual_seed(0)
    d, t = _ids((3, 4), 3, g), _ids((3, 4), 3, g)
    p, q = torch.rand(3, 4, 6, generator=g), torch.rand(3, 4, 6, generator=g)
    u = torch.rand(3, 4, generator=g)
    e = torch.rand(3, 4, 6, generator=g) + 0.5
    cases = [(torch.ops.npuspec.greedy_accept.default, (d, t)),
             (torch.ops.npuspec.ratio_accept.default, (p, q, d, u)),
             (torch.ops.npuspec.ratio_accept.default, (p, None, d, u)),
             (torch.ops.npuspec.residual_probs.default, (p, q, "row")),
             (torch.ops.npuspec.residual_sample.default, (p, q, e, "all", "race")),
             (torch.ops.npuspec.residual_sample.default,
              (p, q, e, "none", "race", "none", 0.0, "zero_inf", -1e10))]
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
