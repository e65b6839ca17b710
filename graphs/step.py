"""The backend's capture wrapper: one callable per Dynamo graph, one GraphSet per K inside.

    compiled = lowering.lower(gm, example_inputs, opts)
    return wrap_compiled(gm, example_inputs, compiled, opts, platform)

Dynamo calls the returned StepDispatcher with real-size inputs. Token dims are unbacked
(`mark_token_dim`), so one Dynamo graph and one compiled callable serve every batch size, 1
included; the dispatcher pads each step to the next captured size (one request for B=1) and
replays. A K that Dynamo keeps static
(drafts [B, K]) gets its own Dynamo graph, hence its own dispatcher; a K that Dynamo made
dynamic is a key symbol here, and each value gets its own GraphSet. Either way a swap back to a
seen K finds its set already captured.
"""
from __future__ import annotations

import logging
import threading
import weakref
from typing import Any, Callable, Sequence

import torch

from npuspec.graphs.dispatch import TOKEN, GraphSet, fallback
from npuspec.graphs.layout import analyse, concretize, key_of, runtime_values
from npuspec import envs
from npuspec.graphs.plan import k_values_of, plan_capture_sets, plan_capture_sizes

log = logging.getLogger("npuspec.graphs")

MAX_KEYS = 16  # graph sets per Dynamo graph; beyond this, new layouts run eagerly (counted)
_LIVE: "weakref.WeakSet[StepDispatcher]" = weakref.WeakSet()


def live_dispatchers() -> list:
    """Every StepDispatcher still alive (one per Dynamo graph), for introspection and tests."""
    return list(_LIVE)


_PLANS: dict = {}


def planned_sizes(k: int, opts, platform) -> list[int]:
    """The capture sizes for K. Every K of the config is planned together, once per process
    and setting, so a rounding warning is given once for all K, not once per Dynamo graph."""
    ks = k_values_of(opts.speculative_config)
    key = (ks, opts.max_num_seqs, opts.capture_sizes, envs.capture_sizes() and
           tuple(envs.capture_sizes()), platform.device)
    if key not in _PLANS:
        _PLANS[key] = plan_capture_sets(ks, opts.max_num_seqs, opts.capture_sizes, platform)
    plans = _PLANS[key]
    if k not in plans:  # a K the config does not list (e.g. K=0 for a plain graph)
        plans[k] = plan_capture_sizes(k, opts.max_num_seqs, opts.capture_sizes, platform)
    return plans[k]


class StepDispatcher:
    def __init__(self, compiled: Callable, layout, opts, platform, name: str = "step"):
        self.compiled, self.layout, self.opts, self.platform = compiled, layout, opts, platform
        self.name = name
        self.sets: dict[Any, GraphSet] = {}
        self.seen: set = set()  # keys of a graph with nothing to pad, seen once
        self._lock = threading.Lock()
        # Nothing to pad (no token dims): on CPU a replay would only add copies, so the
        # compiled graph is called directly; on a device a shape is captured on its second
        # call, so shapes that never come back (HF generate's growing KV length) cost none.
        self.direct = not layout.pad_syms and platform.graph_runner == "cpu"
        _LIVE.add(self)

    def __call__(self, *args):
        if self.layout.reason:
            fallback(f"{self.name}: cannot pad this graph ({self.layout.reason})")
            return self.compiled(*args)
        if self.direct:
            return self.compiled(*args)
        key, u = key_of(self.layout, runtime_values(self.layout, args))
        with self._lock:
            gs = self._set_for(key, args)
        return self.compiled(*args) if gs is None else gs.run_units(args, u)

    def _set_for(self, key, args):
        """The graph set of `key` (made on first use), or None: run the compiled graph."""
        gs = self.sets.get(key)
        if gs is not None:
            return gs
        if not self.layout.pad_syms and key not in self.seen:
            self.seen.add(key)  # first call at this shape: not worth a capture yet
            return None
        if len(self.sets) >= MAX_KEYS:
            fallback(f"{self.name}: more than {MAX_KEYS} distinct shape layouts")
            return None
        gs = self.sets[key] = self._make_set(key, args)
        return gs

    def _pick_k(self, kl, slots, args) -> int:
        if kl.k is not None:
            return kl.k
        ks = k_values_of(self.opts.speculative_config)
        if len(ks) == 1:
            return ks[0]
        coefs = [s.coef for s in slots if s.kind == TOKEN]
        if coefs and max(coefs) % min(coefs) == 0 and max(coefs) // min(coefs) - 1 in ks:
            return max(coefs) // min(coefs) - 1  # flat tokens [B*(K+1)] next to rows [B, ...]
        for s, a in zip(slots, args):  # [rows, K+1, ...] token inputs name their K
            if s.kind == TOKEN and s.dim == 0 and a.dim() >= 2 and a.shape[1] - 1 in ks:
                return a.shape[1] - 1
        log.info("npuspec graphs: %s: cannot tell which K of %s this graph runs; planning "
                 "token sizes without a K+1 multiple", self.name, ks)
        return 0

    def _make_set(self, key, args) -> GraphSet:
        kl = concretize(self.layout, key)
        k = self._pick_k(kl, kl.slots, args)
        tpu = kl.tokens_per_unit
        if tpu is None:  # [rows, K+1] inputs: a unit is a request; flat [T] inputs: a token
            tpu = max([s.coef for s in kl.slots if s.kind == TOKEN] or [1])
            for s, a in zip(kl.slots, args):
                if s.kind == TOKEN and s.dim == 0 and a.dim() >= 2 and a.shape[1] == k + 1:
                    tpu = s.coef * (k + 1)
                    break
        if not any(s.kind == TOKEN for s in kl.slots):
            units = [1]  # nothing to pad: one graph at the traced shape
        else:
            sizes = planned_sizes(k, self.opts, self.platform)
            units = sorted({-(-s // tpu) for s in sizes})
            units = [n for n in units if kl.ok_units(n)]
        if not units:
            units = [1]
            kl.exact_only = True
        log.info("npuspec graphs: %s K=%d: %s graph set at %s tokens (%s)", self.name, k,
                 self.platform.graph_runner, [n * tpu for n in units],
                 "exact sizes only" if kl.exact_only else "padded")
        return GraphSet(self.compiled, kl.slots, units, k=k, tokens_per_unit=tpu,
                        out_dims=kl.out_dims, runner=self.platform.graph_runner,
                        capture=self.opts.capture, exact_only=kl.exact_only,
                        clone_outputs=True, name=self.name,
                        exact_why=self.layout.rows or "its outputs are not row-aligned")


def wrap_compiled(gm: torch.fx.GraphModule, example_inputs: Sequence, compiled: Callable,
                  opts, platform) -> Callable:
    """The backend's hook: `compiled` wrapped in padding dispatch, unless capture is off."""
    if opts.capture is False:
        return compiled
    layout = analyse(gm, example_inputs)
    return StepDispatcher(compiled, layout, opts, platform, name=f"graph{len(gm.graph.nodes)}")
