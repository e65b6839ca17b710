"""Fused CPU lowering of the row statistics of `npuspec::rejection_sample`.

C++ kernels, compiled and cached by Inductor's C++ toolchain (`CppCodeCache`: the same
compiler flags, vector ISA selection, OpenMP and cache directory as `torch.compile` on CPU).

- `npuspec_standard_rows`, standard verify with the uniforms known (the common case): each
  request walks its rows in order and stops at the row that emits. An accepted sampling row
  costs one read of the logits (an online softmax over L1-sized chunks: chunk max, then exp
  and sum while the chunk sits in L1); the emitting row adds one race over the stored exps;
  greedy rows never exp; rows after the emitting row get only the NaN/inf check. Its exp is
  a polynomial (Cody-Waite reduction and a degree-6 minimax polynomial, at most
  1.03 ulp from exact) that costs about half of at::vec's Sleef exp on AVX-512.
- `npuspec_row_stats`, every other mode (block, entropy, or no uniforms): a vectorised max,
  then one pass computing exp (at::vec), the normaliser, the race scores and their maximum,
  then an early-exit scan for the race winner; the residual and entropy passes follow while
  the row is in cache.

Elementwise both use the formulas of `reference_row_stats`: z = l / t, e = exp(z - max z),
p = e / S, race scores e * (1 / max(E, FLT_MIN)), residual max(p - q, 0), lowest index wins
ties. What differs from the reference is the last bit of exp (torch.exp, at::vec's exp and
the polynomial each differ from the others by up to one ulp on some inputs), the order of the
sums and, in the online softmax, the rescaling of earlier chunks when the running max moves.
So the tokens are identical except when a decision lies within a few ulps of a tie; see
docs/verify.md for the measured rate.

Why not a plain `torch.compile` of the reference: Inductor keeps a running (value, index) pair
per lane for every argmax over every row, which made the fused kernel compute-bound at ~1.5x
the unfused eager pipeline on this machine.
"""
from __future__ import annotations

import ctypes
import functools
from typing import Optional

import torch

from npuspec import counters
from npuspec.kernels.cpp_build import load_library
from npuspec.kernels.verify_rows import FLT_MIN, RowStats, reference_row_stats


