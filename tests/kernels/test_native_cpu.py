"""kernels/native_cpu.py: the C++-dispatched CPU ops equal their Python wrappers bit for bit,
serve the common case in C++ (the counter moves) and hand the rest to the wrapper (it does not)."""
import pytest
import torch

from npuspec.kernels import linear_packed_cpu as lp
from npuspec.kernels import linear_quant_cpu as lq
from npuspec.kernels import native_cpu, rms_norm_cpu
from npuspec.kernels import paged_attention as pa
from npuspec.kernels.cpp_build import toolchain_present

# without a compiler nothing here can run; with one, the build must work (a failed build would
# only log and leave every op in Python)
pytestmark = pytest.mark.skipif(not toolchain_present(), reason="no C++ toolchain")


@pytest.fixture(autouse=True, scope="module")
def _installed():
    assert native_cpu.install(), "the native ops failed to build (see the warning logged)"


def _served(fn, op):
    """-> (fn's result, whether `op` stayed in C++ for it)."""
    before = native_cpu.fast_calls()[op]
    out = fn()
    return out, native_cpu.fast_calls()[op] > before


def _equal(a, b):
    if isinstance(a, tuple):
        return all(torch.equal(x, y) for x, y in zip(a, b))
    return a.dtype == b.dtype and torch.equal(a, b)


def test_every_op_has_a_cpu_kernel_and_a_python_twin():
    for op in native_cpu.OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"npuspec::{op}", "CPU"), op
        assert hasattr(torch.ops.npuspec, f"_{op}_py"), op


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 1, 576), (3, 5, 96), (70, 40)])
def test_add_rms_norm(dtype, shape):
    g = torch.Generator().manual_seed(len(shape))
    x, r = (torch.randn(*shape, generator=g).to(dtype) for _ in range(2))
    w = torch.randn(shape[-1], generator=g).to(dtype)
    got, fast = _served(lambda: torch.ops.npuspec.add_rms_norm(x, r, w, 1e-5), "add_rms_norm")
    assert fast and _equal(got, rms_norm_cpu._impl(x, r, w, 1e-5))
    # a strided input: the Python wrapper (which copies it), same values
    xt = torch.randn(*shape[:-1], 2 * shape[-1], generator=g).to(dtype)[..., ::2]
    got, fast = _served(lambda: torch.ops.npuspec.add_rms_norm(xt, r, w, 1e-5), "add_rms_norm")
    assert not fast and _equal(got, rms_norm_cpu._impl(xt.contiguous(), r, w, 1e-5))


@pytest.mark.parametrize("wdtype", lp.WEIGHT_DTYPES)
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,N", [(1, 70), (5, 64), (0, 33), (9, 100)])
def test_linear_packed(wdtype, xdtype, M, N):
    g = torch.Generator().manual_seed(M * 1000 + N)
    w = torch.randn(N, 96, generator=g).to(wdtype)
    x = torch.randn(M, 96, generator=g).to(xdtype)
    wp = lp.pack_weight(w)
    got, fast = _served(lambda: torch.ops.npuspec.linear_packed(x, wp, None, N), "linear_packed")
    assert fast and _equal(got, lp.linear_packed_impl(x, wp, None, N))
    # a bias of N columns: padded to whole panels by the Python wrapper unless N fills them
    b = torch.randn(N, generator=g)
    got, fast = _served(lambda: torch.ops.npuspec.linear_packed(x, wp, b, N), "linear_packed")
    assert fast == (N % lp.block_width() == 0)
    assert _equal(got, lp.linear_packed_impl(x, wp, b, N))


@pytest.mark.parametrize("dtype,K", [(torch.float32, 96), (torch.bfloat16, 96),
                                     (torch.bfloat16, 95)])   # 95: not the dot-product kernel
@pytest.mark.parametrize("edge", [-1, 0])
def test_linear_packed_hands_prefill_gemms_to_python(monkeypatch, dtype, K, edge):
    """The C++ dispatch hands exactly the calls Python's `takes_gemm` takes, on either side of
    each dtype's row threshold."""
    w = torch.randn(70, K).to(dtype)
    wp = lp.pack_weight(w)
    x = torch.randn(lp.gemm_min_rows(wp, K) + edge, K).to(dtype)
    taken = []
    real = lp._gemm_rows
    monkeypatch.setattr(lp, "_gemm_rows", lambda *a: taken.append(1) or real(*a))
    got, fast = _served(lambda: torch.ops.npuspec.linear_packed(x, wp, None, 70), "linear_packed")
    gemm = edge == 0 and (dtype == torch.float32 or lp._bf16_gemm())
    assert fast != gemm and bool(taken) == gemm == lp.takes_gemm(x, wp, None)
    assert _equal(got, lp.linear_packed_impl(x, wp, None, 70))


