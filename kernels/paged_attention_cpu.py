"""C++ CPU kernel of `npuspec::paged_attention` (contract: kernels/paged_attention.py).

Compiled and cached by Inductor's C++ toolchain (`CppCodeCache`), like verify_cpu.py. Built for
the decode/verify regime: a few rows of T = K+1 tokens over a few hundred to a few thousand
positions, where a call is tens of microseconds, so one (row, kv head) per thread would leave
threads idle and per-call overheads count.

- Split-K (flash-decoding): each row's live positions are cut into chunks of whole blocks; an
  item is (row, kv head, chunk), spread over OpenMP threads with dynamic scheduling. The G
  query heads of a kv head times the row's T tokens form R = T*G query rows that share every
  K/V read. An item computes its R x n scores, their max m, p = exp(s - m) (at::vec's
  vectorised `exp_u20`), l = sum p and acc = p @ V, unnormalised. A row that fits in one chunk
  writes acc / l straight to the output; otherwise, after a barrier, each (row, kv head) merges
  its chunks' (m, l, acc) with weights exp(m_c - max m).
- Batch-invariant where it matters (T <= INVARIANT_MAX_T = 31: decode and verify calls):
  chunks of FIXED_CHUNK positions at fixed offsets, and one score layout (tiled), so every
  value a query row reads (its chunks, each score's sum over D, the softmax sums, p @ V, the
  merge) is summed in the same order whatever B, T, the other rows' lengths and the thread
  count. A row pads with p = 0 (adding 0 is exact) where a tile or chunk holds more keys than
  it sees. The last query of a K+1-token verify call is therefore the same bits as the decode
  call of that position, which is what makes speculative greedy decoding emit plain greedy
  decoding's tokens in bf16 as in fp32 (tests/kernels/test_paged_attention_invariance.py).
  Longer calls (prefill) size their chunks per call for about 8 items per thread and take the
  lanes layout when R is large; their bits may depend on the call, which both decodings
  share.
- Two score layouts, both with independent accumulators in registers. The tiled layout, 3 rows
  x 4 keys of dot products over D, 4 horizontal sums at a time (on AVX-512 one shuffle tree for
  the 4). The lanes layout (prefill, R > half a vector): query rows in the vector lanes (S^T =
  K Q^T, a broadcast key element times a vector of rows, 6 keys x 2 row vectors), no
  horizontal sums and about twice the FMA rate at R = 15, but each score's sum over D runs in
  another order, so decode and verify do not use it: a verify call (R = 15) runs at 0.73-0.95x
  the speed it had with it (`python -m npuspec.bench.attention_cpu --cold --against OLD`,
  T = 5, B = 1-64, L = 300-2000; decode calls 0.95-1.28x, the fixed chunks). End to end that
  is inside this machine's noise (SmolLM2 fp32, 16 requests x 64 tokens, fixed K = 4, medians
  of 3 in 2 processes each: 18.9 and 19.3 s against 17.1 and 21.5 s before). 6-row score tiles
  (fewer passes over a chunk's keys) measured no faster; not kept. p @ V is 3 rows x 4
  vectors of D in both.
- Causal rule: query t of row b sees positions <= seq_lens[b] - T + t; per chunk each query row
  gets its visible count, tiles stop at the longest of their rows and shorter rows are masked
  to -inf (p = 0); rows that see nothing of a chunk get m = -inf, l = 0 and drop out of the
  merge. Padding rows (`seq_lens == 0`) and queries at negative positions output zeros.
- K/V in fp32, bf16 or fp16: fp32 with D a multiple of the vector width is read in place from
  the pool; otherwise a chunk's rows are widened into a per-thread fp32 buffer (zero-padded to
  the vector width). All arithmetic in fp32. Scratch is thread-local and only grows, so a call
  allocates nothing after the first; the arguments travel as one packed block (one ctypes
  argument: about 2 us less per call than 17 converted ones).

What differs from `reference_paged_attention`: the order of the sums (per chunk, then the
merge) and exp's last bits, so results agree to fp32 rounding, not bitwise (measured against
an fp64 computation, the kernel's error is no larger than the fp32 reference's).
"""
from __future__ import annotations

import ctypes
import functools
import struct
import threading

import torch

from npuspec.kernels.cpp_build import load_library


# The kernel's arguments as one struct: the Python wrapper packs them into one block (`_ARGS`),
# since a ctypes call costs per argument and this one runs once per layer per step; the
# native op (native_cpu.py) fills the same struct in C++.
ARGS_DECL = r"""
struct Args {
  const void *q, *k_cache, *v_cache;  // q [B, T, H, D]; the pools [layers, pool_rows, Hkv, D]
  float* out;                         // [B, T, H, D] fp32
  const int32_t *bt, *lens;           // [B, MB], [B]
  int64_t dtype, layer, pool_rows, B, T, H, Hkv, D, MB, bs, nthreads, chunk;
  double scale;
};
static_assert(sizeof(Args) == 19 * 8, "Args must match _ARGS in paged_attention_cpu.py");
"""

