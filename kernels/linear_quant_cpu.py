"""`npuspec::linear_quant`: y = x @ w.T for a weight-only quantized w, executed from its packed
integer codes on CPU (8-bit and 4-bit, groups of 32 along K).

Why. A decode step reads every weight once; the step's time is those bytes over the memory's
streaming speed (kernels/linear_packed_cpu.py). GGUF's Q8_0 is 1.06 bytes a weight and
Q4_1 0.63, against 4 for the fp32 weights a dequantising loader makes: the same file runs
from 4-6x fewer bytes when it is executed as stored.

The format (one for every GGUF block type this loads, and for on-the-fly quantization):
  w[n, k] = (code[n, k] - zero) * scale[n, k // 32] (+ minv[n, k // 32])
- code: int8 (bits 8, zero 0) or a 4-bit code 0..15 (bits 4; zero 8 for Q4_0 and int4, 0 with
  a min for Q4_1 and Q4_K); scale and minv fp32 (GGUF's fp16 scales convert exactly, and
  Q4_K's super-block products d * sc and dmin * m are what ggml computes in fp32).
- Packed like linear_packed's panels: codes [NB, K, BW] int8, or [NB, K, BW/2] uint8 where
  byte j holds column j in its low nibble and column j + BW/2 in its high one; scale/minv
  [NB, K/32, BW]. Each thread streams one contiguous panel.

The kernel works group by group: g_i = sum_{k in group} x[i, k] * (code[k] - zero) in fp32 (codes
are small integers, exact in fp32), then y_i += scale * g_i (+ minv * sum_{k in group} x[i, k]).
x, accumulation and y are fp32.

`linear_quant_reference` dequantises (the formula above, fp32) and calls torch.mm. The two
round the K-sum differently, so they agree to fp32 rounding on arbitrary x; on inputs where
every partial sum is exact in fp32 (the tests: one-hot rows, small integers, power-of-two
scales) they are bit-identical, which pins the codes, nibble order, zero, scales and mins.
"""
from __future__ import annotations

import ctypes
import functools
from typing import Optional

import torch

from npuspec._counters import counters
from npuspec.kernels.cpp_build import load_library
from npuspec.kernels.linear_packed_cpu import block_width, built_for, to_panels

GROUP = 32

