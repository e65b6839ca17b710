"""C++ CPU kernel of `npuspec::paged_attention` (contract: kernels/paged_attention.py).

Compiled and cached by Inductor's C++ toolchain (`CppCodeCache`), like verify_cpu.py. One work
item per (row, kv head), spread over OpenMP threads: the G query heads of a kv head times the
row's T tokens form R = T*G query rows that share every K/V read. The item walks the row's
blocks up to `seq_lens[b]` through the block table (the work follows the live length), and per
block computes the R x n scores, then an online-softmax update (running max, normaliser,
rescaled fp32 accumulator). K/V in fp32, bf16 or fp16 (bf16/fp16 blocks are widened to fp32
in a per-thread buffer); all arithmetic in fp32.

What differs from `reference_paged_attention`: the order of the sums (blockwise online
softmax vs one softmax) and exp's last bits, so results agree to fp32 rounding, not bitwise.
"""
from __future__ import annotations

import ctypes
import functools
import logging

import torch

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/csrc/inductor/cpp_prefix.h>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {
using Vec = at::vec::Vectorized<float>;
constexpr int64_t kL = Vec::size();

inline float dot(const float* a, const float* b, int64_t D) {
  Vec s(0.f);
  int64_t d = 0;
  for (; d + kL <= D; d += kL) s = at::vec::fmadd(Vec::loadu(a + d), Vec::loadu(b + d), s);
  __at_align__ float t[kL];
  s.store(t);
  float r = 0.f;
  for (int64_t i = 0; i < kL; ++i) r += t[i];
  for (; d < D; ++d) r += a[d] * b[d];
  return r;
}

inline void axpy(float* y, float a, const float* x, int64_t D) {  // y += a * x
  Vec va(a);
  int64_t d = 0;
  for (; d + kL <= D; d += kL) at::vec::fmadd(va, Vec::loadu(x + d), Vec::loadu(y + d)).store(y + d);
  for (; d < D; ++d) y[d] += a * x[d];
}

inline void scale_row(float* y, float a, int64_t D) {
  Vec va(a);
  int64_t d = 0;
  for (; d + kL <= D; d += kL) (Vec::loadu(y + d) * va).store(y + d);
  for (; d < D; ++d) y[d] *= a;
}

template <typename T>
inline const float* rows_f32(const T* src, int64_t n, int64_t stride, int64_t D, float* buf) {
  // n rows of D values, `stride` elements apart, widened into buf [n, D]
  for (int64_t i = 0; i < n; ++i)
    for (int64_t d = 0; d < D; ++d) buf[i * D + d] = static_cast<float>(src[i * stride + d]);
  return buf;
}

template <typename T>
void run(const T* q, float* out, const T* kc, const T* vc, const int32_t* bt, const int32_t* lens,
         int64_t B, int64_t T_, int64_t H, int64_t Hkv, int64_t D, int64_t MB, int64_t bs,
         float scale, int64_t nthreads) {
  const int64_t G = H / Hkv, R = T_ * G, stride = Hkv * D;
  const float kNegInf = -std::numeric_limits<float>::infinity();
#pragma omp parallel num_threads(nthreads)
  {
    std::vector<float> qf(R * D), acc(R * D), s(R * bs), m(R), l(R), kbuf, vbuf;
    std::vector<int64_t> qpos(R);
    if (!std::is_same<T, float>::value) { kbuf.resize(bs * D); vbuf.resize(bs * D); }
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < B * Hkv; ++item) {
      const int64_t b = item / Hkv, g = item % Hkv;
      const int64_t L = lens[b];
      for (int64_t r = 0; r < R; ++r) {
        const int64_t t = r / G, h = g * G + r % G;
        const T* src = q + ((b * T_ + t) * H + h) * D;
        for (int64_t d = 0; d < D; ++d) qf[r * D + d] = static_cast<float>(src[d]) * scale;
        qpos[r] = L - T_ + t;
        m[r] = kNegInf;
        l[r] = 0.f;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      const int64_t nblocks = L > 0 ? (L + bs - 1) / bs : 0;
      for (int64_t j = 0; j < nblocks; ++j) {
        const int64_t p0 = j * bs, n = std::min(bs, L - p0);
        const int64_t row0 = static_cast<int64_t>(bt[b * MB + j]) * bs;
        const T* kraw = kc + row0 * stride + g * D;
        const T* vraw = vc + row0 * stride + g * D;
        const float* K;
        const float* V;
        int64_t kst;
        if constexpr (std::is_same<T, float>::value) { K = kraw; V = vraw; kst = stride; }
        else { K = rows_f32(kraw, n, stride, D, kbuf.data()); V = rows_f32(vraw, n, stride, D, vbuf.data()); kst = D; }
        for (int64_t r = 0; r < R; ++r) {
          const int64_t last = std::min<int64_t>(n, qpos[r] - p0 + 1);  // visible: p0 + c <= qpos
          if (last <= 0) continue;
          float* sr = s.data() + r * bs;
          float mc = kNegInf;
          for (int64_t c = 0; c < last; ++c) {
            sr[c] = dot(qf.data() + r * D, K + c * kst, D);
            mc = std::max(mc, sr[c]);
          }
          const float mn = std::max(m[r], mc);
          const float alpha = std::exp(m[r] - mn);  // exp(-inf) = 0 on the first block
          float* ar = acc.data() + r * D;
          if (alpha != 1.f) { scale_row(ar, alpha, D); l[r] *= alpha; }
          float lsum = 0.f;
          for (int64_t c = 0; c < last; ++c) {
            const float e = std::exp(sr[c] - mn);
            lsum += e;
            axpy(ar, e, V + c * kst, D);
          }
          l[r] += lsum;
          m[r] = mn;
        }
      }
      for (int64_t r = 0; r < R; ++r) {
        const int64_t t = r / G, h = g * G + r % G;
        float* dst = out + ((b * T_ + t) * H + h) * D;
        const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
        for (int64_t d = 0; d < D; ++d) dst[d] = acc[r * D + d] * inv;
      }
    }
  }
}
}  // namespace

