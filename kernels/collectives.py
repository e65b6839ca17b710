"""Tensor-parallel collectives as opaque custom ops: npuspec::tp_all_reduce, npuspec::tp_all_gather.

A sharded model calls these where Megatron's layers meet (after the row-parallel attention
output and MLP down projections, after the vocabulary-parallel embedding, and on the
vocabulary-parallel LM head's logits). As `torch.library` ops with fake implementations,
Dynamo traces them as single nodes and Inductor calls them as extern kernels, so a compiled
(and, on CUDA/NPU, captured) step issues each collective exactly where the eager model does,
in the same order on every rank. vLLM spells its collectives the same way, for the same reason.

The group is process-wide (one tensor-parallel engine per process): `set_group` installs it.
With no group (one device) the ops are never called: the model does not shard.

`COMM` counts what the ops moved on this rank (calls, payload bytes, seconds inside the
collective); `npuspec bench tp` reads it per step.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from typing import Optional

import torch
import torch.distributed as dist

from npuspec._counters import counters

log = logging.getLogger("npuspec.kernels")

_GROUP: Optional[dist.ProcessGroup] = None
_SHM = None  # a kernels.shm_collectives.ShmComm when the ranks share this host's memory
COMM = {"all_reduce": 0, "all_gather": 0, "bytes": 0, "seconds": 0.0, "shm": 0}
_told: set = set()
# gloo's worker thread lets go of a collective's tensors just after the caller's wait returns.
# Freeing a tensor that Python has seen takes the GIL, and a thread that asks for it while the
# interpreter finalizes aborts the process ("terminate called without an active exception":
# torchrun's ranks hit it under CPU load, right after their last step). So the tensors of the
# latest gloo collectives are kept here with the C++ reference count each had before the
# call, and `drain_gloo` (TP shutdown, interpreter still whole) waits until gloo let go.
_GLOO_HELD: deque = deque(maxlen=32)


def set_group(group: Optional[dist.ProcessGroup], shm=None) -> None:
    """Install (or, with None, clear) the tensor-parallel group the ops run over, and the
    shared-memory path same-host CPU ranks take for what fits it."""
    global _GROUP, _SHM
    _GROUP, _SHM = group, shm


def gloo_call(fn, *tensors: torch.Tensor) -> None:
    """Run `fn()`, a blocking gloo collective over `tensors`, and remember the tensors until
    `drain_gloo` sees gloo release them."""
    held = tuple((t, t._use_count()) for t in tensors)
    fn()
    while _GLOO_HELD and _released(_GLOO_HELD[0]):  # keep only what gloo may still hold: a
        _GLOO_HELD.popleft()                         # prefill's logits parts are large
    _GLOO_HELD.append(held)


def _released(held: tuple) -> bool:
    return all(t._use_count() <= base for t, base in held)


def drain_gloo(timeout_s: float = 5.0) -> bool:
    """Wait (GIL released) until gloo's threads dropped every remembered tensor. -> whether
    they did within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while _GLOO_HELD:
        if _released(_GLOO_HELD[0]):
            _GLOO_HELD.popleft()
        elif time.monotonic() > deadline:
            log.debug("npuspec: gloo still holds a collective's tensors after %.0f s", timeout_s)
            _GLOO_HELD.clear()
            return False
        else:
            time.sleep(0.001)
    return True


def _shm_for(x: torch.Tensor):
    """The shm path for x, or None (gloo): every rank decides alike (same shapes, dtypes)."""
    if _SHM is None:
        return None
    if _SHM.fits(x):
        return _SHM
    why = "dtype" if x.dtype != torch.float32 else "size"
    counters.bump("tp_shm_fallbacks")
    if why not in _told:
        _told.add(why)
        log.info("npuspec: a %s tensor of %s (%d bytes) is over the shared-memory collectives' "
                 "%s limit; it goes through gloo (counted in tp_shm_fallbacks)",
                 x.dtype, tuple(x.shape), x.numel() * x.element_size(), why)
    return None


def reset_comm() -> None:
    COMM.update(all_reduce=0, all_gather=0, bytes=0, seconds=0.0, shm=0)


def _count(kind: str, nbytes: int, t0: float) -> None:
    COMM[kind] += 1
    COMM["bytes"] += nbytes
    COMM["seconds"] += time.perf_counter() - t0


@torch.library.custom_op("npuspec::tp_all_reduce", mutates_args=())
def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of `x` over the ranks (a new tensor; every rank gets the same bits)."""
    assert _GROUP is not None, "npuspec::tp_all_reduce outside a tensor-parallel engine"
    t0 = time.perf_counter()
    shm = _shm_for(x)
    if shm is not None:
        out = shm.all_reduce(x)
        COMM["shm"] += 1
    else:
        out = x.contiguous().clone()
        gloo_call(lambda: dist.all_reduce(out, group=_GROUP), out)
    _count("all_reduce", out.numel() * out.element_size(), t0)
    return out


@tp_all_reduce.register_fake
def _(x):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("npuspec::tp_all_gather", mutates_args=())
def tp_all_gather(x: torch.Tensor, world: int) -> torch.Tensor:
    """The ranks' `x` concatenated in rank order along the last dim: [..., world * n]."""
    assert _GROUP is not None, "npuspec::tp_all_gather outside a tensor-parallel engine"
    t0 = time.perf_counter()
    shm = _shm_for(x)
    if shm is not None:
        out = shm.all_gather(x)
        COMM["shm"] += 1
    else:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(world)]
        # gloo has no all_gather_into_tensor
        gloo_call(lambda: dist.all_gather(parts, x, group=_GROUP), x, *parts)
        out = torch.cat(parts, dim=-1)
    _count("all_gather", out.numel() * out.element_size(), t0)
    return out


@tp_all_gather.register_fake
def _(x, world):
    return x.new_empty((*x.shape[:-1], x.shape[-1] * world))

