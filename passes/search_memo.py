"""The pattern matcher's search re-trace, reused where the user's shapes cannot change it.

Inductor's `register_replacement` matches a spelling first with every literal ignored (ints,
floats, lists, dtypes, devices: the pattern was traced at tiny example shapes), then, to check
the literals, traces the search function again at the match's own shapes and dtypes and
matches that "specific" pattern with every literal compared. That re-trace was about half of
the passes' time in a compile (fake execution of every op at fresh shapes), and it is repeated
for every graph, though for most spellings it gives the same graph at every shape.

`SearchMemo` is a spelling's trace function. It traces as before (`trace_canonical`), and
when a re-trace gives exactly the graph of an earlier trace at other sizes (every node, target
and literal equal), it keeps that graph for the arguments' *signature*: per tensor its dtype,
device (with its index), rank, which dims are 1 and which strides are the contiguous ones;
every other argument by value. The earlier trace is the registration's at the example shapes (when its ranks and
scalars are the match's) or the signature's previous re-trace. A later match with the same
signature reuses the graph instead of tracing, if its sizes also agree with the kept ones at
every position where the two traces' sizes coincided: a literal derived from a size that was
equal in both traces is then equal in this one too, and one derived from a size that differed
would have made the two graphs differ (nothing kept; the next trace is compared again). Reuse
only skips work: the kept graph is matched against the user's with every literal compared,
exactly as a fresh trace would be; symbolic sizes are always traced. (A replacement is traced
at every match, recorded without make_fx where it can be: passes/direct_trace.py.) So the
first graph of a spelling in a process traces (twice where the example's ranks differ from
the user's), and the graphs after it at new batch sizes do not.

For the default families the registration's graph and a witness trace at moved sizes are
made offline and shipped (passes/trace_store.py, `witness`), so a first match whose sizes equal
the examples' wherever the spelling's literals follow a size reuses the registration's graph.
Two more kinds of evidence are made there: each spelling traced again with a leading dim on
every argument (`variants`: a row rule applied to [B, K, V]), with its own witness, and for
each trace whether it is the same with every argument strided (`strides_free`), so that
sliced arguments (vLLM's `probs[:, :K]`) take the contiguous one's graph. A first match
whose signature is one of these reuses it (`SearchMemo._shipped`).

The evidence is two traces, not a proof: a spelling whose graph changes only at sizes neither
trace had (a branch on `V > 64`) would be missed. The families' spellings branch on no size
(tests/passes/test_search_memo.py traces every one at a third set of sizes and compares).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Callable, Optional

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.fx.node import map_aggregate, map_arg

from npuspec.passes.direct_trace import direct_trace

STATS = {"traced": 0, "reused": 0, "kept": 0}  # search re-traces over the process


def _tensor_sig(t: torch.Tensor) -> tuple:
    size, stride = t.shape, t.stride()
    contiguous, acc = [], 1
    for d in reversed(range(t.dim())):
        contiguous.append(stride[d] == acc)
        acc *= size[d]
    return ("T", t.dtype, str(t.device), t.dim(), tuple(s == 1 for s in size),
            tuple(reversed(contiguous)))


def _static(t: torch.Tensor) -> bool:
    return all(type(s) is int for s in (*t.shape, *t.stride()))


def signature(args) -> Optional[tuple]:
    """The arguments' signature (module docstring), or None when a size is symbolic."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            if not _static(a):
                return None
            out.append(_tensor_sig(a))
        elif isinstance(a, (int, float, bool, str, type(None))):
            out.append(("V", type(a).__name__, a))
        else:
            return None
    return tuple(out)


def _values(args) -> tuple:
    return tuple(None if isinstance(a, torch.Tensor) else (type(a).__name__, a) for a in args)


def _ranks(sizes: tuple) -> tuple:
    return tuple(None if s is None else len(s) for s in sizes)


def _sizes(args) -> tuple:
    return tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else None for a in args)


def _const(t) -> Optional[tuple]:
    if not isinstance(t, torch.Tensor):
        return (type(t).__name__,)
    if t.numel() > 4096:
        return None  # too large to compare by value: no key
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    with unset_fake_temporarily():
        return (tuple(t.shape), t.dtype, tuple(t.detach().cpu().flatten().tolist()))


def _symbolic(a, symbols: dict):
    if isinstance(a, (list, tuple)):
        return type(a)(_symbolic(x, symbols) for x in a)
    if type(a) is int and a in symbols:
        return symbols[a]
    return a