_SOURCE = r"""
#include <torch/csrc/inductor/cpp_prefix.h>
#include <cstdint>

namespace {
using Vec = at::vec::Vectorized<float>;
constexpr int64_t kL = Vec::size();
constexpr int64_t kBW = 2 * kL;
constexpr int64_t kG = 32;

// The kBW codes of one k, minus zero, as two fp32 vectors. AVX2/AVX-512: widened in registers
// (the generic loops below do not vectorize: int8_t is a char type that may alias f).
#if defined(CPU_CAPABILITY_AVX2) && !defined(CPU_CAPABILITY_AVX512)
inline void load_codes(const int8_t* p, float, Vec& a, Vec& b) {
  const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  a = Vec(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c)));
  b = Vec(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(c, 8))));
}
inline void load_codes(const uint8_t* p, float zero, Vec& a, Vec& b) {
  const __m128i c = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i m = _mm_set1_epi8(15);
  const __m128i lo = _mm_and_si128(c, m), hi = _mm_and_si128(_mm_srli_epi16(c, 4), m);
  a = Vec(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(lo), _mm256_set1_epi32(static_cast<int>(zero)))));
  b = Vec(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(hi), _mm256_set1_epi32(static_cast<int>(zero)))));
}
#elif defined(CPU_CAPABILITY_AVX512)
inline void load_codes(const int8_t* p, float, Vec& a, Vec& b) {
  const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  a = Vec(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(c))));
  b = Vec(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(c, 1))));
}
inline void load_codes(const uint8_t* p, float zero, Vec& a, Vec& b) {
  const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i m = _mm_set1_epi8(15);
  const __m512i z = _mm512_set1_epi32(static_cast<int>(zero));
  a = Vec(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_and_si128(c, m)), z)));
  b = Vec(_mm512_cvtepi32_ps(_mm512_sub_epi32(
      _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(c, 4), m)), z)));
}
#else
inline void load_codes(const int8_t* p, float zero, Vec& a, Vec& b) {
  __at_align__ float f[kBW];
  for (int64_t j = 0; j < kBW; ++j) f[j] = static_cast<float>(p[j]) - zero;
  a = Vec::loadu(f); b = Vec::loadu(f + kL);
}
inline void load_codes(const uint8_t* p, float zero, Vec& a, Vec& b) {
  __at_align__ float f[kBW];
  for (int64_t j = 0; j < kL; ++j) {
    f[j] = static_cast<float>(p[j] & 15) - zero;
    f[j + kL] = static_cast<float>(p[j] >> 4) - zero;
  }
  a = Vec::loadu(f); b = Vec::loadu(f + kL);
}
#endif

// y[i, 0:kBW] = sum over groups of scale * g_i (+ minv * xs[i, group]) for MR rows.
// qp: one panel's codes, cs = bytes per k; sp/mp: the panel's [K/kG, kBW] scales and mins.
// Only the group sums live in registers through the k loop (2*MR vectors + 2 weights: MR = 6
// fits 16 AVX2 registers); y takes each group's contribution, so a verify step's K+1 <= 6
// rows unpack each code once.
template <int MR, typename C>
inline void tile(const float* x, const float* xs, int64_t K, const C* qp, int64_t cs,
                 const float* sp, const float* mp, float zero, float* y, int64_t ldy) {
  for (int i = 0; i < MR; ++i) { Vec(0.f).store(y + i * ldy); Vec(0.f).store(y + i * ldy + kL); }
  const int64_t G = K / kG;
  for (int64_t g = 0; g < G; ++g) {
    Vec ga[MR][2];
    for (int i = 0; i < MR; ++i) { ga[i][0] = Vec(0.f); ga[i][1] = Vec(0.f); }
    for (int64_t kk = 0; kk < kG; ++kk) {
      const int64_t k = g * kG + kk;
      __builtin_prefetch(qp + (k + 16) * cs, 0, 3);
      Vec w0, w1;
      load_codes(qp + k * cs, zero, w0, w1);
      for (int i = 0; i < MR; ++i) {
        const Vec xv(x[i * K + k]);
        ga[i][0] = at::vec::fmadd(xv, w0, ga[i][0]);
        ga[i][1] = at::vec::fmadd(xv, w1, ga[i][1]);
      }
    }
    const Vec s0 = Vec::loadu(sp + g * kBW), s1 = Vec::loadu(sp + g * kBW + kL);
    Vec m0(0.f), m1(0.f);
    if (mp) { m0 = Vec::loadu(mp + g * kBW); m1 = Vec::loadu(mp + g * kBW + kL); }
    for (int i = 0; i < MR; ++i) {
      float* yi = y + i * ldy;
      Vec a0 = at::vec::fmadd(ga[i][0], s0, Vec::loadu(yi));
      Vec a1 = at::vec::fmadd(ga[i][1], s1, Vec::loadu(yi + kL));
      if (mp) {
        const Vec xv(xs[i * G + g]);
        a0 = at::vec::fmadd(xv, m0, a0);
        a1 = at::vec::fmadd(xv, m1, a1);
      }
      a0.store(yi);
      a1.store(yi + kL);
    }
  }
}

template <typename C>
inline void panel(const float* x, const float* xs, int64_t M, int64_t K, const C* qp, int64_t cs,
                  const float* sp, const float* mp, float zero, float* y, int64_t ldy) {
  const int64_t G = K / kG;
  int64_t m = 0;
  for (; m + 6 <= M; m += 6)
    tile<6>(x + m * K, xs + m * G, K, qp, cs, sp, mp, zero, y + m * ldy, ldy);
  const float* xm = x + m * K;
  const float* xsm = xs + m * G;
  float* ym = y + m * ldy;
  switch (M - m) {
    case 5: tile<5>(xm, xsm, K, qp, cs, sp, mp, zero, ym, ldy); break;
    case 4: tile<4>(xm, xsm, K, qp, cs, sp, mp, zero, ym, ldy); break;
    case 3: tile<3>(xm, xsm, K, qp, cs, sp, mp, zero, ym, ldy); break;
    case 2: tile<2>(xm, xsm, K, qp, cs, sp, mp, zero, ym, ldy); break;
    case 1: tile<1>(xm, xsm, K, qp, cs, sp, mp, zero, ym, ldy); break;
    default: break;
  }
}

// xs [M, K/kG]: each row's sum over each group (what a group's min multiplies), written here
// rather than by a separate aten::sum per call.
template <typename C>
void run(const float* x, float* xs, const C* q, int64_t cs, const float* s, const float* mn,
         float zero, float* y, int64_t M, int64_t NB, int64_t K) {
  const int64_t ldy = NB * kBW, G = K / kG;
  if (mn) {
    for (int64_t i = 0; i < M * G; ++i) {
      Vec acc(0.f);
      for (int64_t j = 0; j < kG; j += kL) acc = acc + Vec::loadu(x + i * kG + j);
      __at_align__ float a[kL];
      acc.store(a);
      float t = 0.f;
      for (int64_t j = 0; j < kL; ++j) t += a[j];
      xs[i] = t;
    }
  }
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < NB; ++b)
    panel(x, xs, M, K, q + b * K * cs, cs, s + b * G * kBW, mn ? mn + b * G * kBW : nullptr,
          zero, y + b * kBW, ldy);
}
}  // namespace

extern "C" int64_t npuspec_linear_quant_block() { return kBW; }
extern "C" void npuspec_linear_quant_q8(const float* x, float* xs, const int8_t* q,
                                        const float* s, const float* mn, float zero, float* y,
                                        int64_t M, int64_t NB, int64_t K) {
  run(x, xs, q, kBW, s, mn, zero, y, M, NB, K);
}
extern "C" void npuspec_linear_quant_q4(const float* x, float* xs, const uint8_t* q,
                                        const float* s, const float* mn, float zero, float* y,
                                        int64_t M, int64_t NB, int64_t K) {
  run(x, xs, q, kBW / 2, s, mn, zero, y, M, NB, K);
}
"""


