"""The per-layer CPU ops dispatched in C++: no Python between a compiled graph and the kernels.

A decode step calls `npuspec::linear_packed` (or `linear_quant`) ~120 times, `add_rms_norm` 60
times, `paged_attention` 30 times and `rejection_sample` once. Each is registered from Python (torch.library) and its
kernel is a ctypes call, so every call paid the dispatcher's trip into Python, the wrapper's
checks and allocations in Python, and ctypes' argument conversion: ~16 us for an add+RMSNorm
whose kernel takes ~1 us (measured here, 2 threads). That is ~3 ms of a 25 ms fp32 SmolLM2 step
and a quarter of a 4-bit one.

This library registers C++ kernels for those ops (`rejection_sample` for its all-greedy step
only) under the CPU dispatch key
(TORCH_LIBRARY_IMPL, linked against libtorch like Inductor's own kernels). Each checks its
inputs, allocates its outputs with ATen and calls the same compiled kernel entry points the
Python wrappers call (their addresses are handed over once, at `install`), so results are
bit-identical. Whatever is not the common case (a prefill that goes to a vendor GEMM, panels
packed for another width, a forced implementation, a sampled verify, an unexpected layout or
value) is passed
to the Python wrapper itself, through a private twin op `npuspec::_<op>_py` whose only kernel
is that wrapper: the rare path keeps its logic, its counters and its logging in one place.

The Python wrappers are registered under CompositeExplicitAutograd, which a CPU kernel
outranks, so before `install` (or where no C++ toolchain works) every call takes them, as it
did before this library. `install` runs when an engine's model uses the kernels
(npuspec/engine/llm.py) and at the end of the background prebuild.
`fast_calls()` counts the calls that stayed in C++, per op (tests check it moves).
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import threading

import torch

from npuspec.kernels import linear_packed_cpu, linear_quant_cpu, paged_attention, \
    paged_attention_cpu, rms_norm_cpu, verify, verify_cpu
from npuspec import envs
from npuspec.kernels.cpp_build import load_library

log = logging.getLogger(__name__)

OPS = ("add_rms_norm", "linear_packed", "linear_quant", "paged_attention", "rejection_sample")

_SOURCE = r"""
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/ones.h>
#include <torch/library.h>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>

ARGS_DECL

namespace {
using NormFn = void (*)(const void*, const void*, const void*, void*, void*, int64_t, int64_t, double);
// x: fp32, or the weights' 2-byte dtype for packed_x (the entry points' own pointer types, as
// ctypes calls them)
using PackedFn = void (*)(const void*, const void*, const float*, float*, int64_t, int64_t, int64_t);
using QuantFn = void (*)(const float*, float*, const void*, const float*, const float*, float,
                         float*, int64_t, int64_t, int64_t);
using AttnFn = void (*)(const Args*);
// verify_cpu.py's npuspec_standard_rows
using RowsFn = void (*)(const void*, int64_t, const int64_t*, const float*, const float*,
                        const float*, const float*, const float*, const uint8_t*, int64_t*, float*,
                        float*, float*, int64_t*, int64_t*, int64_t, int64_t, int64_t, int64_t,
                        int64_t, int64_t, int32_t*, int32_t*);

// Filled once by `npuspec_native_set` (field order: `_TABLE` in native_cpu.py).
struct Table {
  NormFn norm[3];        // f32, bf16, f16 (x, residual and weight all of that dtype)
  PackedFn packed[3];    // weights f32, bf16, f16; x and bias fp32
  PackedFn packed_x[3];  // -, bf16, f16: x in the weights' dtype
  QuantFn quant[2];      // 8-bit, 4-bit codes
  AttnFn attention;
  RowsFn standard_rows;
  int64_t packed_bw, quant_bw;  // panel widths the kernels were built for
  int64_t gemm_rows;            // this many rows: Python (a vendor GEMM), for fp32 weights and
  int64_t bf16_gemm;            // for bf16 x bf16 without bias where the CPU has native bf16,
  int64_t gemm_rows_bf16;       // from this many rows on the widening loop,
  int64_t gemm_rows_dot_bf16;   // this many on the dot-product one,
  int64_t dot_bf16;             // which runs where this is set and K is even
};
Table T{};
std::atomic<int64_t> attention_forced{0};  // paged_attention.use_impl is active
std::atomic<int64_t> verify_forced{0};     // verify.use_impl is active
// every call to Python: from the library's load (its kernels are registered then) until the
// table is filled, and inside `bypassed()`
std::atomic<int64_t> bypass{1};
std::atomic<int64_t> fast[5];              // calls kept in C++, per op (OPS order)

int dtype_index(at::ScalarType t) {
  return t == at::kFloat ? 0 : t == at::kBFloat16 ? 1 : t == at::kHalf ? 2 : -1;
}

template <typename Sig>
c10::TypedOperatorHandle<Sig> twin(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& r,
                                                const at::Tensor& w, double eps) {
  using Sig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                 const at::Tensor&, double);
  const int d = dtype_index(x.scalar_type());
  const int64_t N = x.dim() ? x.size(-1) : 0;
  if (bypass || d < 0 || r.scalar_type() != x.scalar_type() || w.scalar_type() != x.scalar_type() ||
      !x.is_contiguous() || !r.is_contiguous() || !w.is_contiguous() || !r.sizes().equals(x.sizes()) ||
      w.dim() != 1 || w.size(0) != N || N == 0) {
    static auto op = twin<Sig>("npuspec::_add_rms_norm_py");
    return op.call(x, r, w, eps);
  }
  at::Tensor out = at::empty(x.sizes(), x.options()), s = at::empty(x.sizes(), x.options());
  T.norm[d](x.data_ptr(), r.data_ptr(), w.data_ptr(), out.data_ptr(), s.data_ptr(), x.numel() / N, N, eps);
  fast[0]++;
  return {out, s};
}

