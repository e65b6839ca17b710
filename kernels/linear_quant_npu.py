"""NPU path of weight-only quantized projections: CANN's weight-quant batch matmul.

UNVERIFIED ON ASCEND HARDWARE. Written against the torch_npu API documentation of
`torch_npu.npu_weight_quant_batchmatmul(x, weight, antiquant_scale, antiquant_offset=None,
quant_scale=None, quant_offset=None, bias=None, antiquant_group_size=0)` and
`torch_npu.npu_convert_weight_to_int4pack(weight)`, and tested only against a fake torch_npu
that implements the documented semantics on CPU (tests/kernels/test_linear_quant_npu.py):

    y = x @ ((weight + antiquant_offset) * antiquant_scale)
    x [M, K] fp16/bf16; weight [K, N] int8, or int32 [K, N/8] carrying int4 values in [-8, 7]
    (npu_convert_weight_to_int4pack of an int32 [K, N]); antiquant_scale / _offset
    [ceil(K / group), N] in x's dtype for per-group quantization (group a multiple of 32).

npuspec's format (npuspec/models/quant.py) is w = (code - zero) * scale (+ minv), groups of 32
along K. Mapped onto CANN's: the int4 weight is code - 8 (codes 0..15 -> [-8, 7]) and the
offset is 8 - zero (+ minv / scale); int8 weights are the codes with no offset. Q8_0, Q4_0 and
symmetric int4 map exactly (the offset is 0 or absent). A min (Q4_1, Q4_K, npuspec's int4)
becomes minv / scale rounded to x's dtype: not bit-exact, which the tests bound.

torch_npu is imported lazily, only when this path runs (docs/design.md, "Platforms").
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

GROUP = 32


def _torch_npu():
    try:
        import torch_npu
    except Exception as e:  # absent, or installed without CANN
        raise RuntimeError("npuspec's quantized layers on npu need torch_npu (pip install "
                           f"npuspec[npu], with CANN); import failed: {e}") from e
    return torch_npu


@dataclasses.dataclass
class NpuQuantWeight:
    weight: torch.Tensor                 # [K, N] int8, or [K, N/8] int32 (int4 packed)
    scale: torch.Tensor                  # [K/32, N] in the activation dtype
    offset: Optional[torch.Tensor]       # [K/32, N] or None
    n: int


def to_npu(codes: torch.Tensor, scale: torch.Tensor, minv: Optional[torch.Tensor], bits: int,
           zero: int, dtype: torch.dtype, device) -> NpuQuantWeight:
    """npuspec's row-major quantized weight (codes [N, K], scale/minv [N, K/32]) -> the
    operator's inputs on `device`, activations of `dtype` (float16 or bfloat16)."""
    N, K = codes.shape
    assert dtype in (torch.float16, torch.bfloat16), dtype
    s = scale.float()
    if bits == 8:
        assert zero == 0 and minv is None, (zero, minv is None)
        weight = codes.to(torch.int8).t().contiguous().to(device)
        offset = None
    else:
        if N % 8:
            raise ValueError(f"an int4 weight for the NPU needs a multiple of 8 output rows, got "
                             f"{N}; use quantization='int8' or None for this model")
        signed = codes.to(torch.int32) - 8                       # [-8, 7]
        weight = _torch_npu().npu_convert_weight_to_int4pack(signed.t().contiguous().to(device))
        off = torch.full_like(s, float(8 - zero))
        if minv is not None:
            off = off + minv.float() / torch.where(s == 0, torch.ones_like(s), s)
        offset = None if not off.any() else off.t().contiguous().to(dtype).to(device)
    return NpuQuantWeight(weight, s.t().contiguous().to(dtype).to(device), offset, N)


def linear_quant_npu(x: torch.Tensor, w: NpuQuantWeight, bias: Optional[torch.Tensor] = None
                     ) -> torch.Tensor:
    """F.linear over a quantized weight on the NPU: x [..., K] -> [..., N] in x's dtype."""
    x2 = x.reshape(-1, x.shape[-1])
    y = _torch_npu().npu_weight_quant_batchmatmul(x2, w.weight, w.scale, w.offset, None, None,
                                                  bias, antiquant_group_size=GROUP)
    return y.view(*x.shape[:-1], w.n)