@functools.lru_cache(maxsize=None)
def _library():
    """The compiled library, or None (logged once) when no C++ toolchain works here."""
    args = [ctypes.c_void_p] * 5 + [ctypes.c_float, ctypes.c_void_p] + [ctypes.c_int64] * 3
    sig = {"npuspec_linear_quant_block": (ctypes.c_int64, []),
           "npuspec_linear_quant_q8": (None, args), "npuspec_linear_quant_q4": (None, args)}
    return load_library(_SOURCE, "quantized CPU linear kernel",
                        "quantized layers run their PyTorch reference (dequantise + torch.mm)", sig)


def available() -> bool:
    return _library() is not None


@functools.lru_cache(maxsize=None)
def _kernel_for(bw: int):
    return built_for(_library(), "npuspec_linear_quant_block", bw, "npuspec::linear_quant")


# ---- packing ------------------------------------------------------------------------------

def pack_quant(codes: torch.Tensor, scale: torch.Tensor, minv: Optional[torch.Tensor],
               bits: int) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """codes [N, K] (int8 for bits 8; 0..15 in any integer dtype for bits 4), scale/minv
    [N, K/32] -> the kernel's panels (codes, scale, minv)."""
    N, K = codes.shape
    assert bits in (4, 8) and K % GROUP == 0 and scale.shape == (N, K // GROUP), (bits, codes.shape, scale.shape)
    assert minv is None or minv.shape == scale.shape, (minv.shape, scale.shape)
    bw = block_width()
    s = to_panels(scale.float(), bw)
    m = None if minv is None else to_panels(minv.float(), bw)
    if bits == 8:
        return to_panels(codes.to(torch.int8), bw), s, m
    assert int(codes.min()) >= 0 and int(codes.max()) <= 15, (int(codes.min()), int(codes.max()))
    p = to_panels(codes.to(torch.uint8), bw)                     # [NB, K, bw]
    half = bw // 2
    return (p[..., :half] | (p[..., half:] << 4)).contiguous(), s, m  # [NB, K, bw/2]


def unpack_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Packed codes -> [NB, K, BW] int16 (the 4-bit nibbles split back into columns)."""
    if bits == 8:
        return q.to(torch.int16)
    return torch.cat([q & 15, q >> 4], dim=-1).to(torch.int16)


def _unpanel(t: torch.Tensor, n: int) -> torch.Tensor:
    nb, C, bw = t.shape
    return t.transpose(1, 2).reshape(nb * bw, C)[:n]


def dequantize(q: torch.Tensor, scale: torch.Tensor, minv: Optional[torch.Tensor], bits: int,
               zero: int, n: int) -> torch.Tensor:
    """The fp32 weight [n, K] the packed codes stand for: (code - zero) * scale (+ minv)."""
    c = _unpanel(unpack_codes(q, bits), n).float() - zero            # [n, K]
    w = c * _unpanel(scale, n).repeat_interleave(GROUP, dim=1)
    if minv is not None:
        w = w + _unpanel(minv, n).repeat_interleave(GROUP, dim=1)
    return w


def quant_rows(q: torch.Tensor, scale: torch.Tensor, minv: Optional[torch.Tensor], bits: int,
               zero: int, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` [...] of the dequantised weight -> fp32 [..., K] (an embedding lookup in a
    tied, quantized LM head), reading only those rows' codes."""
    bw = scale.shape[2]
    flat = ids.reshape(-1)
    b, j = flat // bw, flat % bw
    if bits == 8:
        c = q[b, :, j].float()                                        # [R, K]
    else:
        half = bw // 2
        byte = q[b, :, j % half]
        c = torch.where((j < half)[:, None], byte & 15, byte >> 4).float()
    c = c - zero
    w = c * scale[b, :, j].repeat_interleave(GROUP, dim=1)
    if minv is not None:
        w = w + minv[b, :, j].repeat_interleave(GROUP, dim=1)
    return w.view(*ids.shape, -1)


# ---- the op ---------------------------------------------------------------------------------

def linear_quant_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                           minv: Optional[torch.Tensor], bits: int, zero: int, n: int) -> torch.Tensor:
    """fp32 x [M, K] @ dequantize(...).T -> fp32 [M, n]."""
    return x.float() @ dequantize(q, scale, minv, bits, zero, n).t()


