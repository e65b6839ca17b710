"""The NPU mapping of quantized projections (kernels/linear_quant_npu.py) against a FAKE
torch_npu that implements the documented semantics of `npu_weight_quant_batchmatmul` and
`npu_convert_weight_to_int4pack` on CPU. No Ascend hardware here: this pins the layout
arithmetic (transposes, int4 range, offsets, groups), not the operator."""
import sys
import types

import pytest
import torch

from npuspec.kernels import linear_quant_cpu as lq
from npuspec.kernels import linear_quant_npu as lqn
from npuspec.models import load_model, quant

GROUP = 32


def _pack_int4(w):
    """[K, N] int32 in [-8, 7] -> [K, N/8] int32, 8 nibbles per int32 (our fake's order)."""
    assert w.dtype == torch.int32 and w.shape[1] % 8 == 0 and int(w.min()) >= -8 and int(w.max()) <= 7
    nib = (w & 15).view(w.shape[0], -1, 8)
    out = torch.zeros(nib.shape[:2], dtype=torch.int64)
    for j in range(8):
        out |= nib[..., j].long() << (4 * j)
    return out.to(torch.int32)  # wraps like the device's int32 does


def _unpack_int4(p):
    v = p.long() & 0xFFFFFFFF
    nib = torch.stack([(v >> (4 * j)) & 15 for j in range(8)], dim=-1)   # [K, N/8, 8]
    return torch.where(nib > 7, nib - 16, nib).view(p.shape[0], -1)


def _wqbmm(x, weight, antiquant_scale, antiquant_offset=None, quant_scale=None, quant_offset=None,
           bias=None, antiquant_group_size=0):
    """y = x @ ((weight + offset) * scale), per group of antiquant_group_size rows of K."""
    assert quant_scale is None and quant_offset is None
    assert x.dtype in (torch.float16, torch.bfloat16) and antiquant_scale.dtype == x.dtype
    w = _unpack_int4(weight) if weight.dtype == torch.int32 else weight.long()
    K, N = w.shape
    assert x.shape[1] == K and antiquant_group_size % 32 == 0
    g = antiquant_group_size or K
    s = antiquant_scale.float().repeat_interleave(g, dim=0)[:K]
    o = 0 if antiquant_offset is None else antiquant_offset.float().repeat_interleave(g, dim=0)[:K]
    y = x.float() @ ((w.float() + o) * s)
    return (y if bias is None else y + bias.float()).to(x.dtype)


@pytest.fixture
def fake_npu(monkeypatch):
    tnpu = types.ModuleType("torch_npu")
    tnpu.npu_weight_quant_batchmatmul = _wqbmm
    tnpu.npu_convert_weight_to_int4pack = lambda w, inner_k_tiles=0: _pack_int4(w)
    monkeypatch.setitem(sys.modules, "torch_npu", tnpu)
    return tnpu


CASES = [("int8", 8, 0, False), ("q4_0", 4, 8, False), ("q4_1", 4, 0, True)]


@pytest.mark.parametrize("name,bits,zero,with_min", CASES, ids=[c[0] for c in CASES])
def test_layout_reproduces_the_dequantised_weight(fake_npu, name, bits, zero, with_min):
    gen = torch.Generator().manual_seed(bits + zero)
    N, K = 48, 96
    codes = (torch.randint(-127, 128, (N, K), generator=gen, dtype=torch.int8) if bits == 8
             else torch.randint(0, 16, (N, K), generator=gen, dtype=torch.uint8))
    scale = torch.rand(N, K // GROUP, generator=gen) * 0.02 + 1e-3
    minv = torch.randn(N, K // GROUP, generator=gen) * 0.05 if with_min else None
    w = quant.QWeight(codes, scale, minv, bits, zero, name).dequantize()
    nw = lqn.to_npu(codes, scale, minv, bits, zero, torch.bfloat16, "cpu")
    x = torch.randn(5, K, generator=gen).to(torch.bfloat16)
    got = lqn.linear_quant_npu(x, nw).float()
    want = x.float() @ w.t()
    # bf16 activations/scales on the device; a min also rounds minv/scale to bf16
    torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2)
    if not with_min:  # the exact mappings: the operator sees exactly our weights
        ww = (_unpack_int4(nw.weight) if bits == 4 else nw.weight.long()).float()
        s = nw.scale.float().repeat_interleave(GROUP, dim=0)
        o = 0 if nw.offset is None else nw.offset.float().repeat_interleave(GROUP, dim=0)
        w_bf = quant.QWeight(codes, scale.to(torch.bfloat16).float(), None, bits, zero, name).dequantize()
        assert torch.equal(((ww + o) * s).t(), w_bf)


def test_a_quantized_model_placed_for_the_npu_matches_the_cpu_one(fake_npu):
    _, cpu = load_model("tiny", quantization="int8")
    _, npu = load_model("tiny", quantization="int8")
    quant.place_on_npu(npu, torch.bfloat16, "cpu")  # "cpu" stands in for the NPU device here
    assert isinstance(npu.layers[0].wqkv.quant, quant.NpuQuantParams)
    assert npu.embed is not None  # the tied table, dequantised for lookups
    ids = torch.tensor([[1, 50, 90, 300, 2, 7]])
    with torch.no_grad():
        a = cpu.forward_causal(ids)[0]
        b = npu.to(torch.bfloat16).forward_causal(ids)[0].float()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.8
    with pytest.raises(ValueError, match="dtype=torch.float32: quantized layers on the NPU"):
        quant.place_on_npu(load_model("tiny", quantization="int8")[1], torch.float32, "cpu")


def test_int4_rows_must_pack_by_eight(fake_npu):
    with pytest.raises(ValueError, match="multiple of 8 output rows, got 12"):
        lqn.to_npu(torch.zeros(12, 32, dtype=torch.uint8), torch.ones(12, 1), None, 4, 8,
                   torch.bfloat16, "cpu")


def test_unpack_helpers_agree_with_the_cpu_panels():
    codes = torch.randint(0, 16, (40, 64), dtype=torch.uint8)
    q, s, m = lq.pack_quant(codes, torch.ones(40, 2), None, 4)
    back = lq.unpack_codes(q, 4).transpose(1, 2).reshape(-1, 64)[:40]
    assert torch.equal(back.to(torch.uint8), codes)
