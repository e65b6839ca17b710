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
from typing import Optional

import torch
import torch.distributed as dist

from npuspec._counters import counters

log = logging.getLogger("npuspec.kernels")

_GROUP: Optional[dist.ProcessGroup] = None
_SHM = None  # a kernels.shm_collectives.ShmComm when the ranks share this host's memory
COMM = {"all_reduce": 0, "all_gather": 0, "bytes": 0, "seconds": 0.0, "shm": 0}
_told: set = set()


def set_group(group: Optional[dist.ProcessGroup], shm=None) -> None:
    """Install (or, with None, clear) the tensor-parallel group the ops run over, and the
    shared-memory path same-host CPU ranks take for what fits it."""
    global _GROUP, _SHM
    _GROUP, _SHM = group, shm


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
        dist.all_reduce(out, group=_GROUP)
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
        dist.all_gather(parts, x, group=_GROUP)  # gloo has no all_gather_into_tensor
        out = torch.cat(parts, dim=-1)
    _count("all_gather", out.numel() * out.element_size(), t0)
    return out


@tp_all_gather.register_fake
def _(x, world):
    return x.new_empty((*x.shape[:-1], x.shape[-1] * world))

