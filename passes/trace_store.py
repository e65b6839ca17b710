"""How a spelling is traced (`trace_canonical`), and its registration traces shipped as data.

Registering the verify families traces every spelling's search function at its example
shapes (`register_replacement` turns the graph into a pattern): 327 spellings a flavour, 5-6 s
a flavour on 2 cores, paid by the first verify step a process compiles, where Inductor's
whole compile of that step is ~3 s. Those graphs depend only on the spelling's source and
example arguments, the canonicaliser and torch's tracer and decompositions, so they are traced
once, by `python -m npuspec.passes.write_traces`, and shipped as data:
`pattern_traces.json.gz`, JSON nodes with no code in them. An entry is keyed by flavour,
family uuid (its source and config), spelling name and the example arguments' signature; the
file by torch's version and this module's and the canonicaliser's source (`file_key`). Targets
are read back only from torch's `aten`, `prims` and `npuspec` op namespaces and
`operator.getitem`; a graph with anything else is not stored.

A registration whose key the file lacks (an edited spelling, a family built with another
config, another torch) traces as before, counted (`counters["pattern_trace_store.traced"]`,
the others `pattern_trace_store.loaded`) and logged once per family.
tests/passes/test_trace_store.py fails while the file is stale for the pinned torch.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import gzip
import json
import logging
import operator
import os
import sys
from typing import Optional

import torch
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx._lazy_graph_module import _LazyGraphModule, _use_lazy_graph_module

from npuspec import counters
from npuspec.passes import canonical, search_memo
from npuspec.passes.hashing import source_hash

log = logging.getLogger("npuspec.passes")

PATH = os.path.join(os.path.dirname(__file__), "pattern_traces.json.gz")
NAMESPACES = ("aten", "prims", "npuspec")
_warned: set = set()
recording: Optional[dict] = None   # write_traces collects {key: nodes} here


def trace_canonical(fn, args, *, get_decomp_fn=None, **_):
    """Inductor's `fwd_only` trace, then canonical literals (the trace_fn of every pattern).

    The module is lazy: the matcher reads its graph, never its code, and each match traces
    its spelling twice (the search at the user's shapes, then the replacement), so generating
    Python for the three recompiles of each trace was ~20 % of the passes' time."""
    from torch._inductor.pattern_matcher import fwd_only
    with _use_lazy_graph_module(True), _fake_args(args) as args:
        gm = fwd_only(fn, args, get_decomp_fn=get_decomp_fn or (lambda: {}))
        canonical.canonicalize(gm.graph)
        gm.recompile()
    return gm


@contextlib.contextmanager
def _fake_args(args):
    """Real example tensors (a registration's) as fake ones under one FakeTensorMode, that
    mode entered. Traced as real tensors, every value the tracer records builds a fresh
    FakeTensorMode for its meta (`proxy_tensor.extract_val`), and each mode's constructor
    walks the Python stack: ~30 % of registering the spellings. A match's arguments are fake
    already (the user graph's meta) and pass as they are; the graphs are the same
    (tests/passes/test_manager.py)."""
    real = [a for a in args if isinstance(a, torch.Tensor)]
    if not real or detect_fake_mode(real) is not None:
        yield args
        return
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
    with mode:
        yield fake


def file_key() -> str:
    """What every stored trace depends on besides its entry's key."""
    return f"torch {torch.__version__}; " + source_hash(sys.modules[__name__], canonical,
                                                        search_memo)


def entry_key(flavor: str, uuid: str, spelling: str, sig) -> str:
    return f"{flavor}|{uuid}|{spelling}|{sig!r}"


# -- nodes as JSON: a node reference, a float and every container are one-key dicts -------

class _Unstorable(Exception):
    pass


_NAMED = (torch.dtype, torch.layout, torch.memory_format)


def _enc(a, index: dict):
    if isinstance(a, torch.fx.Node):
        return {"n": index[a]}
    if a is None or isinstance(a, (bool, int, str)):
        return a
    if isinstance(a, float):
        return {"f": a}
    if isinstance(a, list):
        return {"l": [_enc(x, index) for x in a]}
    if isinstance(a, tuple):
        return {"t": [_enc(x, index) for x in a]}
    if isinstance(a, dict):
        return {"d": [[k, _enc(v, index)] for k, v in a.items()]}  # in order: a dict
    if isinstance(a, _NAMED):
        return {"torch": str(a).removeprefix("torch.")}
    if isinstance(a, torch.device):
        return {"device": str(a)}
    raise _Unstorable(type(a).__name__)


def _dec(a, nodes: list):
    if not isinstance(a, dict):
        return a
    (tag, v), = a.items()
    if tag == "n":
        return nodes[v]
    if tag == "f":
        return float(v)
    if tag in ("l", "t"):
        seq = [_dec(x, nodes) for x in v]
        return seq if tag == "l" else tuple(seq)
    if tag == "d":
        return {k: _dec(x, nodes) for k, x in v}
    if tag == "device":
        return torch.device(v)
    assert tag == "torch" and isinstance(getattr(torch, v), _NAMED), a
    return getattr(torch, v)


def _target_name(t) -> str:
    if t is operator.getitem:
        return "operator.getitem"
    if isinstance(t, torch._ops.OpOverload) and t.namespace in NAMESPACES:
        return f"{t.namespace}.{t._opname}.{t._overloadname}"
    raise _Unstorable(str(t))


def _target(name: str):
    if name == "operator.getitem":
        return operator.getitem
    ns, op, overload = name.split(".")
    assert ns in NAMESPACES, name
    return getattr(getattr(getattr(torch.ops, ns), op), overload)


def encode(gm: torch.fx.GraphModule) -> Optional[list]:
    """[op, name, target, args, kwargs] per node, or None where a node is not storable (a
    constant, a target outside NAMESPACES, an argument of a type `_enc` does not know)."""
    index, out = {}, []
    try:
        for i, n in enumerate(gm.graph.nodes):
            if n.op not in ("placeholder", "call_function", "output"):
                raise _Unstorable(n.op)
            target = n.target if n.op != "call_function" else _target_name(n.target)
            out.append([n.op, n.name, target, _enc(n.args, index), _enc(dict(n.kwargs), index)])
            index[n] = i
    except _Unstorable:
        return None
    return out


def decode(entry: list) -> torch.fx.GraphModule:
    g = torch.fx.Graph()
    nodes: list = []
    for op, name, target, args, kwargs in entry:
        tgt = _target(target) if op == "call_function" else target
        nodes.append(g.create_node(op, tgt, _dec(args, nodes), _dec(kwargs, nodes), name=name))
    return _LazyGraphModule(torch.nn.Module(), g)


# -- the shipped file ----------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _shipped() -> dict:
    """{entry key: nodes} of the shipped file; {} when it is missing or made for another
    torch or other tracing code (logged)."""
    try:
        with gzip.open(PATH, "rt") as f:
            data = json.load(f)
        assert isinstance(data, dict) and isinstance(data.get("entries"), dict), PATH
    except (OSError, EOFError, ValueError, AssertionError) as e:
        log.warning("npuspec: cannot read %s (%s), so verify patterns are traced when "
                    "registered (python -m npuspec.passes.write_traces writes it)", PATH, e)
        return {}
    if data.get("file_key") != file_key():
        log.warning("npuspec: the shipped pattern traces were made for %r, not %r, so verify "
                    "patterns are traced when registered (python -m "
                    "npuspec.passes.write_traces refreshes them)", data.get("file_key"),
                    file_key())
        return {}
    return data["entries"]


def load(key: str) -> tuple:
    """(the shipped registration trace for `key`, its witness: per argument the dims a reuse
    must match, or None; search_memo.witness), or (None, None) (counted; logged once per
    family)."""
    if recording is not None:
        return None, None
    entry = _shipped().get(key)
    if entry is None:
        counters.bump("pattern_trace_store.traced")
        family = key.split("|")[1]
        if family not in _warned and _shipped():
            _warned.add(family)
            log.info("npuspec: no shipped trace for %s; tracing it (python -m "
                     "npuspec.passes.write_traces refreshes them)", key)
        return None, None
    counters.bump("pattern_trace_store.loaded")
    return decode(entry[0]), _fixed(entry[1])


@dataclasses.dataclass(frozen=True)
class Stored:
    """A shipped trace with its evidence (search_memo): the arguments' sizes it was traced
    at, the dims a reuse must match (`witness`), whether the graph is the same with every
    argument strided (`strides_free`), which float arguments only pass through as literals."""
    gm: torch.fx.GraphModule
    sizes: tuple
    fixed: Optional[tuple]
    strides_free: bool
    floats_free: tuple   # the float arguments whose value is only a literal (floats_free)


def find(key: str) -> Optional[Stored]:
    """The shipped trace for `key` with its evidence, or None; neither counted nor logged (a
    variant's lookup: most signatures have none)."""
    entry = None if recording is not None else _shipped().get(key)
    if entry is None:
        return None
    nodes, fixed, sizes, free, floats = entry
    return Stored(decode(nodes), tuple(None if s is None else tuple(s) for s in sizes),
                  _fixed(fixed), bool(free), tuple(floats))


def _fixed(fixed) -> Optional[tuple]:
    return None if fixed is None else tuple(tuple(f) for f in fixed)


def record(key: str, gm: torch.fx.GraphModule, fixed: Optional[tuple], sizes: tuple = (),
           strides_free: bool = False, floats_free: tuple = ()) -> None:
    if recording is not None:
        nodes = encode(gm)
        if nodes is not None:
            recording[key] = [nodes, fixed, sizes, strides_free, list(floats_free)]


@dataclasses.dataclass(frozen=True)
class Shelf:
    """One spelling's place in the store (a SearchMemo's `shelf`)."""
    flavor: str
    uuid: str
    spelling: str

    def get(self, sig) -> tuple:
        return load(self.key(sig))

    def find(self, sig) -> Optional[Stored]:
        return find(self.key(sig))

    def put(self, sig, gm: torch.fx.GraphModule, fixed: Optional[tuple], sizes: tuple = (),
            strides_free: bool = False, floats_free: tuple = ()) -> None:
        record(self.key(sig), gm, fixed, sizes, strides_free, floats_free)

    def key(self, sig) -> str:
        return entry_key(self.flavor, self.uuid, self.spelling, sig)

    @staticmethod
    def recording() -> bool:
        return recording is not None
