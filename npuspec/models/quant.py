"""Weight-only quantized projections: GGUF blocks read as stored, or fp weights quantized at load.

One format for all of them (kernels/linear_quant_cpu.py executes it from the packed codes):
  w[n, k] = (code[n, k] - zero) * scale[n, k // 32] (+ minv[n, k // 32])

| source | bits | zero | scale | minv |
|---|---|---|---|---|
| GGUF Q8_0 (32 x int8, fp16 d) | 8 | 0 | d | - |
| GGUF Q4_0 (32 x 4-bit, fp16 d) | 4 | 8 | d | - |
| GGUF Q4_1 (fp16 d, m) | 4 | 0 | d | m |
| GGUF Q4_K (256-superblocks: fp16 d, dmin, 6-bit sc/m per 32) | 4 | 0 | d*sc | -(dmin*m) |
| `quantization="int8"` | 8 | 0 | max abs / 127 | - |
| `quantization="int4"` | 4 | 0 | (max - min) / 15 | min |

Each GGUF row decodes to exactly the floats gguf-py's `dequantize` gives (tested): fp16
scales are exact in fp32, and Q4_K's d*sc and dmin*m are computed in fp32 as ggml does.
The block layouts are ggml's (ggml-common.h); this file reads them with numpy.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Optional, Sequence

import numpy as np
import torch
from torch import nn

from npuspec._counters import counters
from npuspec.kernels import linear_quant_cpu as lq
from npuspec.kernels import linear_quant_npu as lqn

log = logging.getLogger(__name__)

GROUP = lq.GROUP
# GGUF block types executed as stored; others are dequantised (logged once per type)
GGUF_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K")
SCHEMES = ("int8", "int4")
# LLM(quantization=...): "gguf" = a GGUF file's quantized tensors as stored
QUANTIZATIONS = ("gguf",) + SCHEMES


@dataclasses.dataclass
class QWeight:
    """A quantized weight [N, K], row-major (not yet packed)."""
    codes: torch.Tensor            # [N, K] int8 (bits 8) or uint8 0..15 (bits 4)
    scale: torch.Tensor            # [N, K/32] fp32
    minv: Optional[torch.Tensor]   # [N, K/32] fp32 or None
    bits: int
    zero: int
    kind: str                      # "Q4_1", "int8", ...

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def rows(self, idx: torch.Tensor) -> "QWeight":
        """The rows `idx` (int64 [R]); index_select: ~7x faster than advanced indexing here."""
        pick = functools.partial(torch.index_select, dim=0, index=idx)
        return dataclasses.replace(self, codes=pick(self.codes), scale=pick(self.scale),
                                   minv=None if self.minv is None else pick(self.minv))

    def dequantize(self) -> torch.Tensor:
        w = (self.codes.float() - self.zero) * self.scale.repeat_interleave(GROUP, dim=1)
        if self.minv is not None:
            w = w + self.minv.repeat_interleave(GROUP, dim=1)
        return w                                                    # [N, K] fp32

    def nbytes(self) -> int:
        code_bytes = self.codes.numel() * self.bits // 8
        return code_bytes + 4 * self.scale.numel() * (1 if self.minv is None else 2)


def cat_rows(parts: Sequence[QWeight]) -> Optional[QWeight]:
    """The row concatenation (a fused q|k|v or gate|up), or None when the parts' formats differ
    (bits, zero, or a min in some only)."""
    p0 = parts[0]
    if any((p.bits, p.zero, p.minv is None) != (p0.bits, p0.zero, p0.minv is None) for p in parts):
        return None
    return QWeight(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]),
                   None if p0.minv is None else torch.cat([p.minv for p in parts]),
                   p0.bits, p0.zero, "+".join(sorted({p.kind for p in parts})))


# ---- GGUF blocks ---------------------------------------------------------------------------

def _f16(b: np.ndarray) -> np.ndarray:
    """Little-endian fp16 from the last axis' 2 bytes -> fp32."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[.., 16] bytes -> [.., 32] codes: the low nibbles are elements 0..15, the high 16..31."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _q4k_scales(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 scale bytes [.., 12] -> 6-bit (sc, m) per sub-block, each [.., 8]."""
    sc = sc.astype(np.uint8)
    lo, hi = sc[..., 0:4], sc[..., 4:8]
    tail = sc[..., 8:12]
    s = np.concatenate([lo & 63, (tail & 15) | ((lo >> 6) << 4)], axis=-1)
    m = np.concatenate([hi & 63, (tail >> 4) | ((hi >> 6) << 4)], axis=-1)
    return s, m


