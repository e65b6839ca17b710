"""The residual ops' `nonneg` mode (kernels/accept.py): op against its PyTorch reference, bit
for bit, on NaN, -0.0 and inf, and the mode in the op schema."""
from __future__ import annotations

import pytest
import torch

from npuspec.kernels import accept

NAN, INF = float("nan"), float("inf")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.dtype.itemsize])


def _inputs(dtype):
    g = torch.Generator().manual_seed(3)
    p, q = torch.rand(4, 37, generator=g), torch.rand(4, 37, generator=g)
    p[0, :5], q[0, :5] = -0.0, 0.0          # p - q = -0.0
    p[1], q[1] = -0.0, 0.0                  # a whole row of -0.0
    p[2, 3], p[2, 9], q[2, 9], p[2, 11] = NAN, INF, INF, INF
    p[3, 20] = -INF
    e = torch.rand(4, 37, generator=g) + 0.1
    return p.to(dtype), q.to(dtype), e.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("normalize", accept.NORMALIZE)
@pytest.mark.parametrize("nonneg", accept.NONNEG)
def test_residual_ops_match_reference_bit_for_bit(nonneg, normalize, dtype):
    p, q, e = _inputs(dtype)
    got = torch.ops.npuspec.residual_probs(p, q, normalize, nonneg)
    assert torch.equal(_bits(got), _bits(accept.residual_probs_ref(p, q, normalize, nonneg)))
    for sampler in accept.SAMPLERS:
        for noise in (e, e[:, None, :1].expand(4, 1, 37)[:, 0]):  # own shape, a broadcast view
            got = torch.ops.npuspec.residual_sample(p, q, noise, normalize, sampler, nonneg)
            want = accept.residual_sample_ref(p, q, noise, normalize, sampler, nonneg)
            assert torch.equal(got, want), (sampler, got, want)


def test_where_mode_is_where_and_clamp_mode_keeps_nan():
    p, q, _ = _inputs(torch.float32)
    d = p - q
    where = torch.ops.npuspec.residual_probs(p, q, "none", "where")
    assert torch.equal(_bits(where), _bits(torch.where(d > 0, d, 0.0)))
    assert not where.isnan().any() and (_bits(where)[1] == 0).all()  # NaN and -0.0 -> +0.0
    clamp = torch.ops.npuspec.residual_probs(p, q, "none")
    assert clamp.isnan()[2, 3] and clamp.isnan()[2, 9]
    assert torch.equal(_bits(clamp), _bits(d.clamp(min=0)))


def test_mode_in_schema_and_default_keeps_the_old_contract():
    for op in (torch.ops.npuspec.residual_probs.default, torch.ops.npuspec.residual_sample.default):
        assert 'str nonneg="clamp"' in str(op._schema)
    p, q, e = _inputs(torch.float32)
    assert torch.equal(torch.ops.npuspec.residual_sample(p, q, e, "row", "race"),
                       torch.ops.npuspec.residual_sample(p, q, e, "row", "race", "clamp"))
    with pytest.raises(ValueError, match="nonneg='relu'"):
        accept.residual_probs(p, q, "none", "relu")


def test_fake_impl_takes_the_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        p, q, e = (mode.from_tensor(t) for t in _inputs(torch.float32))
        assert torch.ops.npuspec.residual_sample(p, q, e, "row", "race", "where").shape == (4,)
        assert torch.ops.npuspec.residual_probs(p, q, "all", "where").shape == (4, 37)
