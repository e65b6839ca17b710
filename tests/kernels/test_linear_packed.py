"""npuspec::linear_packed (kernels/linear_packed_cpu.py) against its PyTorch reference, and
npuspec.models.packing against the unpacked model."""
import logging

import pytest
import torch

from npuspec.kernels import linear_packed_cpu as lp
from npuspec.models import load_model
from npuspec.models.decoder import DecoderLM
from npuspec.models.packing import pack_model

pytestmark = pytest.mark.skipif(not lp.available(), reason="no C++ toolchain for the kernel")

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-5, torch.float16: 1e-5}


@pytest.mark.parametrize("dtype", lp.WEIGHT_DTYPES)
@pytest.mark.parametrize("M", [0, 1, 2, 5, 6, 7, 13, 40])
@pytest.mark.parametrize("N,K", [(48, 64), (37, 19), (100, 576)])
def test_kernel_equals_reference(dtype, M, N, K):
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    w = torch.randn(N, K, generator=g).to(dtype)
    x = torch.randn(M, K, generator=g)
    bias = torch.randn(N, generator=g)
    wp = lp.pack_weight(w)
    assert wp.shape == (-(-N // lp.block_width()), K, lp.block_width()) and wp.dtype == dtype
    for b in (None, bias):
        y = lp.linear_packed_impl(x, wp, b, N)
        ref = lp.linear_packed_reference(x, wp, b, N)
        assert y.shape == (M, N) and y.dtype == torch.float32
        torch.testing.assert_close(y, ref, atol=TOL[dtype] * K ** 0.5, rtol=1e-5)
        # the reference is F.linear on the fp32 weight
        torch.testing.assert_close(ref, torch.nn.functional.linear(x, w.float(), b),
                                   atol=1e-5 * K ** 0.5, rtol=1e-5)


@pytest.mark.parametrize("K", [96, 95])   # 95: odd, so never the dot-product kernel
@pytest.mark.parametrize("edge", [-1, 0, 200])
def test_many_bf16_rows_take_the_bf16_gemm_and_equal_the_kernel(monkeypatch, K, edge):
    g = torch.Generator().manual_seed(edge + K)
    w = torch.randn(70, K, generator=g).bfloat16()
    wp = lp.pack_weight(w)
    rows = lp.gemm_min_rows(wp, K)
    assert rows == (lp.dot_bf16_gemm_min_rows() if lp.dot_bf16(K) else lp.BF16_GEMM_MIN_ROWS)
    M = rows + edge
    x = torch.randn(M, K, generator=g).bfloat16()
    taken = []
    real = lp._gemm_rows
    monkeypatch.setattr(lp, "_gemm_rows", lambda *a: taken.append(1) or real(*a))
    y = lp.linear_packed_impl(x, wp, None, 70)
    assert bool(taken) == (edge >= 0 and lp._bf16_gemm())
    # both accumulate in fp32 and the caller rounds to bf16 once: equal after that rounding
    # up to summation order (one bf16 ulp)
    ref = lp.linear_packed_reference(x.float(), wp, None, 70).bfloat16().float()
    torch.testing.assert_close(y.bfloat16().float(), ref, atol=0.05 * (K / 96) ** 0.5,
                               rtol=1 / 128)
    # fp32 rows and a bias stay on the kernel
    taken.clear()
    lp.linear_packed_impl(x.float(), wp, None, 70)
    lp.linear_packed_impl(x, wp, torch.zeros(70), 70)
    assert not taken


@pytest.mark.parametrize("amx", [False, True])
def test_the_dot_product_hand_off_is_lower_where_amx_runs_the_gemm(monkeypatch, amx):
    # oneDNN's bf16 GEMM on AMX tiles overtakes the dot-product kernel from ~32 rows (the
    # unpacking included), so where the kernel was built without its own tiles the hand-off is
    # there; without AMX, or with the kernel's tiles, the kernel holds up to a full prefill step
    monkeypatch.setattr(lp, "amx_bf16", lambda: amx)
    monkeypatch.setattr(lp, "amx_built", lambda: False)
    assert lp.dot_bf16_gemm_min_rows() == (lp.AMX_BF16_GEMM_MIN_ROWS if amx
                                           else lp.DOT_BF16_GEMM_MIN_ROWS)
    assert lp.AMX_BF16_GEMM_MIN_ROWS < lp.DOT_BF16_GEMM_MIN_ROWS
    if lp.dot_bf16(96):
        wp = lp.pack_weight(torch.randn(70, 96).bfloat16())
        assert lp.gemm_min_rows(wp, 96) == lp.dot_bf16_gemm_min_rows()
        x = torch.randn(lp.AMX_BF16_GEMM_MIN_ROWS, 96).bfloat16()
        assert lp.takes_gemm(x, wp, None) == (amx and lp._bf16_gemm())


def test_the_kernels_own_tiles_keep_the_hand_off_at_512(monkeypatch):
    monkeypatch.setattr(lp, "amx_bf16", lambda: True)
    monkeypatch.setattr(lp, "amx_built", lambda: True)
    assert lp.dot_bf16_gemm_min_rows() == lp.DOT_BF16_GEMM_MIN_ROWS


def test_amx_bf16_reads_the_cpu_capabilities():
    caps = torch.cpu.get_capabilities()
    assert lp.amx_bf16() == bool(caps.get("amx_bf16", False))


@pytest.mark.parametrize("M", [lp.GEMM_MIN_ROWS - 1, lp.GEMM_MIN_ROWS, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_many_fp32_rows_take_the_sgemm_and_equal_the_reference(monkeypatch, M, with_bias):
    g = torch.Generator().manual_seed(M)
    w = torch.randn(70, 96, generator=g)
    x = torch.randn(M, 96, generator=g)
    b = torch.randn(70, generator=g) if with_bias else None
    wp = lp.pack_weight(w)
    taken = []
    real = lp._gemm_rows
    monkeypatch.setattr(lp, "_gemm_rows", lambda *a: taken.append(1) or real(*a))
    y = lp.linear_packed_impl(x, wp, b, 70)
    assert bool(taken) == (M >= lp.GEMM_MIN_ROWS) and lp.gemm_min_rows(wp, 96) == lp.GEMM_MIN_ROWS
    assert y.shape == (M, 70) and y.dtype == torch.float32
    torch.testing.assert_close(y, lp.linear_packed_reference(x, wp, b, 70), atol=1e-4, rtol=1e-5)


def test_pack_roundtrip_and_rows():
    w = torch.randn(50, 24)
    wp = lp.pack_weight(w)
    assert torch.equal(lp.unpack_weight(wp, 50), w)
    ids = torch.tensor([[0, 17, 49], [3, 3, 16]])
    assert torch.equal(lp.packed_rows(wp, ids), w[ids])
    # rows past N are zero padding
    nb, K, bw = wp.shape
    assert torch.count_nonzero(wp.transpose(1, 2).reshape(nb * bw, K)[50:]) == 0


def test_wrapper_keeps_dtype_and_shape():
    w = torch.randn(40, 32).bfloat16()
    x = torch.randn(2, 3, 32).bfloat16()
    y = lp.linear_packed(x, lp.pack_weight(w), None, 40)
    assert y.shape == (2, 3, 40) and y.dtype == torch.bfloat16
    ref = x.float().reshape(6, 32) @ w.float().t()
    torch.testing.assert_close(y.float().reshape(6, 40), ref, atol=0.05, rtol=0.02)


def test_compiled_equals_eager():
    w, b = torch.randn(64, 48), torch.randn(64)
    wp = lp.pack_weight(w)
    f = lambda x: torch.relu(lp.linear_packed(x, wp, b, 64)) * 2  # noqa: E731
    x = torch.randn(5, 48)
    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="inductor")(x)
    torch.testing.assert_close(got, f(x), atol=0, rtol=0)


def _logits(model, ids):
    cache = model.allocate_cache(num_slots=1, max_len=32)
    pos = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        return model(ids, pos, torch.zeros(1, dtype=torch.long), cache)


@pytest.mark.parametrize("tied", [True, False])
def test_packed_model_equals_unpacked(tied):
    _, base = load_model("tiny")
    cfg = base.config
    if not tied:  # an untied head: the embedding stays, the head is packed
        cfg = type(cfg)(**{**cfg.__dict__, "tie_word_embeddings": False})
        base = DecoderLM(cfg)
        torch.nn.init.normal_(base.lm_head.weight)
    ids = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    ref = _logits(base, ids)
    n_before = sum(p.numel() for p in base.parameters())
    assert pack_model(base) and pack_model(base)  # idempotent
    assert base.layers[0].wqkv.weight is None and base.lm_head is None
    assert (base.embed is None) == tied
    # the packed copies replace the row-major weights: no parameter is held twice
    assert sum(p.numel() for p in base.parameters()) < n_before / 2
    torch.testing.assert_close(_logits(base, ids), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_packed_half_model_close_to_unpacked(dtype):
    # the same half-precision model through F.linear: only rounding differs (the packed
    # kernel accumulates in fp32 and rounds once per projection)
    _, ref_model = load_model("tiny", dtype=dtype)
    _, model = load_model("tiny", dtype=dtype)
    assert pack_model(model) and model.head_packed.dtype == dtype
    ids = torch.randint(0, model.config.vocab_size, (1, 10),
                        generator=torch.Generator().manual_seed(1))
    got, ref = _logits(model, ids), _logits(ref_model, ids)
    assert got.dtype == torch.float32
    scale = ref.abs().max()
    assert (got - ref).abs().max() < 0.05 * scale, ((got - ref).abs().max(), scale)


def test_no_compiler_leaves_model_unpacked(monkeypatch, caplog):
    _, model = load_model("tiny")
    monkeypatch.setattr(lp, "toolchain_present", lambda: False)
    with caplog.at_level(logging.WARNING, logger="npuspec.models.packing"):
        assert not pack_model(model)
    assert model.layers[0].wqkv.weight is not None and model.head_packed is None
    assert "not packed" in caplog.text


def test_bench_linear_runs(capsys):
    from npuspec.bench import linear as bench

    assert bench.main(["--model", "tiny", "--rows", "1,5", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    lines = [line.split() for line in out.splitlines()]
    for variant in ("mm", "rows", "packed fp32", "packed bf16", "packed fp16"):
        n = len(variant.split())
        ms = [float(p[n + 1].replace(",", "")) for p in lines if p[:n] == variant.split() and len(p) > n + 1]
        assert len(ms) == 2 and all(m > 0 for m in ms), (variant, out)  # M=1 and M=5
    assert "sum GB/s" in out


def test_block_width_known_before_the_build_matches_the_kernel():
    # weights pack while g++ runs, with the width predicted from Inductor's vector ISA
    assert lp.block_width() == lp._library().npuspec_linear_packed_block()


def test_weights_packed_for_another_width_take_the_reference(caplog):
    from npuspec import counters
    bw = 2 * lp.block_width()  # not what this build reads
    w, x, bias = torch.randn(40, 24), torch.randn(3, 24), torch.randn(40)
    nb = -(-40 // bw)
    padded = torch.zeros(nb * bw, 24)
    padded[:40] = w
    wp = padded.view(nb, bw, 24).transpose(1, 2).contiguous()
    before = counters.snapshot()
    with caplog.at_level(logging.WARNING):
        y = torch.ops.npuspec.linear_packed(x, wp, bias, 40)
    assert counters.delta(before).get("eager_fallbacks") == 1
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w, bias), atol=1e-5, rtol=1e-5)
    assert f"{bw}-column panels" in caplog.text


def test_a_failed_build_after_packing_takes_the_reference(monkeypatch):
    from npuspec import counters
    from npuspec.kernels import native_cpu
    w, x = torch.randn(50, 24), torch.randn(2, 24)
    wp = lp.pack_weight(w)
    monkeypatch.setattr(lp, "_kernel_for", lambda bw: None)
    before = counters.snapshot()
    with native_cpu.bypassed():  # a failed build has no native ops either
        y = torch.ops.npuspec.linear_packed(x, wp, None, 50)
    assert counters.delta(before).get("eager_fallbacks") == 1
    torch.testing.assert_close(y, x @ w.t(), atol=1e-5, rtol=1e-5)


@pytest.fixture
def no_amx():
    """The AMX path off: it takes bf16 calls of >= AMX_MIN_ROWS rows where the CPU has tiles and
    rounds its own way (test_linear_packed_amx.py), so the tests using this see the dot-product
    and widening kernels."""
    with lp.amx_paused():
        yield


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M", [1, 5, 9])
def test_half_x_is_read_as_is_and_equals_the_fp32_x(dtype, M, no_amx):
    """x in the weights' 2-byte dtype goes to the kernel unconverted; widening it in the kernel
    is exact, so the result equals the fp32-x call bit for bit."""
    g = torch.Generator().manual_seed(M)
    wp = lp.pack_weight(torch.randn(70, 96, generator=g).to(dtype))
    x = torch.randn(M, 96, generator=g).to(dtype)
    assert torch.equal(lp.linear_packed_impl(x, wp, None, 70),
                       lp.linear_packed_impl(x.float(), wp, None, 70))


@pytest.mark.parametrize("M", [1, 5, 9, 12, 13, 17, 30])
@pytest.mark.parametrize("N,K", [(100, 576), (37, 20), (37, 19)])
def test_bf16_activations_equal_the_fp32_activation_call_bit_for_bit(M, N, K, no_amx):
    """bf16 x with bf16 weights: read as they are (and, on an AVX512_BF16 CPU with K even, the
    dot-product instruction's path, tiles of up to 12 rows) gives exactly the values of the
    widening kernel on x.float(): exact products, added in k order. Covers tiles of 12, the
    remainders after them, an odd K (the widening loop) and a bias."""
    g = torch.Generator().manual_seed(M * 100 + K)
    w = torch.randn(N, K, generator=g).bfloat16()
    x = torch.randn(M, K, generator=g).bfloat16()
    b = torch.randn(N, generator=g)
    wp = lp.pack_weight(w)
    for bias in (None, b):
        y = lp.linear_packed_impl(x, wp, bias, N)
        assert torch.equal(y, lp.linear_packed_impl(x.float(), wp, bias, N))
        # and the PyTorch reference beside the kernel, to fp32 rounding
        torch.testing.assert_close(y, lp.linear_packed_reference(x, wp, bias, N),
                                   atol=1e-5 * K ** 0.5, rtol=1e-5)
    # the path these calls took: the dot-product one exactly where the CPU has the instruction
    assert lp.dot_bf16(K) == (_cpu_has_avx512_bf16() and lp.block_width() == 32 and K % 2 == 0)


def _cpu_has_avx512_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return " avx512_bf16" in f.read()
    except OSError:
        return False


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_panels", [1, 2, 3])
def test_the_gemm_over_chunks_of_panels_equals_one_gemm(monkeypatch, dtype, chunk_panels):
    """A weight larger than GEMM_CHUNK_BYTES (an LM head) is unpacked a chunk of panels at a
    time into one reused buffer; the columns (a partial last panel, a bias) come out as one
    GEMM over the whole unpacked weight gives them, to summation order."""
    bw = lp.block_width()
    N, K, M = 3 * bw + 5, 40, 70
    g = torch.Generator().manual_seed(chunk_panels)
    w = torch.randn(N, K, generator=g).to(dtype)
    x = torch.randn(M, K, generator=g).to(dtype)
    b = torch.randn(N, generator=g) if dtype == torch.float32 else None
    wp = lp.pack_weight(w)
    whole = lp._gemm_rows(x, wp, b, N)                      # one chunk at the default size
    monkeypatch.setattr(lp, "GEMM_CHUNK_BYTES", chunk_panels * K * bw * wp.element_size())
    got = lp._gemm_rows(x, wp, b, N)
    assert got.shape == (M, N) and got.dtype == torch.float32
    tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.05, rtol=1 / 128)
    torch.testing.assert_close(got, whole, **tol)
    torch.testing.assert_close(got, lp.linear_packed_reference(x.float(), wp, b, N), **tol)