extern "C" void npuspec_paged_attention(
    const void* q, float* out, const void* kc, const void* vc, int64_t dtype,
    const int32_t* bt, const int32_t* lens, int64_t B, int64_t T, int64_t H, int64_t Hkv,
    int64_t D, int64_t MB, int64_t bs, float scale, int64_t nthreads) {
  if (dtype == 0)
    run((const float*)q, out, (const float*)kc, (const float*)vc, bt, lens, B, T, H, Hkv, D, MB, bs, scale, nthreads);
  else if (dtype == 1)
    run((const c10::BFloat16*)q, out, (const c10::BFloat16*)kc, (const c10::BFloat16*)vc, bt, lens, B, T, H, Hkv, D, MB, bs, scale, nthreads);
  else
    run((const c10::Half*)q, out, (const c10::Half*)kc, (const c10::Half*)vc, bt, lens, B, T, H, Hkv, D, MB, bs, scale, nthreads);
}
"""

_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@functools.lru_cache(maxsize=None)
def _compiled():
    """The compiled library, or None (logged once) when no C++ toolchain works here."""
    try:
        from torch._inductor.codecache import CppCodeCache
        lib = CppCodeCache.load(_SOURCE)
        lib.npuspec_paged_attention.restype = None
        return lib
    except Exception as e:  # no compiler, no OpenMP, ...
        log.warning("npuspec: the CPU paged-attention kernel could not be compiled (%s); "
                    "falling back to the PyTorch reference", e)
        return None


def available() -> bool:
    return _compiled() is not None


def _ptr(a: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(a.data_ptr())


def cpu_paged_attention(q, k_cache, v_cache, layer, block_table, seq_lens, block_size, scale):
    assert q.dtype == k_cache.dtype == v_cache.dtype and q.dtype in _DTYPES, (q.dtype, k_cache.dtype)
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "the KV pool must be contiguous"
    B, T, H, D = q.shape
    Hkv = k_cache.shape[2]
    qc = q.contiguous()
    bt = block_table.contiguous()
    lens = seq_lens.contiguous()
    out = torch.empty(B, T, H, D, dtype=torch.float32)
    kc, vc = k_cache[layer], v_cache[layer]  # views: contiguous layer slices of the pool
    i64 = ctypes.c_int64
    _compiled().npuspec_paged_attention(
        _ptr(qc), _ptr(out), _ptr(kc), _ptr(vc), i64(_DTYPES[q.dtype]), _ptr(bt), _ptr(lens),
        i64(B), i64(T), i64(H), i64(Hkv), i64(D), i64(bt.shape[1]), i64(block_size),
        ctypes.c_float(scale), i64(max(1, torch.get_num_threads())))
    return out if q.dtype == torch.float32 else out.to(q.dtype)
