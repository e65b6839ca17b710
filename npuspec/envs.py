"""The one place that reads the environment (docs/design.md, "Environment variables").

Every NPUSPEC_* variable is declared here with a typed parser. Call the accessor each time you
need the value (they are cheap); nothing caches os.environ, so tests can monkeypatch it. What is
cached is the parse of each (variable, raw value), so a value is validated once, at its first
use, and the checks that touch the system (a group lookup, the path's parents) run once.
A bad value raises EnvError (a ValueError) quoting the variable, its value and the fix.
`check_all()` parses every variable: the public entry points (the backend, `LLM`) call it before
any work, so a bad value fails there rather than deep inside a compile.
"""
from __future__ import annotations

import math
import os
import stat
import threading
from typing import Callable, Optional

DEVICES = ("npu", "cuda", "cpu")


class EnvError(ValueError):
    pass


def _raw(name: str) -> Optional[str]:
    v = os.environ.get(name)
    return None if v is None else v


_parsed: dict[tuple[str, str], object] = {}


def _once(name: str, parse: Callable[[str, str], object]) -> Optional[object]:
    """parse(name, raw) for the variable's current value, memoised per raw value (a bad value
    raises every time: exceptions are not stored); None when the variable is unset."""
    v = _raw(name)
    if v is None:
        return None
    key = (name, v)
    if key not in _parsed:
        _parsed[key] = parse(name, v)
    return _parsed[key]


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
    sizes = _once("NPUSPEC_CAPTURE_SIZES", _parse_sizes)
    return None if sizes is None else list(sizes)


def parse_dir(name: str, v: str, drop: str = "or unset it") -> str:
    """A directory path that is, or can become, a directory: empty values and paths at or under
    an existing non-directory are refused here (they would otherwise surface as an OSError from
    the first mkdir, mid-compile, or as a warning that the cache is not used)."""
    if v.strip() == "":
        raise EnvError(f"{name}={v!r}: empty path; set it to a directory, {drop}")
    p = os.path.abspath(os.path.expanduser(v))
    probe = p
    while True:  # the nearest existing path at or above p must be a directory
        try:
            st = os.stat(probe)
        except (FileNotFoundError, NotADirectoryError):  # look further up for the culprit
            parent = os.path.dirname(probe)
            if parent == probe:
                break
            probe = parent
            continue
        except OSError as e:  # ENAMETOOLONG, ELOOP, EACCES on a parent, ...
            raise EnvError(f"{name}={v!r}: cannot use {probe} ({e.strerror}); set it to a "
                           f"directory you can create and write, {drop}") from None
        if not stat.S_ISDIR(st.st_mode):
            what = "is" if probe == p else f"lies under {probe}, which is"
            raise EnvError(f"{name}={v!r}: {p} {what} not a directory; set it to a directory "
                           f"path (it is created if missing), {drop}")
        break
    return p


def cache_dir() -> Optional[str]:
    """NPUSPEC_CACHE_DIR: the shared graph cache directory (None: no persistent cache)."""
    return _once("NPUSPEC_CACHE_DIR", parse_dir)


def _parse_dump_dir(name: str, v: str) -> str:
    """parse_dir, then the directory made and checked writable now: a dump is written in the
    middle of a compile, where an OSError would surface as BackendCompilerFailed."""
    p = parse_dir(name, v)
    try:
        os.makedirs(p, exist_ok=True)
    except OSError as e:
        raise EnvError(f"{name}={v!r}: cannot create {p} ({e.strerror}); set it to a directory "
                       f"you can create and write, or unset it") from None
    if not os.access(p, os.W_OK | os.X_OK):
        raise EnvError(f"{name}={v!r}: {p} is not writable by this user; set it to a directory "
                       f"you can write, or unset it")
    return p


def debug_dump() -> Optional[str]:
    """NPUSPEC_DEBUG_DUMP: a directory for numbered before/after graph dumps (made if missing)."""
    return _once("NPUSPEC_DEBUG_DUMP", _parse_dump_dir)


def device() -> Optional[str]:
    """NPUSPEC_DEVICE: force 'npu', 'cuda' or 'cpu' (None: detect)."""
    return _once("NPUSPEC_DEVICE", _parse_device)


