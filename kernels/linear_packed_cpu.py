"""`npuspec::linear_packed`: y = x @ w.T (+ bias) on CPU over a weight packed once at load.

Why a packed layout. A decode or verify step multiplies a few rows (B*(K+1) tokens) by every
weight, so it is bound by reading the weights once. Reading a row-major `[N, K]` weight for
several output rows at a time means several memory streams per thread, and this project's
CPU then reaches ~19 GB/s where a plain `sum` reaches ~30 (kernels/linear_cpu.py, the
unpacked kernel). Packed as `[ceil(N/BW), K, BW]` (BW = 2 SIMD vectors, 16 floats on AVX2),
each thread streams one contiguous panel, and the loop is the outer-product form of a GEMM
micro-kernel: per k, BW weights are loaded once and FMA'd into up to 6 rows' accumulators
(12 vector registers), so there is no horizontal sum and up to ~8 rows cost what 1 row costs.
Measured on the 2-core AVX2 target (bench: `python -m npuspec.bench.linear`).

Weights may be float32, bfloat16 or float16 (converted to fp32 in registers: a bf16 weight
is half the bytes to read); the accumulation and y are fp32, x is fp32 or the weights' dtype.
bf16 x bf16 on a CPU with AVX512_BF16 runs the dot-product instruction instead of widening
(`dot_bf16`; same values, tiles of up to 12 rows: a bf16 verify step's rows cost about one).
Where the CPU also has AMX-BF16 tiles (Sapphire Rapids and later), calls of >= AMX_MIN_ROWS
(5) rows with K % 32 == 0 run on the tiles instead (`amx_tiles`; 1.3-1.8x the dot-product
kernel's speed at 5 rows, 2.5-3.7x at 12, 4.5-7.5x at 16-32; other values than the
dot-product kernel's, to fp32 rounding; NPUSPEC_CPU_AMX=0 turns it off).
Larger fp32 tiles (9 or 12 rows on AVX-512) were tried: 9 rows 30.5 -> 26-27 ms, but 13 and 17
rows slower (FMA-bound either way on this 2-core AVX-512 CPU); not kept. A product of many rows
(prefill, `gemm_min_rows`) goes to a vendor GEMM over the weight unpacked for the call: MKL's
sgemm for fp32 weights, oneDNN's native bf16 GEMM for bf16 x bf16 (from 512 rows; from 32
where AMX runs oneDNN's GEMM but this kernel was built without its tiles). On the 2-core AVX2
machine of earlier measurements this kernel was ahead of MKL at prefill too (~140 GFLOP/s); on
the AVX-512 machine of the later ones MKL is 1.4-1.9x ahead at 64-256 rows, the unpacking
included.

`linear_packed_reference` is the PyTorch reference; it unpacks and calls torch.mm in fp32.
Results equal it to fp32 rounding (the K-sum runs in k order, 1 FMA per k).
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
from typing import Optional

import torch

from npuspec import envs
from npuspec._counters import counters
from npuspec.kernels.cpp_build import load_library, toolchain_present, vec_isa

log = logging.getLogger(__name__)


WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_SOURCE = r"""
#include <torch/csrc/inductor/cpp_prefix.h>
#include <cstdint>
#include <cstring>

