"""The AMX path of `npuspec::linear_packed` (bf16 x bf16 on AMX tiles, kernels/linear_packed_cpu.py).

It runs only where the CPU has AMX-BF16 (Sapphire Rapids and later) and the OS grants the tile
state; elsewhere these tests are skipped for that reason and the dot-product kernel, tested in
test_linear_packed.py, takes the same calls."""
import os
import subprocess
import sys

import pytest
import torch

from npuspec.kernels import linear_packed_cpu as lp

pytestmark = pytest.mark.skipif(not lp.amx_tiles(), reason="needs a CPU with AMX-BF16 tiles")


def _call(x, wp, bias, n):
    return lp.linear_packed_impl(x, wp, bias, n)


@pytest.mark.parametrize("K", [32, 96, 576])
@pytest.mark.parametrize("M", [1, 5, 16, 17, 31, 32, 33, 70])
@pytest.mark.parametrize("with_bias", [False, True])
def test_amx_rows_equal_the_reference(K, M, with_bias):
    g = torch.Generator().manual_seed(M * 1000 + K)
    n = 70                                           # not a whole number of panels
    w = torch.randn(n, K, generator=g).bfloat16()
    x = torch.randn(M, K, generator=g).bfloat16()
    b = torch.randn(n, generator=g) if with_bias else None
    wp = lp.pack_weight(w)
    if M >= lp.gemm_min_rows(wp, K) and not with_bias:
        pytest.skip("this many rows go to the vendor GEMM (test_linear_packed.py)")
    y = _call(x, wp, b, n)
    assert y.shape == (M, n) and y.dtype == torch.float32
    ref = lp.linear_packed_reference(x.float(), wp, b, n)
    torch.testing.assert_close(y, ref, atol=1e-5 * K ** 0.5, rtol=1e-5)


@pytest.mark.parametrize("K", [64, 576])
def test_a_row_has_the_same_bits_at_every_row_count_from_the_minimum(K):
    # a verify step's K+1 rows, or a batch, give each row what any other call of at least
    # AMX_MIN_ROWS rows gives it, whatever rows sit beside it
    g = torch.Generator().manual_seed(K)
    w = torch.randn(200, K, generator=g).bfloat16()
    wp = lp.pack_weight(w)
    lo = lp.AMX_MIN_ROWS
    x = torch.randn(70, K, generator=g).bfloat16()
    noise = torch.randn(lo - 1, K, generator=g).bfloat16()
    alone = torch.cat([_call(torch.cat([x[i:i + 1], noise]), wp, None, 200)[:1]
                       for i in range(70)])
    for M in (lo, 16, 17, 25, 31, 33, 70):
        assert torch.equal(_call(x[:M], wp, None, 200), alone[:M]), M


def test_the_tiles_take_the_calls_of_many_bf16_rows_only():
    # bf16 x bf16 calls of >= AMX_MIN_ROWS rows with K % 32 == 0 run on the tiles, whose unit
    # rounds its sums its own way (their values differ from the dot-product kernel's); fewer
    # rows, or a K the tiles do not cover, stay on the dot-product kernel
    g = torch.Generator().manual_seed(0)
    for K, M, tiles in ((64, lp.AMX_MIN_ROWS, True), (64, lp.AMX_MIN_ROWS - 1, False),
                        (66, 20, False)):
        wp = lp.pack_weight(torch.randn(64, K, generator=g).bfloat16())
        x = torch.randn(M, K, generator=g).bfloat16()
        on = _call(x, wp, None, 64)
        with lp.amx_paused():
            off = _call(x, wp, None, 64)
        torch.testing.assert_close(on, off, atol=1e-4, rtol=1e-5)
        assert torch.equal(on, off) != tiles, (K, M)


def test_npuspec_cpu_amx_0_keeps_the_dot_product_kernel():
    # a fresh process: the path is chosen once, when the kernel library loads
    code = ("from npuspec.kernels import linear_packed_cpu as lp; "
            "print(lp.amx_tiles(), lp.dot_bf16_gemm_min_rows())")
    env = dict(os.environ, NPUSPEC_CPU_AMX="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["False", str(lp.DOT_BF16_GEMM_MIN_ROWS)], out