def _parse_device(name: str, v: str) -> str:
    d = v.strip().lower()
    if d not in DEVICES:
        raise EnvError(f"{name}={v!r}: must be one of {', '.join(DEVICES)}, "
                       f"or unset it to detect the device")
    return d


MAX_GID = 2**32 - 2  # gid_t is 32 bits and (gid_t)-1 means "no group"


def _parse_group(name: str, v: str) -> str:
    g = v.strip()
    if g == "":
        raise EnvError(f"{name}={v!r}: set a group name or numeric gid, or unset it")
    if g.lstrip("+-").isdigit():
        if not 0 <= int(g) <= MAX_GID:
            raise EnvError(f"{name}={v!r}: a gid must be an integer in [0, {MAX_GID}]; use an "
                           f"existing group's name or gid (see `getent group`), or unset it")
        return str(int(g))
    import grp
    try:
        grp.getgrnam(g)
    except KeyError:
        raise EnvError(f"{name}={v!r}: no such group; set it to an existing group name or "
                       f"numeric gid (see `getent group`), or unset it") from None
    return g


def cache_trusted_group() -> Optional[str]:
    """NPUSPEC_CACHE_TRUSTED_GROUP: a group name or gid whose write access to the cache is
    trusted (a name is checked to exist)."""
    return _once("NPUSPEC_CACHE_TRUSTED_GROUP", _parse_group)


def _seconds(name: str, v: str) -> float:
    example = "such as '600'"
    try:
        x = float(v)
    except ValueError:
        raise EnvError(f"{name}={v!r}: expected a number of seconds {example}, or unset it "
                       f"for the default") from None
    # inf and huge values would overflow the lock's deadline (time_t); nan compares false
    if not math.isfinite(x) or not 0 <= x <= threading.TIMEOUT_MAX:
        raise EnvError(f"{name}={v!r}: must be a finite number of seconds in [0, "
                       f"{threading.TIMEOUT_MAX:.0f}] {example}; to wait a long time use a "
                       f"large finite value such as '86400'")
    return x


def cache_lock_timeout() -> float:
    """NPUSPEC_CACHE_LOCK_TIMEOUT: seconds to wait for another process compiling the same key."""
    x = _once("NPUSPEC_CACHE_LOCK_TIMEOUT", _seconds)
    return 600.0 if x is None else x


def tp_timeout() -> float:
    """NPUSPEC_TP_TIMEOUT: seconds a tensor-parallel rank waits in one collective (and at
    start-up for the others) before failing. A dead rank is reported at once; this bounds
    a live but stuck one. Generous by default: a rank's first step compiles."""
    x = _once("NPUSPEC_TP_TIMEOUT", _seconds)
    return 600.0 if x is None else x


TP_CPU_COMMS = ("shm", "gloo")


def _parse_comm(name: str, v: str) -> str:
    if v not in TP_CPU_COMMS:
        raise EnvError(f"{name}={v!r}: use 'shm' (same-host ranks exchange through shared "
                       f"memory, the default) or 'gloo'; or unset it")
    return v


def tp_cpu_comm() -> str:
    """NPUSPEC_TP_CPU_COMM: how CPU ranks of the "mp" launcher exchange activations: 'shm'
    (shared memory, default) or 'gloo' (torch.distributed's TCP transport)."""
    v = _once("NPUSPEC_TP_CPU_COMM", _parse_comm)
    return "shm" if v is None else v


def set_tp_cpu_comm(v: str) -> None:
    """Set NPUSPEC_TP_CPU_COMM for this process and the ranks it spawns (bench tp --cpu-comm)."""
    os.environ["NPUSPEC_TP_CPU_COMM"] = _parse_comm("NPUSPEC_TP_CPU_COMM", v)


K_CONTROLLERS = ("online", "fixed")


def _parse_k_controller(name: str, v: str) -> str:
    if v not in K_CONTROLLERS:
        raise EnvError(f"{name}={v!r}: use 'online' (K chosen each step up to "
                       f"num_speculative_tokens, the default) or 'fixed' (K is "
                       f"num_speculative_tokens every step); or unset it")
    return v