def test_linear_packed_other_panel_width_takes_the_reference():
    w = torch.randn(40, 96)
    # packed for another CPU (x4: test_linear_packed checks the once-per-width warning at x2)
    wp = lp.to_panels(w, lp.block_width() * 4)
    x = torch.randn(2, 96)
    got, fast = _served(lambda: torch.ops.npuspec.linear_packed(x, wp, None, 40), "linear_packed")
    assert not fast
    torch.testing.assert_close(got, x @ w.t(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bits,zero,with_min", [(8, 0, False), (4, 8, False), (4, 0, True)])
@pytest.mark.parametrize("M", [1, 5, 7])
def test_linear_quant(bits, zero, with_min, M):
    g = torch.Generator().manual_seed(bits * 100 + M)
    N, K = 70, 128
    lo, hi = (-128, 128) if bits == 8 else (0, 16)
    codes = torch.randint(lo, hi, (N, K), generator=g)
    scale = torch.rand(N, K // 32, generator=g)
    minv = -torch.rand(N, K // 32, generator=g) if with_min else None
    q, s, m = lq.pack_quant(codes, scale, minv, bits)
    x = torch.randn(M, K, generator=g).bfloat16()
    got, fast = _served(lambda: torch.ops.npuspec.linear_quant(x, q, s, m, bits, zero, N), "linear_quant")
    assert fast and _equal(got, lq.linear_quant_impl(x, q, s, m, bits, zero, N))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention(dtype):
    g = torch.Generator().manual_seed(0)
    B, T, H, Hkv, D, bs, lens = 3, 5, 9, 3, 64, 16, [37, 16, 0]
    kc, vc = (torch.randn(2, 16 * bs, Hkv, D, generator=g).to(dtype) for _ in range(2))
    bt = (torch.randperm(15, generator=g)[:9] + 1).view(B, 3).int()
    q = torch.randn(B, T, H, D, generator=g).to(dtype)
    args = (q, kc, vc, 1, bt, torch.tensor(lens, dtype=torch.int32), bs)
    got, fast = _served(lambda: pa.paged_attention(*args), "paged_attention")
    with pa.use_impl("cpu"):  # forced: the Python op, which runs the same kernel
        want, forced_fast = _served(lambda: pa.paged_attention(*args), "paged_attention")
    assert fast and not forced_fast and _equal(got, want)
    with pa.use_impl("reference"):
        ref, _ = _served(lambda: pa.paged_attention(*args), "paged_attention")
    torch.testing.assert_close(got.float(), ref.float(), atol=1e-2 if dtype != torch.float32 else 1e-5,
                               rtol=1e-2)
    _, fast = _served(lambda: pa.paged_attention(*args), "paged_attention")
    assert fast  # the forcing ended with its block


def test_compiled_graph_calls_the_native_kernels():
    """Inductor's wrapper calls the ops through the dispatcher: the C++ kernels serve them."""
    w = torch.randn(64, 96)
    wp = lp.pack_weight(w)
    nw = torch.randn(96)

    def f(x, r):
        h, s = torch.ops.npuspec.add_rms_norm(x, r, nw, 1e-5)
        return torch.ops.npuspec.linear_packed(h, wp, None, 64), s

    x, r = torch.randn(2, 96), torch.randn(2, 96)
    want = f(x, r)
    cf = torch.compile(f, backend="inductor", fullgraph=True)
    cf(x, r)
    before = native_cpu.fast_calls()
    got = cf(x, r)
    after = native_cpu.fast_calls()
    assert _equal(got, want)
    assert after["add_rms_norm"] > before["add_rms_norm"] and after["linear_packed"] > before["linear_packed"]


def test_bypassed_sends_every_call_to_the_python_wrappers():
    x, r, w = torch.randn(2, 64), torch.randn(2, 64), torch.randn(64)
    with native_cpu.bypassed():
        got, fast = _served(lambda: torch.ops.npuspec.add_rms_norm(x, r, w, 1e-5), "add_rms_norm")
    assert not fast and _equal(got, rms_norm_cpu._impl(x, r, w, 1e-5))
    _, fast = _served(lambda: torch.ops.npuspec.add_rms_norm(x, r, w, 1e-5), "add_rms_norm")
    assert fast


def test_bypassed_nests():
    x, r, w = torch.randn(2, 64), torch.randn(2, 64), torch.randn(64)
    call = lambda: torch.ops.npuspec.add_rms_norm(x, r, w, 1e-5)  # noqa: E731
    with native_cpu.bypassed():
        with native_cpu.bypassed():
            pass
        assert not _served(call, "add_rms_norm")[1]  # still bypassed after the inner block
    assert _served(call, "add_rms_norm")[1]


def _greedy_case(B, K, V, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, K + 1, V, generator=g)
    logits[0, 0, :3] = logits[0, 0].max() + 1  # a tie: the first index wins
    drafts = logits[:, :K].argmax(-1)             # accepted unless changed below
    if K:
        drafts[-1, K // 2] = (drafts[-1, K // 2] + 1) % V   # a rejection
        drafts[0, -1] = -1                                    # no draft
    return logits, drafts


def _verify(logits, drafts):
    return torch.ops.npuspec.rejection_sample(logits, drafts, None, None, None, None, None, None,
                                              False, None, None, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,K,V", [(1, 0, 49152), (1, 4, 49152), (3, 3, 1000), (2, 1, 17)])
def test_greedy_rejection_sample(dtype, B, K, V):
    logits, drafts = _greedy_case(B, K, V, B * 100 + K)
    logits = logits.to(dtype)
    got, fast = _served(lambda: _verify(logits, drafts), "rejection_sample")
    with native_cpu.bypassed():
        want = _verify(logits, drafts)
    assert fast and _equal(got, want)
    from npuspec.kernels import verify
    with verify.use_impl("reference"):  # the specification, and forcing it leaves C++
        ref, forced_fast = _served(lambda: _verify(logits, drafts), "rejection_sample")
    assert not forced_fast and _equal(got, ref)


def test_greedy_rejection_sample_hands_bad_values_to_python():
    logits, drafts = _greedy_case(2, 3, 50, 0)
    bad = logits.clone()
    bad[1, 2, 7] = float("nan")
    with pytest.raises(ValueError, match=r"target_logits\[1, 2\]"):
        _verify(bad, drafts)
    out_of_range = drafts.clone()
    out_of_range[0, 0] = 50
    with pytest.raises(ValueError, match="draft_token_ids"):
        _verify(logits, out_of_range)
    # sampled rows are the Python op's
    _, fast = _served(lambda: torch.ops.npuspec.rejection_sample(
        logits, drafts, None, torch.ones(2), None, None, None, None, False, None, None, None),
        "rejection_sample")
    assert not fast


def test_composed_rejection_sample_goes_to_python():
    """The composed mode (bonus tokens given) passes its arguments through the C++ kernel's
    hand-off unchanged: the Python op's result, bit for bit, and no fast call."""
    from npuspec.kernels.verify_composed import composed_verify_ref
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(3, 4, 20, generator=g), -1)
    q = torch.softmax(torch.randn(3, 3, 20, generator=g), -1)
    ids = torch.randint(0, 20, (3, 3), generator=g)
    u, e = torch.rand(3, 3, generator=g), torch.empty(3, 3, 20).exponential_(generator=g)
    bonus = torch.randint(0, 20, (3, 1), generator=g)
    kw = dict(residual_normalize="row", residual_floor=1e-5)
    got, fast = _served(lambda: torch.ops.npuspec.rejection_sample(
        p, ids, q, None, None, None, u, e, False, None, None, None, bonus, None,
        target_is_probs=True, **kw), "rejection_sample")
    assert not fast
    assert _equal(got, composed_verify_ref(p, ids, q, u, e, bonus, None, "ge", **kw))


def test_ragged_rejection_sample_goes_to_python():
    """The ragged mode (cu_num_draft_tokens given) passes its arguments, max_spec_len and the
    greedy rows included, through the C++ kernel's hand-off unchanged."""
    from npuspec.kernels.verify_ragged import ragged_verify_ref
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(6, 20, generator=g), -1)
    q = torch.softmax(torch.randn(6, 20, generator=g), -1)
    ids = torch.randint(0, 20, (6,), generator=g)
    u = torch.rand(6, generator=g, dtype=torch.float64)
    e = torch.empty(3, 20).exponential_(generator=g)
    bonus, cu = torch.randint(0, 20, (3,), generator=g), torch.tensor([2, 2, 6])
    greedy = torch.tensor([False, False, True])
    got, fast = _served(lambda: torch.ops.npuspec.rejection_sample(
        p, ids, q, None, None, None, u, e, False, None, None, None, bonus, None, cu, greedy,
        target_is_probs=True, max_spec_len=4), "rejection_sample")
    assert not fast
    assert _equal(got, ragged_verify_ref(p, ids, q, u, e, bonus, cu, 4, greedy))