_SOURCE = r"""
#include <torch/csrc/inductor/cpp_prefix.h>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {
using Vec = at::vec::Vectorized<float>;
constexpr int64_t kL = Vec::size();
const float kNegInf = -std::numeric_limits<float>::infinity();
const float kFltMin = FLT_MIN_VALUE;

inline float hmax(const Vec& v) {  // NaN-propagating horizontal max
  __at_align__ float a[kL];
  v.store(a);
  float m = a[0];
  for (int64_t i = 1; i < kL; ++i) m = (std::isnan(a[i]) || a[i] > m) ? a[i] : m;
  return m;
}
inline float hsum(const Vec& v) {
  __at_align__ float a[kL];
  v.store(a);
  float s = 0.f;
  for (int64_t i = 0; i < kL; ++i) s += a[i];
  return s;
}
// Load kL floats at p, or the n < kL left at a row's tail padded with `pad`.
inline Vec load(const float* p, int64_t n, float pad) {
  if (n >= kL) return Vec::loadu(p);
  __at_align__ float a[kL];
  for (int64_t i = 0; i < kL; ++i) a[i] = i < n ? p[i] : pad;
  return Vec::loadu(a);
}
inline void store(const Vec& v, float* p, int64_t n) {
  if (n >= kL) { v.store(p); return; }
  v.store(p, n);
}
// First index v < n with p[v] == target, or -1 (vector compare, early exit).
inline int64_t first_eq(const float* p, int64_t n, float target) {
  const Vec tv(target);
  int64_t v = 0;
  for (; v + kL <= n; v += kL) {
    const int64_t ne = (Vec::loadu(p + v) == tv).zero_mask();  // bit set: lane differs
    const int64_t eq = ~ne & ((int64_t(1) << kL) - 1);
    if (eq) return v + __builtin_ctzll(eq);
  }
  for (; v < n; ++v)
    if (p[v] == target) return v;
  return -1;
}
// NaN-propagating max of a row, four accumulators to hide the compare/blend latency.
inline float row_max(const float* p, int64_t n) {
  Vec a(kNegInf), b(kNegInf), c(kNegInf), d(kNegInf);
  int64_t v = 0;
  for (; v + 4 * kL <= n; v += 4 * kL) {
    a = at::vec::maximum(a, Vec::loadu(p + v));
    b = at::vec::maximum(b, Vec::loadu(p + v + kL));
    c = at::vec::maximum(c, Vec::loadu(p + v + 2 * kL));
    d = at::vec::maximum(d, Vec::loadu(p + v + 3 * kL));
  }
  for (; v < n; v += kL) a = at::vec::maximum(a, load(p + v, n - v, kNegInf));
  return hmax(at::vec::maximum(at::vec::maximum(a, b), at::vec::maximum(c, d)));
}
// Pass 2 over one row: e = exp(z - zmax) with z = l / t masked below th; S += e; the race
// scores s = e * R stored to sb with their running max; e stored to eb when the draft-probs
// residual needs it; exp(l - raw max) and its sum for the entropy.
template <bool DIV, bool THR, bool HASQ, bool ENT>
inline void pass2(const float* f, int64_t V, float t, float th, float zmax, float mx,
                  const float* R, float* sb, float* eb, float* tb, Vec& vS, Vec& vs, Vec& vSt) {
  for (int64_t v = 0; v < V; v += kL) {
    const int64_t n = V - v;
    const Vec l = load(f + v, n, kNegInf);
    Vec z = DIV ? l / Vec(t) : l;
    if (THR) z = Vec::blendv(Vec(kNegInf), z, z >= Vec(th));
    const Vec e = (z - Vec(zmax)).exp();
    if (HASQ) store(e, eb + v, n);
    vS = vS + e;
    const Vec s = e * load(R + v, n, 0.f);
    store(s, sb + v, n);
    vs = at::vec::clamp_min(vs, s);
    if (ENT) {
      const Vec et = (l - Vec(mx)).exp();
      store(et, tb + v, n);
      vSt = vSt + et;
    }
  }
}

// ---- standard verify with early exit: the fast path -------------------------------------
// exp for x <= 0 as 2^n * poly(r): Cody-Waite reduction, then a degree-6 minimax polynomial
// in Horner form (relative error 2e-9 before rounding; measured at most 1.03 ulp from exact,
// and equal to torch.exp on 92% of inputs, as close as at::vec's Sleef exp is).
// x < -110 gives 0, like exp(-inf).
inline Vec fexp(const Vec& xv) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 x = _mm512_max_ps(__m512(xv), _mm512_set1_ps(-110.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.38368446e-3f);  // degree-6 minimax for exp(r), |r| <= ln2/2
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.37481581e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.16682251e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.66664198e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.99999911e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return Vec(_mm512_scalef_ps(p, n));
#else
  return xv.exp();  // other ISAs: at::vec's exp (Sleef)
#endif
}
inline float fexp1(float x) {
  __at_align__ float a[kL];
  fexp(Vec(x)).store(a);
  return a[0];
}

constexpr int64_t kChunk = 2048;  // floats; a chunk is read twice while it sits in L1

// One row of a sampling request: running max and normaliser in a single read of the row
// (online softmax over L1-sized chunks). e = exp(z - m_c) is stored to eb with m_c, the
// running max z when chunk c was done, so a later race can rescale it to the final max.
// Returns the raw max (NaN-propagating); S is relative to z max = raw max / t.
// Lines to bring into L2 while a compute-bound loop runs (another request's rows that only
// need their NaN/inf check later): two lines per loop step.
struct Stream {
  const char* p = nullptr;
  const char* end = nullptr;
  inline void step() {
    if (p < end) {
      _mm_prefetch(p, _MM_HINT_T1);
      _mm_prefetch(p + 64, _MM_HINT_T1);
      p += 128;
    }
  }
};

template <bool DIV, bool THR>
inline float online_row(const float* f, int64_t V, float t, float th, float* eb, float* mc,
                        float& S, const float* pf, Stream& ps) {
  float M = kNegInf;        // raw running max
  float zM = kNegInf;       // running max of z (M / t: division is monotone)
  Vec vS(0.f);
  for (int64_t c0 = 0, c = 0; c0 < V; c0 += kChunk, ++c) {
    const int64_t ce = std::min(V, c0 + kChunk);
    const float cm = row_max(f + c0, ce - c0);
    if (std::isnan(cm)) { S = 0.f; return cm; }
    if (cm > M) {
      const float zn = DIV ? cm / t : cm;
      if (zM != kNegInf) vS = vS * Vec(fexp1(zM - zn));
      M = cm; zM = zn;
    }
    mc[c] = zM;
    if (zM == kNegInf || zM == std::numeric_limits<float>::infinity()) {
      for (int64_t v = c0; v < ce; v += kL) store(Vec(0.f), eb + v, ce - v);
      continue;
    }
    const Vec vzM(zM);
    for (int64_t v = c0; v < ce; v += kL) {
      const int64_t n = ce - v;
      // the next chunk (or the next row) streams in while this one computes its exps
      _mm_prefetch(reinterpret_cast<const char*>(f + v + kChunk), _MM_HINT_T0);
      if (pf) _mm_prefetch(reinterpret_cast<const char*>(pf + v), _MM_HINT_T1);  // E, for the race
      ps.step();
      Vec z = load(f + v, n, kNegInf);
      if (DIV) z = z / Vec(t);
      if (THR) z = Vec::blendv(Vec(kNegInf), z, z >= Vec(th));
      const Vec e = fexp(z - vzM);
      store(e, eb + v, n);
      vS = vS + e;  // tail lanes: exp(-inf) = 0
    }
  }
  S = hsum(vS);
  return M;
}

// e rescaled from chunk c's running max to the final max zmax.
inline float chunk_scale(float m, float zmax) { return m == zmax ? 1.f : fexp1(m - zmax); }

// Lane-wise first-index argmax: lanes keep their first maximum (strict >); at the end the
// smallest index among the lanes holding the overall maximum wins. Indices are tracked as
// floats (exact below 2^24 > any vocabulary).
struct ArgMax {
  Vec vb = Vec(-1.f), vi = Vec(0.f);
  const Vec lane = Vec::arange(0.f, 1.f);
  inline void add(const Vec& s, int64_t v) {
    const Vec gt = s > vb;
    vb = Vec::blendv(vb, s, gt);
    vi = Vec::blendv(vi, lane + Vec(float(v)), gt);
  }
  inline int64_t index(float& best) const {
    __at_align__ float bv[kL], bi[kL];
    vb.store(bv); vi.store(bi);
    best = -1.f; float idx = 0.f;
    for (int64_t i = 0; i < kL; ++i)
      if (bv[i] > best || (bv[i] == best && bi[i] < idx)) { best = bv[i]; idx = bi[i]; }
    return int64_t(idx);
  }
};

// e of chunk c's stored exps at v, rescaled from the chunk's running max to the final one.
inline Vec stored_e(const float* eb, int64_t v, int64_t n, bool one, const Vec& sc) {
  const Vec e = load(eb + v, n, 0.f);
  return one ? e : e * sc;
}

// The race over a row: first-index argmax of s_v = score_v * R_v, R = 1 / max(E, FLT_MIN)
// (the reference's formula), where score is e rescaled to the final max (RESID = false) or
// the residual max(e / S - q, 0) (RESID = true). Tail lanes score -2 and never win.
template <bool RESID>
inline int64_t race(const float* eb, const float* mc, float zmax, float S, const float* q,
                    const float* E, int64_t V, float& best) {
  ArgMax am;
  for (int64_t c0 = 0, c = 0; c0 < V; c0 += kChunk, ++c) {
    const int64_t ce = std::min(V, c0 + kChunk);
    const Vec sc(chunk_scale(mc[c], zmax));
    const bool one = mc[c] == zmax;
    for (int64_t v = c0; v < ce; v += kL) {
      const int64_t n = ce - v;
      const Vec R = Vec(1.f) / at::vec::maximum(load(E + v, n, 1.f), Vec(kFltMin));
      const Vec e = stored_e(eb, v, n, one, sc);
      Vec s;
      if (RESID) s = at::vec::maximum(e / Vec(S) - load(q + v, n, 0.f), Vec(0.f)) * R;
      else s = e * R;
      if (n < kL) s = Vec::set(Vec(-2.f), s, n);
      am.add(s, v);
    }
  }
  return am.index(best);
}
// The race over p (RESID = false above) without a division per element, same winner: an
// approximate score a_v = e_v * rcp14(max(E_v, FLT_MIN)) is within 2^-13 of the exact
// s_v = e_v * (1 / max(E_v, FLT_MIN)), so every index holding the exact maximum has
// a_v >= max a * (1 - 2^-11); only those few candidates get the exact score, in index order.
// ab: scratch for the approximate scores (V + kL floats).
inline int64_t race_fast(const float* eb, const float* mc, float zmax, const float* E, int64_t V,
                      float* ab, float& best) {
  Vec vmax(-2.f);
  for (int64_t c0 = 0, c = 0; c0 < V; c0 += kChunk, ++c) {
    const int64_t ce = std::min(V, c0 + kChunk);
    const Vec sc(chunk_scale(mc[c], zmax));
    const bool one = mc[c] == zmax;
    for (int64_t v = c0; v < ce; v += kL) {
      const int64_t n = ce - v;
      const Vec Ep = at::vec::maximum(load(E + v, n, 1.f), Vec(kFltMin));
#if defined(CPU_CAPABILITY_AVX512)
      const Vec rcp(_mm512_rcp14_ps(__m512(Ep)));
#else
      const Vec rcp = Vec(1.f) / Ep;  // exact: the candidates are then exactly the maxima
#endif
      const Vec e = stored_e(eb, v, n, one, sc);
      Vec a = e * rcp;
      if (n < kL) a = Vec::set(Vec(-2.f), a, n);
      a.store(ab + v);
      vmax = at::vec::maximum(vmax, a);
    }
  }
  const float amax = hmax(vmax);
  // Near the denormals the relative bound fails: there, the exact race (never in practice:
  // the row's max has e = 1 unless it is the masked draft and everything else underflows).
  if (!(amax > 1e-30f)) return race<false>(eb, mc, zmax, 1.f, nullptr, E, V, best);
  best = -1.f;
  const Vec T(amax * (1.f - 1.f / 2048.f));
  int64_t idx = 0;
  for (int64_t v = 0; v < V; v += kL) {
    const int64_t miss = (Vec::loadu(ab + v) >= T).zero_mask();  // bit set: lane below T
    int64_t hit = ~miss & ((int64_t(1) << kL) - 1);
    while (hit) {
      const int64_t i = v + __builtin_ctzll(hit);
      hit &= hit - 1;
      if (i >= V) break;
      const int64_t c = i / kChunk;
      const float e = mc[c] == zmax ? eb[i] : eb[i] * chunk_scale(mc[c], zmax);
      const float sv = e * (1.f / std::max(E[i], kFltMin));
      if (sv > best) { best = sv; idx = i; }
    }
  }
  return idx;
}
}  // namespace

extern "C" void npuspec_row_stats(
    const void* logits, int64_t dtype, const int64_t* xpad, const float* q, const float* temp,
    const float* thr, const float* E, const float* w, int64_t* gidx, float* rawmax, float* px,
    float* qx, int64_t* race_p, int64_t* race_r, float* rho, float* ent, int64_t B, int64_t K1,
    int64_t V, int64_t random, int64_t has_q, int64_t residual, int64_t entropy, int64_t has_thr,
    int64_t nthreads) {
  const int64_t K = K1 - 1;
  // Requests are split over threads; a request's K+1 rows share R = 1 / max(E, FLT_MIN).
#pragma omp parallel num_threads(nthreads)
  {
    std::vector<float> fbuf(dtype ? V : 0), rbuf(random ? V : 0), sbuf(random ? V : 0),
        ebuf(random && has_q ? V : 0), tbuf(entropy ? V : 0);
    float* R = rbuf.data();
    float* sb = sbuf.data();
    float* eb = ebuf.data();
#pragma omp for schedule(dynamic, 1)
    for (int64_t b = 0; b < B; ++b) {
      const float t = random ? temp[b] : 1.f;
      const float* Eb = random ? E + b * V : nullptr;
      if (random) {
        for (int64_t v = 0; v < V; v += kL)
          store(Vec(1.f) / at::vec::maximum(load(Eb + v, V - v, 1.f), Vec(kFltMin)), R + v, V - v);
      }
      for (int64_t j = 0; j < K1; ++j) {
        const int64_t r = b * K1 + j;
        const float* f = (const float*)logits + r * V;
        if (dtype == 1) {  // bfloat16 -> float32 is exact: the bf16 bits are the high half
          const uint16_t* src = (const uint16_t*)logits + r * V;
          uint32_t* dst = (uint32_t*)fbuf.data();
          for (int64_t v = 0; v < V; ++v) dst[v] = uint32_t(src[v]) << 16;
          f = fbuf.data();
        } else if (dtype == 2) {
          const c10::Half* src = (const c10::Half*)logits + r * V;
          for (int64_t v = 0; v < V; ++v) fbuf[v] = static_cast<float>(src[v]);
          f = fbuf.data();
        }
        // pass 1: raw max (NaN-propagating) and the greedy argmax (first index)
        const float mx = row_max(f, V);
        rawmax[r] = mx;
        const int64_t g = first_eq(f, V, mx);
        gidx[r] = g >= 0 ? g : 0;
        px[r] = 0.f; qx[r] = 0.f; race_p[r] = 0; race_r[r] = 0; rho[r] = 0.f; ent[r] = 0.f;
        if (!std::isfinite(mx) || !random) continue;  // non-finite: the caller raises
        const int64_t x = xpad[r];
        const float* qrow = (has_q && j < K) ? q + (b * K + j) * V : nullptr;
        // pass 2: e = exp(z - max z) with z = l / t masked below thr; S; race scores e * R
        const float th = has_thr ? thr[r] : kNegInf;
        const float zmax = mx / t;  // division is monotone: max(l / t) == max(l) / t
        Vec vS(0.f), vs(-1.f), vSt(0.f);
        const int64_t mode = (t != 1.f) | (has_thr << 1) | (has_q << 2) | (entropy << 3);
        switch (mode) {  // one specialised loop per mode (l / 1 == l exactly, so skip it)
#define NPUSPEC_CASE(m) case m: pass2<(m & 1) != 0, (m & 2) != 0, (m & 4) != 0, (m & 8) != 0>( \
            f, V, t, th, zmax, mx, R, sb, eb, tbuf.data(), vS, vs, vSt); break;
          NPUSPEC_CASE(0) NPUSPEC_CASE(1) NPUSPEC_CASE(2) NPUSPEC_CASE(3)
          NPUSPEC_CASE(4) NPUSPEC_CASE(5) NPUSPEC_CASE(6) NPUSPEC_CASE(7)
          NPUSPEC_CASE(8) NPUSPEC_CASE(9) NPUSPEC_CASE(10) NPUSPEC_CASE(11)
          NPUSPEC_CASE(12) NPUSPEC_CASE(13) NPUSPEC_CASE(14) NPUSPEC_CASE(15)
#undef NPUSPEC_CASE
        }
        const float S = hsum(vS);
        const int64_t ip = std::max(first_eq(sb, V, hmax(vs)), int64_t(0));
        race_p[r] = ip;
        if (x >= 0) {  // e[x], by the same vector exp (lanes are computed independently)
          __at_align__ float ex[kL];
          Vec zx = t != 1.f ? Vec(f[x]) / Vec(t) : Vec(f[x]);
          if (has_thr) zx = Vec::blendv(Vec(kNegInf), zx, zx >= Vec(th));
          (zx - Vec(zmax)).exp().store(ex);
          px[r] = ex[0] / S;
        }
        if (!has_q) {
          qx[r] = x >= 0 ? 1.f : 0.f;
          int64_t ir = ip;
          if (x >= 0 && ip == x) {  // the winner is the draft itself: race again without it
            sb[x] = 0.f;
            Vec vb(0.f);
            for (int64_t v = 0; v < V; v += kL) vb = at::vec::clamp_min(vb, load(sb + v, V - v, 0.f));
            const float best = hmax(vb);
            ir = best > 0.f ? first_eq(sb, V, best) : -1;
          }
          race_r[r] = ir;
        } else {
          qx[r] = (x >= 0 && qrow) ? qrow[x] : 0.f;
          if (residual) {
            // pass 3: residual max(w p - q, 0): its mass rho and its race
            const float wr = w[r];
            Vec vr(0.f), vb(0.f);
            for (int64_t v = 0; v < V; v += kL) {
              const int64_t n = V - v;
              const Vec p = load(eb + v, n, 0.f) / Vec(S);
              const Vec qv = qrow ? load(qrow + v, n, 0.f) : Vec(0.f);
              const Vec rv = at::vec::maximum(Vec(wr) * p - qv, Vec(0.f));
              vr = vr + rv;
              const Vec sv = rv * load(R + v, n, 0.f);
              store(sv, sb + v, n);
              vb = at::vec::clamp_min(vb, sv);
            }
            rho[r] = hsum(vr);
            const float bmax = hmax(vb);
            race_r[r] = bmax > 0.f ? first_eq(sb, V, bmax) : -1;
          }
        }
        if (entropy) {
          // pass 4: H = -sum p~ log(p~ + 1e-10) over the raw softmax
          const float St = hsum(vSt);
          Vec vh(0.f);
          const float* tb = tbuf.data();
          for (int64_t v = 0; v < V; v += kL) {
            const Vec pt = load(tb + v, V - v, 0.f) / Vec(St);
            vh = vh + pt * (pt + Vec(1e-10f)).log();
          }
          ent[r] = -hsum(vh);
        }
      }
    }
  }
}

// Standard verify (sampling or greedy rows, uniforms known): each request walks its rows in
// order and stops at its emission row. Rows after it get only the NaN/inf check (one read);
// accepted sampling rows need only the normaliser (one read, online softmax); the emission
// row adds one race over the stored exps. Greedy rows never exp. Statistics the decisions do
// not read (gidx of sampling rows, races of accepted rows, rho) are left at 0.
extern "C" void npuspec_standard_rows(
    const void* logits, int64_t dtype, const int64_t* xpad, const float* q, const float* temp,
    const float* thr, const float* E, const float* uni, const uint8_t* greedy, int64_t* gidx,
    float* rawmax, float* px, float* qx, int64_t* race_p, int64_t* race_r, int64_t B,
    int64_t K1, int64_t V, int64_t has_q, int64_t has_thr, int64_t nthreads, int32_t* out,
    int32_t* num) {
  const int64_t K = K1 - 1;
  const int64_t nchunks = (V + kChunk - 1) / kChunk;
#pragma omp parallel num_threads(nthreads)
  {
    std::vector<float> fbuf(dtype ? V : 0), ebuf(V + kL), abuf(V + kL), mbuf(nchunks);
    float* eb = ebuf.data();
    float* mc = mbuf.data();
    float* ab = abuf.data();
    const int64_t esize = dtype ? 2 : 4;
    auto row_ptr = [&](int64_t r) -> const float* {
      if (dtype == 1) {  // bfloat16 -> float32 is exact: the bf16 bits are the high half
        const uint16_t* src = (const uint16_t*)logits + r * V;
        uint32_t* dst = (uint32_t*)fbuf.data();
        for (int64_t v = 0; v < V; ++v) dst[v] = uint32_t(src[v]) << 16;
        return fbuf.data();
      }
      if (dtype == 2) {
        const c10::Half* src = (const c10::Half*)logits + r * V;
        for (int64_t v = 0; v < V; ++v) fbuf[v] = static_cast<float>(src[v]);
        return fbuf.data();
      }
      return (const float*)logits + r * V;
    };
    // Rows after request b's emitting row n: only the NaN/inf check, then b's output.
    auto finish = [&](int64_t b, int64_t n, int64_t tok) {
      for (int64_t j = n + 1; j < K1; ++j) {
        const int64_t r = b * K1 + j;
        gidx[r] = 0; px[r] = 0.f; qx[r] = 0.f; race_p[r] = 0; race_r[r] = 0;
        rawmax[r] = row_max(row_ptr(r), V);
      }
      if (!out) return;  // the op's output layout, as the decisions + _emit would write it
      bool bad = false;
      for (int64_t j = 0; j < K1; ++j) bad = bad || !std::isfinite(rawmax[b * K1 + j]);
      for (int64_t j = 0; j < K1; ++j)
        out[b * K1 + j] = bad || j > n ? -1 : j < n ? int32_t(xpad[b * K1 + j]) : int32_t(tok);
      num[b] = bad ? 0 : int32_t(n + 1);
    };
    // The checks of one request are deferred until this thread has done its next request,
    // whose compute-bound exp loops prefetch those rows into L2 meanwhile (memory and exp
    // then overlap instead of taking turns).
    int64_t pb = -1, pn = 0, ptok = 0;
    Stream ps;
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t b = 0; b < B; ++b) {
      const float t = temp[b];
      const bool grd = greedy[b] != 0;
      const float* Eb = E + b * V;
      int64_t n = K, tok = 0;  // the emitting row and its token
      for (int64_t j = 0; j < K1; ++j) {
        const int64_t r = b * K1 + j;
        const float* f = row_ptr(r);
        gidx[r] = 0; px[r] = 0.f; qx[r] = 0.f; race_p[r] = 0; race_r[r] = 0;
        const int64_t x = xpad[r];
        if (grd) {
          const float mx = row_max(f, V);
          rawmax[r] = mx;
          gidx[r] = std::max(first_eq(f, V, mx), int64_t(0));
          if (!std::isfinite(mx) || j == K || x < 0 || x != gidx[r]) {
            n = j; tok = gidx[r];
            break;
          }
          continue;
        }
        const float th = has_thr ? thr[r] : kNegInf;
        const float* pf = j == 0 ? Eb : nullptr;  // the request's E row, into L2 for its race
        float S = 0.f, mx;
        const int64_t mode = (t != 1.f) | (has_thr << 1);
        switch (mode) {  // l / 1 == l exactly, so skip the division at t = 1
          case 0: mx = online_row<false, false>(f, V, t, th, eb, mc, S, pf, ps); break;
          case 1: mx = online_row<true, false>(f, V, t, th, eb, mc, S, pf, ps); break;
          case 2: mx = online_row<false, true>(f, V, t, th, eb, mc, S, pf, ps); break;
          default: mx = online_row<true, true>(f, V, t, th, eb, mc, S, pf, ps); break;
        }
        rawmax[r] = mx;
        if (!std::isfinite(mx)) { n = j; break; }  // the caller raises (or emits nothing)
        const float zmax = mx / t;
        const float* qrow = (has_q && j < K) ? q + (b * K + j) * V : nullptr;
        float ex = 0.f;
        if (x >= 0) {  // e[x] = exp(z_x - max z), z_x masked like the row
          float zx = t != 1.f ? f[x] / t : f[x];
          if (has_thr && !(zx >= th)) zx = kNegInf;
          ex = fexp1(zx - zmax);
          px[r] = ex / S;
          qx[r] = qrow ? qrow[x] : 1.f;
        }
        const bool accepted = j < K && x >= 0 && qx[r] > 0.f && px[r] / qx[r] >= uni[b * K + j];
        if (accepted) continue;
        n = j;  // this row emits: a recovered token, or a sample from p
        float best;
        if (qrow && x >= 0) {
          const int64_t i = race<true>(eb, mc, zmax, S, qrow, Eb, V, best);
          race_r[r] = best > 0.f ? i : -1;
          if (race_r[r] < 0) race_p[r] = race_fast(eb, mc, zmax, Eb, V, ab, best);
        } else if (x >= 0) {  // one-hot: the residual is p with the draft masked out
          eb[x] = 0.f;
          const int64_t i = race_fast(eb, mc, zmax, Eb, V, ab, best);
          race_r[r] = best > 0.f ? i : -1;
          if (race_r[r] < 0) {  // only float underflow empties it: fall back to p (x or 0)
            const float sx = ex * (1.f / std::max(Eb[x], kFltMin));
            race_p[r] = sx > 0.f ? x : 0;
          }
        } else {
          race_p[r] = race_fast(eb, mc, zmax, Eb, V, ab, best);
          race_r[r] = best > 0.f ? race_p[r] : -1;
        }
        tok = (x >= 0 && race_r[r] >= 0) ? race_r[r] : race_p[r];
        break;
      }
      if (pb >= 0) finish(pb, pn, ptok);
      pb = b; pn = n; ptok = tok;
      const char* base = (const char*)logits;
      ps.p = base + ((b * K1 + n + 1) * V) * esize;
      ps.end = base + ((b + 1) * K1 * V) * esize;
    }
    if (pb >= 0) finish(pb, pn, ptok);
  }
}
""".replace("FLT_MIN_VALUE", repr(FLT_MIN) + "f")

