"""The composed mode's race on row n, in C for the CPU (kernels/verify_composed.py).

`composed_verify` builds, for each request, the residual of its first rejected row and races
it against the user's draws: pick row n of p, q and E ([B, V] copies), `max(p - q, floor)`,
optionally divide by the row's sum, divide (or multiply) by E, then argmax. In PyTorch that is
three row copies and four passes over [B, V] (vLLM v1's step at B = 8, V = 32,000: ~1.3 ms of
the op's ~2 ms on one core, where Inductor's whole compiled step takes ~1.9 ms). Here two
vectorised passes read the rows in place through per-request offsets:

- `npuspec_residual_rows`: r = nonneg(p_n - q_n), as `accept._residual` computes it (clamp:
  `at::vec::clamp_min` / `isnan(a) ? a : max(a, floor)`, ATen's own clamp_min kernel; where:
  d > 0 ? d : +0.0; none: d);
- `npuspec_race_scores`: in place, r / s (the row sum, taken by PyTorch between the passes so
  its bits are ATen's: `verify_composed._row_sums`), then r / E or r * E, then the
  `zero_inf` guard (fill where E == 0 or is infinite); then each row's argmax as
  torch.argmax takes it (a vectorised maximum, then the first element equal to it; the first
  NaN where there is one), which on one core took ~0.4 ms for 8 rows of 32,000.

Each element is the same IEEE operation as PyTorch's, so the scores and their argmax are
bit for bit the reference's (`composed_verify` without this library;
tests/kernels/test_race_rows_cpu.py). Layouts it does not take (V not innermost, other dtypes,
gumbel's log) go the PyTorch way, which is also the reference.
"""
from __future__ import annotations

import ctypes
import functools
from typing import Optional

import torch
from torch import Tensor

from npuspec.kernels.cpp_build import load_library

