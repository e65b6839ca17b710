"""`npuspec::add_rms_norm`: the residual add and the RMSNorm of a decoder layer in one CPU op.

    sum    = x + residual                                   (rounded to x's dtype)
    normed = weight * (sum * rsqrt(mean(sum^2) + eps))      (statistics in fp32)

Why an op and not Inductor's fusion. Left to itself, Inductor keeps the residual stream
unrealised for a few layers and recomputes the chain of adds inside each norm kernel, up to
its read-count threshold; where the chain is cut differs layer by layer, so a 30-layer model
gets dozens of distinct norm kernels (one g++ run each on a cold cache) that re-read the
embedding row several times per step. One op per norm, as vLLM's `fused_add_rms_norm` and
torch_npu's `npu_add_rms_norm` do, makes every layer the same: the first compile of a real
model drops from minutes of g++ runs to a handful, and each step reads the stream once.

The model uses it only where `npuspec.models.packing.pack_model` turned the CPU kernels on
(`DecoderLM.fused_norm`); elsewhere the plain PyTorch form below runs and Inductor (or the
eager path) fuses it as before. `add_rms_norm_reference` is that form, the oracle; results
equal it to fp32 rounding of the mean (summed in a different order), bit for bit otherwise.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from npuspec._counters import counters
from npuspec.kernels.cpp_build import load_library


_SOURCE = r"""
#include <torch/csrc/inductor/cpp_prefix.h>
#include <cmath>
#include <cstdint>
#include <type_traits>

namespace {
// Inductor's flags turn off auto-vectorisation (-fno-tree-loop-vectorize): vectors are explicit
using V = at::vec::Vectorized<float>;
constexpr int kW = V::size();

template <typename T>
inline V vload(const T* p) {  // kW elements widened to fp32 (exact)
  if constexpr (std::is_same_v<T, float>) {
    return V::loadu(p);
  } else {
    V v;
    at::vec::load_to_float<T>(p, v);
    return v;
  }
}

template <typename T>
inline void vstore(T* p, V v) {  // rounds to T (nearest even, like PyTorch's casts)
  if constexpr (std::is_same_v<T, float>) {
    v.store(p);
  } else {
    at::vec::convert_from_float<T>(v, v).store(p, kW);
  }
}

template <typename T>
void row(const T* __restrict__ x, const T* __restrict__ r, const T* __restrict__ w,
         T* __restrict__ out, T* __restrict__ sum, int64_t N, float eps) {
  V acc(0.f);
  float tail = 0.f;
  int64_t n = 0;
  for (; n + kW <= N; n += kW) {
    vstore(sum + n, vload(x + n) + vload(r + n));
    V s = vload(sum + n);  // the sum as rounded to T: the statistics see what is stored
    acc = acc + s * s;
  }
  for (; n < N; ++n) {
    sum[n] = static_cast<T>(static_cast<float>(x[n]) + static_cast<float>(r[n]));
    float s = static_cast<float>(sum[n]);
    tail += s * s;
  }
  float lanes[kW];
  acc.store(lanes);
  float ss = tail;
  for (int j = 0; j < kW; ++j) ss += lanes[j];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(N) + eps);
  const V vinv(inv);
  for (n = 0; n + kW <= N; n += kW) {
    // (sum * inv) rounded to T, then times the weight, rounded again: the reference's casts
    vstore(out + n, vload(sum + n) * vinv);
    vstore(out + n, vload(w + n) * vload(out + n));
  }
  for (; n < N; ++n) {
    T h = static_cast<T>(static_cast<float>(sum[n]) * inv);
    out[n] = static_cast<T>(static_cast<float>(w[n]) * static_cast<float>(h));
  }
}

template <typename T>
void run(const T* x, const T* r, const T* w, T* out, T* sum, int64_t M, int64_t N, float eps) {
  // a decode step has a few rows of a few hundred elements: threads would cost more than
  // the work; prefill rows are split across them
  if (M < 64) {
    for (int64_t m = 0; m < M; ++m) row(x + m * N, r + m * N, w, out + m * N, sum + m * N, N, eps);
    return;
  }
#pragma omp parallel for
  for (int64_t m = 0; m < M; ++m) row(x + m * N, r + m * N, w, out + m * N, sum + m * N, N, eps);
}
}  // namespace

extern "C" void npuspec_add_rms_norm_f32(const float* x, const float* r, const float* w, float* out,
                                         float* sum, int64_t M, int64_t N, double eps) {
  run(x, r, w, out, sum, M, N, static_cast<float>(eps));
}
extern "C" void npuspec_add_rms_norm_bf16(const at::BFloat16* x, const at::BFloat16* r,
                                          const at::BFloat16* w, at::BFloat16* out,
                                          at::BFloat16* sum, int64_t M, int64_t N, double eps) {
  run(x, r, w, out, sum, M, N, static_cast<float>(eps));
}
extern "C" void npuspec_add_rms_norm_f16(const at::Half* x, const at::Half* r, const at::Half* w,
                                         at::Half* out, at::Half* sum, int64_t M, int64_t N,
                                         double eps) {
  run(x, r, w, out, sum, M, N, static_cast<float>(eps));
}
"""

_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


@functools.lru_cache(maxsize=None)
def _library():
    """The compiled library, or None (logged once) when no C++ toolchain works here."""
    args = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 2 + [ctypes.c_double]
    return load_library(_SOURCE, "CPU add+RMSNorm kernel", "norms stay in PyTorch",
                        {f"npuspec_add_rms_norm_{s}": (None, args) for s in _SUFFIX.values()})


def available() -> bool:
    return _library() is not None


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (weight * rmsnorm(x + residual), x + residual); fp32 statistics, like HF."""
    s = x + residual
    h = s.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(s.dtype), s


def _impl(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    N = x.shape[-1]
    assert (x.shape == residual.shape and weight.shape == (N,) and x.dtype in _SUFFIX
            and residual.dtype == x.dtype == weight.dtype and x.device.type == "cpu"), (
        x.shape, residual.shape, weight.shape, x.dtype, residual.dtype, weight.dtype, x.device)
    lib = _library()
    if lib is None:  # the build failed after the model chose the op (load_library logged it)
        counters.bump("eager_fallbacks")
        return add_rms_norm_reference(x, residual, weight, eps)
    x, residual, weight = x.contiguous(), residual.contiguous(), weight.contiguous()
    out, s = torch.empty_like(x), torch.empty_like(x)
    M = x.numel() // N if N else 0
    if M:
        getattr(lib, f"npuspec_add_rms_norm_{_SUFFIX[x.dtype]}")(
            x.data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr(), s.data_ptr(),
            M, N, float(eps))
    return out, s


_lib = torch.library.Library("npuspec", "FRAGMENT")
_lib.define("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)")
# CompositeExplicitAutograd: the C++ kernel of kernels/native_cpu.py, once installed, outranks
# this Python one for CPU tensors (and hands it the uncommon cases)
_lib.impl("add_rms_norm", _impl, "CompositeExplicitAutograd")


@torch.library.register_fake("npuspec::add_rms_norm")
def _fake(x, residual, weight, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format), \
        torch.empty_like(x, memory_format=torch.contiguous_format)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, sum) of `add_rms_norm_reference`; through the C++ op when `fused`."""
    if fused:
        return torch.ops.npuspec.add_rms_norm(x, residual, weight, eps)
    return add_rms_norm_reference(x, residual, weight, eps)