def nodes_key(order: list, inputs: list = (), module=None,
              symbols: Optional[dict] = None) -> Optional[tuple]:
    """The nodes of `order` (in order) reading `inputs` (by position) and each other: every
    node's op, target and arguments (nodes by position, literals as they are) and each
    constant's value. Equal keys, equal computations. None when a node reads something
    outside, or a constant is too large to compare. `symbols` {int: name} writes the int
    literals equal to a size by the size's name (a batch size B as "B"): equal keys are then
    one computation written for each size."""
    index = {m: ("in", i) for i, m in enumerate(inputs)}
    out = []
    for i, n in enumerate(order):
        if any(a not in index for a in n.all_input_nodes):
            return None
        ref = index.__getitem__
        const = None
        if n.op == "get_attr":
            owner = module if module is not None else n.graph.owning_module
            const = _const(getattr(owner, n.target, None))
            if const is None:
                return None
        target = "" if n.op in ("placeholder", "get_attr") else str(n.target)
        args, kwargs = n.args, n.kwargs
        if symbols:  # literals only: before the nodes become their positions
            args, kwargs = _symbolic(args, symbols), {k: _symbolic(v, symbols)
                                                      for k, v in kwargs.items()}
        args, kwargs = map_arg(args, ref), map_arg(kwargs, ref)
        out.append((n.op, target, repr(args), repr(kwargs), const))
        index[n] = ("%", i)
    return tuple(out)


def size_names(**sizes: int) -> dict:
    """{int: name} for nodes_key's `symbols`: each size and its neighbours (B=8 gives 7 "B-1",
    8 "B", 9 "B+1"); a value two sizes share keeps the name given last."""
    out = {}
    for name, v in sizes.items():
        out.update({v + 1: f"{name}+1", v - 1: f"{name}-1", v: name})
    return out


MEMO_MAX = 256  # entries a check's memo keeps before it starts again


def remember(memo: dict, key, value) -> None:
    """memo[key] = value, the memo emptied first when it is full (MEMO_MAX)."""
    if len(memo) >= MEMO_MAX:
        memo.clear()
    memo[key] = value


def graph_key(gm: torch.fx.GraphModule) -> tuple:
    """nodes_key of a whole graph: two graphs with equal keys are one pattern."""
    key = nodes_key(list(gm.graph.nodes), (), gm)
    return key if key is not None else ("unkeyed", id(gm))


@dataclasses.dataclass
class _Kept:
    gm: torch.fx.GraphModule
    sizes: tuple   # the first match's sizes
    fixed: tuple   # per argument, the dims where the example's size equalled the match's


SHIFT = 100  # a size class moved by this lands past every example size: no new coincidence


@contextlib.contextmanager
def quiet():
    """Fake tensors log each meta that fails: a spelling that cannot take a shape is expected."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


def _traces_to(trace: Callable, args, key, make) -> bool:
    """Whether `trace` of `args`, each tensor remade as `make(a)` under a FakeTensorMode,
    gives the graph whose graph_key is `key` (False where it cannot trace them)."""
    with quiet(), FakeTensorMode():
        moved = [make(a) if isinstance(a, torch.Tensor) else a for a in args]
        try:
            return graph_key(trace(moved)) == key
        except Exception:  # a shape the spelling cannot take
            return False


def witness(trace: Callable, args, gm: torch.fx.GraphModule) -> Optional[tuple]:
    """The registration's evidence, made once, offline (passes/write_traces.py), where a
    process would wait for its first match: the sizes of the example arguments grouped by
    value (B, K, K + 1, V are each one class), each class moved by SHIFT alone, then all the
    classes that left the graph unchanged moved together. When that last trace is `gm` again,
    -> per argument, the dims of the other classes: a match whose sizes equal the example's
    there reuses `gm` (a `_Kept` of it, as if its first match had been traced at the moved
    sizes). None when no class is free. Two traces, as at run time, and no more than that."""
    sizes = _sizes(args)
    classes = sorted({v for sz in sizes if sz for v in sz if v >= 2})
    key = graph_key(gm)

    def same(free: set) -> bool:
        return _traces_to(trace, args, key, lambda a: torch.empty(
            [v + SHIFT if v in free else v for v in a.shape], dtype=a.dtype, device=a.device))

    free = {v for v in classes if same({v})}
    if not free or (len(free) > 1 and not same(free)):
        return None
    return tuple(tuple(d for d, v in enumerate(sz) if v not in free) if sz is not None else ()
                 for sz in sizes)


def _strided(a: torch.Tensor) -> torch.Tensor:
    """`a`'s shape with no dim contiguous: each stride one element past the contiguous one."""
    strides, acc = [], 1
    for n in reversed(a.shape):
        strides.append(acc + 1)
        acc = (acc + 1) * n
    return torch.empty_strided(a.shape, tuple(reversed(strides)), dtype=a.dtype,
                               device=a.device)