namespace {
using Vec = at::vec::Vectorized<float>;
constexpr int64_t kL = Vec::size();
constexpr int64_t kBW = 2 * kL;  // packed block width: output columns per panel
// Elements ahead: 64 k-steps of the panel. Every cache line of a k-step is prefetched: with
// AVX-512 an fp32 k-step is 128 bytes, and prefetching only its first line left the fp32 kernel
// at 23 GB/s where bf16 (one line per k-step) read 28; both lines: 29 GB/s (SmolLM2's step).
constexpr int64_t kPrefetch = 64 * kBW;
constexpr int64_t kLine = 64;

template <typename W>
inline void prefetch_k(const W* wk) {
  const char* p = reinterpret_cast<const char*>(wk + kPrefetch);
  for (int64_t off = 0; off < kBW * static_cast<int64_t>(sizeof(W)); off += kLine)
    __builtin_prefetch(p + off, 0, 3);
}

// The kBW weights of one k, as two fp32 vectors.
inline void load_w(const float* p, Vec& a, Vec& b) { a = Vec::loadu(p); b = Vec::loadu(p + kL); }
inline void load_w(const at::BFloat16* p, Vec& a, Vec& b) {
  std::tie(a, b) = at::vec::convert_to_float<at::BFloat16>(at::vec::Vectorized<at::BFloat16>::loadu(p));
}
inline void load_w(const at::Half* p, Vec& a, Vec& b) {
  std::tie(a, b) = at::vec::convert_to_float<at::Half>(at::vec::Vectorized<at::Half>::loadu(p));
}

// y[i, 0:kBW] (+)= sum_k x[i, k] * wp[k, 0:kBW] for MR rows; wp is one [K, kBW] panel.
template <int MR, typename X, typename W>
inline void tile(const X* x, int64_t K, const W* wp, const float* bias, float* y, int64_t ldy) {
  Vec acc[MR][2];
  for (int i = 0; i < MR; ++i) { acc[i][0] = Vec(0.f); acc[i][1] = Vec(0.f); }
  for (int64_t k = 0; k < K; ++k) {
    const W* wk = wp + k * kBW;
    prefetch_k(wk);
    Vec w0, w1;
    load_w(wk, w0, w1);
    for (int i = 0; i < MR; ++i) {
      const Vec xv(static_cast<float>(x[i * K + k]));  // exact: bf16/fp16 widen
      acc[i][0] = at::vec::fmadd(xv, w0, acc[i][0]);
      acc[i][1] = at::vec::fmadd(xv, w1, acc[i][1]);
    }
  }
  Vec b0(0.f), b1(0.f);
  if (bias) { b0 = Vec::loadu(bias); b1 = Vec::loadu(bias + kL); }
  for (int i = 0; i < MR; ++i) {
    (acc[i][0] + b0).store(y + i * ldy);
    (acc[i][1] + b1).store(y + i * ldy + kL);
  }
}

template <typename X, typename W>
inline void panel(const X* x, int64_t M, int64_t K, const W* wp, const float* bias,
                  float* y, int64_t ldy) {
  int64_t m = 0;
  for (; m + 6 <= M; m += 6) tile<6>(x + m * K, K, wp, bias, y + m * ldy, ldy);
  const X* xm = x + m * K;
  float* ym = y + m * ldy;
  switch (M - m) {
    case 5: tile<5>(xm, K, wp, bias, ym, ldy); break;
    case 4: tile<4>(xm, K, wp, bias, ym, ldy); break;
    case 3: tile<3>(xm, K, wp, bias, ym, ldy); break;
    case 2: tile<2>(xm, K, wp, bias, ym, ldy); break;
    case 1: tile<1>(xm, K, wp, bias, ym, ldy); break;
    default: break;
  }
}

// x [M, K] fp32, wp [NB, K, kBW], bias [NB*kBW] fp32 or null, y [M, NB*kBW] fp32.
template <typename X, typename W>
void run(const X* x, const W* wp, const float* bias, float* y, int64_t M, int64_t NB, int64_t K) {
  const int64_t ldy = NB * kBW;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < NB; ++b)
    panel(x, M, K, wp + b * K * kBW, bias ? bias + b * kBW : nullptr, y + b * kBW, ldy);
}
}  // namespace

// bf16 activations x bf16 weights with AVX512_BF16's VDPBF16PS, which adds two exact bf16
// products per fp32 lane in one instruction: half the multiply-adds of widening both to fp32,
// and no widening. A k-step pair of the panel is interleaved in registers (unpack), so the
// layout is the same as every other dtype's. Same values as the widening kernel: a bf16 x bf16
// product is exact in fp32, and the instruction adds its higher element first, so with x's
// pair swapped (x[k] in the high half) each lane adds x[k] w[k], then x[k+1] w[k+1], rounding
// after each, as the FMA loop does. The instruction treats subnormal inputs and sums as zero
// (DAZ, FTZ), the one place the two can differ. Register tiles of up to 12 rows (24
// accumulators): a verify step's K+1 rows and small batches read each weight once.
#if defined(CPU_CAPABILITY_AVX512) && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 10))
#define NPUSPEC_DPBF16 1
#include <immintrin.h>
#include <vector>
namespace dp {
constexpr int kMaxRows = 12;

bool usable(int64_t K) {
  static const bool cpu = __builtin_cpu_supports("avx512bf16");
  return cpu && kBW == 32 && K % 2 == 0;
}

#pragma GCC push_options
#pragma GCC target("avx512bf16,avx512f,avx512bw,avx512vl")
// y[i, 0:32] = sum_k x[i, k] * wp[k, 0:32] (+ bias) for MR rows; xs holds x's pairs, swapped
template <int MR>
inline void tile(const int32_t* xs, int64_t K2, const uint16_t* wp, const float* bias, float* y,
                 int64_t ldy, __m512i perm0, __m512i perm1) {
  __m512 acc[MR][2];
  for (int i = 0; i < MR; ++i) { acc[i][0] = _mm512_setzero_ps(); acc[i][1] = _mm512_setzero_ps(); }
  for (int64_t p = 0; p < K2; ++p) {
    const uint16_t* wk = wp + p * 2 * kBW;
    prefetch_k(wk);
    prefetch_k(wk + kBW);
    const __m512i r0 = _mm512_loadu_si512(wk), r1 = _mm512_loadu_si512(wk + kBW);
    // per 128-bit lane: columns 8j..8j+3 (lo) and 8j+4..8j+7 (hi) as (k+1, k) pairs
    const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(r1, r0);
    const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(r1, r0);
    for (int i = 0; i < MR; ++i) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(xs[i * K2 + p]);
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], lo, xb);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], hi, xb);
    }
  }
  __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
  if (bias) { b0 = _mm512_loadu_ps(bias); b1 = _mm512_loadu_ps(bias + 16); }
  for (int i = 0; i < MR; ++i) {  // back to column order 0..31
    _mm512_storeu_ps(y + i * ldy, _mm512_add_ps(_mm512_permutex2var_ps(acc[i][0], perm0, acc[i][1]), b0));
    _mm512_storeu_ps(y + i * ldy + 16, _mm512_add_ps(_mm512_permutex2var_ps(acc[i][0], perm1, acc[i][1]), b1));
  }
}

