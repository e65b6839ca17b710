"""The n-gram proposer's index and drafting in C++ (npuspec/spec_decode/ngram.py drives it;
the Python reference, npuspec/spec_decode/ngram_reference.py, says what it computes).

Why: the engine drafts and extends the index every step, right after a model step has filled
the caches, where each Python-level operation costs several µs. On the embedded model at 16
requests the reference's drafting took ~42 µs a step and its upkeep ~11 µs (at 64 requests
81 and 49 µs): a few percent of a step that the K = 0 choice pays too.

Per request: its tokens, and for each n in [nmin, nmax] a hash set of end positions, one per
distinct n-gram that has a follower: the end of its earliest occurrence. The set hashes and
compares the n tokens ending at a position, so the query (the context's last n tokens, ending
at T - 1, never inserted since it has no follower) is a position too and no n-gram is copied.
Inserting keeps the first end of equal n-grams, as the reference's `setdefault` does.

Entries are Python builtins (METH_FASTCALL) that read the engine's own lists: the request-id
-> slot dict, the Requests' `req_id`, the new tokens and the caps, so a step is one call each
for the upkeep and the drafts, with no per-request Python.
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
#include <memory>
#include <unordered_set>
#include <vector>

namespace {

struct Req;
struct GramHash { const Req* r; int64_t n; size_t operator()(int64_t end) const; };
struct GramEq { const Req* r; int64_t n; bool operator()(int64_t a, int64_t b) const; };
using GramSet = std::unordered_set<int64_t, GramHash, GramEq>;

struct Req {  // heap-allocated and never moved: its sets' functors point at it
  std::vector<int64_t> toks;
  std::vector<GramSet> sets;  // [n - nmin]: ends of each distinct n-gram's first occurrence
};

size_t GramHash::operator()(int64_t end) const {
  const int64_t* t = r->toks.data() + (end - n + 1);
  uint64_t h = 0x9E3779B97F4A7C15ull ^ (uint64_t)n;
  for (int64_t i = 0; i < n; ++i) {
    h ^= (uint64_t)t[i] + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
  }
  return (size_t)h;
}

bool GramEq::operator()(int64_t a, int64_t b) const {
  const int64_t* t = r->toks.data();
  for (int64_t i = 0; i < n; ++i)
    if (t[a - i] != t[b - i]) return false;
  return true;
}

struct Index {
  int64_t nmin, nmax;
  std::vector<std::unique_ptr<Req>> reqs;  // by slot; null: free
  std::vector<int64_t> free_slots;
};

Index* index_of(PyObject* h) { return (Index*)PyLong_AsVoidPtr(h); }

Req* req_at(Index* x, PyObject* slot_obj) {
  const int64_t s = PyLong_AsLongLong(slot_obj);
  if (s == -1 && PyErr_Occurred()) return nullptr;
  if (s < 0 || s >= (int64_t)x->reqs.size() || !x->reqs[s]) {
    PyErr_Format(PyExc_IndexError, "ngram index: no request at slot %lld", (long long)s);
    return nullptr;
  }
  return x->reqs[s].get();
}

// the reference's `extend` of one token: the n-grams ending just before it have a follower
void add_token(const Index& x, Req& r, int64_t t) {
  const int64_t i = (int64_t)r.toks.size();
  r.toks.push_back(t);
  const int64_t top = x.nmax < i ? x.nmax : i;
  for (int64_t n = x.nmin; n <= top; ++n) r.sets[n - x.nmin].insert(i - 1);
}

// the reference's `_propose_one`: the longest n whose suffix n-gram occurred before; K tokens
// after its first occurrence, continuing periodically into the draft (LZ77). -> drafted count
int64_t propose_into(const Index& x, const Req& r, int64_t k, int64_t* out) {
  const int64_t T = (int64_t)r.toks.size();
  if (k <= 0) return 0;
  for (int64_t n = x.nmax; n >= x.nmin; --n) {
    if (n >= T) continue;
    const GramSet& s = r.sets[n - x.nmin];
    auto it = s.find(T - 1);
    if (it == s.end()) continue;
    const int64_t start = *it + 1, period = T - start;  // >= 1
    for (int64_t j = 0; j < k; ++j) out[j] = r.toks[start + j % period];
    return k;
  }
  return 0;
}

// tokens of a list or tuple of ints, appended to `out`; false (a Python error set) otherwise
bool read_tokens(PyObject* seq, std::vector<int64_t>* out) {
  if (!PyList_Check(seq) && !PyTuple_Check(seq)) return false;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  PyObject** items = PySequence_Fast_ITEMS(seq);
  for (Py_ssize_t i = 0; i < n; ++i) {
    const long long t = PyLong_AsLongLong(items[i]);
    if (t == -1 && PyErr_Occurred()) return false;
    out->push_back(t);
  }
  return true;
}

bool nargs(Py_ssize_t n, Py_ssize_t want, const char* name) {
  if (n == want) return true;
  PyErr_Format(PyExc_TypeError, "ngram index: %s takes %zd arguments", name, want);
  return false;
}

// new(nmin, nmax) -> handle
PyObject* py_new(PyObject*, PyObject* const* a, Py_ssize_t n) {
  if (!nargs(n, 2, "new")) return nullptr;
  const long long lo = PyLong_AsLongLong(a[0]), hi = PyLong_AsLongLong(a[1]);
  if (PyErr_Occurred()) return nullptr;
  Index* x = new Index();
  x->nmin = lo;
  x->nmax = hi;
  return PyLong_FromVoidPtr(x);
}

PyObject* py_free(PyObject*, PyObject* const* a, Py_ssize_t n) {
  if (!nargs(n, 1, "free")) return nullptr;
  delete index_of(a[0]);
  Py_RETURN_NONE;
}

// start(h, tokens: list | tuple) -> slot; None for tokens of another type (nothing done)
PyObject* py_start(PyObject*, PyObject* const* a, Py_ssize_t n) {
  if (!nargs(n, 2, "start")) return nullptr;
  Index* x = index_of(a[0]);
  std::vector<int64_t> toks;
  if (!read_tokens(a[1], &toks)) {
    if (PyErr_Occurred()) return nullptr;
    Py_RETURN_NONE;
  }
  auto r = std::make_unique<Req>();
  r->toks.reserve(toks.size() + 256);
  for (int64_t m = x->nmin; m <= x->nmax; ++m)
    r->sets.emplace_back(toks.size() + 256, GramHash{r.get(), m}, GramEq{r.get(), m});
  for (int64_t t : toks) add_token(*x, *r, t);
  int64_t s;
  if (!x->free_slots.empty()) {
    s = x->free_slots.back();
    x->free_slots.pop_back();
    x->reqs[s] = std::move(r);
  } else {
    s = (int64_t)x->reqs.size();
    x->reqs.push_back(std::move(r));
  }
  return PyLong_FromLongLong(s);
}

PyObject* py_stop(PyObject*, PyObject* const* a, Py_ssize_t n) {
  if (!nargs(n, 2, "stop")) return nullptr;
  Index* x = index_of(a[0]);
  if (req_at(x, a[1]) == nullptr) return nullptr;
  const int64_t s = PyLong_AsLongLong(a[1]);
  x->reqs[s].reset();
  x->free_slots.push_back(s);
  Py_RETURN_NONE;
}

// extend(h, slots: dict, req_ids: list, tokens: list) -> -1 done; b >= 0: req_ids[b] has no
// slot; -2 - b: tokens[b] is not a list or tuple. Nothing is changed unless it returns -1.
PyObject* py_extend(PyObject*, PyObject* const* a, Py_ssize_t n) {
  if (!nargs(n, 4, "extend")) return nullptr;
  Index* x = index_of(a[0]);
  PyObject *slots = a[1], *ids = a[2], *tokens = a[3];
  if (!PyDict_Check(slots) || !PyList_Check(ids) || !PyList_Check(tokens)
      || PyList_GET_SIZE(ids) != PyList_GET_SIZE(tokens)) {
    PyErr_SetString(PyExc_TypeError, "ngram index: extend takes a dict and two equal lists");
    return nullptr;
  }
  const Py_ssize_t B = PyList_GET_SIZE(ids);
  std::vector<Req*> reqs(B);
  std::vector<int64_t> flat;
  std::vector<Py_ssize_t> ends(B);
  for (Py_ssize_t b = 0; b < B; ++b) {  // read everything first: an error changes nothing
    PyObject* s = PyDict_GetItemWithError(slots, PyList_GET_ITEM(ids, b));
    if (s == nullptr) {
      if (PyErr_Occurred()) return nullptr;
      return PyLong_FromSsize_t(b);
    }
    if ((reqs[b] = req_at(x, s)) == nullptr) return nullptr;
    if (!read_tokens(PyList_GET_ITEM(tokens, b), &flat)) {
      if (PyErr_Occurred()) return nullptr;
      return PyLong_FromSsize_t(-2 - b);
    }
    ends[b] = (Py_ssize_t)flat.size();
  }
  Py_ssize_t i = 0;
  for (Py_ssize_t b = 0; b < B; ++b)
    for (; i < ends[b]; ++i) add_token(*x, *reqs[b], flat[i]);
  return PyLong_FromLong(-1);
}

// draft(h, slots: dict, reqs: list of objects with .req_id, caps: list of ints, k, out) ->
// -1 done, out [B, k] int64 (C order) holding each request's drafts, -1 padded; b >= 0:
// reqs[b].req_id has no slot (out partly written).
PyObject* py_draft(PyObject*, PyObject* const* a, Py_ssize_t n) {
  if (!nargs(n, 6, "draft")) return nullptr;
  static PyObject* req_id_name = PyUnicode_InternFromString("req_id");
  Index* x = index_of(a[0]);
  PyObject *slots = a[1], *reqs = a[2], *caps = a[3];
  const long long k = PyLong_AsLongLong(a[4]);
  if (k == -1 && PyErr_Occurred()) return nullptr;
  if (!PyDict_Check(slots) || !PyList_Check(reqs) || !PyList_Check(caps)
      || PyList_GET_SIZE(reqs) != PyList_GET_SIZE(caps)) {
    PyErr_SetString(PyExc_TypeError, "ngram index: draft takes a dict and two equal lists");
    return nullptr;
  }
  const Py_ssize_t B = PyList_GET_SIZE(reqs);
  Py_buffer v;
  if (PyObject_GetBuffer(a[5], &v, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT) != 0)
    return nullptr;
  const bool ok = v.itemsize == 8 && v.len == (Py_ssize_t)(8 * B * k) && v.format != nullptr
                  && (v.format[0] == 'l' || v.format[0] == 'q') && v.format[1] == 0;
  int64_t* out = (int64_t*)v.buf;
  PyBuffer_Release(&v);  // the caller holds the array
  if (!ok) {
    PyErr_SetString(PyExc_TypeError, "ngram index: draft writes a C-order int64 [B, k] array");
    return nullptr;
  }
  for (Py_ssize_t b = 0; b < B; ++b) {
    PyObject* rid = PyObject_GetAttr(PyList_GET_ITEM(reqs, b), req_id_name);
    if (rid == nullptr) return nullptr;
    PyObject* s = PyDict_GetItemWithError(slots, rid);
    Py_DECREF(rid);  // the dict holds its key
    if (s == nullptr) {
      if (PyErr_Occurred()) return nullptr;
      return PyLong_FromSsize_t(b);
    }
    Req* r = req_at(x, s);
    if (r == nullptr) return nullptr;
    PyObject* c = PyList_GET_ITEM(caps, b);
    const long long cap = PyLong_Check(c) && !PyBool_Check(c) ? PyLong_AsLongLong(c) : -1;
    if (cap < 0 || cap > k) {
      if (!PyErr_Occurred())
        PyErr_Format(PyExc_ValueError, "propose: max_tokens entry %R must be an int in "
                     "[0, %lld] (0 means: draft nothing for this request)", c, k);
      return nullptr;
    }
    int64_t* row = out + b * k;
    const int64_t m = propose_into(*x, *r, cap, row);
    for (int64_t j = m; j < k; ++j) row[j] = -1;
  }
  return PyLong_FromLong(-1);
}

// propose(h, slot, k) -> list of drafted tokens
PyObject* py_propose(PyObject*, PyObject* const* a, Py_ssize_t n) {
  if (!nargs(n, 3, "propose")) return nullptr;
  Index* x = index_of(a[0]);
  Req* r = req_at(x, a[1]);
  if (r == nullptr) return nullptr;
  const long long k = PyLong_AsLongLong(a[2]);
  if (k == -1 && PyErr_Occurred()) return nullptr;
  std::vector<int64_t> buf(k > 0 ? k : 0);
  const int64_t m = propose_into(*x, *r, k, buf.data());
  PyObject* out = PyList_New(m);
  if (out == nullptr) return nullptr;
  for (int64_t j = 0; j < m; ++j) PyList_SET_ITEM(out, j, PyLong_FromLongLong(buf[j]));
  return out;
}

// context(h, slot) -> the request's tokens
PyObject* py_context(PyObject*, PyObject* const* a, Py_ssize_t n) {
  if (!nargs(n, 2, "context")) return nullptr;
  Req* r = req_at(index_of(a[0]), a[1]);
  if (r == nullptr) return nullptr;
  PyObject* out = PyList_New((Py_ssize_t)r->toks.size());
  if (out == nullptr) return nullptr;
  for (size_t j = 0; j < r->toks.size(); ++j)
    PyList_SET_ITEM(out, j, PyLong_FromLongLong(r->toks[j]));
  return out;
}

#define NG_FN(name) {#name, (PyCFunction)(void (*)(void))py_##name, METH_FASTCALL, #name}
PyMethodDef METHODS[] = {NG_FN(new), NG_FN(free), NG_FN(start), NG_FN(stop), NG_FN(extend),
                         NG_FN(draft), NG_FN(propose), NG_FN(context),
                         {nullptr, nullptr, 0, nullptr}};

}  // namespace

// -> {name: builtin}; called once, through ctypes
extern "C" PyObject* npuspec_ngram_functions() {
  PyObject* d = PyDict_New();
  if (d == nullptr) return nullptr;
  for (PyMethodDef* m = METHODS; m->ml_name != nullptr; ++m) {
    PyObject* f = PyCFunction_New(m, nullptr);
    if (f == nullptr || PyDict_SetItemString(d, m->ml_name, f) != 0) {
      Py_XDECREF(f);
      Py_DECREF(d);
      return nullptr;
    }
    Py_DECREF(f);
  }
  return d;
}
"""

SIGNATURES = {"npuspec_ngram_functions": (ctypes.py_object, [])}


@functools.lru_cache(maxsize=None)
def library():
    """The index's entries as Python builtins (`.new`, `.extend`, `.draft`, ...), or None
    (logged once) when the library cannot be built."""
    lib = load_pylibrary(SOURCE, "compiled n-gram proposer",
                         "NgramProposer runs the Python reference (same drafts, more host time)",
                         SIGNATURES)
    if lib is None:
        return None
    return types.SimpleNamespace(dll=lib, **lib.npuspec_ngram_functions())


def available() -> bool:
    return library() is not None