def strides_free(trace: Callable, args, gm: torch.fx.GraphModule) -> bool:
    """Offline evidence that the spelling's graph does not follow its arguments' strides: at
    the example sizes, every tensor argument strided in every dim (`_strided`) traces to `gm`
    again. A decomposition that reads strides (a reshape that is a view only when contiguous,
    a `.contiguous()`) changes the graph at that extreme. Such a spelling's trace is reused
    for a match whose arguments are slices of larger tensors (vLLM's `probs[:, :K]`): as
    everywhere here, the reused graph is then matched with every literal compared."""
    return _traces_to(trace, args, graph_key(gm), _strided)


def variants(args) -> list:
    """Argument lists a spelling is also traced at offline, beside its examples: every tensor
    with a leading dim of 3 (a [B, V] row rule applied to [B, K, V], as vLLM's residual is)."""
    if not any(isinstance(a, torch.Tensor) for a in args):
        return []
    return [[a.unsqueeze(0).expand(3, *a.shape).contiguous() if isinstance(a, torch.Tensor)
             else a for a in args]]


def loose(sig: tuple) -> tuple:
    """`sig` with every tensor's dims called contiguous: the key of a strides-free trace."""
    return tuple(s[:5] + ((True,) * s[3],) if s[0] == "T" else s for s in sig)


def with_float(gm: torch.fx.GraphModule, old: float, new: float) -> torch.fx.GraphModule:
    """A copy of `gm` with every float literal equal to `old` written `new`."""
    g, env = torch.fx.Graph(), {}

    def leaf(a):
        if isinstance(a, torch.fx.Node):
            return env[a]
        return new if type(a) is float and a == old else a

    for n in gm.graph.nodes:
        env[n] = g.create_node(n.op, n.target, map_aggregate(n.args, leaf),
                               map_aggregate(n.kwargs, leaf), name=n.name)
    return _LazyGraphModule(torch.nn.Module(), g)


SENTINELS = (0.8125, 0.6875)


def floats_free(trace: Callable, args, gm: torch.fx.GraphModule) -> list:
    """Offline evidence, per float argument, that its value only passes through to the graph as
    a literal: traced at another value, the graph is `gm` with that literal written anew. A
    match whose float differs from the example's (vLLM's eps 1e-5) then takes the shipped
    graph with the literal replaced. -> the positions where that held."""
    out = []
    for i, a in enumerate(args):
        if type(a) is not float:
            continue
        other = SENTINELS[0] if a != SENTINELS[0] else SENTINELS[1]
        moved = list(args)
        moved[i] = other
        if _traces_to(trace, moved, graph_key(with_float(gm, a, other)),
                      lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype,
                                                    device=t.device)):
            out.append(i)
    return out


def _coincide(example: tuple, real: tuple) -> tuple:
    out = []
    for e, r in zip(example, real):
        if e is None or r is None or len(e) != len(r):
            out.append(tuple(range(len(r))) if r is not None else ())
        else:
            out.append(tuple(d for d in range(len(r)) if e[d] == r[d]))
    return tuple(out)


def _fits(kept: _Kept, args) -> bool:
    sizes = _sizes(args)
    return all(s is None or all(s[d] == k[d] for d in fixed)
               for s, k, fixed in zip(sizes, kept.sizes, kept.fixed))


