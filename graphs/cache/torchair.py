"""Point torchair's GE graph compile cache at one directory, under the npuspec key.

What this relies on (torchair in torch_npu, CANN GE's documented graph compile cache):
- GE persists a compiled graph when two options are both non-empty: `ge.graph_compiler_cache_dir`
  (a directory that must already exist) and `ge.graph_key`. A key already in the directory is
  loaded from its .om model file instead of compiled; otherwise GE compiles and writes the .om
  (plus a variable-description file) and an index JSON there.
- torchair passes a graph's GE options from `CompilerConfig.as_dict()` (its "local" options)
  when it loads the graph into GE. Its public CompilerConfig has no field for these two options
  and refuses unknown attributes, so `compiler_config` returns a subclass whose as_dict() adds
  them. (torchair's own `cache_compile(..., ge_cache=True)` injects the same option through its
  code generator, with the graph key set to "graph_<n>", a per-process counter that depends on
  compile order; npuspec uses its own key instead, and one directory per key.)
- GE compiles when the compiled graph is first *called*, not when torchair's backend returns.
  So compilation/cache.py publishes a torchair entry after the first call (keeping the key's
  lock until then), and on a warm start checks after the first call that GE loaded rather than
  compiled.
- `torchair.inference.cache_compile(func, cache_dir=...)` is not usable here: it wraps a Python
  function or module method, traces it with Dynamo itself and caches Dynamo's output; npuspec
  receives an FX graph inside a backend call, after Dynamo has run.

Written against torchair's source and CANN's documentation; never run on an NPU (the tests use
a fake torchair that follows the documented behaviour).
"""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Any, Callable, Iterator, Optional

EXEC_DIR = "torchair"  # the entry's subdirectory for GE's files (store.EXEC_DIRS)
CACHE_DIR_OPTION = "ge.graph_compiler_cache_dir"
GRAPH_KEY_OPTION = "ge.graph_key"

_local = threading.local()


@contextlib.contextmanager
def torchair_cache_dir(path: str, graph_key: str) -> Iterator[None]:
    """torchair lowerings inside this block make GE cache their graph in `path` under
    `graph_key` (the npuspec key: a hex string, safe in GE's file names)."""
    assert os.path.isdir(path), path  # GE fails the compile if the directory does not exist
    old = getattr(_local, "options", None)
    _local.options = {CACHE_DIR_OPTION: path, GRAPH_KEY_OPTION: graph_key}
    try:
        yield
    finally:
        _local.options = old


def ge_cache_options() -> dict:
    """The GE options of the enclosing torchair_cache_dir block ({} outside one)."""
    return dict(getattr(_local, "options", None) or {})


def compiler_config(torchair: Any) -> Any:
    """A torchair CompilerConfig; inside torchair_cache_dir, one that also hands GE the
    compile-cache options (added to the local options its as_dict() returns)."""
    options = ge_cache_options()
    if not options:
        return torchair.CompilerConfig()
    base = torchair.CompilerConfig

    def as_dict(self, *args, **kwargs):
        local, global_ = base.as_dict(self, *args, **kwargs)
        return {**local, **type(self)._npuspec_ge_options}, global_

    # The options live on the class, so the instance has exactly torchair's own attributes.
    cls = type("NpuspecCompilerConfig", (base,), {"as_dict": as_dict,
                                                  "_npuspec_ge_options": options})
    return cls()


def om_files(path: str) -> set:
    """(relative path, mtime_ns, size) of every GE model file (.om) under `path`: a model GE
    writes shows up as a new item, even when it replaces a file of the same name."""
    out = set()
    for d, _, files in os.walk(path):
        for f in files:
            if f.endswith(".om"):
                p = os.path.join(d, f)
                with contextlib.suppress(OSError):
                    st = os.stat(p)
                    out.add((os.path.relpath(p, path), st.st_mtime_ns, st.st_size))
    return out


def after_first_call(fn: Callable, after: Callable[[], None],
                     on_error: Optional[Callable[[BaseException], None]] = None) -> Callable:
    """`fn`, with `after()` run once after its first call returns (GE has compiled or loaded the
    graph by then). If that first call raises, `on_error(exc)` runs instead and the error
    propagates; later calls go straight to `fn`."""
    state = {"pending": True}
    guard = threading.Lock()

    def call(*args, **kwargs):
        if not state["pending"]:
            return fn(*args, **kwargs)
        with guard:  # a concurrent first call waits: `after` runs exactly once
            if not state["pending"]:
                return fn(*args, **kwargs)
            try:
                out = fn(*args, **kwargs)
            except BaseException as e:
                state["pending"] = False
                if on_error is not None:
                    on_error(e)
                raise
            state["pending"] = False
            after()
            return out

    call.__dict__.update(getattr(fn, "__dict__", {}))  # e.g. _boxed_call: same convention
    return call
