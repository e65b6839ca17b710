"""npuspec::paged_attention: the C++ CPU kernel against the PyTorch reference, and the
reference against plain dense causal attention (the definition)."""
import pytest
import torch
import torch.nn.functional as F

from npuspec.kernels import paged_attention as pa


def _case(B, T, H, Hkv, D, bs, lens, dtype=torch.float32, layers=2, layer=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    mb = max(1, max(-(-n // bs) for n in lens)) + 1
    nb = 1 + B * mb  # block 0 is scratch
    kc = torch.randn(layers, nb * bs, Hkv, D, generator=g).to(dtype)
    vc = torch.randn(layers, nb * bs, Hkv, D, generator=g).to(dtype)
    bt = (torch.randperm(nb - 1, generator=g)[:B * mb] + 1).view(B, mb).int()
    q = torch.randn(B, T, H, D, generator=g).to(dtype)
    return q, kc, vc, layer, bt, torch.tensor(lens, dtype=torch.int32), bs


def _dense(q, kc, vc, layer, bt, lens, bs):
    """Definition: row b's sequence read through its table, causal SDPA, queries at the end."""
    B, T, H, D = q.shape
    out = torch.zeros(B, T, H, D)
    for b, n in enumerate(lens.tolist()):
        if n == 0:
            continue
        p = torch.arange(n)
        rows = bt[b].long()[p // bs] * bs + p % bs
        k, v = kc[layer, rows].float().transpose(0, 1), vc[layer, rows].float().transpose(0, 1)
        qpos = n - T + torch.arange(T)
        mask = p[None, :] <= qpos[:, None]  # [T, n]
        o = F.scaled_dot_product_attention(q[b].float().transpose(0, 1), k, v, attn_mask=mask,
                                           enable_gqa=True).transpose(0, 1)
        out[b] = torch.where((qpos >= 0)[:, None, None], o, 0.0)
    return out


CASES = [  # B, T, H, Hkv, D, bs, lens
    (3, 5, 9, 3, 64, 16, [37, 16, 0]),          # a padding row; a length on a block edge
    (2, 1, 4, 4, 32, 128, [1, 255]),            # MHA decode, lengths 1 and bs-1
    (2, 16, 8, 2, 64, 128, [300, 16]),          # T = 16 (the NPU maximum); T == length
    (4, 4, 6, 2, 40, 16, [3, 17, 15, 32]),      # D not a power of two; length < T (left pad)
    (1, 7, 2, 1, 16, 1, [9]),                   # block size 1
]


@pytest.mark.parametrize("case", CASES)
def test_reference_is_dense_causal_attention(case):
    args = _case(*case)
    ref = pa.reference_paged_attention(*args, scale=args[0].shape[-1] ** -0.5)
    torch.testing.assert_close(ref, _dense(*args), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_kernel_matches_reference(case, dtype):
    args = _case(*case, dtype=dtype)
    ref = pa.reference_paged_attention(*args, scale=args[0].shape[-1] ** -0.5)
    with pa.use_impl("cpu"):
        out = pa.paged_attention(*args)
    assert out.dtype == dtype and out.shape == ref.shape
    tol = {torch.float32: 2e-6, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def test_stale_entries_past_the_length_are_never_read():
    """Rollback is moving seq_lens: whatever sits past a row's length must not matter."""
    q, kc, vc, layer, bt, lens, bs = _case(2, 5, 9, 3, 64, 16, [21, 40])
    with pa.use_impl("cpu"):
        before = pa.paged_attention(q, kc, vc, layer, bt, lens, bs)
        for b, n in enumerate(lens.tolist()):  # poison every pool row past the length
            p = torch.arange(n, bt.shape[1] * bs)
            rows = bt[b].long()[p // bs] * bs + p % bs
            kc[layer, rows] = float("nan")
            vc[layer, rows] = float("nan")
        kc[:, :bs] = float("nan")  # and the scratch block
        after = pa.paged_attention(q, kc, vc, layer, bt, lens, bs)
    assert torch.equal(before, after)


def test_op_compiles_with_a_dynamic_batch():
    """The op is opaque to Inductor (fake impl): one graph serves every batch size."""
    torch._dynamo.reset()
    f = torch.compile(lambda q, kc, vc, bt, sl: pa.paged_attention(q, kc, vc, 1, bt, sl, 16) * 2,
                      fullgraph=True, dynamic=True)
    for B in (3, 2, 5):
        lens = [10 + 7 * b for b in range(B)]
        q, kc, vc, layer, bt, sl, bs = _case(B, 5, 9, 3, 64, 16, lens)
        torch.testing.assert_close(f(q, kc, vc, bt, sl),
                                   2 * pa.reference_paged_attention(q, kc, vc, 1, bt, sl, 16, 0.125),
                                   atol=5e-6, rtol=1e-5)


def test_use_impl_rejects_unknown_names():
    with pytest.raises(ValueError, match="use_impl\\('cuda'\\).*reference, cpu, triton"):
        with pa.use_impl("cuda"):
            pass


# Split-K (the CPU kernel cuts each row's positions into chunks and merges their partial
# softmaxes): FORCED_CHUNK forces many chunks on short rows.
SPLIT_CASES = [  # B, T, H, Hkv, D, bs, lens, positions per chunk
    (4, 5, 9, 3, 64, 16, [1000, 63, 65, 0], 64),  # lengths off the chunk grid; 1-chunk rows; padding
    (3, 5, 9, 3, 64, 16, [66, 64, 129], 64),      # T=5 straddling a chunk edge (66); exact multiple
    (1, 1, 9, 3, 64, 16, [1], 16),                # L=1
    (2, 40, 4, 1, 32, 16, [100, 30], 16),         # T > chunk: early queries see nothing of later
                                                  # chunks; L < T (left pad); G=1: tiles mix tokens
    (2, 5, 8, 2, 40, 16, [300, 47], 32),          # D off the vector width; G=4: tiles mix tokens
    (2, 8, 4, 4, 32, 16, [4, 40], 64),            # G=1, L < T in one chunk: a tile mixes left-pad
                                                  # queries (see nothing) with live ones
    (2, 3, 7, 1, 16, 8, [90, 9], 8),              # G=7, bs=8, chunk = one block
    (1, 5, 9, 3, 64, 48, [500], 64),              # bs=48: the chunk rounds up to 2 blocks
    # decode and verify calls (T <= INVARIANT_MAX_T) take the tiled layout; longer ones with
    # R = T*G > half a vector the lanes layout (query rows in the vector lanes); both are
    # above, these add edge cases
    (3, 1, 9, 3, 64, 16, [200, 65, 0], 64),       # decode (R = 3, tiled), split
    (2, 2, 4, 2, 64, 16, [65, 130], 64),          # R = 4 (tiled): a tile mixes a token that sees
                                                  # nothing of the last chunk with one that does
    (1, 100, 9, 3, 64, 16, [150], 32),            # R = 300 (prefill-like, lanes): row vectors that
                                                  # see nothing of a chunk are skipped
    (2, 33, 8, 2, 40, 16, [300, 47], 32),         # T = 33 (lanes), D off the vector width,
                                                  # G = 4, a row shorter than its chunk
]


@pytest.fixture
def threads(request):
    old = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(old)


def _check_cpu(args, dtype):
    ref = pa.reference_paged_attention(*args, scale=args[0].shape[-1] ** -0.5)
    with pa.use_impl("cpu"):
        out = pa.paged_attention(*args)
    tol = {torch.float32: 2e-6, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", SPLIT_CASES)
def test_cpu_kernel_split_k_matches_reference(case, dtype, threads, monkeypatch):
    from npuspec.kernels import paged_attention_cpu
    *shape, chunk = case
    monkeypatch.setattr(paged_attention_cpu, "FORCED_CHUNK", [chunk])
    _check_cpu(_case(*shape, dtype=dtype), dtype)


@pytest.mark.parametrize("threads", [1, 2, 3], indirect=True)
@pytest.mark.parametrize("lens,T", [([2000, 300, 0, 17], 5), ([300], 1), ([4100], 5),
                                    ([700, 64], 40)])
def test_cpu_kernel_long_rows_auto_chunks(lens, T, threads):
    """The chunking the kernel picks: fixed chunks for decode/verify, per call (depending on
    the threads) for longer T."""
    _check_cpu(_case(len(lens), T, 9, 3, 64, 16, lens), torch.float32)


def test_split_k_never_reads_past_the_length(monkeypatch):
    from npuspec.kernels import paged_attention_cpu
    monkeypatch.setattr(paged_attention_cpu, "FORCED_CHUNK", [16])
    q, kc, vc, layer, bt, lens, bs = _case(2, 5, 9, 3, 64, 16, [70, 33])
    with pa.use_impl("cpu"):
        before = pa.paged_attention(q, kc, vc, layer, bt, lens, bs)
        for b, n in enumerate(lens.tolist()):
            p = torch.arange(n, bt.shape[1] * bs)
            rows = bt[b].long()[p // bs] * bs + p % bs
            kc[layer, rows] = float("nan")
            vc[layer, rows] = float("nan")
        after = pa.paged_attention(q, kc, vc, layer, bt, lens, bs)
    assert torch.equal(before, after)
