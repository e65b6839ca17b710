"""Compile one CPU kernel's C++ source through Inductor's C++ code cache (one place for it).

The cache keys the library by its source and compiler command, so a kernel is compiled once
per machine and loaded from the cache after that. Without a working toolchain (no compiler,
no OpenMP) the kernel is reported unavailable once and its caller takes the PyTorch reference.

Every kernel here starts with `#include <torch/csrc/inductor/cpp_prefix.h>` and compiles with
the command Inductor uses for its own CPU kernels, so all of them, and the kernels of every
compiled graph, share one precompiled header of it. Without that header a cold g++ run
re-parses ATen's vector headers each time (4-9 s per library here); the first build makes the
header (~8 s, once per machine and compiler command) and later ones take 1-4 s. The engine's
background prebuild (`prebuild_cpu_kernels`) is then also what pays for the header that
Inductor's first graph would otherwise build on the critical path.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import shutil
import threading

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def _code_cache():
    """Inductor's `CppCodeCache`, with the precompiled cpp_prefix.h its kernels use."""
    from torch._inductor import codecache

    prefix = getattr(codecache, "_get_cpp_prefix_header", None)
    if prefix is None:  # an Inductor without precompiled headers: compile as it does
        return codecache.CppCodeCache

    class KernelCodeCache(codecache.CppCodeCache):
        cache: dict = {}  # ours, not the base class's
        # the flags of Inductor's own CPU kernels: one compiler command, so one header
        cpp_compile_command_flags = dict(codecache.CppPythonBindingsCodeCache.cpp_compile_command_flags)

        @classmethod
        def _get_uncompiled_header(cls, device: str):
            return prefix(device)

    return KernelCodeCache


_isa_lock = threading.Lock()


def vec_isa():
    """Inductor's vector ISA for this CPU (what every kernel here is built for). Its first call
    compiles probe programs (~4 s cold); the lock makes a caller that comes while the
    background prebuild is probing wait for that result instead of probing again."""
    with _isa_lock:
        from torch._inductor.cpu_vec_isa import pick_vec_isa
        return pick_vec_isa()


def load_library(source: str, what: str, fallback: str, signatures: dict):
    """The loaded library (a ctypes CDLL), or None, with one warning naming `what` and the
    `fallback` the caller takes instead. signatures: entry point -> (restype, argtypes or
    None to leave them unchecked), set on the loaded functions."""
    try:
        lib = _code_cache().load(source)
    except Exception as e:  # no compiler, no OpenMP, ...
        log.warning("npuspec: the %s could not be compiled (%s); %s", what, e, fallback)
        return None
    for name, (restype, argtypes) in signatures.items():
        fn = getattr(lib, name)
        fn.restype = restype
        if argtypes is not None:
            fn.argtypes = argtypes
    return lib


def load_pylibrary(source: str, what: str, fallback: str, signatures: dict):
    """`load_library`, reopened as a ctypes.PyDLL: its calls keep the GIL (for calls of a few
    µs, cheaper than releasing and re-taking it, and two Python threads are never inside it at
    once). None (logged once) when it cannot be built."""
    lib = load_library(source, what, fallback, signatures)
    if lib is None:
        return None
    pylib = ctypes.PyDLL(lib._name)
    for name, (restype, argtypes) in signatures.items():
        fn = getattr(pylib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return pylib


def toolchain_present() -> bool:
    """A C++ compiler Inductor would use is on this machine (no build is run). Callers that
    commit to a kernel before its build finishes (packing weights at load) check this; a
    build that still fails later is logged by `load_library`, and the op takes its reference."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
        return shutil.which(get_cpp_compiler()) is not None
    except Exception as e:
        log.debug("no C++ compiler found: %s", e)
        return False
