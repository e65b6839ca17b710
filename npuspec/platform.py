"""Which device we run on, and what it can do (docs/design.md, "Platforms").

torch_npu is imported only while probing for an NPU, and any failure of that import (absent, or
installed without CANN, which raises on libhccl.so) means "no NPU", logged once at DEBUG.
NPUSPEC_DEVICE overrides detection.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging
import math
from typing import Optional

from npuspec import envs

log = logging.getLogger(__name__)

# The fused attention operator on Ascend takes at most 16 query tokens per request per round.
NPU_MAX_TOKENS_PER_REQUEST = 16


class DeviceUnavailable(envs.EnvError, RuntimeError):
    """NPUSPEC_DEVICE names a device that is not here: a RuntimeError (what callers have always
    caught), and an EnvError (a ValueError) so the CLI reports it as the user's to fix (exit 2)."""


@dataclasses.dataclass(frozen=True)
class Platform:
    device: str  # "npu" | "cuda" | "cpu"
    graph_runner: str  # "acl" | "cuda" | "cpu"
    has_triton: bool
    # Query tokens one request may carry in one decode round (K+1 must fit); inf = no limit.
    max_tokens_per_request: float
    device_name: str = ""

    @property
    def torch_device(self) -> str:
        return self.device

    def check_tokens_per_request(self, k: int, key: str = "num_speculative_tokens") -> None:
        if k + 1 > self.max_tokens_per_request:
            raise ValueError(
                f"{key}={k}: K+1={k + 1} exceeds the {self.device} limit of "
                f"{int(self.max_tokens_per_request)} query tokens per request per decode round "
                f"(the fused attention operator's limit); use {key} <= "
                f"{int(self.max_tokens_per_request) - 1}")


def _npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    try:
        import torch_npu  # noqa: F401  (registers torch.npu)
        import torch
        return bool(torch.npu.is_available())
    except Exception as e:  # broken install (e.g. no CANN): treat as absent
        log.debug("torch_npu present but unusable: %s", e)
        return False


def _cuda_available() -> bool:
    import torch
    return torch.cuda.is_available()


def triton_available(device: str) -> bool:
    """Triton can launch kernels on `device` (on CPU only through TRITON_INTERPRET=1)."""
    spec = importlib.util.find_spec("triton")
    if spec is None:
        return False
    if device == "cpu":
        return envs.triton_interpret()
    return True


def _device_name(device: str) -> str:
    import torch
    try:
        if device == "cuda":
            return torch.cuda.get_device_name()
        if device == "npu":
            return torch.npu.get_device_name()
    except Exception as e:
        log.debug("could not read the %s device name: %s", device, e)
    import platform as _p
    return _p.processor() or _p.machine()


def detect(device: Optional[str] = None) -> Platform:
    """Build the Platform for `device`, or for NPUSPEC_DEVICE, or for what is present."""
    dev = device or envs.device()
    if dev is None:
        dev = "npu" if _npu_available() else "cuda" if _cuda_available() else "cpu"
    else:  # a configuration mistake, not a bug: EnvError (a ValueError) with the fix
        check_available(dev, f"NPUSPEC_DEVICE={dev}", "unset NPUSPEC_DEVICE to detect the "
                        "device", error=DeviceUnavailable)
    runner = {"npu": "acl", "cuda": "cuda", "cpu": "cpu"}[dev]
    limit = NPU_MAX_TOKENS_PER_REQUEST if dev == "npu" else math.inf
    return Platform(dev, runner, triton_available(dev), limit, _device_name(dev))


DEVICES = ("npu", "cuda", "cpu")


def check_available(dev: str, what: str, alt: str, error: type = ValueError) -> None:
    """Raise `error` quoting `what` (key=value) unless a device of type `dev` is present
    (`alt`: the other fix)."""
    if dev == "npu" and not _npu_available():
        raise error(f"{what}: torch_npu cannot be imported or sees no NPU; install "
                    f"npuspec[npu] with CANN, or {alt}")
    if dev == "cuda" and not _cuda_available():
        import torch
        why = ("this torch build has no CUDA" if torch.version.cuda is None
               else "torch.cuda.is_available() is False (no GPU visible)")
        raise error(f"{what}: {why}; install a CUDA build of torch on a GPU machine, or "
                    f"{alt}")


def parse_device(device, key: str = "device"):
    """`LLM(device=...)`: None (the current platform's), a string such as 'cuda:1', or a
    torch.device -> a torch.device of a type npuspec runs on that is present here."""
    import torch
    if device is None:
        return torch.device(current_platform().device)
    fix = f"use one of {', '.join(map(repr, DEVICES))} (optionally with an index, e.g. 'cuda:1')"
    if not isinstance(device, (str, torch.device)):
        raise ValueError(f"{key}={device!r}: must be a string or torch.device; {fix}")
    alt = "pass device='cpu' (or None to detect)"
    if isinstance(device, str) and device.split(":")[0] == "npu":
        # importing torch_npu (in the check) registers the 'npu' device type with torch
        check_available("npu", f"{key}={device!r}", alt)
    try:
        d = torch.device(device)
    except RuntimeError:  # torch's 'Invalid device string' / 'Expected one of cpu, cuda, ...'
        d = None
    if d is None or d.type not in DEVICES:
        raise ValueError(f"{key}={device!r}: not a device npuspec runs on; {fix}, or None to "
                         f"detect")
    check_available(d.type, f"{key}={device!r}", alt)
    if d.type == "cuda" and d.index is not None and d.index >= torch.cuda.device_count():
        raise ValueError(f"{key}={device!r}: only {torch.cuda.device_count()} CUDA device(s) "
                         f"are visible; use an index below that, or 'cuda' for the current one")
    return d


def free_memory(device) -> tuple[int, str]:
    """(bytes free for new allocations on `device`, where that number comes from)."""
    import torch
    d = torch.device(device)
    if d.type == "cuda":
        return torch.cuda.mem_get_info(d)[0], "torch.cuda.mem_get_info"
    if d.type == "npu":
        return torch.npu.mem_get_info(d)[0], "torch.npu.mem_get_info"
    free, source = _meminfo_available()
    limit = _cgroup_headroom()  # a container's limit is lower than the host's MemAvailable
    if limit is not None and limit < free:
        return limit, "the cgroup memory limit less its usage"
    return free, source


def _meminfo_available() -> tuple[int, str]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"
    except OSError:
        pass
    import os  # not Linux: free physical pages
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "sysconf(SC_AVPHYS_PAGES)"


def _cgroup_headroom() -> Optional[int]:
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                          "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit) as f, open(usage) as g:
                lim, used = f.read().strip(), g.read().strip()
        except OSError:
            continue
        if lim.isdigit() and used.isdigit():  # "max": no limit
            return max(0, int(lim) - int(used))
    return None


def named(device: str) -> Platform:
    """The Platform a device name implies, without probing for the device (for planning a
    deployment elsewhere: its limits, not its presence; `has_triton` is not known, so False)."""
    if device not in DEVICES:
        raise ValueError(f"platform={device!r}: use one of {', '.join(map(repr, DEVICES))} or a "
                         f"npuspec Platform (npuspec.platform.current_platform())")
    limit = NPU_MAX_TOKENS_PER_REQUEST if device == "npu" else math.inf
    return Platform(device, {"npu": "acl", "cuda": "cuda", "cpu": "cpu"}[device], False, limit)


@functools.lru_cache(maxsize=None)
def _cached(key: Optional[str]) -> Platform:
    return detect(key)


def current_platform() -> Platform:
    """The platform for this process (re-detected when NPUSPEC_DEVICE changes)."""
    return _cached(envs.device())