SOURCE = r"""
#include <torch/csrc/inductor/cpp_prefix.h>
#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__FAST_MATH__) || defined(__ASSOCIATIVE_MATH__) || defined(__RECIPROCAL_MATH__)
#error "the composed race must round like PyTorch: build without -funsafe-math-optimizations"
#endif

namespace {
using Vec = at::vec::Vectorized<float>;
constexpr int64_t kL = Vec::size();

inline float nonneg1(float d, int64_t mode, float floor) {
  if (mode == 0) return std::isnan(d) ? d : std::max(d, floor);
  if (mode == 1) return d > 0.f ? d : 0.f;
  return d;
}

inline Vec nonneg(const Vec& d, int64_t mode, const Vec& floor, const Vec& zero) {
  if (mode == 0) return at::vec::clamp_min(d, floor);
  if (mode == 1) return Vec::blendv(zero, d, d > zero);
  return d;
}

// torch.argmax of a row: the first NaN if there is one, else the first element equal to the
// maximum (-0.0 == +0.0, so the first zero when the maximum is a zero)
int64_t argmax_row(const float* x, int64_t V) {
  if (V == 0) return 0;
  Vec vm(x[0]);
  int64_t v = 0;
  for (; v + kL <= V; v += kL) vm = at::vec::maximum(vm, Vec::loadu(x + v));  // NaN sticks
  __at_align__ float lanes[kL];
  vm.store(lanes);
  float m = lanes[0];
  for (int64_t i = 1; i < kL; ++i) m = (std::isnan(lanes[i]) || lanes[i] > m) ? lanes[i] : m;
  for (; v < V; ++v) m = (std::isnan(x[v]) || x[v] > m) ? x[v] : m;
  if (std::isnan(m) || std::isnan(x[0])) {
    for (int64_t i = 0; i < V; ++i)
      if (std::isnan(x[i])) return i;
  }
  const Vec target(m);
  for (v = 0; v + kL <= V; v += kL) {
    if ((Vec::loadu(x + v) == target).zero_mask() != (1 << kL) - 1) {   // some lane equals m
      for (int64_t i = v; i < v + kL; ++i)
        if (x[i] == m) return i;
    }
  }
  for (; v < V; ++v)
    if (x[v] == m) return v;
  return 0;
}
}  // namespace

extern "C" {

// r[b, :] = nonneg(p[po[b] + v] - q[qo[b] + v]); mode 0 clamp (at floor), 1 where, 2 none;
// qo[b] < 0: no residual for that row, r[b, :] = p's row as it is
void npuspec_residual_rows(const float* p, const int64_t* po, const float* q, const int64_t* qo,
                           int64_t B, int64_t V, int64_t mode, float floor, float* r,
                           int64_t threads) {
  const Vec vfloor(floor), zero(0.f);
#pragma omp parallel for num_threads(threads) if (threads > 1 && B > 1)
  for (int64_t b = 0; b < B; ++b) {
    const float* pr = p + po[b];
    float* rr = r + b * V;
    if (qo[b] < 0) {
      std::copy(pr, pr + V, rr);
      continue;
    }
    const float* qr = q + qo[b];
    int64_t v = 0;
    for (; v + kL <= V; v += kL)
      nonneg(Vec::loadu(pr + v) - Vec::loadu(qr + v), mode, vfloor, zero).store(rr + v);
    for (; v < V; ++v) rr[v] = nonneg1(pr[v] - qr[v], mode, floor);
  }
}

// in place: r = r / s[b] (s may be null), then r / e or r * e (mul != 0), then fill where
// e == 0 or |e| == inf (guard != 0); e rows at e + eo[b]; idx[b] = the row's argmax
void npuspec_race_scores(float* r, const float* s, const float* e, const int64_t* eo,
                         int64_t B, int64_t V, int64_t mul, int64_t guard, float fill,
                         int64_t* idx, int64_t threads) {
  const Vec zero(0.f), inf(INFINITY), vfill(fill);
#pragma omp parallel for num_threads(threads) if (threads > 1 && B > 1)
  for (int64_t b = 0; b < B; ++b) {
    float* rr = r + b * V;
    const float* er = e + eo[b];
    const bool norm = s != nullptr;
    const float sb = norm ? s[b] : 1.f;
    const Vec vs(sb);
    int64_t v = 0;
    for (; v + kL <= V; v += kL) {
      Vec x = Vec::loadu(rr + v);
      if (norm) x = x / vs;
      const Vec ev = Vec::loadu(er + v);
      x = mul ? x * ev : x / ev;
      if (guard) x = Vec::blendv(x, vfill, (ev == zero) | (ev.abs() == inf));
      x.store(rr + v);
    }
    for (; v < V; ++v) {
      float x = rr[v];
      if (norm) x = x / sb;
      const float ev = er[v];
      x = mul ? x * ev : x / ev;
      if (guard && (ev == 0.f || std::isinf(ev))) x = fill;
      rr[v] = x;
    }
    idx[b] = argmax_row(rr, V);
  }
}

}  // extern "C"
"""

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
SIGNATURES = {
    "npuspec_residual_rows": (None, [_P, _P, _P, _P, _I, _I, _I, _F, _P, _I]),
    "npuspec_race_scores": (None, [_P, _P, _P, _P, _I, _I, _I, _I, _F, _P, _I]),
}
NONNEG_MODES = {"clamp": 0, "where": 1, "none": 2}
SAMPLERS = {"race": 0, "race_mul": 1}


@functools.lru_cache(maxsize=None)
def library():
    """The compiled library (ctypes), or None (logged once) when it cannot be built."""
    return load_library(SOURCE, "composed-mode race kernel",
                        "the composed mode races row n in PyTorch (same tokens, slower)",
                        SIGNATURES)


def available() -> bool:
    return library() is not None


def _offsets(t: Tensor, nk: Tensor, B: int, K: int, V: int) -> Optional[Tensor]:
    """int64 [B]: element offset of row nk[b] of request b in t (t broadcasting to [B, K, V]),
    or None where t is not float32 on the CPU with its V innermost."""
    if t.dtype != torch.float32 or t.device.type != "cpu":
        return None
    try:
        tb = torch.broadcast_to(t, (B, K, V))
    except RuntimeError:
        return None
    if V > 1 and tb.stride(2) != 1:
        return None
    s0, s1 = tb.stride(0), tb.stride(1)
    return torch.arange(B, dtype=torch.int64) * s0 + nk * s1


def _flat_offsets(t: Tensor, rows: Tensor) -> Optional[Tensor]:
    """int64 [B]: element offset of row rows[b] of a 2-D t [N, V] (V innermost), or None."""
    if t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() != 2:
        return None
    if t.shape[1] > 1 and t.stride(1) != 1:
        return None
    return rows.to(torch.int64) * t.stride(0)


def _takes(nonneg: str, floor: float, sampler: str, guard: str) -> bool:
    """The library is built and the residual's settings are ones it runs. Combinations the
    PyTorch path refuses (a floor without clamp, a guard without the race) go there, which
    names the error."""
    return (library() is not None and nonneg in NONNEG_MODES and sampler in SAMPLERS
            and (nonneg == "clamp" or floor == 0) and (guard == "none" or sampler == "race"))


