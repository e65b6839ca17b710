"""Graph runners: one captured graph at one size, behind one small protocol.

    runner = make_runner("cuda")            # or "acl" | "cpu"
    outs = runner.capture(fn, static_args)  # warm up, capture; returns the static outputs
    outs = runner.replay()                  # same output objects, refreshed

`static_args` are the graph's inputs at this size: tensors the dispatcher refills before every
replay (their storage must never move, since a device graph baked their addresses in), plus
Python ints (SymInt values, fixed per size). The outputs are static too: the next replay
overwrites them.

- CudaGraphRunner: torch.cuda.CUDAGraph / torch.cuda.graph.
- AclGraphRunner: torch.npu.NPUGraph / torch.npu.graph (torch_npu mirrors the CUDA graph API).
  Import-guarded: torch.npu is only touched when the runner is used. Tested against a fake
  torch.npu module only; unverified on Ascend hardware.
- CpuRunner: no device graph. It keeps the same static input and output buffers and runs the
  compiled callable on replay, so every piece of dispatch logic runs on CPU too.

All runners of one device share one memory pool (`shared_pool`), and the dispatcher captures the
largest size first, so a pool holds the largest graph's working memory, not the sum.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Protocol, Sequence

import torch

from npuspec import counters, envs
from npuspec.kernels import paged_attention_npu  # GRAPH_UPDATES, looked up per call (tests swap it)

log = logging.getLogger("npuspec.graphs")

WARMUP_RUNS = 2  # eager runs before a device capture (lazy inits, allocator warm-up)


class Runner(Protocol):
    kind: str

    def capture(self, fn: Callable, static_args: Sequence[Any]) -> list: ...

    def replay(self) -> list: ...


def _ptrs(args: Sequence[Any]) -> list[Optional[int]]:
    return [a.data_ptr() if isinstance(a, torch.Tensor) else None for a in args]


def _as_list(out) -> list:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _storage_key(t) -> Optional[int]:
    """The storage `t`'s memory lives in (None: not a tensor, or no memory to share)."""
    if not isinstance(t, torch.Tensor) or t.untyped_storage().nbytes() == 0:
        return None
    return t.untyped_storage().data_ptr()


def shared_storages(outs: Sequence[Any], skip=()) -> dict[int, list[int]]:
    """Storage -> indices of the outputs in it, for storages that hold two or more outputs
    (a view returned next to its base: `return o, o[:, None]`). `skip`: indices left out."""
    groups: dict[int, list[int]] = {}
    for j, o in enumerate(outs):
        k = _storage_key(o)
        if k is not None and j not in skip:
            groups.setdefault(k, []).append(j)
    return {k: js for k, js in groups.items() if len(js) > 1}


def clone_outputs(outs: Sequence[Any], skip=()) -> list:
    """Copies of `outs` (`skip`: indices returned as they are). Outputs that share a storage
    get one copy of it, each at its own offset, sizes and strides, so a view of an output is
    still a view of it, as in eager (where writing one shows in the other)."""
    shared = shared_storages(outs, skip)
    copies: dict[int, Any] = {}
    res = []
    for j, o in enumerate(outs):
        k = _storage_key(o)
        if j in skip or not isinstance(o, torch.Tensor):
            res.append(o)
        elif k not in shared:
            res.append(o.clone())
        else:
            if k not in copies:
                copies[k] = o.untyped_storage().clone()
            res.append(o.new_empty(0).set_(copies[k], o.storage_offset(), o.shape, o.stride()))
    return res


class _RunnerBase:
    kind = "base"

    def __init__(self):
        self.args: list = []
        self.outs: list = []
        self.alias: dict[int, int] = {}  # output index -> input index it *is* (x.mul_(2))
        self._in_ptrs: list = []
        self.captured = False

    def _record(self, static_args):
        self.args = list(static_args)
        self._in_ptrs = _ptrs(self.args)

    def _find_aliases(self, outs: list) -> None:
        """Outputs that are an input itself (same storage, shape and strides): the caller gets
        its own tensor back, as in eager, not a copy (Dynamo may store it as module state)."""
        for j, o in enumerate(outs):
            for i, a in enumerate(self.args):
                if (isinstance(o, torch.Tensor) and isinstance(a, torch.Tensor)
                        and o.data_ptr() == a.data_ptr() and o.shape == a.shape
                        and o.stride() == a.stride() and o.dtype == a.dtype):
                    self.alias[j] = i
                    break

    def check_addresses(self) -> None:
        """Debug mode (NPUSPEC_DEBUG=1): static inputs must not have moved since capture."""
        now = _ptrs(self.args)
        assert now == self._in_ptrs, (self.kind, self._in_ptrs, now)


