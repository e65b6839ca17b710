"""npuspec::add_rms_norm (kernels/rms_norm_cpu.py) against its PyTorch reference, and the
decoder's fused-norm path against the plain one."""
import pytest
import torch

from npuspec.kernels import rms_norm_cpu as rn
from npuspec.models import load_model
from npuspec.models.packing import pack_model

pytestmark = pytest.mark.skipif(not rn.available(), reason="no C++ toolchain for the kernel")

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 576), (5, 576), (3, 4, 577), (7, 5), (70, 128), (0, 64)])
def test_kernel_equals_reference(dtype, shape):
    g = torch.Generator().manual_seed(sum(shape))
    x, r = (torch.randn(shape, generator=g).mul(3).to(dtype) for _ in range(2))
    w = torch.randn(shape[-1], generator=g).to(dtype)
    out, s = torch.ops.npuspec.add_rms_norm(x, r, w, 1e-5)
    ref_out, ref_s = rn.add_rms_norm_reference(x, r, w, 1e-5)
    assert out.shape == s.shape == x.shape and out.dtype == s.dtype == dtype
    assert torch.equal(s, ref_s)  # the add is one rounding either way
    if dtype == torch.float32:  # the square-sum runs in another order: fp32 rounding only
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    else:  # that difference is far below a half-precision ulp: the same values
        assert (out != ref_out).sum() <= 0.01 * out.numel(), (out - ref_out).abs().max()
        torch.testing.assert_close(out.float(), ref_out.float(), atol=0.02, rtol=0.01)


def test_non_contiguous_inputs():
    x = torch.randn(6, 64).t()  # [64, 6] strided
    r = torch.randn(64, 6)
    w = torch.randn(6)
    out, s = torch.ops.npuspec.add_rms_norm(x, r, w, 1e-6)
    ref_out, ref_s = rn.add_rms_norm_reference(x, r, w, 1e-6)
    assert torch.equal(s, ref_s)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)


def test_compiled_equals_eager():
    w = torch.randn(48)
    f = lambda x, r: [t * 2 for t in rn.add_rms_norm(x, r, w, 1e-5, fused=True)]  # noqa: E731
    x, r = torch.randn(5, 48), torch.randn(5, 48)
    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="inductor")(x, r)
    for a, b in zip(got, f(x, r)):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def _logits(model, ids):
    B, T = ids.shape
    cache = model.allocate_cache(num_slots=B, max_len=32)
    with torch.no_grad():
        return model(ids, torch.arange(T).expand(B, T), torch.arange(B), cache)


def test_packed_model_fuses_every_norm():
    _, model = load_model("tiny")
    assert pack_model(model) and model.fused_norm
    L = model.config.num_layers
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    fused = _logits(model, ids)
    model.fused_norm = False  # the plain PyTorch norms, same packed weights
    plain = _logits(model, ids)
    torch.testing.assert_close(fused, plain, atol=1e-4, rtol=1e-4)
    assert torch.equal(fused.argmax(-1), plain.argmax(-1))

    # in the traced graph: one op per norm but layer 0's input norm (no residual yet)
    model.fused_norm = True
    graphs = []

    def record(gm, inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    cache = model.allocate_cache(num_slots=2, max_len=32)
    with torch.no_grad():
        torch.compile(model, backend=record, fullgraph=True)(
            ids, torch.arange(9).expand(2, 9), torch.arange(2), cache)
    calls = [n for gm in graphs for n in gm.graph.nodes
             if n.op == "call_function" and n.target in (torch.ops.npuspec.add_rms_norm,
                                                         torch.ops.npuspec.add_rms_norm.default)]
    assert len(calls) == 2 * L, (len(calls), L)
    torch._dynamo.reset()


def test_unpacked_model_keeps_plain_norms():
    _, model = load_model("tiny")
    assert not model.fused_norm  # only pack_model turns the CPU op on


def test_a_broken_build_is_reported_and_unavailable(caplog):
    """The shared loader: a source that does not compile gives None and one warning that
    names the kernel and the fallback the caller takes."""
    import logging

    from npuspec.kernels.cpp_build import load_library

    with caplog.at_level(logging.WARNING, logger="npuspec.kernels.cpp_build"):
        assert load_library("this is not C++ {", "test kernel", "using the reference", {}) is None
    assert "the test kernel could not be compiled" in caplog.text
    assert "using the reference" in caplog.text


def test_a_failed_build_takes_the_reference(monkeypatch):
    # a model picks the op before its build finishes (packing.pack_model); a build that
    # fails after all must still give the reference's values, counted
    from npuspec import counters
    from npuspec.kernels import native_cpu
    x, r, w = torch.randn(3, 64), torch.randn(3, 64), torch.randn(64)
    monkeypatch.setattr(rn, "_library", lambda: None)
    before = counters.snapshot()
    with native_cpu.bypassed():  # a failed build has no native ops either
        out, s = torch.ops.npuspec.add_rms_norm(x, r, w, 1e-5)
    assert counters.delta(before).get("eager_fallbacks") == 1
    ref_out, ref_s = rn.add_rms_norm_reference(x, r, w, 1e-5)
    assert torch.equal(out, ref_out) and torch.equal(s, ref_s)


def test_kernels_share_inductor_kernels_precompiled_header(monkeypatch):
    """load_library compiles with the command Inductor's CPU kernels use and its precompiled
    cpp_prefix.h, so a cold start builds that header once for both (kernels/cpp_build.py)."""
    import uuid

    from torch._inductor import codecache

    from npuspec.kernels import cpp_build

    cache = cpp_build._code_cache()
    assert cache.cpp_compile_command_flags == codecache.CppPythonBindingsCodeCache.cpp_compile_command_flags
    assert cache._get_uncompiled_header("cpu") == codecache.CppPythonBindingsCodeCache._get_uncompiled_header("cpu")
    seen = []
    real = codecache._precompile_header

    def spy(header, cmd, **kw):
        seen.append(header)
        return real(header, cmd, **kw)

    monkeypatch.setattr(codecache, "_precompile_header", spy)
    src = ("#include <torch/csrc/inductor/cpp_prefix.h>\n"
           f'extern "C" int npuspec_test_{uuid.uuid4().hex}() {{ return at::vec::Vectorized<float>::size(); }}\n')
    lib = cpp_build.load_library(src, "test kernel", "nothing", {})
    assert lib is not None and seen == ["torch/csrc/inductor/cpp_prefix.h"]
