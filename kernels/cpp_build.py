"""Compile one CPU kernel's C++ source through Inductor's C++ code cache (one place for it).

The cache keys the library by its source and compiler command, so a kernel is compiled once
per machine and loaded from the cache after that. Without a working toolchain (no compiler,
no OpenMP) the kernel is reported unavailable once and its caller takes the PyTorch reference.
"""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def load_library(source: str, what: str, fallback: str, signatures: dict):
    """The loaded library (a ctypes CDLL), or None, with one warning naming `what` and the
    `fallback` the caller takes instead. signatures: entry point -> (restype, argtypes or
    None to leave them unchecked), set on the loaded functions."""
    try:
        from torch._inductor.codecache import CppCodeCache
        lib = CppCodeCache.load(source)
    except Exception as e:  # no compiler, no OpenMP, ...
        log.warning("npuspec: the %s could not be compiled (%s); %s", what, e, fallback)
        return None
    for name, (restype, argtypes) in signatures.items():
        fn = getattr(lib, name)
        fn.restype = restype
        if argtypes is not None:
            fn.argtypes = argtypes
    return lib