class CpuRunner(_RunnerBase):
    """Static input/output buffers; 'replay' runs the compiled callable on them.

    Capture runs nothing (a CPU replay needs no recording), so a step with side effects runs
    exactly once per call. The static outputs are made by the first replay, into the list
    `capture` returned."""
    kind = "cpu"

    def __init__(self, pool=None):
        super().__init__()
        self.fn: Optional[Callable] = None
        self.shared: dict[int, list[int]] = {}  # outputs sharing a storage, refreshed as one

    def capture(self, fn, static_args):
        self._record(static_args)
        self.fn = fn
        self.outs = []
        self.captured = True
        counters.bump("graphs_captured")
        return self.outs

    def replay(self):
        if envs.debug():
            self.check_addresses()
        fresh = _as_list(self.fn(*self.args))
        if not self.outs:
            self._find_aliases(fresh)
            # Detach from the callable's own allocations, as a device graph's outputs would be.
            self.shared = shared_storages(fresh, skip=self.alias)
            outs = clone_outputs(fresh, skip=self.alias)
            self.outs.extend(self.args[self.alias[j]] if j in self.alias else o
                             for j, o in enumerate(outs))
        else:
            grouped = {j for js in self.shared.values() for j in js}
            for i, (s, f) in enumerate(zip(self.outs, fresh)):
                if i in self.alias or i in grouped:
                    continue
                if isinstance(s, torch.Tensor):
                    s.copy_(f)
                else:
                    self.outs[i] = f
            self._refresh_shared(fresh)
        counters.bump("graph_replays")
        return self.outs

    def _refresh_shared(self, fresh: list) -> None:
        """Outputs that share a storage: copy the storage (a copy_ into each could not write
        an expanded view, whose elements overlap)."""
        for js in self.shared.values():
            dst, src = self.outs[js[0]].untyped_storage(), fresh[js[0]].untyped_storage()
            if dst.nbytes() == src.nbytes():
                dst.copy_(src)
                continue
            # a storage of another size than at the first replay: new copies, not a partial copy
            for j, o in zip(js, clone_outputs([fresh[j] for j in js])):
                self.outs[j] = o


class DeviceGraphRunner(_RunnerBase):
    """Capture/replay through a torch.cuda-like module (`torch.cuda` or `torch.npu`)."""
    kind = "device"
    graph_class = "CUDAGraph"

    def __init__(self, pool=None):
        super().__init__()
        self.api = self.module()
        self.pool = pool if pool is not None else shared_pool(self.kind)
        self.graph = None

    @staticmethod
    def module():
        raise NotImplementedError

    def capture(self, fn, static_args):
        api = self.api
        self._record(static_args)
        # Warm up on a side stream (lazy initialisation must not land inside the graph).
        side = api.Stream()
        side.wait_stream(api.current_stream())
        with api.stream(side):
            for _ in range(WARMUP_RUNS):
                fn(*self.args)
        api.current_stream().wait_stream(side)
        api.synchronize()
        self.graph = getattr(api, self.graph_class)()
        with api.graph(self.graph, pool=self.pool):
            outs = _as_list(fn(*self.args))
        api.synchronize()
        self.outs = outs
        self._find_aliases(outs)
        self.captured = True
        counters.bump("graphs_captured")
        return self.outs

    def replay(self):
        if envs.debug():
            self.check_addresses()
        self.graph.replay()
        counters.bump("graph_replays")
        return self.outs


class CudaGraphRunner(DeviceGraphRunner):
    kind = "cuda"
    graph_class = "CUDAGraph"

    @staticmethod
    def module():
        return torch.cuda


class AclGraphRunner(DeviceGraphRunner):
    """ACL graphs via torch_npu (torch.npu.NPUGraph, torch.npu.graph). Unverified on hardware."""
    kind = "acl"
    graph_class = "NPUGraph"

    @staticmethod
    def module():
        npu = getattr(torch, "npu", None)
        if npu is None or not hasattr(npu, "NPUGraph"):
            try:  # torch_npu registers torch.npu; only imported when an ACL runner is wanted
                import torch_npu  # noqa: F401
            except Exception as e:
                raise RuntimeError(
                    "the ACL graph runner needs torch_npu (pip install npuspec[npu], with CANN); "
                    f"import failed: {e}. Use options['capture']=False or NPUSPEC_DEVICE=cpu") from e
            npu = torch.npu
        return npu

    # npu_fused_infer_attention_score takes its lengths as host lists, frozen into the graph at
    # capture: its captured tasks are recorded while capturing and re-issued with the current
    # lengths before every replay (kernels/paged_attention_npu.py, docs/attention_npu.md)
    def capture(self, fn, static_args):
        with paged_attention_npu.GRAPH_UPDATES.capturing(self):
            return super().capture(fn, static_args)

    def replay(self):
        paged_attention_npu.GRAPH_UPDATES.before_replay(self)
        return super().replay()


RUNNERS = {"cpu": CpuRunner, "cuda": CudaGraphRunner, "acl": AclGraphRunner}
_POOLS: dict[str, Any] = {}


def shared_pool(kind: str):
    """The one memory pool every graph of this runner kind captures into (None for cpu)."""
    if kind == "cpu":
        return None
    if kind not in _POOLS:
        api = RUNNERS[kind].module()
        _POOLS[kind] = api.graph_pool_handle()
    return _POOLS[kind]


def make_runner(kind: str) -> Runner:
    if kind not in RUNNERS:
        raise ValueError(f"graph runner {kind!r}: must be one of {', '.join(RUNNERS)}")
    return RUNNERS[kind]()