def linear_quant_impl(x, q, scale, minv, bits: int, zero: int, n: int) -> torch.Tensor:
    M, K = x.shape
    nb, Kq, _ = q.shape
    bw = scale.shape[2]
    assert K == Kq and K % GROUP == 0 and n <= nb * bw and bits in (4, 8) and x.device.type == "cpu", (
        x.shape, q.shape, n, bits, x.device)
    lib = _kernel_for(bw)
    if lib is None:
        counters.bump("eager_fallbacks")
        return linear_quant_reference(x, q, scale, minv, bits, zero, n)
    if x.dtype != torch.float32 or not x.is_contiguous():
        x = x.float().contiguous()
    y = torch.empty(M, nb * bw, dtype=torch.float32)
    if M:
        # the group sums a min multiplies: filled by the kernel ([M, K/32] fp32)
        xs = torch.empty(M, K // GROUP, dtype=torch.float32) if minv is not None else y
        fn = lib.npuspec_linear_quant_q8 if bits == 8 else lib.npuspec_linear_quant_q4
        fn(x.data_ptr(), xs.data_ptr(), q.data_ptr(), scale.data_ptr(),
           0 if minv is None else minv.data_ptr(), float(zero), y.data_ptr(), M, nb, K)
    return y if n == nb * bw else y[:, :n].contiguous()


_lib = torch.library.Library("npuspec", "FRAGMENT")
_lib.define("linear_quant(Tensor x, Tensor q, Tensor scale, Tensor? minv, int bits, int zero, "
            "int n) -> Tensor")
# CompositeExplicitAutograd: the C++ kernel of kernels/native_cpu.py, once installed, outranks
# this Python one for CPU tensors (and hands it the uncommon cases)
_lib.impl("linear_quant", linear_quant_impl, "CompositeExplicitAutograd")


@torch.library.register_fake("npuspec::linear_quant")
def _fake(x, q, scale, minv, bits, zero, n):
    return x.new_empty(x.shape[0], n, dtype=torch.float32)


def linear_quant(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, minv: Optional[torch.Tensor],
                 bits: int, zero: int, n: int) -> torch.Tensor:
    """F.linear over a packed quantized weight: x [..., K] (any float dtype) -> [..., n] in x's
    dtype, accumulated in fp32."""
    y = torch.ops.npuspec.linear_quant(x.reshape(-1, x.shape[-1]), q, scale, minv, bits, zero, n)
    return y.to(x.dtype).view(*x.shape[:-1], n)
