"""Padding dispatch over one graph set (one K): pad, copy, replay, slice.

A step is measured in *units* u (normally requests; its token count is `tokens_per_unit * u`).
Every token-carrying input dim has size `coef * u`. The set holds one captured graph per unit
size; a step with u units replays the smallest captured size u_pad >= u:

    tokens [coef*u] --copy--> static [coef*u_pad] (rows past u refilled with the pad value)
    replay
    outputs [coef*u_pad] --narrow--> [coef*u]          (padding rows dropped)

Padding rows are inert for a row-separable step: each row's outputs depend on that row only,
and draft ids of -1 make the verify op reject every padded draft. A step beyond the largest
size runs the callable eagerly (counted as eager_fallbacks, logged once per cause).

A replay computes what one eager call computes, once (docs/graphs.md, "Equal to eager"):
every input is copied in at every call (so one refilled in place is never stale), inputs the
step writes in place are copied back, captures run on the static buffers, never on the
caller's tensors, and by-reference state the step mutates is restored after a device capture's
warm-up runs. Static buffers keep the strides the graph was compiled for, and one lock per
set serialises calls from several threads.
"""
from __future__ import annotations

import bisect
import dataclasses
import logging
import threading
from typing import Any, Callable, Optional, Sequence

import torch

from npuspec import counters
from npuspec.graphs.runners import clone_outputs, make_runner

log = logging.getLogger("npuspec.graphs")

TOKEN = "token"    # tensor with a token dim: padded copy into a static buffer
COPY = "copy"      # tensor without a token dim: copied whole into a static buffer
STATIC = "static"  # tensor passed by address (parameters, buffers, mutated state)
INT = "int"        # Python int (a Dynamo SymInt): coef*u + const
CONST = "const"    # anything else, passed as is

_LOGGED: set = set()


def fallback(cause: str) -> None:
    """Count an eager fallback; log its cause the first time it happens."""
    counters.bump("eager_fallbacks")
    if cause not in _LOGGED:
        _LOGGED.add(cause)
        log.warning("npuspec graphs: running eagerly: %s (logged once; counted in "
                    "npuspec.counters['eager_fallbacks'])", cause)


@dataclasses.dataclass(frozen=True)
class Slot:
    kind: str
    dim: int = 0      # TOKEN: the token dim
    coef: int = 1     # TOKEN: size along dim = coef*u; INT: value = coef*u + const
    const: Any = 0    # INT: constant term
    pad: Any = 0      # TOKEN: value of the padding rows
    mutated: bool = False  # TOKEN/COPY: the step writes it in place; copy (real rows) back
    stride: tuple = ()     # TOKEN/COPY: per dim (a, b), stride = a*u + b; () = contiguous
    restore: bool = False  # STATIC: mutated; restored after a device capture's warm-up runs


def token(dim: int = 0, coef: int = 1, pad: Any = 0, mutated: bool = False) -> Slot:
    return Slot(TOKEN, dim, coef, 0, pad, mutated)


@dataclasses.dataclass
class _Entry:  # one captured size
    units: int
    runner: Any
    args: list
    outs: list


