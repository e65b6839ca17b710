"""Which device we run on, and what it can do (DESIGN.md §5).

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
    elif dev == "npu" and not _npu_available():
        raise RuntimeError("NPUSPEC_DEVICE=npu but torch_npu cannot be imported or sees no NPU; "
                           "install npuspec[npu] with CANN, or unset NPUSPEC_DEVICE")
    elif dev == "cuda" and not _cuda_available():
        raise RuntimeError("NPUSPEC_DEVICE=cuda but torch.cuda.is_available() is False; "
                           "unset NPUSPEC_DEVICE or set it to cpu")
    runner = {"npu": "acl", "cuda": "cuda", "cpu": "cpu"}[dev]
    limit = NPU_MAX_TOKENS_PER_REQUEST if dev == "npu" else math.inf
    return Platform(dev, runner, triton_available(dev), limit, _device_name(dev))


DEVICES = ("npu", "cuda", "cpu")


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
