"""`npuspec::linear_quant` (kernels/linear_quant_cpu.py) against its PyTorch reference.

Exact where the arithmetic allows it: on one-hot rows the kernel returns the dequantised
weight bit for bit (every sum adds zeros), and on small-integer rows with power-of-two scales
every partial sum is exact in fp32, so kernel and reference agree bit for bit whatever their
summation order. That pins the codes, the nibble order, the zero point, the scales and mins.
On arbitrary rows they agree to fp32 rounding."""
import pytest
import torch

from npuspec._counters import counters
from npuspec.kernels import linear_quant_cpu as lq

pytestmark = pytest.mark.skipif(not lq.available(), reason="no C++ toolchain for the CPU kernel")

# (bits, zero, with a min): int8 / Q8_0, Q4_0 and int4-symmetric, Q4_1 / Q4_K / int4
FORMATS = [(8, 0, False), (4, 8, False), (4, 0, True)]
IDS = ["q8", "q4-zero8", "q4-min"]


def _weight(N, K, bits, with_min, gen, pow2=False):
    if bits == 8:
        codes = torch.randint(-127, 128, (N, K), generator=gen, dtype=torch.int8)
    else:
        codes = torch.randint(0, 16, (N, K), generator=gen, dtype=torch.uint8)
    G = K // lq.GROUP
    if pow2:  # exact products and sums
        scale = 2.0 ** torch.randint(-4, 1, (N, G), generator=gen).float()
        minv = torch.randint(-8, 8, (N, G), generator=gen).float() if with_min else None
    else:
        scale = torch.rand(N, G, generator=gen) * 0.02 + 1e-3
        minv = torch.randn(N, G, generator=gen) * 0.05 if with_min else None
    return codes, scale, minv


def _dequant(codes, scale, minv, zero):
    w = (codes.float() - zero) * scale.repeat_interleave(lq.GROUP, dim=1)
    return w if minv is None else w + minv.repeat_interleave(lq.GROUP, dim=1)


@pytest.mark.parametrize("bits,zero,with_min", FORMATS, ids=IDS)
def test_pack_roundtrip_and_one_hot_rows_are_exact(bits, zero, with_min):
    gen = torch.Generator().manual_seed(bits + zero)
    N, K = 37, 96  # N not a multiple of any panel width: padding columns are cut off
    codes, scale, minv = _weight(N, K, bits, with_min, gen)
    q, s, m = lq.pack_quant(codes, scale, minv, bits)
    want = _dequant(codes, scale, minv, zero)
    assert torch.equal(lq.dequantize(q, s, m, bits, zero, N), want)
    y = lq.linear_quant_impl(torch.eye(K), q, s, m, bits, zero, N)
    assert torch.equal(y, want.t())
    ids = torch.tensor([[0, 36, 5], [17, 16, 15]])
    assert torch.equal(lq.quant_rows(q, s, m, bits, zero, ids), want[ids])


@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 7])
@pytest.mark.parametrize("bits,zero,with_min", FORMATS, ids=IDS)
def test_kernel_equals_reference(bits, zero, with_min, M):
    gen = torch.Generator().manual_seed(M)
    N, K = 50, 128
    codes, scale, minv = _weight(N, K, bits, with_min, gen, pow2=True)
    q, s, m = lq.pack_quant(codes, scale, minv, bits)
    x = torch.randint(-3, 4, (M, K), generator=gen).float()
    assert torch.equal(lq.linear_quant_impl(x, q, s, m, bits, zero, N),
                       lq.linear_quant_reference(x, q, s, m, bits, zero, N))
    codes, scale, minv = _weight(N, K, bits, with_min, gen)
    q, s, m = lq.pack_quant(codes, scale, minv, bits)
    x = torch.randn(M, K, generator=gen)
    ref = lq.linear_quant_reference(x, q, s, m, bits, zero, N)
    torch.testing.assert_close(lq.linear_quant_impl(x, q, s, m, bits, zero, N), ref,
                               rtol=1e-5, atol=1e-5)
    # a row's result does not depend on the rows beside it (a verify step's K+1 rows give
    # each row what a one-row step gives it)
    one = torch.cat([lq.linear_quant_impl(x[i:i + 1], q, s, m, bits, zero, N) for i in range(M)])
    assert torch.equal(lq.linear_quant_impl(x, q, s, m, bits, zero, N), one)


def test_op_keeps_the_input_dtype_and_leading_dims():
    gen = torch.Generator().manual_seed(0)
    codes, scale, minv = _weight(40, 64, 4, True, gen)
    q, s, m = lq.pack_quant(codes, scale, minv, 4)
    x = torch.randn(2, 3, 64, generator=gen).to(torch.bfloat16)
    y = lq.linear_quant(x, q, s, m, 4, 0, 40)
    assert y.shape == (2, 3, 40) and y.dtype == torch.bfloat16
    # fp32 inside, one rounding to the caller's dtype at the end
    want = lq.linear_quant_impl(x.reshape(6, 64).float(), q, s, m, 4, 0, 40).to(torch.bfloat16)
    assert torch.equal(y.reshape(6, 40), want)


def test_without_the_kernel_the_reference_runs_and_is_counted(monkeypatch):
    gen = torch.Generator().manual_seed(1)
    codes, scale, minv = _weight(20, 64, 8, False, gen)
    q, s, m = lq.pack_quant(codes, scale, minv, 8)
    x = torch.randn(3, 64, generator=gen)
    monkeypatch.setattr(lq, "_kernel_for", lambda bw: None)
    before = counters.snapshot()
    y = lq.linear_quant_impl(x, q, s, m, 8, 0, 20)
    assert counters.delta(before).get("eager_fallbacks") == 1
    assert torch.equal(y, lq.linear_quant_reference(x, q, s, m, 8, 0, 20))


def test_op_compiles_into_a_graph():
    gen = torch.Generator().manual_seed(2)
    codes, scale, minv = _weight(24, 64, 4, False, gen)
    q, s, m = lq.pack_quant(codes, scale, minv, 4)
    x = torch.randn(2, 64, generator=gen)

    def f(x):
        return torch.relu(lq.linear_quant(x, q, s, m, 4, 8, 24)) * 2

    torch._dynamo.reset()
    got = torch.compile(f, backend="aot_eager", fullgraph=True)(x)
    assert torch.equal(got, f(x))