def from_gguf(raw: np.ndarray, qtype: str, n_cols: int) -> QWeight:
    """A GGUF tensor's raw rows [N, bytes per row] uint8 of block type `qtype` -> QWeight."""
    N = raw.shape[0]
    if qtype == "Q8_0":
        b = raw.reshape(N, -1, 34)
        codes = np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(N, n_cols)
        scale, minv, bits, zero = _f16(b[..., 0:2]), None, 8, 0
    elif qtype in ("Q4_0", "Q4_1"):
        size = 18 if qtype == "Q4_0" else 20
        b = raw.reshape(N, -1, size)
        codes = _nibbles(b[..., size - 16:]).reshape(N, n_cols)
        scale = _f16(b[..., 0:2])
        minv, zero = (None, 8) if qtype == "Q4_0" else (_f16(b[..., 2:4]), 0)
        bits = 4
    elif qtype == "Q4_K":
        b = raw.reshape(N, -1, 144)                                 # [N, S, 144] superblocks
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])              # [N, S]
        sc, m = _q4k_scales(b[..., 4:16])                          # [N, S, 8]
        qs = b[..., 16:].reshape(N, -1, 4, 32)                      # 4 chunks of 64 values
        codes = np.stack([qs & 15, qs >> 4], axis=3).reshape(N, n_cols)  # sub-blocks 2i, 2i+1
        scale = (d[..., None] * sc.astype(np.float32)).reshape(N, -1)
        minv = -(dmin[..., None] * m.astype(np.float32)).reshape(N, -1)
        bits, zero = 4, 0
    else:
        raise ValueError(f"GGUF block type {qtype}: not executed as stored (use one of "
                         f"{', '.join(GGUF_TYPES)}, or quantization=None to dequantise)")
    return QWeight(torch.from_numpy(np.ascontiguousarray(codes)),
                   torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32)),
                   None if minv is None else torch.from_numpy(np.ascontiguousarray(minv, dtype=np.float32)),
                   bits, zero, qtype)


# ---- quantizing fp weights -----------------------------------------------------------------