class GraphSet:
    """Captured graphs of one step function for one K, at several unit sizes.

    fn: the compiled step (called with the static buffers); slots: one Slot per positional arg;
    unit_sizes: sizes in units (token count / tokens_per_unit); out_dims: per output, the token
    dim or None (returned whole). capture: True = capture every size on first use (largest
    first), "lazy" = each size on its first use, False = never (plain calls). exact_only: the step
    is not row-separable, so only steps whose size is exactly captured replay.
    clone_outputs: return copies instead of views into the static outputs (which the next replay
    of that size overwrites).
    """

    def __init__(self, fn: Callable, slots: Sequence[Slot], unit_sizes: Sequence[int], *,
                 k: int = 0, tokens_per_unit: int = 1, out_dims: Optional[Sequence] = None,
                 runner: str = "cpu", capture=True, exact_only: bool = False,
                 clone_outputs: bool = False, name: str = "step", exact_why: str = ""):
        assert unit_sizes and all(s >= 1 for s in unit_sizes), unit_sizes
        assert any(s.kind == TOKEN for s in slots) or len(unit_sizes) == 1, slots
        self.fn, self.slots, self.k, self.name = fn, list(slots), k, name
        self.sizes = sorted(set(unit_sizes))
        self.tokens_per_unit = tokens_per_unit
        self.out_dims = None if out_dims is None else list(out_dims)
        self.runner_kind, self.capture_mode = runner, capture
        self.exact_only, self.clone_outputs = exact_only, clone_outputs
        self.exact_why = exact_why  # why the step is not padded (named in the fallback log)
        self.entries: dict[int, _Entry] = {}
        self._out_coef: Optional[list] = None
        self._out_type = tuple
        self._shared: dict[int, torch.Tensor] = {}  # slot index -> largest static buffer
        self._lock = threading.Lock()  # static buffers are shared: one call at a time
        self._dirty: dict[tuple, int] = {}  # (slot, buffer address) -> rows that may be non-pad
        self._token_idx = [i for i, s in enumerate(slots) if s.kind == TOKEN]
        self._copy_idx = [i for i, s in enumerate(slots) if s.kind == COPY]
        self._static_idx = [i for i, s in enumerate(slots) if s.kind == STATIC]
        self._restore_idx = [i for i in self._static_idx if slots[i].restore]
        self._back_idx = [i for i, s in enumerate(slots) if s.kind in (TOKEN, COPY) and s.mutated]

    # -- sizes -------------------------------------------------------------------------------
    def units_of(self, args: Sequence) -> Optional[int]:
        """u for these inputs, or None when the token dims are not coef*u for one u."""
        u = None
        for i in self._token_idx:
            s = self.slots[i]
            n = args[i].shape[s.dim]
            if n % s.coef:
                return None
            if u is None:
                u = n // s.coef
            elif n != s.coef * u:
                return None
        return u if u is not None else self.sizes[0]

    def pick(self, u: int) -> Optional[int]:
        if self.exact_only:
            return u if u in self.sizes else None
        i = bisect.bisect_left(self.sizes, u)
        return self.sizes[i] if i < len(self.sizes) else None

    # -- capture -------------------------------------------------------------------------------
    def _buffer(self, i: int, like: torch.Tensor, units: int) -> torch.Tensor:
        s = self.slots[i]
        shape = list(like.shape)
        if s.kind == COPY:
            if i not in self._shared:
                self._shared[i] = _empty(like, shape, s, units)
            return self._shared[i]
        shape[s.dim] = s.coef * units
        if s.dim == 0 and not any(a for a, _ in s.stride):
            # every size is a prefix view of the largest one (captured first)
            big = self._shared.get(i)
            if big is None or big.shape[0] < shape[0] or list(big.shape[1:]) != shape[1:]:
                big = self._shared[i] = _empty(like, [s.coef * self.sizes[-1]] + shape[1:], s,
                                               self.sizes[-1])
            return big[:shape[0]]
        return _empty(like, shape, s, units)

    def _static_args(self, args: Sequence, units: int) -> list:
        out = []
        for i, (s, a) in enumerate(zip(self.slots, args)):
            if s.kind in (TOKEN, COPY):
                out.append(self._buffer(i, a, units))
            elif s.kind == INT:
                out.append(s.coef * units + s.const)
            else:  # STATIC / CONST: by reference
                out.append(a)
        return out

    def capture(self, units: int, args: Sequence) -> _Entry:
        """Capture the graph at `units`, using `args` (any size) as shape/dtype templates."""
        assert units in self.sizes, (units, self.sizes)
        static = self._static_args(args, units)
        # Capture on padding rows only: the capture runs of a step with side effects (KV cache
        # writes) then touch only what padding rows touch (e.g. a scratch slot), never real data.
        self._fill_pad(static, args)
        runner = make_runner(self.runner_kind)
        # A device capture runs the step (warm-up runs): state it mutates by reference is put
        # back afterwards, so the call that captures mutates it once, as eager does. The CPU
        # runner runs nothing at capture.
        keep = ([(static[i], static[i].clone()) for i in self._restore_idx]
                if runner.kind != "cpu" else [])
        # The capture runs draw from a copy of the CPU generator, so the call that captures
        # sees eager's random stream (device generators: see docs/graphs.md).
        with torch.random.fork_rng(devices=[]):
            outs = runner.capture(self._typed_fn, static)
        for t, saved in keep:
            t.copy_(saved)
        if outs:
            self._learn_outputs(outs, units)
        e = self.entries[units] = _Entry(units, runner, static, runner.outs)
        log.debug("npuspec graphs: captured %s K=%d at %d tokens (%s runner)", self.name, self.k,
                  units * self.tokens_per_unit, self.runner_kind)
        return e

    def capture_all(self, args: Sequence) -> None:
        """Capture every missing size, largest first (the shared pool peaks at the largest)."""
        for units in reversed(self.sizes):
            if units not in self.entries:
                self.capture(units, args)

    def _typed_fn(self, *args):
        out = self.fn(*args)  # remember the container so results come back the same way
        self._out_type = type(out) if isinstance(out, (tuple, list)) else None
        return out

    def _learn_outputs(self, outs: list, units: int) -> None:
        if self._out_coef is not None:
            return
        if self.out_dims is None:
            self.out_dims = [0 if isinstance(o, torch.Tensor) and o.dim() > 0 else None for o in outs]
        assert len(self.out_dims) == len(outs), (self.out_dims, len(outs))
        coefs = []
        for o, d in zip(outs, self.out_dims):
            if d is None or not isinstance(o, torch.Tensor):
                coefs.append(None)
                continue
            n = o.shape[d]
            assert n % units == 0, f"output dim {d} of size {n} is not a multiple of {units} units"
            coefs.append(n // units)
        self._out_coef = coefs

    # -- run -----------------------------------------------------------------------------------
    def _fill_pad(self, static: list, args: Sequence) -> None:
        """Capture-time content: every token row is a padding row."""
        for i in self._token_idx:
            static[i].fill_(self.slots[i].pad)
            self._dirty[(i, static[i].data_ptr())] = 0
        for i in self._copy_idx:
            static[i].copy_(args[i])

    def _fill(self, static: list, args: Sequence) -> None:
        """Copy the real rows in; re-pad only rows a previous step left non-pad."""
        for i in self._token_idx:
            s, buf, a = self.slots[i], static[i], args[i]
            n, total = a.shape[s.dim], buf.shape[s.dim]
            key = (i, buf.data_ptr())  # sizes sharing a buffer share its dirty mark
            # rows >= dirty hold the pad value; rows below may hold an earlier step's data
            dirty = total if s.mutated else self._dirty.get(key, total)
            if n == total:
                buf.copy_(a)
                self._dirty[key] = max(dirty, total)
                continue
            buf.narrow(s.dim, 0, n).copy_(a)
            if dirty > n:
                buf.narrow(s.dim, n, min(dirty, total) - n).fill_(s.pad)
            self._dirty[key] = n if dirty <= total else dirty
        for i in self._copy_idx:
            # every call: a caller may refill one tensor in place through a numpy view or
            # `.data`, which its version counter does not see
            static[i].copy_(args[i])

    def _check_static(self, e: _Entry, args: Sequence) -> bool:
        for i in self._static_idx:
            a, b = args[i], e.args[i]
            if a is not b and (a.data_ptr() != b.data_ptr() or a.shape != b.shape
                               or a.stride() != b.stride()):
                return False
        return True

    def run(self, *args):
        u = self.units_of(args)
        if u is None:
            fallback(f"{self.name}: token dims are not proportional ({self._sizes_str(args)})")
            return self.fn(*args)
        return self.run_units(args, u)

    def run_units(self, args: Sequence, u: int):
        if self.capture_mode is False:
            return self.fn(*args)
        with self._lock:
            return self._run_locked(args, u)

    def _run_locked(self, args: Sequence, u: int):
        units = self.pick(u)
        if units is None:
            why = (f"not a captured size, and not padded ({self.exact_why or 'not row-separable'})"
                   if self.exact_only
                   else f"above the largest captured size ({self.sizes[-1] * self.tokens_per_unit} tokens)")
            fallback(f"{self.name} K={self.k}: {u * self.tokens_per_unit} tokens {why}")
            return self.fn(*args)
        e = self.entries.get(units)
        if e is None:
            if self.capture_mode is True:
                self.capture_all(args)
            else:
                self.capture(units, args)
            e = self.entries[units]
        if not self._check_static(e, args):
            fallback(f"{self.name}: a parameter/buffer input moved or changed shape since capture")
            return self.fn(*args)
        self._fill(e.args, args)
        outs = e.runner.replay()  # debug mode: the runner asserts the buffers did not move
        if self._out_coef is None:  # the CPU runner's first replay made the outputs
            self._learn_outputs(outs, units)
        for i in self._back_idx:  # in-place writes of the step go back to the caller's tensor
            s = self.slots[i]
            src = e.args[i] if s.kind == COPY else e.args[i].narrow(s.dim, 0, s.coef * u)
            args[i].copy_(src)
        return self._slice(outs, u, e.runner.alias, args)

    def _slice(self, outs: list, u: int, alias: dict, args: Sequence):
        res = []
        for j, (o, c, d) in enumerate(zip(outs, self._out_coef, self.out_dims)):
            if j in alias:  # the step returned an input (`return x.mul_(2)`): the caller's
                res.append(args[alias[j]])
                continue
            if c is not None and o.shape[d] != c * u:
                o = o.narrow(d, 0, c * u)
            res.append(o)
        if self.clone_outputs:  # outputs that are views of each other stay so (eager's aliasing)
            res = clone_outputs(res, skip=alias)
        if self._out_type is None:
            return res[0]
        return res if self._out_type is list else tuple(res)

    def _sizes_str(self, args) -> str:
        return ", ".join(f"arg{i}.shape[{self.slots[i].dim}]={args[i].shape[self.slots[i].dim]}"
                         for i in self._token_idx)

    @property
    def captured_sizes(self) -> list[int]:
        """Captured token counts, ascending."""
        return sorted(u * self.tokens_per_unit for u in self.entries)


def _empty(like: torch.Tensor, shape: list, s: Slot, units: int) -> torch.Tensor:
    """A buffer of `shape` with the strides the graph was compiled for (s.stride at `units`)."""
    if s.stride and len(s.stride) == len(shape):
        stride = [a * units + b for a, b in s.stride]
        if all(st > 0 or n <= 1 for st, n in zip(stride, shape)):
            return torch.empty_strided(shape, stride, dtype=like.dtype, device=like.device)
    return like.new_empty(shape)
