"""All-reduce and all-gather for tensor-parallel ranks on one host, through shared memory.

Why: gloo moves a decode step's activations (KiB) over loopback TCP, and on a small host each
of its collectives costs 0.5-1 ms of wake-up latency: a 30-layer model's 61 collectives per
step then cost more than the step (docs/distributed.md). Here each rank copies its tensor into
its slot of one shared file, publishes a sequence number, spins (yielding) until every rank
has published, and reads the others' slots, as vLLM's CPU backend does with its shm ops.

Layout of the file (zero-filled at creation, so every sequence number starts at 0):
    [world x 64-byte slots: std::atomic<int64> seq]  [2 x world x cap bytes of data]
Op number s uses data half s & 1: a rank can only start op s + 2, which reuses op s's half,
after every rank published s + 1, i.e. after every rank finished reading op s.

The sum runs in rank order on every rank, so every rank gets the same bits (gloo's property,
which the engine relies on: each rank continues with the same residual stream). fp32 only;
other dtypes and tensors over `cap` take gloo (`kernels/collectives.py` decides, the same way
on every rank since every rank sees the same shapes).

Waiting is bounded: `wait` returns after `max_s` even if a peer has not published, so the
caller can check that its peers are alive (a dead peer never publishes) and then wait again.
"""
from __future__ import annotations

import ctypes
import functools
import mmap
import os
import time

import torch

from npuspec.kernels.cpp_build import load_library

HEADER = 64 * 64  # room for 64 ranks' sequence slots
_SOURCE = r"""
#include <torch/csrc/inductor/cpp_prefix.h>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <sched.h>

namespace {
inline std::atomic<int64_t>* seq_of(char* base, int64_t r) {
    return reinterpret_cast<std::atomic<int64_t>*>(base + 64 * r);
}
inline char* slot(char* base, int64_t world, int64_t cap, int64_t s, int64_t r) {
    return base + 4096 + ((s & 1) * world + r) * cap;
}
inline void relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
}
}  // namespace

extern "C" {
// copy `nbytes` of x into this rank's slot of op s, then publish s
void npuspec_shm_post(char* base, int64_t rank, int64_t world, int64_t cap, int64_t s,
                      const char* x, int64_t nbytes) {
    std::memcpy(slot(base, world, cap, s, rank), x, nbytes);
    seq_of(base, rank)->store(s, std::memory_order_release);
}

// 1 once every rank published s; 0 if max_s passed first
int npuspec_shm_wait(char* base, int64_t world, int64_t s, double max_s) {
    auto t0 = std::chrono::steady_clock::now();
    for (int64_t spins = 0;; ++spins) {
        int64_t r = 0;
        while (r < world && seq_of(base, r)->load(std::memory_order_acquire) >= s) ++r;
        if (r == world) return 1;
        if (spins < 2000) { relax(); continue; }
        sched_yield();  // a peer may share this core: let it run
        if ((spins & 255) == 0) {
            double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            if (dt > max_s) return 0;
        }
    }
}

// out[i] = sum over ranks r = 0..world-1, in that order, of slot r's x[i] (fp32)
void npuspec_shm_sum(char* base, int64_t world, int64_t cap, int64_t s, float* out, int64_t n) {
    const float* p0 = reinterpret_cast<const float*>(slot(base, world, cap, s, 0));
    std::memcpy(out, p0, n * sizeof(float));
    for (int64_t r = 1; r < world; ++r) {
        const float* p = reinterpret_cast<const float*>(slot(base, world, cap, s, r));
        for (int64_t i = 0; i < n; ++i) out[i] += p[i];
    }
}

// out [rows, world * row_bytes]: row i = rank 0's row i, rank 1's row i, ... (a gather along
// the last dim of [rows, row_bytes] parts)
void npuspec_shm_gather(char* base, int64_t world, int64_t cap, int64_t s, char* out,
                        int64_t rows, int64_t row_bytes) {
    for (int64_t r = 0; r < world; ++r) {
        const char* p = slot(base, world, cap, s, r);
        for (int64_t i = 0; i < rows; ++i)
            std::memcpy(out + (i * world + r) * row_bytes, p + i * row_bytes, row_bytes);
    }
}
}
"""

_p, _i64, _f64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double


@functools.lru_cache(maxsize=None)
def _library():
    return load_library(_SOURCE, "shared-memory collectives", "tensor-parallel ranks use gloo",
                        {"npuspec_shm_post": (None, [_p, _i64, _i64, _i64, _i64, _p, _i64]),
                         "npuspec_shm_wait": (ctypes.c_int, [_p, _i64, _i64, _f64]),
                         "npuspec_shm_sum": (None, [_p, _i64, _i64, _i64, _p, _i64]),
                         "npuspec_shm_gather": (None, [_p, _i64, _i64, _i64, _p, _i64, _i64])})


def available() -> bool:
    return _library() is not None


class ShmComm:
    """One rank's handle on the shared file at `path` (rank 0 creates it, before the others
    open it). `alive()` raises when a peer is known to be gone; `timeout` bounds one wait."""

    def __init__(self, path: str, rank: int, world: int, cap: int, create: bool,
                 alive, timeout: float):
        assert world <= 64 and cap % 64 == 0, (world, cap)
        self.rank, self.world, self.cap = rank, world, cap
        self.alive, self.timeout = alive, timeout
        size = HEADER + 2 * world * cap
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._buf = ctypes.c_char.from_buffer(self._mm)
        self.base = ctypes.addressof(self._buf)
        self.seq = 0
        self.lib = _library()

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype == torch.float32 and x.numel() * 4 <= self.cap

    def _exchange(self, x: torch.Tensor) -> int:
        x = x.contiguous()
        self.seq += 1
        s = self.seq
        self.lib.npuspec_shm_post(self.base, self.rank, self.world, self.cap, s, x.data_ptr(),
                                  x.numel() * x.element_size())
        t0 = time.monotonic()
        while not self.lib.npuspec_shm_wait(self.base, self.world, s, 0.05):
            self.alive()
            if time.monotonic() - t0 > self.timeout:
                raise RuntimeError(f"npuspec shm collective {s}: a tensor-parallel peer did "
                                   f"not arrive within {self.timeout:.0f} s "
                                   f"(NPUSPEC_TP_TIMEOUT)")
        return s

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        s = self._exchange(x)
        out = torch.empty(x.shape, dtype=x.dtype)
        self.lib.npuspec_shm_sum(self.base, self.world, self.cap, s, out.data_ptr(), x.numel())
        return out

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenation of the ranks' x along the last dim, in rank order."""
        s = self._exchange(x)
        n = x.shape[-1] if x.dim() else 1
        out = torch.empty((*x.shape[:-1], n * self.world), dtype=x.dtype)
        rows = x.numel() // max(n, 1)
        self.lib.npuspec_shm_gather(self.base, self.world, self.cap, s, out.data_ptr(), rows,
                                    n * x.element_size())
        return out

    def close(self) -> None:
        del self._buf
        self._mm.close()


def all_reduce_reference(parts: list[torch.Tensor]) -> torch.Tensor:
    """What ShmComm.all_reduce returns on every rank: the rank-order fp32 sum."""
    out = parts[0].clone()
    for p in parts[1:]:
        out += p
    return out