// Where output column c sits after the unpacks, as permutex2var indices over (lo, hi): lane
// c/8*4 + c%4 of lo when c%8 < 4, else of hi (indices 16..31)
struct alignas(64) Perm { int32_t at[32]; };
constexpr Perm make_perm() {
  Perm p{};
  for (int c = 0; c < 32; ++c) p.at[c] = (c % 8 < 4 ? 0 : 16) + c / 8 * 4 + c % 4;
  return p;
}
constexpr Perm kPerm = make_perm();

void panel(const int32_t* xs, int64_t M, int64_t K2, const uint16_t* wp, const float* bias,
           float* y, int64_t ldy) {
  const __m512i perm0 = _mm512_load_si512(kPerm.at), perm1 = _mm512_load_si512(kPerm.at + 16);
  int64_t m = 0;
  for (; m + kMaxRows <= M; m += kMaxRows)
    tile<kMaxRows>(xs + m * K2, K2, wp, bias, y + m * ldy, ldy, perm0, perm1);
  const int32_t* xm = xs + m * K2;
  float* ym = y + m * ldy;
  switch (M - m) {
#define NPUSPEC_TILE(n) case n: tile<n>(xm, K2, wp, bias, ym, ldy, perm0, perm1); break;
    NPUSPEC_TILE(11) NPUSPEC_TILE(10) NPUSPEC_TILE(9) NPUSPEC_TILE(8) NPUSPEC_TILE(7)
    NPUSPEC_TILE(6) NPUSPEC_TILE(5) NPUSPEC_TILE(4) NPUSPEC_TILE(3) NPUSPEC_TILE(2) NPUSPEC_TILE(1)
#undef NPUSPEC_TILE
    default: break;
  }
}
#pragma GCC pop_options

void run(const uint16_t* x, const uint16_t* wp, const float* bias, float* y, int64_t M,
         int64_t NB, int64_t K) {
  const int64_t K2 = K / 2, ldy = NB * kBW;
  // x's pairs as one 32-bit word each, x[k] in the high half (the instruction adds it first);
  // the caller's thread builds them once for every panel (a few KB: M x K / 2 words)
  static thread_local std::vector<int32_t> xs;
  xs.resize(static_cast<size_t>(M * K2));
  for (int64_t i = 0; i < M; ++i)
    for (int64_t p = 0; p < K2; ++p)
      xs[i * K2 + p] = static_cast<int32_t>((uint32_t(x[i * K + 2 * p]) << 16) | x[i * K + 2 * p + 1]);
  const int32_t* xp = xs.data();
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < NB; ++b)
    panel(xp, M, K2, wp + b * K * kBW, bias ? bias + b * kBW : nullptr, y + b * kBW, ldy);
}
}  // namespace dp
#endif

// bf16 x bf16 on AMX tiles (Sapphire Rapids and later), where the CPU has them and the OS grants
// the tile state (`amx::enabled`, set from Python): TDPBF16PS multiplies a 16-row x 32-k tile of
// x by a 32-k x 16-column tile of the weights in one instruction. The weights' tile must hold k
// in pairs per column (VNNI), so each thread re-lays one [K, 32] panel at a time into a buffer
// (the unpacks the dot-product kernel does in registers, done once per panel and call), then
// runs every 32-row block of x over it: 2 x 2 accumulator tiles, the x tiles read in place.
// Every row goes through the same instructions in the same order whatever M is, so a row has
// the same bits at any row count from kMinRows on; they are not the dot-product kernel's bits
// (the tile unit rounds its sums its own way: neither the k-ordered sum nor per-32-k-block sums,
// emulated, reproduced them; both are fp32-accurate). Below kMinRows the dot-product
// kernel, which streams a panel without the re-layout, is faster (one row: ~1.5x).
#if defined(NPUSPEC_DPBF16) && ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define NPUSPEC_AMX 1
#include <algorithm>
namespace amx {
bool enabled = false;
int64_t kMinRows = 5;   // set from Python (AMX_MIN_ROWS)

bool usable(int64_t M, int64_t K) { return enabled && kBW == 32 && K % 32 == 0 && M >= kMinRows; }

struct alignas(64) TileCfg {
  uint8_t palette_id; uint8_t start_row; uint8_t reserved[14];
  uint16_t colsb[16]; uint8_t rows[16];
};

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw")
// tiles 0-3: y for rows 0-15 / 16-31 x columns 0-15 / 16-31; 4, 5: x rows; 6, 7: weight halves
inline void configure(int r0, int r1) {
  TileCfg c{};
  c.palette_id = 1;
  const int rows[8] = {r0, r0, r1, r1, r0, r1, 16, 16};
  for (int t = 0; t < 8; ++t) { c.rows[t] = static_cast<uint8_t>(std::max(rows[t], 1)); c.colsb[t] = 64; }
  _tile_loadconfig(&c);
}

// panel [K, 32] -> buf [K/32][2][16][32]: for each 32-k block, two tiles (columns 0-15, 16-31)
// whose row p holds (w[2p][c], w[2p+1][c]) for their 16 columns c
inline void to_pairs(const uint16_t* wp, int64_t K, uint16_t* buf) {
  const __m512i lanes0 = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0);
  const __m512i lanes1 = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
  for (int64_t p = 0; p < K / 2; ++p) {
    const __m512i r0 = _mm512_loadu_si512(wp + 2 * p * kBW);
    const __m512i r1 = _mm512_loadu_si512(wp + (2 * p + 1) * kBW);
    const __m512i lo = _mm512_unpacklo_epi16(r0, r1), hi = _mm512_unpackhi_epi16(r0, r1);
    uint16_t* row = buf + ((p / 16) * 2 * 16 + p % 16) * 32;
    _mm512_storeu_si512(row, _mm512_permutex2var_epi64(lo, lanes0, hi));
    _mm512_storeu_si512(row + 16 * 32, _mm512_permutex2var_epi64(lo, lanes1, hi));
  }
}

