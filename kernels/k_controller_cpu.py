"""The online K controller's per-step work in C (npuspec/spec_decode/k_controller.py).

Inside the engine the controller's Python runs right after a model step has filled the caches
with its own data, and each numpy call or Python-level lookup then costs several µs (batch 64,
embedded model: `choose_after` 36-45 µs, `observe` 49-56 µs, `lengths_of` 10-11 µs; with only
the arithmetic in C, the argument handling and the decision in Python still took ~100 µs). So
each of the engine's two per-step calls is one C call, reached as a Python builtin
(`library().choose` / `.verified`, METH_FASTCALL: a ctypes call of these arguments cost
11-14 µs cold):

- `npuspec_kc_choose`: each row's drafted length (drafts >= 0), the per-position sums
  `sum_b c[b, i] * [i < L_b]`, and the decision of `KController._after`: the expected tokens
  and the step's cost at each K the drafts allow, the best rate (an unmeasured K first), the
  value of drafting, the refresh of a stale (rows, K) pair. Returns the K to verify.
- `npuspec_kc_verified`: `KController.observe`'s update in place (availability, optional;
  acceptance at the verified positions, the accepted counts read from the step's int32 result
  [rows, K+2]) and the step's records: the verify window and its lower median, the host's and
  the drafter's running averages, the prefill rate (StepCosts' record_* methods); on the
  observations where `KController._pool` is due, the pooled estimates moved toward the rows'
  means (its numpy calls cost ~70 µs cold every fourth step).
- `probe_match` (a builtin only): a probe's comparison (npuspec/engine/k_online.py,
  `OnlineK._resolve`): each request's leading drafts that its output went on to emit, read
  from the Requests' output lists; its Python loop cost ~125 µs cold at 64 requests, once
  every EXPLORE_EVERY steps.

The cost tables are StepCosts' arrays (npuspec/spec_decode/k_costs.py), read through `ctx`, an
int64 array of their addresses and sizes (k_costs.CTX_FIELDS, the order of `struct Ctx`; the
running averages' weights are in its `scalars`, so this source holds no tuning constant).
Every figure rounds as the Python reference does: the same operations in the same order, every product rounded before
its sum (`volatile`, so no FMA contraction), so the state, and every K chosen from it, is bit
for bit the reference's (tests/spec_decode/test_k_controller_native.py). The reference is the
Python path in KController and StepCosts; it runs when this library cannot be built.
"""
from __future__ import annotations

import ctypes
import functools
import types

from npuspec.kernels.cpp_build import load_pylibrary