# Calls of at most this many tokens per row (decode, and verify of up to 30 drafts) are
# batch-invariant, with chunks of FIXED_CHUNK positions (rounded up to whole blocks); longer ones
# size chunks per call and take the lanes layout. The engine's prefill rows hold 32 tokens
# (model_runner.PREFILL_CHUNK), one more, so prefill keeps the faster lanes layout (the tiled
# one ran 8 x 32-token rows at 0.64-0.82x its speed).
INVARIANT_MAX_T = 31
FIXED_CHUNK = 128

_SOURCE = r"""
#include <torch/csrc/inductor/cpp_prefix.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace {
using Vec = at::vec::Vectorized<float>;
constexpr int64_t kL = Vec::size();
constexpr int kRows = 3;      // query rows per register tile (p @ V; scores in the tiled layout)
constexpr int kKeys = 4;      // keys per score tile, tiled layout
constexpr int kLaneKeys = 6;  // keys per score tile, lanes layout
constexpr int kDv = 4;        // vectors of D per p @ V tile
constexpr int64_t kPtrPad = 12;                    // key pointers padded to a multiple of both
constexpr int64_t kPad = kL > kKeys ? kL : kKeys;  // tiled score rows padded to this
constexpr int64_t kItemsPerThread = 8;             // split-K target: enough items to balance
constexpr int64_t kMinChunk = 64, kMaxChunk = 512; // positions per chunk
constexpr int64_t kMaxScores = 1 << 14;            // R x chunk scores per thread (L1/L2-sized)
// Decode and verify calls (T <= kInvariantT) are batch-invariant: chunks of a fixed kFixedChunk
// positions (rounded up to whole blocks) and the tiled layout, whatever B, T, the other rows'
// lengths and the thread count, so a query's output is the same bits as in any other call.
constexpr int64_t kInvariantT = INVARIANT_MAX_T, kFixedChunk = FIXED_CHUNK;
const float kNegInf = -std::numeric_limits<float>::infinity();

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

inline float hmax(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec x, Vec y) { return at::vec::maximum(x, y); }, v);
}
inline float hsum(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec x, Vec y) { return x + y; }, v);
}

// s[0..3] = the horizontal sums of a0..a3.
inline void hsum4(const Vec& a0, const Vec& a1, const Vec& a2, const Vec& a3, float* s) {
#if defined(CPU_CAPABILITY_AVX2) && !defined(CPU_CAPABILITY_AVX512)
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  _mm_storeu_ps(s, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
#elif defined(CPU_CAPABILITY_AVX512)
  // Four sums at once (a vec_reduce_all per score cost more than the score's FMAs): halves,
  // then quarters, then pairs and neighbours within each 128-bit lane. Each score's tree is the
  // same whichever scores share the call.
  const __m512 x01 = _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, 0x44),
                                    _mm512_shuffle_f32x4(a0, a1, 0xEE));
  const __m512 x23 = _mm512_add_ps(_mm512_shuffle_f32x4(a2, a3, 0x44),
                                    _mm512_shuffle_f32x4(a2, a3, 0xEE));
  __m512 y = _mm512_add_ps(_mm512_shuffle_f32x4(x01, x23, 0x88),
                           _mm512_shuffle_f32x4(x01, x23, 0xDD));
  y = _mm512_add_ps(y, _mm512_permute_ps(y, 0x4E));
  y = _mm512_add_ps(y, _mm512_permute_ps(y, 0xB1));
  alignas(64) float t[16];
  _mm512_store_ps(t, y);
  s[0] = t[0]; s[1] = t[4]; s[2] = t[8]; s[3] = t[12];
#else
  s[0] = hsum(a0); s[1] = hsum(a1); s[2] = hsum(a2); s[3] = hsum(a3);
#endif
}

// ---- Scores, tiled layout (few query rows): S [R][sst], one dot product per score over D
// in the lanes, 3 rows x 4 keys of independent accumulators, a horizontal sum per 4 scores.

// s[i * sst + j] = q row i . key j for RT rows (dp apart) and keys k[0..3], nv vectors of D.
template <int RT>
inline void score_tile(const float* q, int64_t dp, const float* const* k, int64_t nv, float* s,
                       int64_t sst) {
  Vec acc[RT][kKeys];
  for (int i = 0; i < RT; ++i)
    for (int j = 0; j < kKeys; ++j) acc[i][j] = Vec(0.f);
  for (int64_t d = 0; d < nv * kL; d += kL) {
    Vec qv[RT];
    for (int i = 0; i < RT; ++i) qv[i] = Vec::loadu(q + i * dp + d);
    for (int j = 0; j < kKeys; ++j) {
      const Vec kv = Vec::loadu(k[j] + d);
      for (int i = 0; i < RT; ++i) acc[i][j] = at::vec::fmadd(qv[i], kv, acc[i][j]);
    }
  }
  for (int i = 0; i < RT; ++i) hsum4(acc[i][0], acc[i][1], acc[i][2], acc[i][3], s + i * sst);
}

template <int RT>
void score_rows(const float* q, int64_t dp, const float* const* k, int64_t n, int64_t nv,
                float* s, int64_t sst) {
  for (int64_t c = 0; c < n; c += kKeys) score_tile<RT>(q, dp, k + c, nv, s + c, sst);
}

// Scores of rt (<= kRows) rows against keys [0, n) (rounded up to kKeys).
void scores_tiled(int64_t rt, const float* q, int64_t dp, const float* const* k, int64_t n,
                  int64_t nv, float* s, int64_t sst) {
  if (rt == 3) score_rows<3>(q, dp, k, n, nv, s, sst);
  else if (rt == 2) score_rows<2>(q, dp, k, n, nv, s, sst);
  else score_rows<1>(q, dp, k, n, nv, s, sst);
}

// Row s[0..npad): p = exp(s - m) over the n visible scores, 0 past them, in place; returns
// l = sum p. A row that sees nothing (n == 0, possible when a tile mixes tokens) gets
// m = -inf, p = 0, l = 0.
float softmax_row(float* s, int64_t n, int64_t npad, float* m) {
  if (n == 0) {
    std::fill(s, s + npad, 0.f);
    *m = kNegInf;
    return 0.f;
  }
  for (int64_t c = n; c < npad; ++c) s[c] = kNegInf;
  Vec mx(kNegInf);
  for (int64_t c = 0; c < npad; c += kL) mx = at::vec::maximum(mx, Vec::loadu(s + c));
  *m = hmax(mx);
  const Vec mv(*m);
  Vec sum(0.f);
  for (int64_t c = 0; c < npad; c += kL) {
    const Vec e = (Vec::loadu(s + c) - mv).exp_u20();  // exp(-inf) = 0
    e.store(s + c);
    sum = sum + e;
  }
  return hsum(sum);
}

// ---- Scores, lanes layout (R > kL / 2 query rows, e.g. verify's T*G = 15): S^T [n][rp],
// query rows in the lanes. Each FMA multiplies a broadcast key element by a vector of rows:
// no horizontal sums, 6 keys x 2 row vectors of accumulators, about twice the tiled layout's
// FMA rate at T = 5.

// st[j * rp + ...] = scores of keys k[0..NK) against NRV vectors of query rows of Q^T
// (qt [D][rp], already offset to the first row vector).
template <int NK, int NRV>
inline void score_lanes_tile(const float* qt, int64_t rp, const float* const* k, int64_t D,
                             float* st) {
  Vec a[NK][NRV];
  for (int j = 0; j < NK; ++j)
    for (int u = 0; u < NRV; ++u) a[j][u] = Vec(0.f);
  for (int64_t d = 0; d < D; ++d) {
    Vec qv[NRV];
    for (int u = 0; u < NRV; ++u) qv[u] = Vec::loadu(qt + d * rp + u * kL);
    for (int j = 0; j < NK; ++j) {
      const Vec kb(k[j][d]);
      for (int u = 0; u < NRV; ++u) a[j][u] = at::vec::fmadd(kb, qv[u], a[j][u]);
    }
  }
  for (int j = 0; j < NK; ++j)
    for (int u = 0; u < NRV; ++u) a[j][u].store(st + j * rp + u * kL);
}

// Scores of row vectors [u0, rp / kL) against keys [0, n) (rounded up to kLaneKeys).
void scores_lanes(const float* qt, int64_t rp, int64_t u0, const float* const* k, int64_t n,
                  int64_t D, float* st) {
  const int64_t nu = rp / kL;
  for (int64_t c = 0; c < n; c += kLaneKeys) {
    int64_t u = u0;
    for (; u + 2 <= nu; u += 2)
      score_lanes_tile<kLaneKeys, 2>(qt + u * kL, rp, k + c, D, st + c * rp + u * kL);
    if (u < nu) score_lanes_tile<kLaneKeys, 1>(qt + u * kL, rp, k + c, D, st + c * rp + u * kL);
  }
}

// Softmax of S^T [n][rp] per query row (lane) r >= u0 * kL over its nvis[r] visible keys, in
// place; m, l per row (rows that see nothing: m = -inf, l = 0, p = 0). mbuf, lbuf: rp floats.
void softmax_lanes(float* st, int64_t rp, int64_t u0, int64_t n, const int64_t* nvis,
                   int64_t R, float* m, float* l, float* mbuf, float* lbuf) {
  for (int64_t r = u0 * kL; r < R; ++r)  // causal mask: only the last T-1 keys of a row's
    for (int64_t c = nvis[r]; c < n; ++c) st[c * rp + r] = kNegInf;  // last chunk, mostly
  const Vec neg_inf(kNegInf), zero(0.f);
  for (int64_t u = u0; u < rp / kL; ++u) {
    float* col = st + u * kL;
    Vec mx(kNegInf);
    for (int64_t c = 0; c < n; ++c) mx = at::vec::maximum(mx, Vec::loadu(col + c * rp));
    const Vec shift = Vec::blendv(mx, zero, mx == neg_inf);  // all -inf: p = exp(-inf) = 0
    Vec sum(0.f);
    for (int64_t c = 0; c < n; ++c) {
      const Vec e = (Vec::loadu(col + c * rp) - shift).exp_u20();
      e.store(col + c * rp);
      sum = sum + e;
    }
    mx.store(mbuf + u * kL);
    sum.store(lbuf + u * kL);
  }
  for (int64_t r = u0 * kL; r < R; ++r) { m[r] = mbuf[r]; l[r] = lbuf[r]; }
}

// ---- p @ V (both layouts): acc[i][d] = sum over keys c of p(i, c) * V[c][d], lanes over D,
// 3 rows x 4 vectors of D of accumulators. p(i, c) = p[i * prs + c * pks].

template <int RT, int NV>
inline void pv_tile(const float* p, int64_t prs, int64_t pks, const float* const* v, int64_t n,
                    int64_t d0, float* acc, int64_t dp) {
  Vec a[RT][NV];
  for (int i = 0; i < RT; ++i)
    for (int u = 0; u < NV; ++u) a[i][u] = Vec(0.f);
  for (int64_t c = 0; c < n; ++c) {
    Vec pc[RT];
    for (int i = 0; i < RT; ++i) pc[i] = Vec(p[i * prs + c * pks]);
    for (int u = 0; u < NV; ++u) {
      const Vec vv = Vec::loadu(v[c] + d0 + u * kL);
      for (int i = 0; i < RT; ++i) a[i][u] = at::vec::fmadd(pc[i], vv, a[i][u]);
    }
  }
  for (int i = 0; i < RT; ++i)
    for (int u = 0; u < NV; ++u) a[i][u].store(acc + i * dp + d0 + u * kL);
}

template <int RT>
void pv_rows(const float* p, int64_t prs, int64_t pks, const float* const* v, int64_t n,
             int64_t nv, float* acc, int64_t dp) {
  int64_t u = 0;
  for (; u + kDv <= nv; u += kDv) pv_tile<RT, kDv>(p, prs, pks, v, n, u * kL, acc, dp);
  switch (nv - u) {
    case 3: pv_tile<RT, 3>(p, prs, pks, v, n, u * kL, acc, dp); break;
    case 2: pv_tile<RT, 2>(p, prs, pks, v, n, u * kL, acc, dp); break;
    case 1: pv_tile<RT, 1>(p, prs, pks, v, n, u * kL, acc, dp); break;
    default: break;
  }
}

// p @ V for rt (<= kRows) rows over keys [0, n).
void pv(int64_t rt, const float* p, int64_t prs, int64_t pks, const float* const* v, int64_t n,
        int64_t nv, float* acc, int64_t dp) {
  if (rt == 3) pv_rows<3>(p, prs, pks, v, n, nv, acc, dp);
  else if (rt == 2) pv_rows<2>(p, prs, pks, v, n, nv, acc, dp);
  else pv_rows<1>(p, prs, pks, v, n, nv, acc, dp);
}

// ---- Work items.

struct Problem {
  int64_t B, T, H, Hkv, D, MB, bs;
  float scale;
  int64_t G, R, stride;  // query heads per kv head, query rows per item, pool row stride
  int64_t dp, nv;        // D padded to the vector width, in floats and in vectors
  int64_t chunk;         // positions per chunk (a multiple of bs)
  bool lanes;            // lanes layout (else tiled)
  int64_t rp;            // lanes: R padded to the vector width
  int64_t sst;           // tiled: score row stride
};

struct Scratch {  // per thread; grows only
  std::vector<float> q, s, acc, kw, vw, m, l, lane_m, lane_l;
  std::vector<const float*> kp, vp;
  std::vector<int64_t> nvis;
  void fit(const Problem& P, bool widen) {
    auto grow = [](auto& v, size_t n) { if (v.size() < n) v.resize(n); };
    const int64_t keys = round_up(P.chunk, kPtrPad);
    grow(q, P.lanes ? P.D * P.rp : P.R * P.dp);
    grow(s, P.lanes ? keys * P.rp : P.R * P.sst);
    grow(acc, P.R * P.dp); grow(m, P.R); grow(l, P.R); grow(lane_m, P.rp); grow(lane_l, P.rp);
    grow(kp, keys); grow(vp, keys); grow(nvis, P.R);
    if (widen) { grow(kw, P.chunk * P.dp); grow(vw, P.chunk * P.dp); }
  }
};

Scratch& scratch() {
  static thread_local Scratch s;
  return s;
}

// dst[0..dp) = src[0..D) * scale widened to fp32, zero-padded. Explicit vectors: Inductor's
// flags turn the compiler's loop vectoriser off.
template <typename T>
inline void widen_row(const T* src, int64_t D, int64_t dp, float scale, float* dst) {
  const Vec vs(scale);
  int64_t d = 0;
  for (; d + kL <= D; d += kL) {
    Vec x;
    if constexpr (std::is_same<T, float>::value) x = Vec::loadu(src + d);
    else at::vec::load_to_float(src + d, x);
    (x * vs).store(dst + d);
  }
  for (; d < D; ++d) dst[d] = static_cast<float>(src[d]) * scale;
  for (; d < dp; ++d) dst[d] = 0.f;
}

// Asks for a K/V row into L2. Decode reads K/V from memory (a step's weights evict it between
// layers) in 256-byte pieces of scattered blocks; requesting a whole chunk up front keeps
// many more misses in flight than the hardware prefetchers do (about 10% in this regime).
template <typename T>
inline void prefetch_row(const T* row, int64_t D) {
  for (int64_t d = 0; d < D; d += 64 / sizeof(T))
    __builtin_prefetch(row + d, /*read*/ 0, /*locality: L2, like _MM_HINT_T1*/ 2);
}

// Row pointers of n pool rows (position p0 + c of row b, kv head g), widened to fp32 in buf
// when needed; pointers are padded to a multiple of kPtrPad with a valid row. Every row is
// prefetched first: rows read in place then arrive while the scores run, and rows to widen
// (bf16, fp16) arrive together instead of one miss after another (bf16 decode at live length
// 300, K/V from memory: 83 -> 76 us a call, interleaved medians).
template <typename T>
void gather(const Problem& P, const T* pool, const int32_t* bt_row, int64_t g, int64_t p0,
            int64_t n, float* buf, const float** ptr) {
  const bool direct = std::is_same<T, float>::value && P.dp == P.D;
  if (!direct) {
    for (int64_t c = 0; c < n; ++c) {
      const int64_t p = p0 + c;
      prefetch_row(pool + (static_cast<int64_t>(bt_row[p / P.bs]) * P.bs + p % P.bs) * P.stride + g * P.D, P.D);
    }
  }
  for (int64_t c = 0; c < n;) {  // block by block: p0 is a multiple of bs
    const int64_t p = p0 + c, in_block = std::min(P.bs - p % P.bs, n - c);
    const T* src = pool + (static_cast<int64_t>(bt_row[p / P.bs]) * P.bs + p % P.bs) * P.stride + g * P.D;
    for (int64_t i = 0; i < in_block; ++i, ++c, src += P.stride) {
      if (direct) {
        ptr[c] = reinterpret_cast<const float*>(src);
        prefetch_row(src, P.D);
        continue;
      }
      widen_row(src, P.D, P.dp, 1.f, buf + c * P.dp);
      ptr[c] = buf + c * P.dp;
    }
  }
  for (int64_t c = n; c < round_up(n, kPtrPad); ++c) ptr[c] = ptr[0];
}

// Tiled layout: per tile of kRows query rows, scores (up to the tile's longest visible row),
// softmax, p @ V. q rows are W.q [R][dp].
void chunk_tiled(const Problem& P, Scratch& W, float* m, float* l, float* acc) {
  for (int64_t r0 = 0; r0 < P.R; r0 += kRows) {
    const int64_t rt = std::min<int64_t>(kRows, P.R - r0);
    const int64_t nt = W.nvis[r0 + rt - 1];  // nvis grows with r: the tile's longest row
    float* s = W.s.data() + r0 * P.sst;
    float* a = acc + r0 * P.dp;
    if (nt == 0) {  // no row of the tile sees this chunk
      for (int64_t r = r0; r < r0 + rt; ++r) { m[r] = kNegInf; l[r] = 0.f; }
      std::fill(a, a + rt * P.dp, 0.f);
      continue;
    }
    scores_tiled(rt, W.q.data() + r0 * P.dp, P.dp, W.kp.data(), nt, P.nv, s, P.sst);
    for (int64_t i = 0; i < rt; ++i)
      l[r0 + i] = softmax_row(s + i * P.sst, W.nvis[r0 + i], round_up(nt, kPad), m + r0 + i);
    pv(rt, s, P.sst, 1, W.vp.data(), nt, P.nv, a, P.dp);
  }
}

// Lanes layout: all rows' scores at once into S^T, softmax per lane, then p @ V per tile of
// kRows rows. Q^T is W.q [D][rp]. Row vectors before the first row that sees the chunk (only
// with long T, as in chunked prefill) are skipped.
void chunk_lanes(const Problem& P, Scratch& W, int64_t n, float* m, float* l, float* acc) {
  int64_t r_first = 0;
  while (r_first < P.R && W.nvis[r_first] == 0) ++r_first;
  const int64_t u0 = r_first / kL, r0_lanes = u0 * kL;
  for (int64_t r = 0; r < r0_lanes; ++r) { m[r] = kNegInf; l[r] = 0.f; }
  std::fill(acc, acc + r0_lanes * P.dp, 0.f);
  if (r_first == P.R) {  // nobody sees this chunk
    for (int64_t r = r0_lanes; r < P.R; ++r) { m[r] = kNegInf; l[r] = 0.f; }
    std::fill(acc + r0_lanes * P.dp, acc + P.R * P.dp, 0.f);
    return;
  }
  float* st = W.s.data();
  scores_lanes(W.q.data(), P.rp, u0, W.kp.data(), n, P.D, st);
  softmax_lanes(st, P.rp, u0, n, W.nvis.data(), P.R, m, l, W.lane_m.data(), W.lane_l.data());
  for (int64_t r0 = r0_lanes; r0 < P.R; r0 += kRows) {
    const int64_t rt = std::min<int64_t>(kRows, P.R - r0);
    const int64_t nt = W.nvis[r0 + rt - 1];  // p = 0 past each row's own count
    float* a = acc + r0 * P.dp;
    if (nt == 0) std::fill(a, a + rt * P.dp, 0.f);
    else pv(rt, st + r0, 1, P.rp, W.vp.data(), nt, P.nv, a, P.dp);
  }
}

// Work item: chunk `c` of row b, kv head g. Leaves the chunk's m, l (per query row) and the
// unnormalised acc (R x dp) in m, l, acc.
template <typename T>
void run_chunk(const Problem& P, const T* q, const T* kc, const T* vc, const int32_t* bt,
               int64_t L, int64_t b, int64_t g, int64_t c, Scratch& W, float* m, float* l,
               float* acc) {
  const int64_t p0 = c * P.chunk, n = std::min(P.chunk, L - p0);
  float* qbuf = W.q.data();
  for (int64_t r = P.R; r < (P.lanes ? P.rp : 0); ++r)  // Q^T's padding lanes: score 0, unused
    for (int64_t d = 0; d < P.D; ++d) qbuf[d * P.rp + r] = 0.f;
  for (int64_t r = 0; r < P.R; ++r) {
    const int64_t t = r / P.G, h = g * P.G + r % P.G;
    const T* src = q + ((b * P.T + t) * P.H + h) * P.D;
    if (P.lanes) {  // Q^T [D][rp]
      for (int64_t d = 0; d < P.D; ++d) qbuf[d * P.rp + r] = static_cast<float>(src[d]) * P.scale;
    } else {
      widen_row(src, P.D, P.dp, P.scale, qbuf + r * P.dp);
    }
    const int64_t qpos = L - P.T + t;  // sees positions <= qpos
    W.nvis[r] = std::max<int64_t>(0, std::min(n, qpos - p0 + 1));
  }
  const int32_t* bt_row = bt + b * P.MB;
  gather(P, kc, bt_row, g, p0, n, W.kw.data(), W.kp.data());
  gather(P, vc, bt_row, g, p0, n, W.vw.data(), W.vp.data());
  if (P.lanes) chunk_lanes(P, W, n, m, l, acc);
  else chunk_tiled(P, W, m, l, acc);
}

// out rows of (b, kv head g) = acc / l, zeros where l == 0 (queries that see nothing).
void write_rows(const Problem& P, float* out, int64_t b, int64_t g, const float* l,
                const float* acc) {
  for (int64_t r = 0; r < P.R; ++r) {
    const int64_t t = r / P.G, h = g * P.G + r % P.G;
    float* dst = out + ((b * P.T + t) * P.H + h) * P.D;
    if (l[r] > 0.f) widen_row(acc + r * P.dp, P.D, P.D, 1.f / l[r], dst);
    else std::fill(dst, dst + P.D, 0.f);
  }
}

// Merges nc chunk partials (each m[R], l[R], acc[R][dp], `stride` floats apart) into l, acc:
// l = sum_c w_c l_c and acc = sum_c w_c acc_c with w_c = exp(m_c - max_c m_c).
void merge(const Problem& P, const float* part, int64_t nc, int64_t stride, float* l,
           float* acc) {
  for (int64_t r = 0; r < P.R; ++r) {
    float M = kNegInf;
    for (int64_t c = 0; c < nc; ++c) M = std::max(M, part[c * stride + r]);
    float* a = acc + r * P.dp;
    std::fill(a, a + P.dp, 0.f);
    l[r] = 0.f;
    for (int64_t c = 0; c < nc && M != kNegInf; ++c) {
      const float* pc = part + c * stride;
      if (pc[r] == kNegInf) continue;  // this chunk is invisible to row r
      const float w = std::exp(pc[r] - M);
      l[r] += w * pc[P.R + r];
      const float* src = pc + 2 * P.R + r * P.dp;
      const Vec wv(w);
      for (int64_t d = 0; d < P.dp; d += kL)
        at::vec::fmadd(wv, Vec::loadu(src + d), Vec::loadu(a + d)).store(a + d);
    }
  }
}

// Positions per chunk: about kItemsPerThread items per thread, in whole blocks (or `forced`
// rounded up to whole blocks, for tests).
int64_t chunk_size(const Problem& P, const int32_t* lens, int64_t nthreads, int64_t forced) {
  if (forced > 0) return round_up(forced, P.bs);
  int64_t work = 0;  // positions x kv heads
  for (int64_t b = 0; b < P.B; ++b) work += std::max<int32_t>(lens[b], 0) * P.Hkv;
  const int64_t hi = std::max(kMinChunk, std::min(kMaxChunk, kMaxScores / P.R));
  const int64_t want = std::min(hi, std::max(kMinChunk, work / (kItemsPerThread * nthreads)));
  return std::max<int64_t>(1, want / P.bs) * P.bs;
}

// A call's work: (row, chunk) pairs, each taken by Hkv items (item = pair * Hkv + kv head).
// Kept by the calling thread across calls (grows only).
struct Plan {
  std::vector<int32_t> pair_b, pair_c, first;  // pair -> row, chunk; row -> its first pair
  std::vector<float> partials;                 // split rows: item -> its chunk's m, l, acc
  bool second_pass = false;                    // some row is split or is padding
  int64_t pairs() const { return static_cast<int64_t>(pair_b.size()); }
};

void plan(const Problem& P, const int32_t* lens, int64_t slot, Plan& pl) {
  pl.pair_b.clear(); pl.pair_c.clear(); pl.first.assign(P.B, 0);
  pl.second_pass = false;
  for (int64_t b = 0; b < P.B; ++b) {
    pl.first[b] = static_cast<int32_t>(pl.pair_b.size());
    const int64_t nc = lens[b] > 0 ? (lens[b] + P.chunk - 1) / P.chunk : 0;
    for (int64_t c = 0; c < nc; ++c) { pl.pair_b.push_back(b); pl.pair_c.push_back(c); }
    pl.second_pass |= nc != 1;
  }
  const size_t need = pl.pairs() * P.Hkv * slot;
  if (pl.second_pass && pl.partials.size() < need) pl.partials.resize(need);
}

template <typename T>
void run(const T* q, float* out, const T* kc, const T* vc, const int32_t* bt, const int32_t* lens,
         Problem P, int64_t nthreads, int64_t forced_chunk) {
  P.G = P.H / P.Hkv;
  P.R = P.T * P.G;
  P.stride = P.Hkv * P.D;
  P.dp = round_up(P.D, kL);
  P.nv = P.dp / kL;
  const bool invariant = P.T <= kInvariantT;
  P.chunk = invariant && forced_chunk <= 0 ? round_up(kFixedChunk, P.bs)
                                           : chunk_size(P, lens, nthreads, forced_chunk);
  P.lanes = !invariant && 2 * P.R > kL;  // enough query rows to fill most of a vector's lanes
  P.rp = round_up(P.R, kL);
  P.sst = round_up(P.chunk, kPad);
  const bool widen = !std::is_same<T, float>::value || P.dp != P.D;
  const int64_t slot = P.R * (2 + P.dp);  // one item's m, l, acc

  static thread_local Plan plan_;
  plan(P, lens, slot, plan_);
  // Plain pointers for the team: inside the parallel region, plan_ would name each worker
  // thread's own (empty) copy.
  const int64_t nitems = plan_.pairs() * P.Hkv;
  const int32_t *pair_b = plan_.pair_b.data(), *pair_c = plan_.pair_c.data();
  const int32_t* first = plan_.first.data();
  float* part = plan_.partials.data();
  const bool second_pass = plan_.second_pass;

#pragma omp parallel num_threads(nthreads)
  {
    Scratch& W = scratch();
    W.fit(P, widen);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < nitems; ++item) {
      const int64_t pi = item / P.Hkv, g = item % P.Hkv, b = pair_b[pi], L = lens[b];
      if (L <= P.chunk) {  // the row's only chunk: normalise and write out directly
        run_chunk(P, q, kc, vc, bt, L, b, g, 0, W, W.m.data(), W.l.data(), W.acc.data());
        write_rows(P, out, b, g, W.l.data(), W.acc.data());
      } else {
        float* m = part + item * slot;
        run_chunk(P, q, kc, vc, bt, L, b, g, pair_c[pi], W, m, m + P.R, m + 2 * P.R);
      }
    }
    // (Implicit barrier: every chunk is done.) Merge the split rows, zero the padding rows;
    // every thread skips this alike when no row needs it.
    if (second_pass) {
#pragma omp for schedule(dynamic, 1)
      for (int64_t bg = 0; bg < P.B * P.Hkv; ++bg) {
        const int64_t b = bg / P.Hkv, g = bg % P.Hkv, L = lens[b];
        if (L > 0 && L <= P.chunk) continue;  // written above
        if (L <= 0) {
          std::fill(W.l.begin(), W.l.begin() + P.R, 0.f);  // padding row: zeros
        } else {  // kv head g's chunks are Hkv slots apart
          const int64_t nc = (L + P.chunk - 1) / P.chunk;
          merge(P, part + (first[b] * P.Hkv + g) * slot, nc, P.Hkv * slot, W.l.data(),
                W.acc.data());
        }
        write_rows(P, out, b, g, W.l.data(), W.acc.data());
      }
    }
  }
}
}  // namespace

ARGS_DECL

template <typename T>
void dispatch(const Args& a) {
  const Problem P{a.B, a.T, a.H, a.Hkv, a.D, a.MB, a.bs, static_cast<float>(a.scale)};
  const int64_t layer_off = a.layer * a.pool_rows * a.Hkv * a.D;  // elements
  run(static_cast<const T*>(a.q), a.out, static_cast<const T*>(a.k_cache) + layer_off,
      static_cast<const T*>(a.v_cache) + layer_off, a.bt, a.lens, P, a.nthreads, a.chunk);
}

extern "C" void npuspec_paged_attention(const Args* args) {
  const Args a = *args;
  if (a.dtype == 0) dispatch<float>(a);
  else if (a.dtype == 1) dispatch<c10::BFloat16>(a);
  else dispatch<c10::Half>(a);
}
""".replace("ARGS_DECL", ARGS_DECL).replace("INVARIANT_MAX_T", str(INVARIANT_MAX_T)).replace(
    "FIXED_CHUNK", str(FIXED_CHUNK))

