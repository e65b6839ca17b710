"""The CPU kernel is batch-invariant in the decode/verify regime (T <= INVARIANT_MAX_T): a
query's output is the same bits whatever else shares the call. That is what lets speculative
greedy decoding emit exactly plain greedy decoding's tokens in bf16 too: the last query of a
K+1-token verify call must equal the one-token decode call that plain decoding makes at that
position."""
import pytest
import torch

from npuspec.kernels import paged_attention as pa
from npuspec.kernels import paged_attention_cpu

pytestmark = pytest.mark.skipif(not paged_attention_cpu.available(),
                                reason="no C++ toolchain: the CPU kernel falls back")

GEOMETRIES = [  # H, Hkv, D, bs
    (9, 3, 64, 16),     # SmolLM2-135M
    (8, 2, 40, 16),     # G = 4 (a 3-row tile mixes tokens), D off the vector width
    (4, 4, 32, 128),    # MHA, large blocks
    (7, 1, 16, 8),      # G = 7, small blocks
]
LENGTHS = [5, 127, 128, 129, 300, 700]   # around the fixed chunk's edge, several chunks


def _pool(H, Hkv, D, bs, dtype, rows=2, max_len=800, seed=0):
    g = torch.Generator().manual_seed(seed)
    mb = -(-max_len // bs)
    nb = 1 + rows * mb
    kc = torch.randn(1, nb * bs, Hkv, D, generator=g).to(dtype)
    vc = torch.randn(1, nb * bs, Hkv, D, generator=g).to(dtype)
    bt = (torch.randperm(nb - 1, generator=g)[:rows * mb] + 1).view(rows, mb).int()
    q = torch.randn(rows, 32, H, D, generator=g).to(dtype)     # row b's queries at its end
    return q, kc, vc, bt


def _call(q, kc, vc, bt, lens, bs):
    with pa.use_impl("cpu"):
        return pa.paged_attention(q.contiguous(), kc, vc, 0, bt,
                                  torch.tensor(lens, dtype=torch.int32), bs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("geom", GEOMETRIES)
def test_verify_rows_equal_the_decode_calls_at_their_positions(geom, dtype):
    H, Hkv, D, bs = geom
    q, kc, vc, bt = _pool(H, Hkv, D, bs, dtype)
    for L in LENGTHS:
        for T in (5, 25, paged_attention_cpu.INVARIANT_MAX_T):
            if T > L:
                continue
            verify = _call(q[:1, :T], kc, vc, bt[:1], [L], bs)           # [1, T, H, D]
            for t in range(T):
                decode = _call(q[:1, t:t + 1], kc, vc, bt[:1], [L - T + t + 1], bs)
                assert torch.equal(verify[0, t], decode[0, 0]), (geom, dtype, L, T, t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_is_the_same_beside_other_rows_and_on_any_thread_count(dtype):
    H, Hkv, D, bs = GEOMETRIES[0]
    q, kc, vc, bt = _pool(H, Hkv, D, bs, dtype)
    old = torch.get_num_threads()
    try:
        for T in (1, 5):
            torch.set_num_threads(1)
            alone = _call(q[:1, :T], kc, vc, bt[:1], [300], bs)
            for threads in (1, 2, 3):
                torch.set_num_threads(threads)
                for other in (0, 9, 700):          # padding, a short row, a long row
                    both = _call(q[:, :T], kc, vc, bt, [300, other], bs)
                    assert torch.equal(both[0], alone[0]), (T, threads, other)
    finally:
        torch.set_num_threads(old)