// the kernels read whole panels: a bias of n < NB*BW columns or another dtype is padded in Python
bool bias_ok(const std::optional<at::Tensor>& b, int64_t cols) {
  return !b.has_value() || (b->scalar_type() == at::kFloat && b->is_contiguous() && b->dim() == 1 &&
                            b->size(0) == cols);
}

at::Tensor x_fp32(const at::Tensor& x) {
  return x.scalar_type() == at::kFloat ? x.contiguous() : x.to(at::kFloat).contiguous();
}

at::Tensor cut(const at::Tensor& y, int64_t n) {  // [M, NB*BW] -> [M, n]
  return n == y.size(1) ? y : y.narrow(1, 0, n).contiguous();
}

// linear_packed_cpu.takes_gemm (x is 2-D)
bool takes_gemm(const at::Tensor& x, const at::Tensor& wp, const std::optional<at::Tensor>& bias) {
  if (wp.scalar_type() == at::kFloat) return x.size(0) >= T.gemm_rows;
  if (!T.bf16_gemm || bias.has_value() || x.scalar_type() != at::kBFloat16 ||
      wp.scalar_type() != at::kBFloat16)
    return false;
  const bool dot = T.dot_bf16 && x.size(1) % 2 == 0;
  return x.size(0) >= (dot ? T.gemm_rows_dot_bf16 : T.gemm_rows_bf16);
}

at::Tensor linear_packed(const at::Tensor& x, const at::Tensor& wp, const std::optional<at::Tensor>& bias,
                         int64_t n) {
  using Sig = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, int64_t);
  const int d = dtype_index(wp.scalar_type());
  if (bypass || d < 0 || x.dim() != 2 || takes_gemm(x, wp, bias) || wp.dim() != 3 || wp.size(2) != T.packed_bw ||
      x.size(1) != wp.size(1) || !wp.is_contiguous() || dtype_index(x.scalar_type()) < 0 ||
      n > wp.size(0) * wp.size(2) || !bias_ok(bias, wp.size(0) * wp.size(2))) {
    static auto op = twin<Sig>("npuspec::_linear_packed_py");
    return op.call(x, wp, bias, n);
  }
  const int64_t M = x.size(0), NB = wp.size(0), K = wp.size(1);
  // x in the weights' 2-byte dtype is read as it is (linear_packed_cpu.linear_packed_impl)
  const bool same = d > 0 && x.scalar_type() == wp.scalar_type();
  at::Tensor xc = same ? x.contiguous() : x_fp32(x);
  at::Tensor y = at::empty({M, NB * T.packed_bw}, x.options().dtype(at::kFloat));
  if (M) (same ? T.packed_x : T.packed)[d](xc.data_ptr(), wp.data_ptr(),
                                           bias ? bias->data_ptr<float>() : nullptr,
                                           y.data_ptr<float>(), M, NB, K);
  fast[1]++;
  return cut(y, n);
}