_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# Positions per split-K chunk, rounded up to whole blocks; 0 (the default): FIXED_CHUNK for
# calls of at most INVARIANT_MAX_T tokens a row, sized per call for longer ones. Tests set it to
# force many chunks on short sequences (a forced size applies to every call).
FORCED_CHUNK = [0]


# `Args` of the C++ source, field by field: 6 pointers, 12 int64, the scale as a double.
_ARGS = struct.Struct("=18qd")
_local = threading.local()  # one argument block per thread: ctypes drops the GIL in the call


@functools.lru_cache(maxsize=None)
def _compiled():
    """The compiled entry point, or None (logged once) when no C++ toolchain works here."""
    lib = load_library(_SOURCE, "CPU paged-attention kernel", "falling back to the PyTorch reference",
                       {"npuspec_paged_attention": (None, [ctypes.c_void_p])})
    return None if lib is None else lib.npuspec_paged_attention


def available() -> bool:
    return _compiled() is not None


def _args_block():
    """(writable view, address) of this thread's argument block."""
    try:
        return _local.block
    except AttributeError:
        buf = ctypes.create_string_buffer(_ARGS.size)
        _local.block = (memoryview(buf).cast("B"), ctypes.addressof(buf), buf)
        return _local.block


def cpu_paged_attention(q, k_cache, v_cache, layer, block_table, seq_lens, block_size, scale):
    assert q.dtype == k_cache.dtype == v_cache.dtype and q.dtype in _DTYPES, (q.dtype, k_cache.dtype)
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "the KV pool must be contiguous"
    B, T, H, D = q.shape
    _, pool_rows, Hkv, _ = k_cache.shape
    qc = q.contiguous()
    bt = block_table.contiguous()
    lens = seq_lens.contiguous()
    out = torch.empty(B, T, H, D, dtype=torch.float32)
    view, addr, _ = _args_block()
    _ARGS.pack_into(view, 0, qc.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
                    bt.data_ptr(), lens.data_ptr(), _DTYPES[q.dtype], layer, pool_rows, B, T, H,
                    Hkv, D, bt.shape[1], block_size, max(1, torch.get_num_threads()),
                    FORCED_CHUNK[0], scale)
    _compiled()(addr)
    return out if q.dtype == torch.float32 else out.to(q.dtype)
