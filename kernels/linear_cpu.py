"""`npuspec::linear_rows`: y = x @ w.T (+ bias) for the few rows of a decode/verify step on CPU.

A decode step at batch 1 multiplies 1 to ~16 rows (B*(K+1) tokens, plus the engine's padding
row) by every weight matrix, so the step is bound by reading the weights once (docs/graphs.md,
"Compiled step vs eager on a real model"). MKL handles 1 row as a GEMV at memory speed, but 2
to ~16 rows as a small GEMM that costs about twice as much: on this project's CPU a 2-row step
of SmolLM2-135M took ~1.6x the 1-row step, all of it in `aten::mm`.

This kernel streams each weight row block once whatever M is: blocks of 4 weight rows (the
threads split the blocks), and for each pair of x rows 8 vector accumulators over K, so the
arithmetic stays under the memory time up to `SMALL_M_MAX` rows; larger M goes to
`torch.mm`/`torch.addmm` (MKL's blocked GEMM wins there). fp32, contiguous x [M, K] and w [N, K]
only; anything else takes the aten path. Compiled and cached by Inductor's C++ toolchain
(`CppCodeCache`), like kernels/verify_cpu.py; no toolchain means the aten path (logged once).

Results equal `F.linear` to fp32 rounding (the K-sum is ordered differently: 8 lanes, then a
horizontal sum).
"""
from __future__ import annotations

import ctypes
import functools
from typing import Optional

import torch

from npuspec.kernels.cpp_build import load_library


# Rows up to which the kernel beats MKL on the target CPU (AVX2, 2 threads); see the bench.
SMALL_M_MAX = 16
# One row is a GEMV, which MKL runs at memory speed: 1.1-3.3x faster than this kernel for
# 192 KiB-3.9 MiB weights at 1 thread and up to 1.3 MiB at 2 threads; at 3.9 MiB and 2 threads
# the two were even (0.94x). From 2 rows MKL switches to a small GEMM, where the kernel wins.
SMALL_M_MIN = 2

_SOURCE = r"""
#include <torch/csrc/inductor/cpp_prefix.h>
#include <algorithm>
#include <cstdint>

namespace {
using Vec = at::vec::Vectorized<float>;
constexpr int64_t kL = Vec::size();

inline float hsum(const Vec& v) {
  __at_align__ float a[kL];
  v.store(a);
  float s = 0.f;
  for (int64_t i = 0; i < kL; ++i) s += a[i];
  return s;
}

inline float dot(const float* a, const float* b, int64_t K) {
  Vec acc(0.f);
  int64_t k = 0;
  for (; k + kL <= K; k += kL) acc = at::vec::fmadd(Vec::loadu(a + k), Vec::loadu(b + k), acc);
  float s = hsum(acc);
  for (; k < K; ++k) s += a[k] * b[k];
  return s;
}
}  // namespace

// y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]); x [M, K], w [N, K], y [M, N], all contiguous.
extern "C" void npuspec_linear_rows(const float* x, const float* w, const float* bias, float* y,
                                    int64_t M, int64_t N, int64_t K) {
  constexpr int64_t NB = 4;
  const int64_t nblocks = (N + NB - 1) / NB;
  const int64_t Kv = K - K % kL;
#pragma omp parallel for schedule(static)
  for (int64_t blk = 0; blk < nblocks; ++blk) {
    const int64_t n0 = blk * NB;
    if (n0 + NB > N) {  // the last, partial block
      for (int64_t n = n0; n < N; ++n)
        for (int64_t m = 0; m < M; ++m)
          y[m * N + n] = dot(x + m * K, w + n * K, K) + (bias ? bias[n] : 0.f);
      continue;
    }
    const float* w0 = w + n0 * K;
    const float* w1 = w0 + K;
    const float* w2 = w1 + K;
    const float* w3 = w2 + K;
    const float b0 = bias ? bias[n0] : 0.f, b1 = bias ? bias[n0 + 1] : 0.f;
    const float b2 = bias ? bias[n0 + 2] : 0.f, b3 = bias ? bias[n0 + 3] : 0.f;
    int64_t m = 0;
    for (; m + 2 <= M; m += 2) {  // two x rows x four w rows: 8 accumulators, 6 loads per 8 FMAs
      const float* xa = x + m * K;
      const float* xb = xa + K;
      Vec a0(0.f), a1(0.f), a2(0.f), a3(0.f), c0(0.f), c1(0.f), c2(0.f), c3(0.f);
      for (int64_t k = 0; k < Kv; k += kL) {
        const Vec va = Vec::loadu(xa + k), vb = Vec::loadu(xb + k);
        const Vec v0 = Vec::loadu(w0 + k), v1 = Vec::loadu(w1 + k);
        const Vec v2 = Vec::loadu(w2 + k), v3 = Vec::loadu(w3 + k);
        a0 = at::vec::fmadd(va, v0, a0); c0 = at::vec::fmadd(vb, v0, c0);
        a1 = at::vec::fmadd(va, v1, a1); c1 = at::vec::fmadd(vb, v1, c1);
        a2 = at::vec::fmadd(va, v2, a2); c2 = at::vec::fmadd(vb, v2, c2);
        a3 = at::vec::fmadd(va, v3, a3); c3 = at::vec::fmadd(vb, v3, c3);
      }
      float s[8] = {hsum(a0), hsum(a1), hsum(a2), hsum(a3), hsum(c0), hsum(c1), hsum(c2), hsum(c3)};
      for (int64_t k = Kv; k < K; ++k) {
        s[0] += xa[k] * w0[k]; s[1] += xa[k] * w1[k]; s[2] += xa[k] * w2[k]; s[3] += xa[k] * w3[k];
        s[4] += xb[k] * w0[k]; s[5] += xb[k] * w1[k]; s[6] += xb[k] * w2[k]; s[7] += xb[k] * w3[k];
      }
      float* ya = y + m * N + n0;
      float* yb = ya + N;
      ya[0] = s[0] + b0; ya[1] = s[1] + b1; ya[2] = s[2] + b2; ya[3] = s[3] + b3;
      yb[0] = s[4] + b0; yb[1] = s[5] + b1; yb[2] = s[6] + b2; yb[3] = s[7] + b3;
    }
    for (; m < M; ++m) {  // an odd last row
      const float* xa = x + m * K;
      float* ya = y + m * N + n0;
      ya[0] = dot(xa, w0, K) + b0; ya[1] = dot(xa, w1, K) + b1;
      ya[2] = dot(xa, w2, K) + b2; ya[3] = dot(xa, w3, K) + b3;
    }
  }
}
"""


