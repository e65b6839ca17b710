"""The Triton paged-attention kernel against `reference_paged_attention`.

On CPU it runs under TRITON_INTERPRET=1, which Triton's own helpers (tl.zeros, tl.max, ...)
read when triton is imported: in a process that imported triton without it, the interpreter
rejects them. So `test_interpreter_cases` reruns this file in a child process with the
variable set, and the interpreter cases run only there. The interpreter is slow, so the
shapes are small: the cases are chosen for coverage (block edges, padding rows, left-padded
chunks, GQA packing, several tiles per block and blocks per tile, several query blocks per
head, a grid-stride walk), not size.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from npuspec.kernels import paged_attention as pa
from npuspec.kernels.paged_attention import reference_paged_attention

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5),
       torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
       torch.float16: dict(atol=4e-3, rtol=4e-3)}


CHILD = os.environ.get("NPUSPEC_TRITON_CHILD") == "1"


def test_interpreter_cases():
    if CHILD:
        pytest.skip("this is the child run")
    env = dict(os.environ, TRITON_INTERPRET="1", NPUSPEC_TRITON_CHILD="1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        os.path.abspath(__file__)], env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and " failed" not in r.stdout, r.stdout[-2000:]


@pytest.fixture
def interp():
    if not CHILD:
        pytest.skip("runs in test_interpreter_cases' child process (TRITON_INTERPRET=1)")
    from npuspec.kernels import paged_attention_triton
    return paged_attention_triton


def edge_lens(T: int, bs: int, g: torch.Generator) -> list[int]:
    """One row per residue seq_len % bs in {0, 1, T-1, T, bs-1}, 1 or 2 full blocks before it
    (a residue-0 row ends exactly on a block edge), a row shorter than T (left padding: some
    query positions negative) and a padding row (seq_len 0)."""
    lens = []
    for r in sorted({0, 1, T - 1, T, bs - 1}):
        n = int(torch.randint(1, 3, (1,), generator=g)) * bs + r
        lens.append(n)
    lens += [max(1, T // 2), 0]
    return lens


def make_case(T, H, Hkv, D, bs, dtype, lens, seed, layers=2):
    """Pool with a random permutation of physical blocks per row (block 0 is scratch, never
    mapped); every pool row outside the live prefixes is NaN, so a read past a row's length
    would show. The block table's unused tail points at block 0."""
    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    MB = max(1, max(-(-n // bs) for n in lens))
    num_blocks = B * MB + 1
    perm = torch.randperm(num_blocks - 1, generator=g) + 1
    bt = torch.zeros(B, MB, dtype=torch.int32)
    live = torch.zeros(num_blocks * bs, dtype=torch.bool)
    for b, n in enumerate(lens):
        nb = -(-n // bs)
        bt[b, :nb] = perm[b * MB:b * MB + nb].int()
        for p in range(n):
            live[int(bt[b, p // bs]) * bs + p % bs] = True
    shape = (layers, num_blocks * bs, Hkv, D)
    k = torch.randn(shape, generator=g).to(dtype)
    v = torch.randn(shape, generator=g).to(dtype)
    k[:, ~live] = float("nan")
    v[:, ~live] = float("nan")
    q = torch.randn(B, T, H, D, generator=g).to(dtype)
    return q, k, v, bt, torch.tensor(lens, dtype=torch.int32)


def check(interp, q, k, v, bt, lens, bs, layer=1, **kw):
    scale = q.shape[-1] ** -0.5
    ref = reference_paged_attention(q, k, v, layer, bt, lens, bs, scale)
    out = interp.triton_paged_attention(q, k, v, layer, bt, lens, bs, scale, **kw)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert torch.isfinite(out.float()).all()
    torch.testing.assert_close(out.float(), ref.float(), **TOL[q.dtype])
    assert (out[lens == 0] == 0).all()


# (T, H, Hkv, D, block_size, dtype)
CASES = [
    (1, 4, 4, 32, 16, torch.float32),
    (5, 9, 3, 32, 16, torch.float32),
    (16, 9, 3, 32, 128, torch.float32),
    (5, 9, 3, 64, 128, torch.bfloat16),
    (16, 4, 4, 32, 16, torch.float16),
]


@pytest.mark.parametrize("T,H,Hkv,D,bs,dtype", CASES)
def test_matches_reference_at_block_edges(interp, T, H, Hkv, D, bs, dtype):
    g = torch.Generator().manual_seed(T * 1000 + H * 10 + bs)
    lens = edge_lens(T, bs, g)
    check(interp, *make_case(T, H, Hkv, D, bs, dtype, lens, seed=T + bs), bs)


@pytest.mark.parametrize("tile,block_m", [(16, 16), (128, 16), (32, 64)])
def test_tile_and_query_block_overrides(interp, tile, block_m):
    """tile < block_size (several tiles per block), tile > block_size (a tile spans blocks),
    block_m < G*T (several query blocks per kv head, each with its own causal bound)."""
    T, H, Hkv, D, bs = 5, 9, 3, 32, 64
    lens = [bs + 1, 2 * bs, bs - 1, 3, 0]
    check(interp, *make_case(T, H, Hkv, D, bs, torch.float32, lens, seed=tile), bs,
          tile=tile, block_m=block_m)


def test_odd_head_dim_and_block_size(interp):
    """D not a power of two (lanes masked up to 64), block_size not a power of two."""
    T, bs = 3, 24
    lens = [2 * bs, bs + 2, 1, 0, 47]
    check(interp, *make_case(T, 6, 2, 48, bs, torch.float32, lens, seed=7), bs, layer=0)


def test_grid_stride_walk(interp, monkeypatch):
    """With the grid capped below the number of work items, programs walk several items."""
    monkeypatch.setattr(interp, "MAX_GRID", 2)
    T, bs = 2, 16
    lens = [17, 0, 32, 5, 1]
    check(interp, *make_case(T, 4, 2, 32, bs, torch.float32, lens, seed=3), bs, block_m=16)


def test_through_the_op_with_strided_query(interp):
    """`npuspec::paged_attention` forced to 'triton' on CPU, q a non-contiguous view."""
    T, H, Hkv, D, bs = 4, 4, 2, 32, 16
    lens = [20, 0, 4]
    q, k, v, bt, sl = make_case(T, H, Hkv, D, bs, torch.float32, lens, seed=11)
    qs = q.transpose(1, 2).contiguous().transpose(1, 2)        # same values, other strides
    assert not qs.is_contiguous()
    with pa.use_impl("triton"):
        out = pa.paged_attention(qs, k, v, 1, bt, sl, bs)
    ref = reference_paged_attention(q, k, v, 1, bt, sl, bs, D ** -0.5)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


def test_rejects_unsupported_head_dim(interp):
    q = torch.zeros(1, 1, 1, 512)
    kv = torch.zeros(1, 16, 1, 512)
    with pytest.raises(AssertionError, match="head_dim 512"):
        interp.triton_paged_attention(q, kv, kv, 0, torch.zeros(1, 1, dtype=torch.int32),
                                      torch.ones(1, dtype=torch.int32), 16, 1.0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_reference_and_replays_in_a_graph(monkeypatch):
    """Compiled kernel on a GPU; then one CUDA-graph capture replayed with new seq_lens and
    block tables copied into its static buffers (the engine's pattern)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from npuspec.kernels.paged_attention_triton import triton_paged_attention
    dev = torch.device("cuda")
    for T, H, Hkv, D, bs, dtype in CASES + [(16, 32, 4, 128, 128, torch.bfloat16),
                                              (4, 16, 2, 256, 16, torch.float16)]:
        g = torch.Generator().manual_seed(T + D)
        lens = edge_lens(T, bs, g) + [1000, 4 * bs + 3]
        q, k, v, bt, sl = (x.to(dev) for x in make_case(T, H, Hkv, D, bs, dtype, lens, seed=D))
        ref = reference_paged_attention(q, k, v, 1, bt, sl, bs, D ** -0.5)
        out = triton_paged_attention(q, k, v, 1, bt, sl, bs, D ** -0.5)
        torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])

    # graph: fixed shapes, lengths and block tables refilled before each replay
    T, H, Hkv, D, bs, dtype = 4, 8, 2, 64, 16, torch.bfloat16
    B, MB = 4, 8
    gen = torch.Generator().manual_seed(0)
    num_blocks = B * MB + 1
    k = torch.randn(2, num_blocks * bs, Hkv, D, generator=gen).to(dtype).to(dev)
    v = torch.randn(2, num_blocks * bs, Hkv, D, generator=gen).to(dtype).to(dev)
    q_buf = torch.randn(B, T, H, D, generator=gen).to(dtype).to(dev)
    bt_buf = torch.zeros(B, MB, dtype=torch.int32, device=dev)
    sl_buf = torch.zeros(B, dtype=torch.int32, device=dev)
    scale = D ** -0.5
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                                # compile + warm up
        triton_paged_attention(q_buf, k, v, 1, bt_buf, sl_buf, bs, scale)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_buf = triton_paged_attention(q_buf, k, v, 1, bt_buf, sl_buf, bs, scale)
    for step, lens in enumerate([[5, 0, 16, 17], [128, 1, 0, 33], [3, 100, 64, 2], [0, 0, 0, 0]]):
        perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).int()
        bt_buf.copy_(perm[:B * MB].view(B, MB))
        sl_buf.copy_(torch.tensor(lens, dtype=torch.int32))
        q_buf.copy_(torch.randn(B, T, H, D, generator=gen).to(dtype))
        graph.replay()
        torch.cuda.synchronize()
        ref = reference_paged_attention(q_buf, k, v, 1, bt_buf, sl_buf, bs, scale)
        torch.testing.assert_close(out_buf.float(), ref.float(), **TOL[dtype], msg=f"replay {step}")
