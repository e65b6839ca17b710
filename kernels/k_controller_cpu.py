"""The online K controller's per-step arithmetic in C (npuspec/spec_decode/k_controller.py).

Inside the engine the controller's numpy calls run right after a model step has filled the
caches with its own data, and each costs 5-15 µs there against ~1 µs on a warm loop (batch 64,
embedded model: `choose_after` 36-45 µs, `observe` 49-56 µs, `lengths_of` 10-11 µs). These two
functions do that work in one call each, over the controller's own [B, K_max] float64 rows:

- `npuspec_kc_after`: each row's drafted length (drafts >= 0) and the per-position sums
  `sum_b c[b, i] * [i < L_b]` that `KController.choose_after` weighs; returns the longest draft.
- `npuspec_kc_observe`: `KController.observe`'s update, in place: availability (optional) and
  acceptance at the verified positions, the accepted counts read from the step's result
  (int32 [rows, K+2], as the engine's verify step returns it).

Both round as the numpy reference does: the same products and sums in the same order, every
product rounded before its sum (`volatile`, so no FMA contraction), so the state, and every K
chosen from it, is bit for bit the reference's (tests/spec_decode/test_k_controller_native.py).
The reference is the numpy path in KController; it runs when this library cannot be built.
"""
from __future__ import annotations

import ctypes
import functools

from npuspec.kernels.cpp_build import load_pylibrary

SOURCE = r"""
#include <torch/csrc/inductor/cpp_prefix.h>
#include <cstdint>

#if defined(__FAST_MATH__) || defined(__ASSOCIATIVE_MATH__) || defined(__RECIPROCAL_MATH__)
#error "the K controller must round like numpy: build without -funsafe-math-optimizations"
#endif

extern "C" {

// drafts [B, kd] (row stride ld) -> lengths [B]; per_pos[j] = sum over b, in order, of
// c[b, j] * (j < lengths[b] ? 1 : 0) for j < km; returns max(lengths) (0 for B = 0).
int64_t npuspec_kc_after(const int64_t* drafts, int64_t B, int64_t kd, int64_t ld,
                         const double* c, int64_t km, int64_t* lengths, double* per_pos) {
  int64_t longest = 0;
  for (int64_t j = 0; j < km; ++j) per_pos[j] = 0.0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t* d = drafts + b * ld;
    int64_t n = 0;
    for (int64_t j = 0; j < kd; ++j) n += d[j] >= 0;
    lengths[b] = n;
    if (n > longest) longest = n;
    const double* row = c + b * km;
    for (int64_t j = 0; j < km; ++j) {
      volatile double t = row[j] * (j < n ? 1.0 : 0.0);
      per_pos[j] = per_pos[j] + t;
    }
  }
  return longest;
}

// p (nullable) and c [B, km] in place, as KController.observe: with L the drafted lengths,
// v = min(L, k) the verified positions and a = min(res[b, col] - 1, v) the accepted ones,
//   p <- p + w * ([j < L] - p),   w = alpha at j < k_draft, else 0
//   c <- c * (j < v ? 1 - alpha : 1) + (j < a ? alpha : 0)
void npuspec_kc_observe(double* p, double* c, int64_t B, int64_t km, const int64_t* L,
                        int64_t k_draft, int64_t k, const int32_t* res, int64_t res_ld,
                        int64_t col, double alpha) {
  const double keep = 1.0 - alpha;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t l = L[b];
    if (p != nullptr) {
      double* pr = p + b * km;
      for (int64_t j = 0; j < km; ++j) {
        volatile double d = (j < l ? 1.0 : 0.0) - pr[j];
        volatile double t = (j < k_draft ? alpha : 0.0) * d;
        pr[j] = pr[j] + t;
      }
    }
    const int64_t v = l < k ? l : k;
    int64_t a = (int64_t)res[b * res_ld + col] - 1;
    if (a > v) a = v;
    double* cr = c + b * km;
    for (int64_t j = 0; j < km; ++j) {
      volatile double t = cr[j] * (j < v ? keep : 1.0);
      cr[j] = t + (j < a ? alpha : 0.0);
    }
  }
}

}  // extern "C"
"""

_P, _I, _D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
SIGNATURES = {
    "npuspec_kc_after": (_I, [_P, _I, _I, _I, _P, _I, _P, _P]),
    "npuspec_kc_observe": (None, [_P, _P, _I, _I, _P, _I, _I, _P, _I, _I, _D]),
}


@functools.lru_cache(maxsize=None)
def library():
    """The compiled library (a ctypes PyDLL: a call of a few µs keeps the GIL), or None
    (logged once) when it cannot be built."""
    return load_pylibrary(SOURCE, "compiled K controller step",
                          "the K controller runs its numpy reference (same choices, more host "
                          "time)",
                          SIGNATURES)


def available() -> bool:
    return library() is not None