void panel(const uint16_t* x, int64_t M, int64_t K, const uint16_t* wp, const float* bias,
           float* y, int64_t ldy, uint16_t* buf, int* shape) {
  // one block of rows: each 32-k block is re-laid just before its tiles load it (from L1); a
  // whole panel re-laid first and read back took ~2x as long at 8-32 rows. More rows: once.
  const bool per_block = M <= 32;
  if (!per_block) to_pairs(wp, K, buf);
  const int64_t nkb = K / 32, ldx = K * 2, ldc = ldy * 4;
  for (int64_t m = 0; m < M; m += 32) {
    const int r0 = static_cast<int>(std::min<int64_t>(16, M - m));
    const int r1 = static_cast<int>(std::min<int64_t>(16, std::max<int64_t>(0, M - m - 16)));
    if (r0 != shape[0] || r1 != shape[1]) { configure(r0, r1); shape[0] = r0; shape[1] = r1; }
    const uint16_t* xm = x + m * K;
    _tile_zero(0); _tile_zero(1);
    if (r1) { _tile_zero(2); _tile_zero(3); }
    for (int64_t kb = 0; kb < nkb; ++kb) {
      if (per_block) to_pairs(wp + kb * 32 * kBW, 32, buf + kb * 1024);
      _tile_loadd(4, xm + kb * 32, ldx);
      _tile_loadd(6, buf + kb * 1024, 64);
      _tile_loadd(7, buf + kb * 1024 + 512, 64);
      _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7);
      if (r1) {
        _tile_loadd(5, xm + 16 * K + kb * 32, ldx);
        _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
      }
    }
    float* ym = y + m * ldy;
    _tile_stored(0, ym, ldc); _tile_stored(1, ym + 16, ldc);
    if (r1) { _tile_stored(2, ym + 16 * ldy, ldc); _tile_stored(3, ym + 16 * ldy + 16, ldc); }
    if (bias) {
      const __m512 b0 = _mm512_loadu_ps(bias), b1 = _mm512_loadu_ps(bias + 16);
      for (int i = 0; i < r0 + r1; ++i) {
        _mm512_storeu_ps(ym + i * ldy, _mm512_add_ps(_mm512_loadu_ps(ym + i * ldy), b0));
        _mm512_storeu_ps(ym + i * ldy + 16, _mm512_add_ps(_mm512_loadu_ps(ym + i * ldy + 16), b1));
      }
    }
  }
}

void release() { _tile_release(); }
#pragma GCC pop_options

void run(const uint16_t* x, const uint16_t* wp, const float* bias, float* y, int64_t M,
         int64_t NB, int64_t K) {
  const int64_t ldy = NB * kBW;
#pragma omp parallel
  {
    // the tile configuration is per thread, and other libraries' kernels (oneDNN's) set their
    // own between our calls: each thread configures on its first block and releases at the end
    static thread_local std::vector<uint16_t> buf;
    buf.resize(static_cast<size_t>(K * kBW));
    int shape[2] = {-1, -1};
#pragma omp for schedule(static)
    for (int64_t b = 0; b < NB; ++b)
      panel(x, M, K, wp + b * K * kBW, bias ? bias + b * kBW : nullptr, y + b * kBW, ldy,
            buf.data(), shape);
    if (shape[0] >= 0) release();
  }
}
}  // namespace amx
#endif