def race_flat_rows(p: Tensor, q: Tensor, e: Tensor, t: Tensor, nonneg: str, floor: float,
                   row_sums, sampler: str, guard: str, fill: float
                   ) -> Optional[tuple[Tensor, Tensor]]:
    """`race_scores` for the ragged mode's flat rows: p, q [N, V], row t[b] of request b,
    raced against e [B, V] (its row b) -> (scores [B, V], argmax [B]), or None."""
    if not _takes(nonneg, floor, sampler, guard):
        return None
    B = t.shape[0]
    eo = _flat_offsets(e, torch.arange(B)) if e.dim() == 2 and e.shape[0] == B else None
    return _race(p, _flat_offsets(p, t), q, _flat_offsets(q, t), e, eo, B, p.shape[-1], nonneg,
                 floor, row_sums, sampler, guard, fill)


def race_probs_rows(p: Tensor, q: Optional[Tensor], e: Tensor, n: Tensor, xn: Tensor,
                    K: int) -> Optional[Tensor]:
    """The probability mode's emitted token (kernels/verify_probs.py) -> argmax [B], or None:
    row n[b] of p [B, K+1, V]; where the row has a draft xn[b] >= 0, max(p - q, 0) against q's
    row (one-hot q, None: p with x_n zeroed), else p as it is; divided by E's row (e [B, V]
    or [B, K+1, V])."""
    if library() is None:
        return None
    B, V = p.shape[0], p.shape[-1]
    po = _offsets(p, n, B, K + 1, V)
    eo = _offsets(e, n, B, K + 1, V) if e.dim() == 3 else (
        _flat_offsets(e, torch.arange(B)) if e.dim() == 2 and e.shape[0] == B else None)
    has = xn >= 0                                                          # [B]
    if q is None or K == 0:  # (K = 0: row n is the bonus row, no draft there)
        qo, src = torch.full((B,), -1, dtype=torch.int64), p

        def between(r):  # the draft's own entry out of the one-hot residual
            r[torch.nonzero(has, as_tuple=True)[0], xn[has]] = 0.0
            return None
    else:
        qo, src, between = _offsets(q, n.clamp_max(K - 1), B, K, V), q, None
        qo = None if qo is None else torch.where(has, qo, -1)
    out = _race(p, po, src, qo, e, eo, B, V, "clamp", 0.0, between, "race", "none", 0.0)
    return None if out is None else out[1]


def race_scores(p: Tensor, q: Tensor, e: Tensor, nk: Tensor, K: int, nonneg: str, floor: float,
                row_sums, sampler: str, guard: str, fill: float) -> Optional[tuple[Tensor, Tensor]]:
    """(row nk[b] of each request's race scores [B, V] (module doc), their argmax [B] as
    torch.argmax takes it: the first NaN, else the first maximum), or None when the library
    is missing or a layout, dtype or mode is not one it takes (the caller computes them in
    PyTorch). `row_sums(r)` -> the rows' sums [B, 1] to divide by; None: no division."""
    if not _takes(nonneg, floor, sampler, guard):
        return None
    B, V = p.shape[0], p.shape[-1]
    po, qo, eo = (_offsets(t, nk, B, K, V) for t in (p, q, e))
    return _race(p, po, q, qo, e, eo, B, V, nonneg, floor, row_sums, sampler, guard, fill)


def _race(p, po, q, qo, e, eo, B, V, nonneg, floor, between, sampler, guard, fill):
    """The two passes; `between(r)` runs after the first: it may edit r in place and returns
    the row sums to divide by, or None."""
    lib = library()
    if B == 0 or po is None or qo is None or eo is None:
        return None
    r = torch.empty(B, V)
    threads = torch.get_num_threads()
    lib.npuspec_residual_rows(p.data_ptr(), po.data_ptr(), q.data_ptr(), qo.data_ptr(), B, V,
                              NONNEG_MODES[nonneg], floor, r.data_ptr(), threads)
    s = None if between is None else between(r)
    s = None if s is None else s.contiguous()                         # [B, 1]
    idx = torch.empty(B, dtype=torch.int64)
    lib.npuspec_race_scores(r.data_ptr(), 0 if s is None else s.data_ptr(), e.data_ptr(),
                            eo.data_ptr(), B, V, SAMPLERS[sampler], int(guard == "zero_inf"),
                            fill, idx.data_ptr(), threads)
    return r, idx