at::Tensor linear_quant(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                        const std::optional<at::Tensor>& minv, int64_t bits, int64_t zero, int64_t n) {
  using Sig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         const std::optional<at::Tensor>&, int64_t, int64_t, int64_t);
  const bool ok = !bypass && x.dim() == 2 && q.dim() == 3 && scale.dim() == 3 && (bits == 8 || bits == 4) &&
                  dtype_index(x.scalar_type()) >= 0 && scale.size(2) == T.quant_bw &&
                  x.size(1) == q.size(1) && x.size(1) % 32 == 0 && n <= q.size(0) * T.quant_bw &&
                  q.is_contiguous() && scale.is_contiguous() && scale.scalar_type() == at::kFloat &&
                  (!minv.has_value() || (minv->is_contiguous() && minv->scalar_type() == at::kFloat));
  if (!ok) {
    static auto op = twin<Sig>("npuspec::_linear_quant_py");
    return op.call(x, q, scale, minv, bits, zero, n);
  }
  const int64_t M = x.size(0), NB = q.size(0), K = x.size(1);
  at::Tensor xf = x_fp32(x);
  at::Tensor y = at::empty({M, NB * T.quant_bw}, x.options().dtype(at::kFloat));
  if (M) {
    // the group sums a min multiplies, filled by the kernel ([M, K/32] fp32)
    at::Tensor xs = minv.has_value() ? at::empty({M, K / 32}, y.options()) : y;
    T.quant[bits == 8 ? 0 : 1](xf.data_ptr<float>(), xs.data_ptr<float>(), q.data_ptr(),
                               scale.data_ptr<float>(), minv ? minv->data_ptr<float>() : nullptr,
                               static_cast<float>(zero), y.data_ptr<float>(), M, NB, K);
  }
  fast[2]++;
  return cut(y, n);
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t layer,
                           const at::Tensor& bt, const at::Tensor& lens, int64_t bs, double scale) {
  using Sig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                         const at::Tensor&, const at::Tensor&, int64_t, double);
  const int d = dtype_index(q.scalar_type());
  const bool ok = !attention_forced && !bypass && d >= 0 && k.scalar_type() == q.scalar_type() &&
                  v.scalar_type() == q.scalar_type() && q.dim() == 4 && k.dim() == 4 &&
                  k.sizes().equals(v.sizes()) && k.is_contiguous() && v.is_contiguous() &&
                  q.size(3) == k.size(3) && k.size(2) > 0 && q.size(2) % k.size(2) == 0 && layer >= 0 &&
                  layer < k.size(0) && bs > 0 && k.size(1) % bs == 0 && bt.dim() == 2 &&
                  bt.size(0) == q.size(0) && lens.dim() == 1 && lens.size(0) == q.size(0) &&
                  bt.scalar_type() == at::kInt && lens.scalar_type() == at::kInt;
  if (!ok) {
    static auto op = twin<Sig>("npuspec::_paged_attention_py");
    return op.call(q, k, v, layer, bt, lens, bs, scale);
  }
  at::Tensor qc = q.contiguous(), btc = bt.contiguous(), lc = lens.contiguous();
  at::Tensor out = at::empty(q.sizes(), q.options().dtype(at::kFloat));
  const Args a{qc.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr<float>(),
               btc.data_ptr<int32_t>(), lc.data_ptr<int32_t>(), d, layer, k.size(1), q.size(0),
               q.size(1), q.size(2), k.size(2), q.size(3), bt.size(1), bs,
               std::max<int64_t>(1, at::get_num_threads()), 0, scale};
  T.attention(&a);
  fast[3]++;
  return d == 0 ? out : out.to(q.scalar_type());
}