extern "C" int64_t npuspec_linear_packed_block() { return kBW; }
extern "C" void npuspec_linear_packed_f32(const float* x, const float* wp, const float* bias,
                                          float* y, int64_t M, int64_t NB, int64_t K) {
  run(x, wp, bias, y, M, NB, K);
}
extern "C" void npuspec_linear_packed_bf16(const float* x, const at::BFloat16* wp, const float* bias,
                                           float* y, int64_t M, int64_t NB, int64_t K) {
  run(x, wp, bias, y, M, NB, K);
}
extern "C" void npuspec_linear_packed_f16(const float* x, const at::Half* wp, const float* bias,
                                          float* y, int64_t M, int64_t NB, int64_t K) {
  run(x, wp, bias, y, M, NB, K);
}
// wp [NB, K, kBW] -> out [K, NB * kBW] (w^T, row-major): each panel row is one contiguous
// kBW-element copy, rows split over the threads.
template <typename E>
void packed_to_kn(const E* wp, E* out, int64_t NB, int64_t K) {
#pragma omp parallel for schedule(static)
  for (int64_t k = 0; k < K; ++k)
    for (int64_t b = 0; b < NB; ++b)
      std::memcpy(out + (k * NB + b) * kBW, wp + (b * K + k) * kBW, kBW * sizeof(E));
}
// x in the weights' 2-byte dtype (a bf16 / fp16 model's activations), read and widened in the
// kernel: no fp32 copy of x per call. bf16 x bf16 takes the dot-product path where the CPU has
// AVX512_BF16 (same values, below).
extern "C" void npuspec_linear_packed_bf16_x(const at::BFloat16* x, const at::BFloat16* wp,
                                             const float* bias, float* y, int64_t M, int64_t NB,
                                             int64_t K) {
#ifdef NPUSPEC_AMX
  if (amx::usable(M, K)) return amx::run(reinterpret_cast<const uint16_t*>(x),
                                         reinterpret_cast<const uint16_t*>(wp), bias, y, M, NB, K);
#endif
#ifdef NPUSPEC_DPBF16
  if (dp::usable(K)) return dp::run(reinterpret_cast<const uint16_t*>(x),
                                    reinterpret_cast<const uint16_t*>(wp), bias, y, M, NB, K);
#endif
  run(x, wp, bias, y, M, NB, K);
}
// on < 0: ask; 0 / 1: turn the AMX path off / on (Python turns it on once the OS has granted
// the tile state). Returns whether it is on; 0 where the kernel was built without it.
extern "C" int64_t npuspec_linear_packed_amx(int64_t on, int64_t min_rows) {
#ifdef NPUSPEC_AMX
  if (on >= 0) { amx::enabled = on != 0; amx::kMinRows = min_rows; }
  return amx::enabled;
#else
  return 0;
#endif
}
extern "C" int64_t npuspec_linear_packed_amx_built() {
#ifdef NPUSPEC_AMX
  return 1;
#else
  return 0;
#endif
}
extern "C" int64_t npuspec_linear_packed_dpbf16(int64_t K) {
#ifdef NPUSPEC_DPBF16
  return dp::usable(K);
#else
  return 0;
#endif
}
extern "C" void npuspec_linear_packed_f16_x(const at::Half* x, const at::Half* wp, const float* bias,
                                            float* y, int64_t M, int64_t NB, int64_t K) {
  run(x, wp, bias, y, M, NB, K);
}
extern "C" void npuspec_packed_to_kn_2byte(const uint16_t* wp, uint16_t* out, int64_t NB, int64_t K) {
  packed_to_kn(wp, out, NB, K);
}
extern "C" void npuspec_packed_to_kn_4byte(const uint32_t* wp, uint32_t* out, int64_t NB, int64_t K) {
  packed_to_kn(wp, out, NB, K);
}
"""

_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


@functools.lru_cache(maxsize=None)
def _library():
    """The compiled library, or None (logged once) when no C++ toolchain works here."""
    sig = {"npuspec_linear_packed_block": (ctypes.c_int64, []),
           "npuspec_linear_packed_dpbf16": (ctypes.c_int64, [ctypes.c_int64]),
           "npuspec_linear_packed_amx": (ctypes.c_int64, [ctypes.c_int64, ctypes.c_int64]),
           "npuspec_linear_packed_amx_built": (ctypes.c_int64, [])}
    for n in (2, 4):
        sig[f"npuspec_packed_to_kn_{n}byte"] = (None, [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2)
    sig.update({f"npuspec_linear_packed_{s}": (None, [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3)
                for s in (*_SUFFIX.values(), "bf16_x", "f16_x")})
    lib = load_library(_SOURCE, "packed CPU linear kernel", "weights stay unpacked (torch.mm)", sig)
    if lib is not None:
        _enable_amx(lib)
    return lib


# bf16 x bf16 calls of at least this many rows run on AMX tiles where the CPU has them (the
# kernel's `amx` path). A 2-core Xeon with AMX, 2 threads, SmolLM2's shapes, dot-product kernel /
# tiles time (2026-12-06, medians of 50, one weight; the 49152x576 head read from memory):
# projections 0.62-0.64 at 1 row, 0.86-0.89 at 2, 1.08-1.18 at 3, 1.38-1.45 at 4, 1.78-1.80 at
# 5, 2.6-2.7 at 8, 3.4-3.7 at 12, 4.5-7.5 at 16-32; the head 0.72 at 1, 0.94-0.95 at 3-4, 1.34
# at 5, 2.5 at 12, 5.0 at 25-32. (With each panel re-laid whole before its tiles ran, the
# first version: 1.4-1.5 at 12, 2.0-2.3 at 16-25.)
AMX_MIN_ROWS = 5


def _enable_amx(lib) -> None:
    """Turn the kernel's AMX path on where the CPU has AMX-BF16 and the OS grants this process
    the tile state (`torch._C._cpu._init_amx`: the arch_prctl request oneDNN makes too), unless
    NPUSPEC_CPU_AMX=0."""
    init = getattr(torch._C._cpu, "_init_amx", None)
    if envs.cpu_amx() and amx_bf16() and init is not None and init():
        lib.npuspec_linear_packed_amx(1, AMX_MIN_ROWS)


@functools.lru_cache(maxsize=None)
def amx_built() -> bool:
    """The kernel was compiled with its AMX path (a compiler with the AMX intrinsics)."""
    lib = _library()
    return lib is not None and bool(lib.npuspec_linear_packed_amx_built())


def amx_tiles() -> bool:
    """Whether bf16 x bf16 calls of >= AMX_MIN_ROWS rows with K % 32 == 0 run on AMX tiles."""
    lib = _library()
    return lib is not None and bool(lib.npuspec_linear_packed_amx(-1, 0))


@contextlib.contextmanager
def amx_paused():
    """Inside the block bf16 x bf16 calls stay off the tiles (where they run on them): for
    comparisons with the dot-product kernel, as `native_cpu.bypassed()` is for the Python ops.
    The GEMM hand-off does not move (it follows the build, `amx_built`)."""
    on = amx_tiles()
    if on:
        _library().npuspec_linear_packed_amx(0, AMX_MIN_ROWS)
    try:
        yield
    finally:
        if on:
            _library().npuspec_linear_packed_amx(1, AMX_MIN_ROWS)


def available() -> bool:
    return _library() is not None


@functools.lru_cache(maxsize=None)
def block_width() -> int:
    """Output columns per packed panel: 2 SIMD vectors of the ISA Inductor builds the kernel
    for. Known without the build, so a model packs while g++ runs; the op checks it against
    the built kernel's `kBW` and takes the reference if they differ."""
    isa = vec_isa()
    # no usable ISA: ATen's generic Vectorized<float> is 32 bytes
    return 2 * (isa.nelements(torch.float) if isa else 8)


