"""The mechanism behind the compiled step's speed on CPU (docs/graphs.md, "Compiled step vs
eager on a real model"): the Inductor lowering rewrites few-row linears on parameter weights to
`npuspec::linear_rows`, whose kernel equals F.linear to fp32 rounding. No timings here (the
figures come from `python -m npuspec.bench.step`)."""
import pytest
import torch
import torch.nn.functional as F

from npuspec.compilation import cache_keys as keys
from npuspec.compilation import lowering
from npuspec.compilation.backend import BackendOptions
from npuspec.kernels import linear_cpu

needs_kernel = pytest.mark.skipif(not linear_cpu.available(), reason="no C++ toolchain")


@needs_kernel
@pytest.mark.parametrize("M", [1, 2, 3, 5, 10, 16, 17])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_rows_equals_f_linear(M, bias):
    g = torch.Generator().manual_seed(M)
    x = torch.randn(M, 37, generator=g)           # K not a multiple of the vector width
    w = torch.randn(10, 37, generator=g)          # N not a multiple of the 4-row block
    b = torch.randn(10, generator=g) if bias else None
    # one row is MKL's GEMV; 2..SMALL_M_MAX rows the kernel
    assert linear_cpu.uses_kernel(x, w, b) == (linear_cpu.SMALL_M_MIN <= M <= linear_cpu.SMALL_M_MAX)
    torch.testing.assert_close(torch.ops.npuspec.linear_rows(x, w, b), F.linear(x, w, b),
                               rtol=1e-5, atol=1e-5)
    x3 = x.view(1, M, 37)
    torch.testing.assert_close(linear_cpu.linear(x3, w, b), F.linear(x3, w, b),
                               rtol=1e-5, atol=1e-5)


def test_inductor_lowering_installs_the_pass_and_keys_it(monkeypatch):
    patches = lowering.inductor_config_patches(BackendOptions())
    assert isinstance(patches["post_grad_custom_pre_pass"], lowering.SmallMLinearPass)
    assert patches["post_grad_custom_pre_pass"].uuid() == lowering.small_m_linear_uuid()
    opts = BackendOptions(lowering="inductor")
    on = keys._lowering_key(opts)
    assert on == {"small_m_linear": lowering.small_m_linear_uuid()}
    assert keys._lowering_key(BackendOptions(lowering="eager")) == {}
    monkeypatch.setattr(lowering, "SMALL_M_LINEAR", False)
    assert "post_grad_custom_pre_pass" not in lowering.inductor_config_patches(BackendOptions())
    assert keys._lowering_key(opts) != on          # a different cache entry
    # the patch is per compile, never the process's global Inductor config
    assert torch._inductor.config.post_grad_custom_pre_pass is None


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(24, 40, bias=True)
        self.b = torch.nn.Linear(40, 24, bias=False)

    def forward(self, x):
        return x + self.b(F.silu(self.a(x)))


@needs_kernel
def test_compiled_equals_eager_through_the_kernel(monkeypatch, delta, fresh_dynamo):
    calls = []
    real = linear_cpu._compiled()
    monkeypatch.setattr(linear_cpu, "_compiled", lambda: (calls.append(1), real)[1])
    monkeypatch.setattr(lowering, "SMALL_M_MIN_WEIGHT_BYTES", 0)  # this test's weights are tiny
    torch.manual_seed(0)
    m = _Block().eval()
    fn = torch.compile(m, backend="npuspec", options={"capture": False, "lowering": "inductor"})
    # a cold Inductor cache, so the pass runs (and counts) here; config.patch, not monkeypatch,
    # whose undo deletes the key from Inductor's config module for every later test
    with torch.inference_mode(), torch._inductor.config.patch(force_disable_caches=True):
        for rows in (3, 5, 20):                    # 20 rows: the MKL branch of the same op
            x = torch.randn(1, rows, 24)
            torch._dynamo.mark_dynamic(x, 1)
            calls.clear()
            torch.testing.assert_close(fn(x), m(x), rtol=1e-5, atol=1e-5)
            assert bool(calls) == (rows <= linear_cpu.SMALL_M_MAX)
    assert delta().get("small_m_linears", 0) == 2  # both linears, one (dynamic) graph


def test_small_weights_stay_mkl(delta, fresh_dynamo):
    """Below SMALL_M_MIN_WEIGHT_BYTES the custom op's per-call cost outweighs the streaming."""
    torch.manual_seed(0)
    m = _Block().eval()
    assert m.a.weight.numel() * 4 < lowering.SMALL_M_MIN_WEIGHT_BYTES
    fn = torch.compile(m, backend="npuspec", options={"capture": False, "lowering": "inductor"})
    with torch.inference_mode(), torch._inductor.config.patch(force_disable_caches=True):
        x = torch.randn(1, 3, 24)
        torch.testing.assert_close(fn(x), m(x), rtol=1e-5, atol=1e-5)
    assert "small_m_linears" not in delta()


@needs_kernel
@pytest.mark.parametrize("rows,rewritten", [(1, False), (3, True), (20, False)])
def test_static_rows_outside_the_kernel_stay_inductors_mm(rows, rewritten, monkeypatch, delta,
                                                          fresh_dynamo):
    """HF's one-token decode graph has a static row count of 1: the op would only wrap torch.mm
    in a Python custom-op call there."""
    monkeypatch.setattr(lowering, "SMALL_M_MIN_WEIGHT_BYTES", 0)
    torch.manual_seed(0)
    m = _Block().eval()
    fn = torch.compile(m, backend="npuspec", options={"capture": False, "lowering": "inductor"},
                       dynamic=False)
    with torch.inference_mode(), torch._inductor.config.patch(force_disable_caches=True):
        x = torch.randn(1, rows, 24)
        torch.testing.assert_close(fn(x), m(x), rtol=1e-5, atol=1e-5)
    assert delta().get("small_m_linears", 0) == (2 if rewritten else 0)
    assert lowering._rows_may_use_kernel(rows) == rewritten