class SearchMemo:
    """One spelling's trace function for `register_replacement` (see the module docstring);
    `trace` is the trace it wraps, `search` the spelling's search function."""

    def __init__(self, search: Callable, trace: Callable, shelf=None):
        """`shelf`: the spelling's place in the shipped registration traces
        (`trace_store.Shelf`), which gives the registration's graph and witness instead of
        tracing where it has them."""
        self.search, self.trace, self.shelf = search, trace, shelf
        self.example = None  # (sizes, graph key, values) of the registration's trace
        self.kept: dict = {}  # signature -> _Kept
        self.witness: dict = {}  # signature -> (sizes, graph key) of its latest trace
        self.looked: set = set()  # signatures already looked up in the shelf

    def __call__(self, fn, args, **kw):
        if fn is not self.search:  # the replacement, or a wrapper for symbolic sizes
            gm = direct_trace(fn, args, kw.get("get_decomp_fn"))
            return gm if gm is not None else self.trace(fn, args, **kw)
        sig = signature(args)
        if self.example is None:  # the first call is the registration's, at the examples
            gm, fixed = self.shelf.get(sig) if self.shelf is not None else (None, None)
            if gm is None:
                gm = self.trace(fn, args, **kw)
                if self.shelf is not None and self.shelf.recording():
                    fixed = self._record(lambda a: self.trace(fn, a, **kw), args, gm)
            if fixed is not None and sig is not None:  # the witness trace was made offline
                self.kept[sig] = _Kept(gm, _sizes(args), fixed)
            self.example = (_sizes(args), graph_key(gm), _values(args))
            return gm
        kept = self.kept.get(sig) if sig is not None else None
        if kept is None and sig is not None and self.shelf is not None:
            kept = self._shipped(sig)
        if kept is not None and _fits(kept, args):
            STATS["reused"] += 1
            return kept.gm
        gm = self.trace(fn, args, **kw)
        STATS["traced"] += 1
        sizes = _sizes(args)
        if sig is None:
            return gm
        key = graph_key(gm)
        for e_sizes, e_key in self._evidence(sig, sizes, _values(args)):
            if key == e_key:
                self.kept[sig] = _Kept(gm, sizes, _coincide(e_sizes, sizes))
                STATS["kept"] += 1
                break
        self.witness[sig] = (sizes, key)
        return gm

    def _record(self, trace: Callable, args, gm) -> Optional[tuple]:
        """write_traces: the registration's evidence, and each of `variants` traced with its
        own; -> the registration's witness."""
        fixed = witness(trace, args, gm)
        self.shelf.put(signature(args), gm, fixed, _sizes(args), strides_free(trace, args, gm),
                       floats_free(trace, args, gm))
        for v in variants(args):
            try:
                with quiet():
                    vgm = trace(v)
            except Exception:  # a spelling that takes no leading dim
                continue
            self.shelf.put(signature(v), vgm, witness(trace, v, vgm), _sizes(v),
                           strides_free(trace, v, vgm), floats_free(trace, v, vgm))
        return fixed

    def _shipped(self, sig) -> Optional[_Kept]:
        """The shipped trace for `sig` as a kept one: made offline at that signature (a
        variant), or at its contiguous one when that graph is strides-free, with a float
        argument's literal rewritten where its value only passes through; once per
        signature."""
        if sig in self.looked:
            return None
        self.looked.add(sig)
        at, floats = self._at_example_floats(sig)
        got = self.shelf.find(at)
        if got is None and loose(at) != at:
            got = self.shelf.find(loose(at))
            got = got if got is not None and got.strides_free else None
        if got is None or got.fixed is None or not set(floats) <= set(got.floats_free):
            return None
        gm = got.gm
        for old, new in floats.values():
            gm = with_float(gm, old, new)
        self.kept[sig] = _Kept(gm, got.sizes, got.fixed)
        return self.kept[sig]

    def _at_example_floats(self, sig) -> tuple:
        """(`sig` with each float argument at the example's value, {position: (example's
        value, this one)} where they differ); nothing moved where two would share a value."""
        values = self.example[2]
        at, floats = list(sig), {}
        for i, (s, e) in enumerate(zip(sig, values)):
            if s[0] == "V" and s[1] == "float" and e is not None and e[0] == "float" \
                    and s[2] != e[1]:
                at[i], floats[i] = ("V", "float", e[1]), (e[1], s[2])
        if len({old for old, _ in floats.values()}) < len(floats):
            return sig, {}
        return tuple(at), floats

    def _evidence(self, sig, sizes: tuple, values: tuple) -> list:
        """Earlier traces this one may be compared with: the registration's when its ranks and
        other arguments are this call's, and the signature's latest trace."""
        out = []
        e_sizes, e_key, e_values = self.example
        if e_values == values and _ranks(e_sizes) == _ranks(sizes):
            out.append((e_sizes, e_key))
        if sig in self.witness:
            out.append(self.witness[sig])
        return out