_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@functools.lru_cache(maxsize=None)
def _compiled():
    """The compiled library, or None (logged once) when no C++ toolchain works here."""
    return load_library(_SOURCE, "fused CPU verify kernel", "falling back to the PyTorch reference",
                        {"npuspec_row_stats": (None, None), "npuspec_standard_rows": (None, None)})


def _library():
    lib = _compiled()
    return lib.npuspec_row_stats if lib is not None else None


def available() -> bool:
    return _compiled() is not None


def cpu_row_stats(logits: torch.Tensor, xpad: torch.Tensor, draft_probs: Optional[torch.Tensor],
                  t: torch.Tensor, thr: Optional[torch.Tensor],
                  exponentials: Optional[torch.Tensor], weights: Optional[torch.Tensor], *,
                  random: bool, entropy: bool, residual: bool = True,
                  early_exit: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> RowStats:
    """Same contract as `reference_row_stats`, computed by the fused C++ kernel.

    early_exit=(uniforms [B, K], greedy_rows [B]) (standard verify: random, no entropy,
    residual) runs `npuspec_standard_rows`: rows after a request's emitting row get only the
    NaN/inf check; statistics the decisions never read are left at 0. Elsewhere it is ignored."""
    fn = _library()
    if fn is None or logits.dtype not in _DTYPES or logits.device.type != "cpu":
        counters.bump("eager_fallbacks")
        return reference_row_stats(logits, xpad, draft_probs, t, thr, exponentials, weights,
                                   random=random, entropy=entropy, residual=residual)
    if early_exit is not None and random and not entropy and residual:
        return _standard_rows(logits, xpad, draft_probs, t, thr, exponentials, early_exit)
    B, K1, V = logits.shape
    lg = logits.contiguous()
    f32 = dict(dtype=torch.float32)
    gidx, race_p, race_r = (torch.empty(B, K1, dtype=torch.int64) for _ in range(3))
    rawmax, px, qx, rho, ent = (torch.empty(B, K1, **f32) for _ in range(5))
    has_q = draft_probs is not None
    q = draft_probs.float().contiguous() if has_q else None
    E = exponentials.float().contiguous() if random else None
    thr_ = thr.float().contiguous() if thr is not None else None
    w = None
    if has_q and residual and random:
        w = torch.ones(B, K1, **f32)
        if weights is not None:
            w[:, :K1 - 1] = weights.float()
    tt = t.float().contiguous()
    xp = xpad.long().contiguous()
    i64 = ctypes.c_int64
    fn(_ptr(lg), i64(_DTYPES[lg.dtype]), _ptr(xp), _ptr(q), _ptr(tt), _ptr(thr_), _ptr(E),
       _ptr(w), _ptr(gidx), _ptr(rawmax), _ptr(px), _ptr(qx), _ptr(race_p), _ptr(race_r),
       _ptr(rho), _ptr(ent), i64(B), i64(K1), i64(V), i64(int(random)), i64(int(has_q)),
       i64(int(residual)), i64(int(entropy)), i64(int(thr is not None)),
       i64(max(1, torch.get_num_threads())))
    return RowStats(gidx, rawmax, px, qx, race_p, race_r, rho, ent)


def _ptr(a: Optional[torch.Tensor]) -> ctypes.c_void_p:
    return ctypes.c_void_p(a.data_ptr() if a is not None else 0)


def _standard_rows(logits, xpad, draft_probs, t, thr, exponentials, early_exit, *,
                   emit: bool = False):
    """Standard verify with the uniforms known: the early-exit kernel (see its C++ comment).
    Statistics the decisions never read are 0: gidx of sampling rows, races of accepted rows,
    everything but rawmax after a request's emission row, and rho. emit=True also returns the
    op's outputs (tokens int32 [B, K+1], num_emitted int32 [B]), decided in the kernel."""
    B, K1, V = logits.shape
    assert V < 1 << 24, V  # race indices are tracked in float32 lanes
    lg = logits.contiguous()
    gidx, race_p, race_r = (torch.empty(B, K1, dtype=torch.int64) for _ in range(3))
    rawmax, px, qx = (torch.empty(B, K1, dtype=torch.float32) for _ in range(3))
    q = draft_probs.float().contiguous() if draft_probs is not None else None
    E = exponentials.float().contiguous()
    thr_ = thr.float().contiguous() if thr is not None else None
    uni = early_exit[0].float().contiguous()
    grd = early_exit[1].to(torch.uint8).contiguous()
    xp, tt = xpad.long().contiguous(), t.float().contiguous()  # kept alive over the call
    out = torch.empty(B, K1, dtype=torch.int32) if emit else None
    num = torch.empty(B, dtype=torch.int32) if emit else None
    i64 = ctypes.c_int64
    _compiled().npuspec_standard_rows(
        _ptr(lg), i64(_DTYPES[lg.dtype]), _ptr(xp), _ptr(q), _ptr(tt), _ptr(thr_), _ptr(E),
        _ptr(uni), _ptr(grd), _ptr(gidx), _ptr(rawmax), _ptr(px), _ptr(qx), _ptr(race_p),
        _ptr(race_r), i64(B), i64(K1), i64(V), i64(int(q is not None)),
        i64(int(thr is not None)), i64(max(1, torch.get_num_threads())), _ptr(out), _ptr(num))
    zeros = torch.zeros(B, K1, dtype=torch.float32)
    st = RowStats(gidx, rawmax, px, qx, race_p, race_r, zeros, zeros.clone())
    return (st, out, num) if emit else st


def cpu_standard_verify(logits, xpad, draft_probs, t, thr, exponentials, early_exit):
    """The whole standard verify (temperature rows, uniforms known) in the C++ kernel:
    (tokens int32 [B, K+1], num_emitted int32 [B], rawmax float32 [B, K+1]), or None when the
    kernel cannot run here (the caller then takes the row-statistics path)."""
    if _compiled() is None or logits.dtype not in _DTYPES or logits.device.type != "cpu":
        return None
    st, out, num = _standard_rows(logits, xpad, draft_probs, t, thr, exponentials, early_exit,
                                  emit=True)
    return out, num, st.rawmax