SOURCE = r"""
#include <torch/csrc/inductor/cpp_prefix.h>
#include <Python.h>
#include <cstdint>

#if defined(__FAST_MATH__) || defined(__ASSOCIATIVE_MATH__) || defined(__RECIPROCAL_MATH__)
#error "the K controller must round like Python: build without -funsafe-math-optimizations"
#endif

namespace {

const int64_t MAX_KS = 64, MAX_WINDOW = 64;

// k_costs.CTX_FIELDS, in order; scalars: [prefill seconds per token, prefill pending (0/1),
// ALPHA_TIME, ALPHA_REQUEST]
struct Ctx {
  int64_t nk; const int64_t* ks; double* verify; double* book; double* book_per_req;
  double* draft_s; double* draft_values; int64_t* measured_at; double* window; int64_t* wn;
  int64_t* wpos; double* scalars; int64_t refresh_every; int64_t window_len; int64_t buckets;
  double alpha_time; double alpha_request;
};

Ctx ctx_of(const int64_t* x) {
  Ctx t;
  t.nk = x[0];
  t.ks = (const int64_t*)(intptr_t)x[1];
  t.verify = (double*)(intptr_t)x[2];
  t.book = (double*)(intptr_t)x[3];
  t.book_per_req = (double*)(intptr_t)x[4];
  t.draft_s = (double*)(intptr_t)x[5];
  t.draft_values = (double*)(intptr_t)x[6];
  t.measured_at = (int64_t*)(intptr_t)x[7];
  t.window = (double*)(intptr_t)x[8];
  t.wn = (int64_t*)(intptr_t)x[9];
  t.wpos = (int64_t*)(intptr_t)x[10];
  t.scalars = (double*)(intptr_t)x[11];
  t.refresh_every = x[12];
  t.window_len = x[13];
  t.buckets = x[14];
  t.alpha_time = t.scalars[2];
  t.alpha_request = t.scalars[3];
  return t;
}

// a running average; NaN: nothing yet, the value itself (k_costs._ema)
double ema(const Ctx& t, double old, double v) {
  if (old != old) return v;
  volatile double d = v - old;
  volatile double s = t.alpha_time * d;
  return old + s;
}

double or_zero(double x) { return x != x ? 0.0 : x; }

int64_t k_index(const Ctx& t, int64_t k) {
  for (int64_t i = 0; i < t.nk; ++i)
    if (t.ks[i] == k) return i;
  return -1;
}

int64_t bucket(const Ctx& t, int64_t batch) {  // k_costs.bucket: bit length of max(batch, 1)
  uint64_t b = batch < 1 ? 1 : (uint64_t)batch;
  int64_t n = 0;
  while (b) { ++n; b >>= 1; }
  return n < t.buckets ? n : t.buckets - 1;
}

// StepCosts.draft_per_request: the bucket's figure, else the K's latest (bucket 0), else 0
double draft_per_request(const Ctx& t, int64_t ki, int64_t batch) {
  double v = t.draft_s[bucket(t, batch) * t.nk + ki];
  if (v != v) v = t.draft_s[ki];
  return or_zero(v);
}

// An integer array's layout from its buffer (numpy's, read through the Python buffer protocol:
// in the engine, after a model step, reading a fresh array's address from Python cost ~17 µs).
// False, nothing read: not a signed integer array of this item size and rank, or its last dim
// is strided.
struct View { const char* buf; int64_t rows, cols, ld; };  // ld: the row stride, in items

bool int_format(const char* f, int64_t itemsize) {
  if (f == nullptr) return false;
  if (*f == '@' || *f == '=' || *f == '<') ++f;  // native order (a little-endian host)
  if (f[0] == 0 || f[1] != 0) return false;
  switch (f[0]) {
    case 'i': return itemsize == (int64_t)sizeof(int);
    case 'l': return itemsize == (int64_t)sizeof(long);
    case 'q': return itemsize == (int64_t)sizeof(long long);
    default: return false;
  }
}

bool int_view(PyObject* o, int64_t itemsize, int ndim, View* out, bool writable = false) {
  Py_buffer v;
  if (PyObject_GetBuffer(o, &v, writable ? PyBUF_RECORDS : PyBUF_RECORDS_RO) != 0) {
    PyErr_Clear();
    return false;
  }
  bool ok = v.ndim == ndim && v.itemsize == itemsize && int_format(v.format, itemsize);
  if (ok) {
    out->buf = (const char*)v.buf;
    out->rows = v.shape[0];
    out->cols = ndim == 2 ? v.shape[1] : 1;
    const int64_t last = v.strides[ndim - 1];
    out->ld = ndim == 2 ? v.strides[0] / itemsize : 1;
    ok = ndim == 1 ? out->rows <= 1 || last == itemsize  // read as contiguous
                   : (out->cols <= 1 || last == itemsize) && v.strides[0] >= 0
                         && v.strides[0] % itemsize == 0;
  }
  PyBuffer_Release(&v);  // the caller holds the array, whose data does not move
  return ok;
}

// StepCosts.cost(batch, ., draft=False) at the K of index ki, flat pair index i
double cost_at(const Ctx& t, int64_t ki, int64_t i, double B, double per_k) {
  double book = t.book[i];
  if (book != book) {
    volatile double x = B * or_zero(t.book_per_req[ki]);
    book = x;
  }
  volatile double s = t.verify[i] + book;
  volatile double s2 = s + 0.0;  // the drafter's share, nothing once drafted
  volatile double kp = (double)t.ks[ki] * per_k;
  return s2 + kp;
}

// StepCosts.value_of_drafting
void value_of_drafting(const Ctx& t, int64_t B, const double* gain, const double* cost,
                       int64_t best) {
  if (cost[0] != cost[0] || cost[best] != cost[best]) return;
  const double Bd = (double)B;
  volatile double drafter = Bd * draft_per_request(t, t.nk - 1, B);
  volatile double den = cost[best] + drafter;
  volatile double rate = gain[best] / den;
  volatile double base = Bd / cost[0];
  volatile double ratio = rate / base;
  const int64_t b = bucket(t, B);
  double old = t.draft_values[b];
  if (old != old) old = 1.0;
  volatile double d = ratio - old;
  volatile double s = t.alpha_time * d;
  t.draft_values[b] = old + s;
}

void record_verify(const Ctx& t, int64_t i, double seconds, int64_t step) {
  const int64_t W = t.window_len;
  double* w = t.window + i * W;
  const int64_t pos = t.wpos[i];
  w[pos] = seconds;
  t.wpos[i] = (pos + 1) % W;
  int64_t n = t.wn[i] + 1;
  if (n > W) n = W;
  t.wn[i] = n;
  double s[MAX_WINDOW];
  for (int64_t j = 0; j < n; ++j) {  // insertion sort: sorted(window)
    double x = w[j];
    int64_t m = j;
    while (m > 0 && s[m - 1] > x) { s[m] = s[m - 1]; --m; }
    s[m] = x;
  }
  t.verify[i] = s[(n - 1) / 2];
  t.measured_at[i] = step;
}

// request b's row of a [slots, km] table: row slots[b] (slots null: row b)
inline int64_t row_of(const int64_t* slots, int64_t b, int64_t km) {
  return (slots != nullptr ? slots[b] : b) * km;
}

// drafts [B, kd] (row stride ld) -> lengths [B]; per_pos[j] = sum over b, in order, of
// c[b's row, j] * (j < lengths[b] ? 1 : 0) for j < km; returns max(lengths) (0 for B = 0)
int64_t lengths_and_sums(const int64_t* drafts, int64_t B, int64_t kd, int64_t ld,
                         const double* c, const int64_t* slots, int64_t km, int64_t* lengths,
                         double* per_pos) {
  int64_t longest = 0;
  for (int64_t j = 0; j < km; ++j) per_pos[j] = 0.0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t* d = drafts + b * ld;
    int64_t n = 0;
    for (int64_t j = 0; j < kd; ++j) n += d[j] >= 0;
    lengths[b] = n;
    if (n > longest) longest = n;
    const double* row = c + row_of(slots, b, km);
    for (int64_t j = 0; j < km; ++j) {
      volatile double x = row[j] * (j < n ? 1.0 : 0.0);
      per_pos[j] = per_pos[j] + x;
    }
  }
  return longest;
}

}  // namespace

extern "C" {

// KController.choose_after_drafts + _after (no prior, k_draft > 0): -> the K to verify, or -2,
// nothing changed, where the drafts are not an int64 [B, kd] array with contiguous rows;
// *last_cap <- the smallest K holding the longest draft. idx [nk]: the flat (rows, K) index of
// this batch size at each K; step: the controller's step count, this step counted. c: the
// acceptance table [slots, km], read at the batch's rows slots [B] (null: its rows 0..B-1).
int64_t npuspec_kc_choose(const int64_t* ctx, PyObject* drafts_obj, int64_t B, const double* c,
                          const int64_t* slots, int64_t* lengths, double* per_pos,
                          const int64_t* idx,
                          int64_t k_draft, int64_t explore, int64_t step, int64_t* last_cap) {
  const Ctx t = ctx_of(ctx);
  const int64_t k_max = t.ks[t.nk - 1], km = k_max > 1 ? k_max : 1;
  View d;
  if (!int_view(drafts_obj, 8, 2, &d) || d.rows != B) return -2;
  const int64_t* drafts = (const int64_t*)d.buf;
  int64_t longest = lengths_and_sums(drafts, B, d.cols, d.ld, c, slots, km, lengths, per_pos);
  if (longest > k_draft) longest = k_draft;
  int64_t n = 0;  // bisect_left(ks, longest) + 1
  while (n < t.nk && t.ks[n] < longest) ++n;
  n += 1;
  // not reached (longest <= k_draft <= K_max; StepCosts checks the sizes)
  if (n > t.nk || t.nk > MAX_KS || t.window_len > MAX_WINDOW) return -1;
  *last_cap = t.ks[n - 1];
  const double Bd = (double)B;
  const double displaced = t.scalars[1] != 0.0 ? t.scalars[0] : 0.0;
  double per_k = 0.0;
  if (displaced == displaced) { volatile double x = Bd * displaced; per_k = x; }
  double gain[MAX_KS], cost[MAX_KS];
  if (n == 1) {  // no drafts: K = 0, and the drafting that found none is weighed
    if (k_draft == k_max) {
      gain[0] = Bd;
      cost[0] = cost_at(t, 0, idx[0], Bd, per_k);
      value_of_drafting(t, B, gain, cost, 0);
    }
    return 0;
  }
  double cum[MAX_KS + 1];
  cum[0] = 0.0;
  for (int64_t j = 1; j <= km; ++j) cum[j] = j == 1 ? per_pos[0] : cum[j - 1] + per_pos[j - 1];
  int64_t best = -1;
  for (int64_t i = 0; i < n; ++i) {
    gain[i] = Bd + cum[t.ks[i]];
    cost[i] = cost_at(t, i, idx[i], Bd, per_k);
    if (cost[i] != cost[i]) best = i;  // the largest unmeasured K is tried first
  }
  if (best < 0) {
    best = 0;
    double top = gain[0] / cost[0];
    for (int64_t i = 1; i < n; ++i) {
      const double r = gain[i] / cost[i];
      if (r > top) { top = r; best = i; }
    }
  }
  if (k_draft == k_max) value_of_drafting(t, B, gain, cost, best);
  if (explore) return t.ks[n - 1];
  for (int64_t i = n - 1; i > 0; --i) {  // StepCosts.stale
    const int64_t ix = idx[i], at = t.measured_at[ix];
    if (i != best && at >= 0 && step - at >= t.refresh_every) {
      t.wn[ix] = 0;
      t.wpos[ix] = 0;
      t.measured_at[ix] = step;
      best = i;
      break;
    }
  }
  return t.ks[best];
}

// pool <- pool + alpha * (rows.mean(0) - pool) over the batch's rows of a table, as numpy
// rounds it: the column sums row by row (an axis-0 reduction of the gathered C-contiguous
// [B, km] array), then one division by B
static void pool_toward(const double* table, const int64_t* slots, double* pool, int64_t B,
                        int64_t km, double alpha) {
  for (int64_t j = 0; j < km; ++j) {
    volatile double s = 0.0;
    for (int64_t b = 0; b < B; ++b) s = s + table[row_of(slots, b, km) + j];
    volatile double mean = s / (double)B;
    volatile double d = mean - pool[j];
    volatile double x = alpha * d;
    pool[j] = pool[j] + x;
  }
}

// After the verify step. observe: KController.observe on p (nullable) and c in place, tables
// [slots, km] at the batch's rows slots [B] (null: rows 0..B-1),
// with L the drafted lengths, v = min(L, k) the verified positions and a = min(res[b, k+1] - 1,
// v) the accepted ones:
//   p <- p + w * ([j < L] - p),   w = alpha at j < k_draft, else 0
//   c <- c * (j < v ? 1 - alpha : 1) + (j < a ? alpha : 0)
// then the records whose time is not NaN; ix: the flat index of the step's (rows, K). L: int64
// [>= B]; res: int32 [>= B, >= K+2] (rows may be strided). -> 0, or -2, nothing changed, where
// either is laid out otherwise.
int64_t npuspec_kc_verified(const int64_t* ctx, double* p, double* c, const int64_t* slots,
                            int64_t B,
                            PyObject* L_obj, int64_t k_draft, int64_t k, PyObject* res_obj,
                            int64_t observe, int64_t ix, double t_draft, double t_run,
                            double book_s, double prefill_tok_s, int64_t step,
                            double* pool_p, double* pool_c, double pool_alpha) {
  const Ctx t = ctx_of(ctx);
  const int64_t k_max = t.ks[t.nk - 1], km = k_max > 1 ? k_max : 1;
  const int64_t* L = nullptr;
  const int32_t* res = nullptr;
  int64_t res_ld = 0;
  if (observe) {
    View lv, rv;
    if (!int_view(L_obj, 8, 1, &lv) || lv.rows < B || !int_view(res_obj, 4, 2, &rv)
        || rv.rows < B || rv.cols < k + 2)
      return -2;
    L = (const int64_t*)lv.buf;
    res = (const int32_t*)rv.buf;
    res_ld = rv.ld;
  }
  if (observe) {
    const double alpha = t.alpha_request, keep = 1.0 - alpha;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t l = L[b];
      if (p != nullptr) {
        double* pr = p + row_of(slots, b, km);
        for (int64_t j = 0; j < km; ++j) {
          volatile double d = (j < l ? 1.0 : 0.0) - pr[j];
          volatile double x = (j < k_draft ? alpha : 0.0) * d;
          pr[j] = pr[j] + x;
        }
      }
      const int64_t v = l < k ? l : k;
      int64_t a = (int64_t)res[b * res_ld + k + 1] - 1;
      if (a > v) a = v;
      double* cr = c + row_of(slots, b, km);
      for (int64_t j = 0; j < km; ++j) {
        volatile double x = cr[j] * (j < v ? keep : 1.0);
        cr[j] = x + (j < a ? alpha : 0.0);
      }
    }
    if (pool_alpha != 0.0) {  // KController._pool, on its POOL_EVERY-th observation
      if (p != nullptr && pool_p != nullptr) pool_toward(p, slots, pool_p, B, km, pool_alpha);
      pool_toward(c, slots, pool_c, B, km, pool_alpha);
    }
  }
  const double per = (double)(B > 1 ? B : 1);
  if (prefill_tok_s == prefill_tok_s) t.scalars[0] = ema(t, t.scalars[0], prefill_tok_s);
  if (t_draft == t_draft) {
    const int64_t i = k_index(t, k_draft);
    if (i >= 0) {
      double* d = t.draft_s + bucket(t, B) * t.nk + i;
      *d = ema(t, *d, t_draft / per);
      t.draft_s[i] = *d;  // bucket 0: the K's latest figure
    }
  }
  if (t_run == t_run && ix >= 0) {
    record_verify(t, ix, t_run, step);
    t.book[ix] = ema(t, t.book[ix], book_s);
    const int64_t i = k_index(t, k);
    if (i >= 0) t.book_per_req[i] = ema(t, t.book_per_req[i], book_s / per);
  }
  return 0;
}

}  // extern "C"

namespace {

// The two entries as Python builtins (METH_FASTCALL): a ctypes call converts each argument
// through its type's from_param and prepares a libffi call every time (~11 µs for these in
// the engine, cold); a builtin reads its arguments from the interpreter's own array.
// v[i] <- a[i] as an int (None: 0) for every i not in `skip` (a bit mask)
bool int_args(PyObject* const* a, Py_ssize_t n, int64_t* v, uint32_t skip) {
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (skip >> i & 1u) continue;
    v[i] = a[i] == Py_None ? 0 : PyLong_AsLongLong(a[i]);
    if (v[i] == -1 && PyErr_Occurred()) return false;
  }
  return true;
}

PyObject* py_choose(PyObject*, PyObject* const* a, Py_ssize_t n) {
  if (n != 12) {
    PyErr_SetString(PyExc_TypeError, "choose takes 12 arguments (KController)");
    return nullptr;
  }
  int64_t v[12];
  if (!int_args(a, n, v, 1u << 1)) return nullptr;
  return PyLong_FromLongLong(npuspec_kc_choose(
      (const int64_t*)v[0], a[1], v[2], (const double*)v[3], (const int64_t*)v[4],
      (int64_t*)v[5], (double*)v[6], (const int64_t*)v[7], v[8], v[9], v[10],
      (int64_t*)v[11]));
}

PyObject* py_verified(PyObject*, PyObject* const* a, Py_ssize_t n) {
  if (n != 19) {
    PyErr_SetString(PyExc_TypeError, "verified takes 19 arguments (KController)");
    return nullptr;
  }
  int64_t v[19];
  double f[5];
  for (int i = 0; i < 5; ++i) {
    f[i] = PyFloat_AsDouble(a[i < 4 ? 11 + i : 18]);
    if (f[i] == -1.0 && PyErr_Occurred()) return nullptr;
  }
  // arrays, floats
  if (!int_args(a, n, v, 1u << 5 | 1u << 8 | 0xFu << 11 | 1u << 18)) return nullptr;
  return PyLong_FromLongLong(npuspec_kc_verified(
      (const int64_t*)v[0], (double*)v[1], (double*)v[2], (const int64_t*)v[3], v[4], a[5],
      v[6], v[7], a[8], v[9], v[10], f[0], f[1], f[2], f[3], v[15], (double*)v[16],
      (double*)v[17], f[4]));
}

// OnlineK._resolve's comparison: (reqs, starts, drafts [B, K] int64, lengths [B] int64, res
// [B, K+2] int32, known [B] int64) -> B. For each request b: res[b, K+1] <- 1 + the leading
// drafts[b] equal to reqs[b].output[starts[b]:], known[b] <- min(lengths[b], how many of those
// K tokens exist). -2: arguments laid out otherwise, found before anything is written (an
// output that is not a list, mid-way); the caller then runs its Python loop over every row.
PyObject* py_probe_match(PyObject*, PyObject* const* a, Py_ssize_t n) {
  if (n != 6) {
    PyErr_SetString(PyExc_TypeError, "probe_match takes 6 arguments (OnlineK._resolve)");
    return nullptr;
  }
  static PyObject* output_name = PyUnicode_InternFromString("output");
  PyObject *reqs = a[0], *starts = a[1];
  View d, len, r, kn;
  if (!PyList_Check(reqs) || !PyList_Check(starts) || !int_view(a[2], 8, 2, &d)
      || !int_view(a[3], 8, 1, &len) || !int_view(a[4], 4, 2, &r, true)
      || !int_view(a[5], 8, 1, &kn, true))
    return PyLong_FromLong(-2);
  const Py_ssize_t B = PyList_GET_SIZE(reqs);
  const int64_t K = d.cols;
  if (PyList_GET_SIZE(starts) != B || d.rows != B || len.rows != B || r.rows != B
      || r.cols != K + 2 || kn.rows != B)
    return PyLong_FromLong(-2);
  const int64_t* lengths = (const int64_t*)len.buf;
  int32_t* res = (int32_t*)r.buf;
  int64_t* known = (int64_t*)kn.buf;
  for (Py_ssize_t b = 0; b < B; ++b) {
    const int64_t start = PyLong_AsLongLong(PyList_GET_ITEM(starts, b));
    if (start == -1 && PyErr_Occurred()) return nullptr;
    PyObject* out = PyObject_GetAttr(PyList_GET_ITEM(reqs, b), output_name);
    if (out == nullptr) return nullptr;
    if (!PyList_Check(out)) {
      Py_DECREF(out);
      return PyLong_FromLong(-2);
    }
    int64_t have = (int64_t)PyList_GET_SIZE(out) - start;
    have = have < 0 ? 0 : (have > K ? K : have);
    const int64_t* dr = (const int64_t*)d.buf + b * d.ld;
    int64_t m = 0;
    for (; m < have; ++m) {  // a -1 draft matches no token
      const long long tok = PyLong_AsLongLong(PyList_GET_ITEM(out, start + m));
      if (tok == -1 && PyErr_Occurred()) {
        Py_DECREF(out);
        return nullptr;
      }
      if (tok != dr[m]) break;
    }
    Py_DECREF(out);
    res[b * r.ld + K + 1] = (int32_t)(m + 1);
    known[b] = lengths[b] < have ? lengths[b] : have;
  }
  return PyLong_FromSsize_t(B);
}

PyMethodDef METHODS[] = {
    {"choose", (PyCFunction)(void (*)(void))py_choose, METH_FASTCALL, "npuspec_kc_choose"},
    {"verified", (PyCFunction)(void (*)(void))py_verified, METH_FASTCALL,
     "npuspec_kc_verified"},
    {"probe_match", (PyCFunction)(void (*)(void))py_probe_match, METH_FASTCALL,
     "OnlineK._resolve's comparison"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

// -> (choose, verified, probe_match) as builtins; called once, through ctypes
extern "C" PyObject* npuspec_kc_functions() {
  return Py_BuildValue("(NNN)", PyCFunction_New(&METHODS[0], nullptr),
                       PyCFunction_New(&METHODS[1], nullptr),
                       PyCFunction_New(&METHODS[2], nullptr));
}
"""

SIGNATURES = {"npuspec_kc_functions": (ctypes.py_object, [])}  # -> the three builtins


@functools.lru_cache(maxsize=None)
def library():
    """The compiled step as `.choose(...)` and `.verified(...)`, Python builtins with the C
    entries' arguments (addresses as ints; arrays as themselves; None for a null pointer),
    or None (logged once) when it cannot be built."""
    lib = load_pylibrary(SOURCE, "compiled K controller step",
                         "the K controller runs its Python reference (same choices, more host "
                         "time)",
                         SIGNATURES)
    if lib is None:
        return None
    choose, verified, probe_match = lib.npuspec_kc_functions()
    return types.SimpleNamespace(choose=choose, verified=verified, probe_match=probe_match,
                                 dll=lib)


def available() -> bool:
    return library() is not None
