"""Every npuspec op a compiled step calls returns tensors laid out as its fake says (sizes,
strides, dtype). The npuspec lowering turns off Inductor's `size_asserts`
(npuspec/compilation/lowering.py), which would otherwise check this on every call; Inductor's
generated code indexes an extern op's output by the fake's strides, so a real output laid out
otherwise would be read wrongly, not fail. Each op runs with the C++ kernels installed and
bypassed (the Python wrappers), on the decode (1 row) and verify (K+1 rows) shapes."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from npuspec.bench.attention_cpu import make_case
from npuspec.kernels import linear_packed_cpu as lp
from npuspec.kernels import linear_quant_cpu as lq
from npuspec.kernels import native_cpu
from npuspec.models import quant

ops = torch.ops.npuspec


def _flat(out):
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _same_layout_as_fake(op, *args):
    real = _flat(op(*args))
    with FakeTensorMode() as mode:
        fargs = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        fake = _flat(op(*fargs))
    assert len(real) == len(fake), (op, len(real), len(fake))
    for r, f in zip(real, fake):
        assert (r.shape, r.dtype) == (f.shape, f.dtype), (op, r.shape, f.shape, r.dtype, f.dtype)
        # a size-1 dim's stride is never used to index (assert_size_stride skips it too)
        assert _strides(r) == _strides(f), (op, r.shape, r.stride(), f.stride())


def _strides(t):
    return [s for n, s in zip(t.shape, t.stride()) if n != 1]


def _cases():
    g = torch.Generator().manual_seed(0)
    for dt in (torch.float32, torch.bfloat16):
        for M in (1, 5):
            x = torch.randn(M, 576, generator=g).to(dt)
            w = torch.randn(100, 576, generator=g).to(dt)
            yield "linear_packed", ops.linear_packed, (x, lp.pack_weight(w), None, 100)
            r, nw = torch.randn(M, 576, generator=g).to(dt), torch.randn(576, generator=g).to(dt)
            yield "add_rms_norm", ops.add_rms_norm, (x, r, nw, 1e-5)
            q, kc, vc, bt, lens = make_case(1, M, 300, 2, 512, dtype=dt)
            yield "paged_attention", ops.paged_attention, (q, kc, vc, 1, bt, lens, 16, 0.125)
        for scheme in ("int8", "int4"):
            qw = quant.quantize(torch.randn(70, 576, generator=g), scheme)
            packed = lq.pack_quant(qw.codes, qw.scale, qw.minv, qw.bits)
            x = torch.randn(5, 576, generator=g).to(dt)
            yield "linear_quant", ops.linear_quant, (x, *packed, qw.bits, qw.zero, 70)
    logits = torch.randn(2, 5, 50, generator=g)
    drafts = torch.randint(0, 50, (2, 4), generator=g)
    yield "rejection_sample", ops.rejection_sample, (logits, drafts, None, None, None, None, None,
                                                    None, False, None, None, None)
    temp = torch.full((2,), 0.7)
    probs = torch.softmax(torch.randn(2, 4, 50, generator=g), -1)
    yield "rejection_sample (sampled)", ops.rejection_sample, (
        logits, drafts, probs, temp, None, None, torch.rand(2, 4, generator=g),
        torch.empty(2, 50).exponential_(generator=g), False, None, None, None)


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_ops_return_the_fakes_layout(native):
    if native and not native_cpu.install():
        pytest.skip("no C++ toolchain for the native kernels")
    seen = set()
    for name, op, args in _cases():
        if native:
            _same_layout_as_fake(op, *args)
        else:
            with native_cpu.bypassed():
                _same_layout_as_fake(op, *args)
        seen.add(name)
    assert seen == {"linear_packed", "add_rms_norm", "paged_attention", "linear_quant",
                    "rejection_sample", "rejection_sample (sampled)"}