// The all-greedy, one-hot verify (no temperatures, probabilities or draws: an engine step where
// no request samples): the verify kernel's greedy rows decide and emit, as verify.py's
// _cpu_greedy does. Any value the Python op would refuse (a draft id outside [-1, V), a row
// with NaN or +inf logits or -inf everywhere) is handed to it, which raises the error.
std::tuple<at::Tensor, at::Tensor> rejection_sample(
    const at::Tensor& logits, const at::Tensor& drafts, const std::optional<at::Tensor>& draft_probs,
    const std::optional<at::Tensor>& temperature, const std::optional<at::Tensor>& top_k,
    const std::optional<at::Tensor>& top_p, const std::optional<at::Tensor>& uniforms,
    const std::optional<at::Tensor>& exponentials, bool block_verify, std::optional<double> thr,
    std::optional<double> alpha, const std::optional<at::Tensor>& synthetic,
    const std::optional<at::Tensor>& bonus, const std::optional<at::Tensor>& accept_q,
    const std::optional<at::Tensor>& cu, const std::optional<at::Tensor>& is_greedy,
    bool target_is_probs, c10::string_view accept_mode, bool ratio_cap, c10::string_view accept_rule,
    c10::string_view r_normalize, c10::string_view r_sampler, c10::string_view r_nonneg,
    double r_floor, c10::string_view r_guard, double r_fill, bool checks, int64_t max_spec_len) {
  using O = const std::optional<at::Tensor>&;
  using S = c10::string_view;
  using Sig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, O, O, O, O, O, O,
                                                 bool, std::optional<double>, std::optional<double>, O,
                                                 O, O, O, O, bool, S, bool, S, S, S, S, double, S,
                                                 double, bool, int64_t);
  const int d = dtype_index(logits.scalar_type());
  bool ok = !bypass && !verify_forced && d >= 0 && !draft_probs && !temperature && !top_k &&
            !top_p && !uniforms && !exponentials && !synthetic && !thr && !alpha &&
            !target_is_probs && accept_mode == "ge" && !ratio_cap && accept_rule == "prefix" &&
            !bonus && !accept_q && !cu && !is_greedy && r_normalize == "none" && r_sampler == "race" &&
            r_nonneg == "clamp" && r_floor == 0.0 && r_guard == "none" && r_fill == 0.0 &&
            logits.dim() == 3 && logits.is_contiguous() && logits.size(0) > 0 &&
            logits.size(2) > 0 && logits.size(2) < (int64_t{1} << 24) && drafts.dim() == 2 &&
            drafts.scalar_type() == at::kLong && drafts.is_contiguous() &&
            drafts.size(0) == logits.size(0) && drafts.size(1) + 1 == logits.size(1);
  const int64_t B = ok ? logits.size(0) : 0, K1 = ok ? logits.size(1) : 0, V = ok ? logits.size(2) : 0;
  at::Tensor xpad;
  if (ok) {  // verify_rows._padded_drafts: [B, K+1], -1 for no draft and the bonus row
    xpad = at::empty({B, K1}, drafts.options());
    const int64_t* x = drafts.data_ptr<int64_t>();
    int64_t* xp = xpad.data_ptr<int64_t>();
    for (int64_t b = 0; b < B && ok; ++b) {
      for (int64_t j = 0; j < K1 - 1; ++j) {
        const int64_t v = x[b * (K1 - 1) + j];
        ok = ok && v >= -1 && v < V;
        xp[b * K1 + j] = v;
      }
      xp[b * K1 + K1 - 1] = -1;
    }
  }
  auto python = [&] {
    static auto op = twin<Sig>("npuspec::_rejection_sample_py");
    return op.call(logits, drafts, draft_probs, temperature, top_k, top_p, uniforms, exponentials,
                   block_verify, thr, alpha, synthetic, bonus, accept_q, cu, is_greedy,
                   target_is_probs, accept_mode, ratio_cap, accept_rule, r_normalize, r_sampler,
                   r_nonneg, r_floor, r_guard, r_fill, checks, max_spec_len);
  };
  if (!ok) return python();
  const auto f32 = logits.options().dtype(at::kFloat), i64 = logits.options().dtype(at::kLong);
  // greedy rows read no temperature, threshold, uniform or exponential: placeholders
  at::Tensor t = at::ones({B}, f32), E = at::empty({B, V}, f32), uni = at::ones({B, K1 - 1}, f32);
  at::Tensor grd = at::ones({B}, logits.options().dtype(at::kByte));
  at::Tensor gidx = at::empty({B, K1}, i64), race_p = at::empty({B, K1}, i64), race_r = at::empty({B, K1}, i64);
  at::Tensor rawmax = at::empty({B, K1}, f32), px = at::empty({B, K1}, f32), qx = at::empty({B, K1}, f32);
  at::Tensor out = at::empty({B, K1}, logits.options().dtype(at::kInt));
  at::Tensor num = at::empty({B}, logits.options().dtype(at::kInt));
  T.standard_rows(logits.data_ptr(), d, xpad.data_ptr<int64_t>(), nullptr, t.data_ptr<float>(), nullptr,
                  E.data_ptr<float>(), uni.data_ptr<float>(), grd.data_ptr<uint8_t>(),
                  gidx.data_ptr<int64_t>(), rawmax.data_ptr<float>(), px.data_ptr<float>(),
                  qx.data_ptr<float>(), race_p.data_ptr<int64_t>(), race_r.data_ptr<int64_t>(), B,
                  K1, V, 0, 0, std::max<int64_t>(1, at::get_num_threads()), out.data_ptr<int32_t>(),
                  num.data_ptr<int32_t>());
  const float* rm = rawmax.data_ptr<float>();
  for (int64_t i = 0; i < B * K1; ++i) {
    if (!std::isfinite(rm[i])) return python();  // it names the row and raises
  }
  fast[4]++;
  return {out, num};
}
}  // namespace