@functools.lru_cache(maxsize=None)
def dot_bf16(K: int) -> bool:
    """Whether bf16 x bf16 products over K inputs run on AVX512_BF16's dot-product instruction
    (same values as the widening loop but for subnormals, which it flushes to zero)."""
    lib = _library()
    return lib is not None and bool(lib.npuspec_linear_packed_dpbf16(K))


def can_pack() -> bool:
    """Whether to pack now: a compiler is present. The build itself runs in the background
    (`prebuild_cpu_kernels`); if it fails after all, the op logs once and runs the reference."""
    return toolchain_present()


def built_for(lib, block_fn: str, bw: int, op: str):
    """`lib` when its kernels were built for panels of `bw` columns (its `block_fn` says), else
    None with a warning naming `op` (callers cache the answer: once per width)."""
    if lib is None:
        return None  # load_library logged why
    built = int(getattr(lib, block_fn)())
    if built != bw:
        log.warning("npuspec: weights were packed for %d-column panels but the %s kernel was "
                    "built for %d; it runs its PyTorch reference", bw, op, built)
        return None
    return lib


@functools.lru_cache(maxsize=None)
def _kernel_for(bw: int):
    return built_for(_library(), "npuspec_linear_packed_block", bw, "npuspec::linear_packed")


def pack_weight(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] -> [ceil(N/BW), K, BW], same dtype; rows past N are zero."""
    assert w.dim() == 2 and w.dtype in WEIGHT_DTYPES and w.device.type == "cpu", (w.shape, w.dtype, w.device)
    return to_panels(w, block_width())


def to_panels(t: torch.Tensor, bw: int) -> torch.Tensor:
    """t [N, C] -> [ceil(N/bw), C, bw], same dtype; rows past N are zero."""
    N, C = t.shape
    nb = -(-N // bw)
    padded = t.new_zeros(nb * bw, C)
    padded[:N] = t
    return padded.view(nb, bw, C).transpose(1, 2).contiguous()


def unpack_weight(wp: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of `pack_weight`: [NB, K, BW] -> [n, K]."""
    nb, K, bw = wp.shape
    return wp.transpose(1, 2).reshape(nb * bw, K)[:n]


