"""Loader of the compiled suffix proposer (the C++ is in `suffix_cpu_source`).

`npuspec.spec_decode.suffix_reference.SuffixProposer` drives it through ctypes over an opaque handle; the
Python reference (`SuffixProposerReference`) runs instead when this returns None. Token ids
cross as uint32 buffers (`array('I', list)` measured cheapest from a Python list: ~0.4 us for
3 tokens, 5.5 ns per token for a 4096-token prompt, against ~1.2 us and 15 ns for numpy).

The functions are called through `ctypes.PyDLL`, which keeps the GIL for the call: a call
takes microseconds (less than releasing and re-taking the GIL would cost), and two Python
threads can then never be inside one proposer at once, as with the Python reference.
"""
from __future__ import annotations

import ctypes
import functools

from npuspec.kernels.cpp_build import load_pylibrary
from npuspec.kernels.suffix_cpu_source import SOURCE

_P, _I, _D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
SIGNATURES = {
    "npuspec_suffix_new": (_P, [_I, _D, _D, _D, _I, _I, _I, _I, _I]),
    "npuspec_suffix_free": (None, [_P]),
    "npuspec_suffix_sum": (_D, [_P, _I, _I]),
    "npuspec_suffix_start": (_I, [_P, _P, _I]),
    "npuspec_suffix_add_response": (_I, [_P, _I]),
    "npuspec_suffix_remove_response": (None, [_P, _I]),
    "npuspec_suffix_extend": (None, [_P, _I, _P, _I]),
    "npuspec_suffix_extend_many": (None, [_P, _P, _I, _P, _P]),
    "npuspec_suffix_stop": (None, [_P, _I]),
    "npuspec_suffix_propose": (_I, [_P, _P, _P, _I, _I, _P, _P, _P]),
}


@functools.lru_cache(maxsize=None)
def library():
    """The compiled library (a ctypes PyDLL), or None (logged once) when it cannot be built."""
    return load_pylibrary(SOURCE, "compiled suffix proposer",
                          "SuffixProposer runs the Python reference (same drafts, 4-5x slower)",
                          SIGNATURES)


def available() -> bool:
    return library() is not None