extern "C" void npuspec_native_set(const Table* t) {
  T = *t;
  bypass = 0;  // after the table: a thread that sees 0 sees the table (seq_cst)
}
extern "C" void npuspec_native_force_attention(int64_t on) { attention_forced = on; }
extern "C" void npuspec_native_bypass(int64_t on) { bypass = on; }
extern "C" void npuspec_native_force_verify(int64_t on) { verify_forced = on; }
extern "C" int64_t npuspec_native_fast_calls(int64_t op) { return fast[op].load(); }

TORCH_LIBRARY_IMPL(npuspec, CPU, m) {
  m.impl("add_rms_norm", add_rms_norm);
  m.impl("linear_packed", linear_packed);
  m.impl("linear_quant", linear_quant);
  m.impl("paged_attention", paged_attention);
  m.impl("rejection_sample", rejection_sample);
}
""".replace("ARGS_DECL", paged_attention_cpu.ARGS_DECL)

_P = ctypes.c_void_p
# `Table` of the C++ source, field by field
_TABLE = [("norm", _P * 3), ("packed", _P * 3), ("packed_x", _P * 3), ("quant", _P * 2),
          ("attention", _P),
          ("standard_rows", _P),
          ("packed_bw", ctypes.c_int64), ("quant_bw", ctypes.c_int64),
          ("gemm_rows", ctypes.c_int64), ("bf16_gemm", ctypes.c_int64),
          ("gemm_rows_bf16", ctypes.c_int64), ("gemm_rows_dot_bf16", ctypes.c_int64),
          ("dot_bf16", ctypes.c_int64)]


class _Table(ctypes.Structure):
    _fields_ = _TABLE


# The Python wrappers, each also registered as the private twin op the C++ kernels hand the
# uncommon cases to (same schema, name `_<op>_py`)
_PYTHON = {"add_rms_norm": rms_norm_cpu._impl, "linear_packed": linear_packed_cpu.linear_packed_impl,
           "linear_quant": linear_quant_cpu.linear_quant_impl,
           "paged_attention": paged_attention._paged_attention_op,
           "rejection_sample": verify._rejection_sample_impl}
_lib = torch.library.Library("npuspec", "FRAGMENT")
for _op, _fn in _PYTHON.items():
    _schema = str(getattr(torch.ops.npuspec, _op).default._schema)
    _lib.define(_schema.replace(f"npuspec::{_op}(", f"_{_op}_py("))
    _lib.impl(f"_{_op}_py", _fn, "CPU")

_install_lock = threading.Lock()
_bypass_depth = [0]  # nested `bypassed()` blocks


def _addr(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


@functools.lru_cache(maxsize=None)
def _library():
    """The native ops' library with its table filled (registered on load), or None."""
    kernels = (rms_norm_cpu._library(), linear_packed_cpu._library(), linear_quant_cpu._library(),
               paged_attention_cpu._compiled(), verify_cpu._compiled())
    if any(k is None for k in kernels):
        return None  # a kernel's build failed and was logged: the Python wrappers stay
    norm, packed, quant, attention, rows = kernels
    lib = load_library(_SOURCE, "native CPU op dispatch", "the ops keep dispatching through Python",
                       {"npuspec_native_set": (None, [ctypes.c_void_p]),
                        "npuspec_native_force_attention": (None, [ctypes.c_int64]),
                        "npuspec_native_bypass": (None, [ctypes.c_int64]),
                        "npuspec_native_force_verify": (None, [ctypes.c_int64]),
                        "npuspec_native_fast_calls": (ctypes.c_int64, [ctypes.c_int64])})
    if lib is None:
        return None
    sfx = ("f32", "bf16", "f16")
    table = _Table(
        (_P * 3)(*[_addr(getattr(norm, f"npuspec_add_rms_norm_{s}")) for s in sfx]),
        (_P * 3)(*[_addr(getattr(packed, f"npuspec_linear_packed_{s}")) for s in sfx]),
        (_P * 3)(0, _addr(packed.npuspec_linear_packed_bf16_x), _addr(packed.npuspec_linear_packed_f16_x)),
        (_P * 2)(_addr(quant.npuspec_linear_quant_q8), _addr(quant.npuspec_linear_quant_q4)),
        _addr(attention), _addr(rows.npuspec_standard_rows), int(packed.npuspec_linear_packed_block()),
        int(quant.npuspec_linear_quant_block()),
        linear_packed_cpu.GEMM_MIN_ROWS, int(linear_packed_cpu._bf16_gemm()),
        linear_packed_cpu.BF16_GEMM_MIN_ROWS, linear_packed_cpu.dot_bf16_gemm_min_rows(),
        int(linear_packed_cpu.dot_bf16(2)))  # an even K
    lib.npuspec_native_set(ctypes.byref(table))
    if _bypass_depth[0]:  # installed inside a `bypassed()` block
        lib.npuspec_native_bypass(1)
    return lib