def k_controller() -> str:
    """NPUSPEC_K_CONTROLLER: how K is chosen when speculative_config does not say
    (k_controller): 'online' (the default) or 'fixed'."""
    v = _once("NPUSPEC_K_CONTROLLER", _parse_k_controller)
    return "online" if v is None else v


def _parse_bool(name: str, v: str) -> bool:
    s = v.strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off", ""):
        return False
    raise EnvError(f"{name}={v!r}: expected 1/0, true/false, yes/no or on/off; or unset it")


def _bool(name: str, default: bool) -> bool:
    b = _once(name, _parse_bool)
    return default if b is None else b


def native_ops() -> bool:
    """NPUSPEC_NATIVE_OPS: the CPU kernels' ops dispatched in C++ (kernels/native_cpu.py); on
    unless 0. Off keeps every call in their Python wrappers (a comparison, or a way around a
    build problem)."""
    return _bool("NPUSPEC_NATIVE_OPS", True)


def cpu_amx() -> bool:
    """NPUSPEC_CPU_AMX: bf16 x bf16 projections of >= 5 rows on AMX tiles where the CPU has
    them, and oneDNN's bf16 GEMM from 32 rows where only it has them (kernels/
    linear_packed_cpu.py); on unless 0. Off keeps bf16 x bf16 on the dot-product kernel up to
    512 rows, as on a CPU without AMX, so a verify step's rows round as the one-row decode
    step's (greedy speculation bit-identical to plain greedy decoding in bf16 at one request,
    docs/verify.md), without the tiles' speed-up."""
    return _bool("NPUSPEC_CPU_AMX", True)


def cpu_hugepages() -> bool:
    """NPUSPEC_CPU_HUGEPAGES: a CPU model's packed weights placed in one arena, in the order a
    step reads them, advised for transparent huge pages (npuspec/models/arena.py); on unless 0."""
    return _bool("NPUSPEC_CPU_HUGEPAGES", True)


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


def torchrun_rank() -> Optional[tuple[int, int, int]]:
    """(RANK, WORLD_SIZE, LOCAL_RANK) when this process was started by torchrun (or another
    launcher that sets them for torch.distributed's env:// rendezvous), else None."""
    vals = [os.environ.get(n) for n in ("RANK", "WORLD_SIZE", "LOCAL_RANK")]
    if vals[0] is None or vals[1] is None:
        return None
    try:
        rank, world = int(vals[0]), int(vals[1])
        local = rank if vals[2] is None else int(vals[2])
    except ValueError:
        raise EnvError(f"RANK={vals[0]!r}, WORLD_SIZE={vals[1]!r}, LOCAL_RANK={vals[2]!r}: "
                       f"expected integers, as torchrun sets them; unset them to run "
                       f"without a launcher") from None
    return rank, world, local


# name -> accessor, for `npuspec env` style listings and the env tests.
VARIABLES: dict[str, Callable] = {
    "NPUSPEC_CAPTURE_SIZES": capture_sizes,
    "NPUSPEC_CACHE_DIR": cache_dir,
    "NPUSPEC_DEVICE": device,
    "NPUSPEC_DEBUG_DUMP": debug_dump,
    "NPUSPEC_CACHE_TRUSTED_GROUP": cache_trusted_group,
    "NPUSPEC_CACHE_LOCK_TIMEOUT": cache_lock_timeout,
    "NPUSPEC_DEBUG": debug,
    "NPUSPEC_TP_TIMEOUT": tp_timeout,
    "NPUSPEC_TP_CPU_COMM": tp_cpu_comm,
    "NPUSPEC_K_CONTROLLER": k_controller,
    "NPUSPEC_NATIVE_OPS": native_ops,
    "NPUSPEC_CPU_AMX": cpu_amx,
    "NPUSPEC_CPU_HUGEPAGES": cpu_hugepages,
}


def check_all() -> None:
    """Parse every NPUSPEC_* variable now, raising EnvError for the first bad one (the public
    entry points call this before any work: see the module docstring)."""
    for accessor in VARIABLES.values():
        accessor()