def quantize(w: torch.Tensor, scheme: str) -> QWeight:
    """w [N, K] (K a multiple of 32) -> QWeight: "int8" symmetric per group (Q8_0's rule),
    "int4" asymmetric per group with a min (Q4_1's rule), round to nearest."""
    N, K = w.shape
    if K % GROUP:
        raise ValueError(f"quantization={scheme!r}: a weight with {K} input features is not a "
                         f"multiple of {GROUP}; use quantization=None for this model")
    g = w.detach().float().cpu().reshape(N, K // GROUP, GROUP)  # packed on the host
    if scheme == "int8":
        d = g.abs().amax(-1) / 127                                  # [N, G]
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        codes = (g * inv[..., None]).round().clamp(-127, 127).to(torch.int8)
        return QWeight(codes.reshape(N, K), d, None, 8, 0, scheme)
    assert scheme == "int4", scheme
    lo, hi = g.amin(-1), g.amax(-1)
    d = (hi - lo) / 15
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    codes = ((g - lo[..., None]) * inv[..., None]).round().clamp(0, 15).to(torch.uint8)
    return QWeight(codes.reshape(N, K), d, lo, 4, 0, scheme)


# ---- attaching to a model ------------------------------------------------------------------

class QuantParams(nn.Module):
    """A projection's packed quantized weight: buffers that move with the model."""

    def __init__(self, q: QWeight):
        super().__init__()
        codes, scale, minv = lq.pack_quant(q.codes, q.scale, q.minv, q.bits)
        self.register_buffer("codes", codes, persistent=False)
        self.register_buffer("scale", scale, persistent=False)
        self.register_buffer("minv", minv, persistent=False)
        self.bits, self.zero, self.kind, self.n = q.bits, q.zero, q.kind, q.shape[0]

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return lq.linear_quant(x, self.codes, self.scale, self.minv, self.bits, self.zero, self.n)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return lq.quant_rows(self.codes, self.scale, self.minv, self.bits, self.zero, ids)

    def extra_repr(self) -> str:
        return f"{self.kind}, {self.bits}-bit, n={self.n}"


class NpuQuantParams(nn.Module):
    """The same weight as the operator inputs of CANN's weight-quant matmul
    (kernels/linear_quant_npu.py; unverified on hardware)."""

    def __init__(self, p: QuantParams, dtype: torch.dtype, device):
        super().__init__()
        codes = lq.unpack_codes(p.codes, p.bits)                        # [NB, K, BW]
        codes = codes.transpose(1, 2).reshape(-1, codes.shape[1])[:p.n]  # [N, K]
        w = lqn.to_npu(codes, _rows(p.scale, p.n), None if p.minv is None else _rows(p.minv, p.n),
                       p.bits, p.zero, dtype, device)
        self.register_buffer("weight", w.weight, persistent=False)
        self.register_buffer("scale", w.scale, persistent=False)
        self.register_buffer("offset", w.offset, persistent=False)
        self.bits, self.zero, self.kind, self.n = p.bits, p.zero, p.kind, p.n

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return lqn.linear_quant_npu(x, lqn.NpuQuantWeight(self.weight, self.scale, self.offset,
                                                          self.n))


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """Panels [NB, C, BW] -> rows [n, C]."""
    return t.transpose(1, 2).reshape(-1, t.shape[1])[:n]


def place_on_npu(model: nn.Module, dtype: torch.dtype, device) -> None:
    """Swap every quantized projection's CPU panels for the NPU operator's inputs. A tied
    embedding gets its own dequantised table in `dtype` (the NPU head's int4 layout is by
    column), an extra V x hidden of memory."""
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"dtype={dtype}: quantized layers on the NPU take float16 or bfloat16 "
                         "activations; pass dtype='bfloat16'")
    for m in list(model.modules()):
        q = getattr(m, "quant", None)
        if isinstance(q, QuantParams):
            m.quant = NpuQuantParams(q, dtype, device)
    head = getattr(model, "head_quant", None)
    if isinstance(head, QuantParams):
        if model.embed is None:
            V, K = head.n, head.codes.shape[1]
            table = head.rows(torch.arange(V)).to(dtype).to(device)
            model.embed = nn.Embedding(V, K, _weight=table).requires_grad_(False)
        model.head_quant = NpuQuantParams(head, dtype, device)


def attach(layer: nn.Linear, q: QWeight) -> None:
    """Replace layer's weight by the packed quantized one (decoder._linear reads `quant`)."""
    assert tuple(q.shape) == (layer.out_features, layer.in_features), (q.shape, layer)
    del layer.weight
    layer.register_parameter("weight", None)
    layer.quant = QuantParams(q)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer: what the model keeps resident."""
    return sum(t.numel() * t.element_size()
               for t in list(model.parameters()) + list(model.buffers()) if t is not None)


def quantize_model(model: nn.Module, scheme: str) -> None:
    """Quantize every projection and the LM head of a loaded `DecoderLM` in place
    (`LLM(quantization="int8" | "int4")`); the embedding of a tied model is then looked up in
    the quantized head. Norms stay in the model's dtype."""
    if scheme not in SCHEMES:
        raise ValueError(f"quantization={scheme!r}: use one of {', '.join(SCHEMES)}")
    with torch.no_grad():
        for block in model.layers:
            for layer in (block.wqkv, block.wo, block.w13, block.w2):
                if getattr(layer, "quant", None) is None:
                    attach(layer, quantize(layer.weight, scheme))
        if getattr(model, "head_quant", None) is None:
            w = model.embed.weight if model.lm_head is None else model.lm_head.weight
            set_head(model, quantize(w, scheme))


def set_head(model: nn.Module, q: QWeight) -> None:
    """Make q the model's LM head (and, when tied, its embedding table)."""
    model.head_quant = QuantParams(q)
    if model.lm_head is None:
        model.embed = None
    else:
        model.lm_head = None


def note_dequantised(kind: str, name: str) -> None:
    """A tensor whose block type is not executed as stored: logged once per type, counted."""
    counters.bump("quant_dequantised")
    if kind not in _LOGGED:
        _LOGGED.add(kind)
        log.warning("npuspec: GGUF tensors of type %s (first: %s) are dequantised at load; "
                    "only %s run as stored", kind, name, ", ".join(GGUF_TYPES))


_LOGGED: set = set()