def install() -> bool:
    """Build (once per machine) and load the native ops; True when they now serve the CPU
    calls. Idempotent and thread-safe; a failed build was logged by `load_library`.
    NPUSPEC_NATIVE_OPS=0 turns it off (every call stays in the Python wrappers)."""
    if not envs.native_ops():
        return False
    with _install_lock:
        lib = _library()
        if lib is not None and force_attention not in paged_attention.FORCE_HOOKS:
            paged_attention.FORCE_HOOKS.append(force_attention)
            force_attention(paged_attention._FORCED[0] is not None)
            verify.FORCE_HOOKS.append(force_verify)
            force_verify(verify._FORCED_IMPL[0] is not None)
    return lib is not None


def installed() -> bool:
    return _library.cache_info().currsize > 0 and _library() is not None


def force_attention(on: bool) -> None:
    """paged_attention.use_impl is active: the native kernel passes every call to Python."""
    if installed():
        _library().npuspec_native_force_attention(int(on))


@contextlib.contextmanager
def bypassed():
    """Inside the block every call goes to the Python wrappers (through the C++ kernel and
    the twin op: one dispatcher hop more than before `install`). Tests of the wrappers' own
    paths, and A/B timings, use it."""
    lib = _library() if installed() else None
    with _install_lock:
        _bypass_depth[0] += 1
        if lib is not None:
            lib.npuspec_native_bypass(1)
    try:
        yield
    finally:
        with _install_lock:
            _bypass_depth[0] -= 1
            if lib is not None and _bypass_depth[0] == 0:
                lib.npuspec_native_bypass(0)


def force_verify(on: bool) -> None:
    """verify.use_impl is active: the native kernel passes every call to Python."""
    if installed():
        _library().npuspec_native_force_verify(int(on))


def fast_calls() -> dict:
    """Calls each op served in C++ since the process started ({} before `install`)."""
    if not installed():
        return {}
    lib = _library()
    return {op: int(lib.npuspec_native_fast_calls(i)) for i, op in enumerate(OPS)}


def available() -> bool:
    """`install` (the background prebuild's entry point, like the kernels' `available`)."""
    return install()
