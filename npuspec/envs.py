"""The one place that reads the environment (DESIGN.md §3.2).

Every NPUSPEC_* variable is declared here with a typed parser. Call the accessor each time you
need the value (they are cheap); nothing caches os.environ, so tests can monkeypatch it.
A bad value raises EnvError (a ValueError) quoting the variable and its value.
"""
from __future__ import annotations

import os
from typing import Callable, Optional

DEVICES = ("npu", "cuda", "cpu")


class EnvError(ValueError):
    pass


def _raw(name: str) -> Optional[str]:
    v = os.environ.get(name)
    return None if v is None else v


def _parse_sizes(name: str, value: str) -> list[int]:
    parts = [p.strip() for p in value.split(",")]
    if value.strip() == "" or any(p == "" for p in parts):
        raise EnvError(
            f"{name}={value!r}: expected comma-separated positive integers such as "
            f"'4,8,16,32'; unset it to use the default capture ladder")
    sizes = []
    for p in parts:
        try:
            n = int(p)
        except ValueError:
            raise EnvError(f"{name}={value!r}: {p!r} is not an integer; use positive integers "
                           f"such as '4,8,16,32'") from None
        if n <= 0:
            raise EnvError(f"{name}={value!r}: {n} is not positive; every capture size must be "
                           f">= 1, e.g. '4,8,16,32'")
        sizes.append(n)
    return sizes


def capture_sizes() -> Optional[list[int]]:
    """NPUSPEC_CAPTURE_SIZES as given (rounding to multiples of K+1 is the planner's job)."""
    v = _raw("NPUSPEC_CAPTURE_SIZES")
    return None if v is None else _parse_sizes("NPUSPEC_CAPTURE_SIZES", v)


def _path(name: str) -> Optional[str]:
    v = _raw(name)
    if v is None:
        return None
    if v.strip() == "":
        raise EnvError(f"{name}={v!r}: empty path; set it to a directory or unset it")
    return os.path.abspath(os.path.expanduser(v))


def cache_dir() -> Optional[str]:
    """NPUSPEC_CACHE_DIR: the shared graph cache directory (None: no persistent cache)."""
    return _path("NPUSPEC_CACHE_DIR")


def debug_dump() -> Optional[str]:
    """NPUSPEC_DEBUG_DUMP: a directory for numbered before/after graph dumps."""
    return _path("NPUSPEC_DEBUG_DUMP")


def device() -> Optional[str]:
    """NPUSPEC_DEVICE: force 'npu', 'cuda' or 'cpu' (None: detect)."""
    v = _raw("NPUSPEC_DEVICE")
    if v is None:
        return None
    d = v.strip().lower()
    if d not in DEVICES:
        raise EnvError(f"NPUSPEC_DEVICE={v!r}: must be one of {', '.join(DEVICES)}, "
                       f"or unset it to detect the device")
    return d


def cache_trusted_group() -> Optional[str]:
    """NPUSPEC_CACHE_TRUSTED_GROUP: a group name or gid whose write access to the cache is trusted."""
    v = _raw("NPUSPEC_CACHE_TRUSTED_GROUP")
    if v is None:
        return None
    if v.strip() == "":
        raise EnvError("NPUSPEC_CACHE_TRUSTED_GROUP='': set a group name or numeric gid, or unset it")
    return v.strip()


def _float(name: str, default: float, lo: float = 0.0) -> float:
    v = _raw(name)
    if v is None:
        return default
    try:
        x = float(v)
    except ValueError:
        raise EnvError(f"{name}={v!r}: expected a number of seconds such as '600'") from None
    if not x >= lo:
        raise EnvError(f"{name}={v!r}: must be >= {lo}")
    return x


def cache_lock_timeout() -> float:
    """NPUSPEC_CACHE_LOCK_TIMEOUT: seconds to wait for another process compiling the same key."""
    return _float("NPUSPEC_CACHE_LOCK_TIMEOUT", 600.0)


def _bool(name: str, default: bool) -> bool:
    v = _raw(name)
    if v is None:
        return default
    s = v.strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off", ""):
        return False
    raise EnvError(f"{name}={v!r}: expected 1/0, true/false, yes/no or on/off")


def debug() -> bool:
    """NPUSPEC_DEBUG: extra runtime assertions (e.g. static buffer addresses on replay)."""
    return _bool("NPUSPEC_DEBUG", False)


# Other tools' variables that npuspec reads (never writes here).

def triton_interpret() -> bool:
    """TRITON_INTERPRET=1: Triton kernels run on the CPU through the interpreter."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def ascend_toolkit_home() -> Optional[str]:
    """CANN's install directory (ASCEND_TOOLKIT_HOME, else ASCEND_HOME_PATH), for its version."""
    for name in ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH"):
        v = os.environ.get(name)
        if v:
            return v
    return None


# name -> accessor, for `npuspec env` style listings and the env tests.
VARIABLES: dict[str, Callable] = {
    "NPUSPEC_CAPTURE_SIZES": capture_sizes,
    "NPUSPEC_CACHE_DIR": cache_dir,
    "NPUSPEC_DEVICE": device,
    "NPUSPEC_DEBUG_DUMP": debug_dump,
    "NPUSPEC_CACHE_TRUSTED_GROUP": cache_trusted_group,
    "NPUSPEC_CACHE_LOCK_TIMEOUT": cache_lock_timeout,
    "NPUSPEC_DEBUG": debug,
}