def packed_rows(wp: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the unpacked weight (an embedding lookup on a tied, packed LM head):
    ids [...] int64 -> [..., K]."""
    bw = wp.shape[2]
    return wp[ids // bw, :, ids % bw]


def linear_packed_reference(x: torch.Tensor, wp: torch.Tensor, bias: Optional[torch.Tensor],
                            n: int) -> torch.Tensor:
    """fp32 x [M, K] @ unpack(wp)[:n].T (+ bias) -> fp32 [M, n]."""
    w = unpack_weight(wp, n).float()
    y = x.float() @ w.t()
    return y if bias is None else y + bias.float()


# From this many rows on (prefill, big batches) a product goes to a vendor GEMM (MKL for fp32,
# oneDNN for bf16 x bf16 where the CPU has native bf16) over the weight unpacked by one C++
# copy, which costs what one extra read of the weight does. Below it the kernel (one read of
# the weight per tile of rows) wins. Crossovers on this project's AVX-512 CPU, 2 threads,
# SmolLM2's shapes (576x1536, 1536x576; packed / GEMM time, scratch timing 2026-12-05):
# - fp32: 64. In isolation the kernel crosses the GEMM at 24-32 rows on one weight (1.12-1.46
#   at 48), but in a model step every layer's weight comes from memory once, and the GEMM's
#   unpacking then copies it there and back: SmolLM2 fp32, 16 requests at K = 1 (32 rows),
#   the steps took 7.9 s with the hand-off at 32 against 5.4 s at 64 (medians of 3
#   interleaved runs, same tokens); at K = 4 (80 rows) 9.0 s with it at 64, 8.8 s at 160;
# - bf16 x bf16 on the dot-product instruction (`dot_bf16`): 512. In isolation 0.65-0.79 at
#   64 rows, 0.74-0.80 at 128, 0.89-0.97 at 256-384, 0.54-1.10 at 512 (noisy): the GEMM never
#   wins clearly below a full prefill step of the default budget (16 chunks of 32 tokens);
#   SmolLM2 bf16 prefill of one prompt 1,044-1,145 -> 1,273-1,385 tokens/s with it;
# - bf16 x bf16 on the widening loop (no AVX512_BF16: FMA-bound): 64, measured when that was
#   the only bf16 kernel (145-180 GFLOP/s against the GEMM's 275-413).
# - bf16 x bf16 where the CPU also has AMX-BF16 tiles (Sapphire Rapids and later), which
#   oneDNN's bf16 GEMM runs on, and this kernel was built without its AMX path: 32. A 2-core
#   Xeon with AMX, 2 threads, SmolLM2's three shapes (576x1536, 1536x576, the 49152x576 LM
#   head), packed / GEMM time with the unpacking
#   included (2026-12-06): 0.44-0.71 at 12 rows, 0.79-1.43 at 25, 1.33-1.42 at 32, 1.78-2.15 at
#   64, 3.0-5.7 at 128-256 (the kernel runs ~120 GFLOP/s at any row count there, the GEMM
#   600-1000 at 128-256 rows). One bf16 prefill of the 6 code-edit prompts: 2.92 s -> 1.10 s.
GEMM_MIN_ROWS = 64
BF16_GEMM_MIN_ROWS = 64
DOT_BF16_GEMM_MIN_ROWS = 512
AMX_BF16_GEMM_MIN_ROWS = 32


@functools.lru_cache(maxsize=None)
def amx_bf16() -> bool:
    """The CPU has AMX-BF16 tiles (oneDNN's bf16 GEMM runs on them)."""
    caps = getattr(torch.cpu, "get_capabilities", None)
    return bool(caps is not None and caps().get("amx_bf16", False))


def dot_bf16_gemm_min_rows() -> int:
    """The hand-off for bf16 x bf16 on the dot-product kernel: lower where AMX runs the GEMM
    and not this kernel, unless NPUSPEC_CPU_AMX=0 (the kernel's AMX path holds its own against
    the GEMM with its unpacking: 256 rows 0.63 / 0.84 ms, 0.62 / 0.59, 21.7 / 34.6 on the three
    shapes)."""
    if envs.cpu_amx() and amx_bf16() and not amx_built():
        return AMX_BF16_GEMM_MIN_ROWS
    return DOT_BF16_GEMM_MIN_ROWS


def gemm_min_rows(wp: torch.Tensor, K: int) -> int:
    """The rows from which a product with these packed weights goes to the GEMM."""
    if wp.dtype == torch.float32:
        return GEMM_MIN_ROWS
    return dot_bf16_gemm_min_rows() if dot_bf16(K) else BF16_GEMM_MIN_ROWS


@functools.lru_cache(maxsize=None)
def _bf16_gemm() -> bool:
    """oneDNN runs bf16 GEMMs natively here (AVX512-BF16 / AMX)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def takes_gemm(x: torch.Tensor, wp: torch.Tensor, bias: Optional[torch.Tensor]) -> bool:
    """Whether `linear_packed_impl` hands this call to `_gemm_rows` (kernels/native_cpu.py
    mirrors it)."""
    M = x.shape[0]
    if wp.dtype == torch.float32:
        return M >= GEMM_MIN_ROWS
    # bf16: no bias, since adding one after the GEMM's bf16 rounding would round twice
    return (bias is None and x.dtype == wp.dtype == torch.bfloat16 and _bf16_gemm()
            and M >= gemm_min_rows(wp, x.shape[1]))


# The GEMM path unpacks at most this much weight at a time, into one buffer reused per chunk of
# panels: an LM head (SmolLM2's 576 x 49152, 113 MB in fp32) unpacked whole into a fresh
# buffer cost ~100 ms of page faults per call, and its copy went to memory and back.
GEMM_CHUNK_BYTES = 4 << 20


def _unpack(lib, wp: torch.Tensor, p0: int, p1: int, out: torch.Tensor) -> None:
    """Panels p0..p1 of wp [NB, K, BW] (contiguous) -> out [K, (p1 - p0) * BW]."""
    K, bw = wp.shape[1], wp.shape[2]
    if lib is None:  # a strided torch copy: slower, same values
        out.copy_(wp[p0:p1].permute(1, 0, 2).reshape(K, (p1 - p0) * bw))
        return
    fn = lib.npuspec_packed_to_kn_4byte if wp.element_size() == 4 else lib.npuspec_packed_to_kn_2byte
    fn(wp[p0].data_ptr(), out.data_ptr(), p1 - p0, K)


def _gemm_rows(x: torch.Tensor, wp: torch.Tensor, bias: Optional[torch.Tensor], n: int) -> torch.Tensor:
    """x [M, K] @ unpack(wp)[:n].T (+ bias) in vendor GEMMs with fp32 accumulation -> fp32
    [M, n], over chunks of panels of at most GEMM_CHUNK_BYTES. bf16: one rounding to bf16 per
    output, which the bf16 model's output gets anyway."""
    nb, K, bw = wp.shape
    lib = _kernel_for(bw)
    wp = wp.contiguous()
    fp32 = wp.dtype == torch.float32
    if fp32:
        x = x.float()
    panels = -(-n // bw)
    step = max(1, GEMM_CHUNK_BYTES // (K * bw * wp.element_size()))   # panels per chunk
    buf = torch.empty(K * min(step, panels) * bw, dtype=wp.dtype)
    if step >= panels:  # one chunk: the GEMM's output is the result
        wt = buf.view(K, panels * bw)
        _unpack(lib, wp, 0, panels, wt)
        if not fp32:
            return torch.mm(x, wt[:, :n]).float()
        return torch.mm(x, wt[:, :n]) if bias is None else torch.addmm(bias.float(), x, wt[:, :n])
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    for p0 in range(0, panels, step):
        p1 = min(panels, p0 + step)
        c0, c1 = p0 * bw, min(p1 * bw, n)
        wt = buf[:K * (p1 - p0) * bw].view(K, (p1 - p0) * bw)            # w^T [K, cols]
        _unpack(lib, wp, p0, p1, wt)
        if fp32 and bias is not None:
            y[:, c0:c1] = torch.addmm(bias[c0:c1].float(), x, wt[:, :c1 - c0])
        else:
            y[:, c0:c1] = torch.mm(x, wt[:, :c1 - c0])
    return y


def linear_packed_impl(x: torch.Tensor, wp: torch.Tensor, bias: Optional[torch.Tensor],
                       n: int) -> torch.Tensor:
    M, K = x.shape
    nb, Kw, bw = wp.shape
    assert K == Kw and n <= nb * bw and wp.dtype in _SUFFIX and x.device.type == "cpu", (
        x.shape, wp.shape, n, wp.dtype, x.device)
    if takes_gemm(x, wp, bias):
        return _gemm_rows(x, wp, bias, n)
    lib = _kernel_for(bw)
    if lib is None:
        counters.bump("eager_fallbacks")
        return linear_packed_reference(x, wp, bias, n)
    # x in the weights' 2-byte dtype is read as it is (the kernel widens it, exactly)
    same = x.dtype == wp.dtype and wp.dtype != torch.float32
    x = x.contiguous() if same else x.float().contiguous()
    wp = wp.contiguous()
    b = bias
    if bias is not None and (n != nb * bw or bias.dtype != torch.float32 or not bias.is_contiguous()):
        b = bias.new_zeros(nb * bw, dtype=torch.float32)  # the kernel reads whole panels
        b[:n] = bias
    y = torch.empty(M, nb * bw, dtype=torch.float32)
    if M:
        getattr(lib, f"npuspec_linear_packed_{_SUFFIX[wp.dtype]}{'_x' if same else ''}")(
            x.data_ptr(), wp.data_ptr(), 0 if b is None else b.data_ptr(), y.data_ptr(), M, nb, K)
    return y if n == nb * bw else y[:, :n].contiguous()


_lib = torch.library.Library("npuspec", "FRAGMENT")
_lib.define("linear_packed(Tensor x, Tensor wp, Tensor? bias, int n) -> Tensor")
# CompositeExplicitAutograd: the C++ kernel of kernels/native_cpu.py, once installed, outranks
# this Python one for CPU tensors (and hands it the uncommon cases)
_lib.impl("linear_packed", linear_packed_impl, "CompositeExplicitAutograd")


@torch.library.register_fake("npuspec::linear_packed")
def _fake(x, wp, bias, n):
    return x.new_empty(x.shape[0], n, dtype=torch.float32)


def linear_packed(x: torch.Tensor, wp: torch.Tensor, bias: Optional[torch.Tensor], n: int
                  ) -> torch.Tensor:
    """F.linear for a packed weight: x [..., K] (any float dtype) -> [..., n] in x's dtype,
    accumulated in fp32."""
    y = torch.ops.npuspec.linear_packed(x.reshape(-1, x.shape[-1]), wp, bias, n)
    return y.to(x.dtype).view(*x.shape[:-1], n)