@functools.lru_cache(maxsize=None)
def _compiled():
    """The compiled function, or None (logged once) when no C++ toolchain works here."""
    sig = {"npuspec_linear_rows": (None, [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3)}
    lib = load_library(_SOURCE, "small-M CPU linear kernel", "using torch.mm", sig)
    return None if lib is None else lib.npuspec_linear_rows


def available() -> bool:
    return _compiled() is not None


def kernel_takes_rows(m: int) -> bool:
    """Whether the kernel takes M rows: one row is MKL's GEMV, more than SMALL_M_MAX its GEMM."""
    return SMALL_M_MIN <= m <= SMALL_M_MAX


def uses_kernel(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> bool:
    """Whether `linear_rows(x, w, bias)` runs the kernel (else torch.mm / addmm)."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and w.dtype == torch.float32
            and x.dim() == 2 and w.dim() == 2 and kernel_takes_rows(x.shape[0])
            and x.shape[1] == w.shape[1] and x.is_contiguous() and w.is_contiguous()
            and (bias is None or (bias.dtype == torch.float32 and bias.dim() == 1
                                  and bias.is_contiguous() and bias.shape[0] == w.shape[0]))
            and not (torch.is_grad_enabled()  # no autograd formula: leave training to aten
                     and (x.requires_grad or w.requires_grad
                          or (bias is not None and bias.requires_grad)))
            and _compiled() is not None)


def linear_rows_impl(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None
                     ) -> torch.Tensor:
    """x [M, K] @ w[N, K].T (+ bias): the kernel for small fp32 M on CPU, else aten."""
    if not uses_kernel(x, w, bias):
        return torch.mm(x, w.t()) if bias is None else torch.addmm(bias, x, w.t())
    M, K = x.shape
    N = w.shape[0]
    y = torch.empty(M, N, dtype=torch.float32)
    _compiled()(x.data_ptr(), w.data_ptr(), 0 if bias is None else bias.data_ptr(),
                y.data_ptr(), M, N, K)
    return y


_lib = torch.library.Library("npuspec", "FRAGMENT")
_lib.define("linear_rows(Tensor x, Tensor w, Tensor? bias=None) -> Tensor")
_lib.impl("linear_rows", linear_rows_impl, "CPU")
_lib.impl("linear_rows", lambda x, w, bias=None: torch.mm(x, w.t()) if bias is None
          else torch.addmm(bias, x, w.t()), "CompositeExplicitAutograd")


@torch.library.register_fake("npuspec::linear_rows")
def _fake(x, w, bias=None):
    return x.new_empty(x.shape[0], w.shape[0])


def linear(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Drop-in for `F.linear(x, w, bias)` (x [..., K]) for fp32 CPU inference: one
    `npuspec::linear_rows` call, eager or traced alike, so a compiled step (any lowering)
    computes what the eager one does; the op takes the kernel for few rows, aten otherwise."""
    if (x.device.type != "cpu" or x.dtype != torch.float32 or w.dtype != torch.float32
            or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))):
        return torch.nn.functional.linear(x, w, bias)
    y = torch.ops.npuspec.linear_rows(x.reshape(-1, x.shape[-1]), w, bias)
    return y.view(*x.shape[:-1], w.shape[0])
