"""Point Inductor's on-disk caches at one directory for the duration of one compile.

Inductor has no config option for its cache location: `cache_dir()` in
torch/_inductor/runtime/cache_dir_utils.py reads TORCHINDUCTOR_CACHE_DIR from os.environ on
every call (and writes the default back into it), and Triton reads TRITON_CACHE_DIR. So this
module is the one place in npuspec that sets those two variables; it sets them only around a
single `compile_fx` call and restores the previous values afterwards. Everything else goes
through config patches: the FX graph cache and the AOTAutograd cache are switched on (their
torch 2.13 defaults), remote caches off, and TORCH_COMPILE_CACHE_KEY_TAG
(`torch.compiler.config.cache_key_tag`) carries the npuspec fingerprint into Inductor's keys.

On a warm start the FX graph cache and the AOTAutograd cache hit, so the generated code and the
compiled C++ (.so) / Triton kernels are loaded instead of being generated and built again.
Inductor's in-memory code caches are cleared on entry and exit so that every kernel a graph
needs is written to (or read from) the directory in use, not reused from an earlier compile in
this process.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

_ENV = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


def _clear_inductor_memory_caches() -> None:
    try:
        from torch._inductor.utils import clear_caches
    except ImportError:  # older/newer torch: nothing to clear
        return
    clear_caches()


@contextlib.contextmanager
def _env(values: dict) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    try:
        os.environ.update(values)
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _patch(module, **values):
    present = {k: v for k, v in values.items() if hasattr(module, k)}
    return module.patch(present)


@contextlib.contextmanager
def inductor_cache_dir(path: str, tag: str) -> Iterator[None]:
    """Inductor (and Triton) read and write their caches under `path` inside this block."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    import torch.compiler.config as compiler_config

    env = {"TORCHINDUCTOR_CACHE_DIR": path, "TRITON_CACHE_DIR": os.path.join(path, "triton")}
    with contextlib.ExitStack() as stack:
        stack.enter_context(_patch(inductor_config, fx_graph_cache=True, fx_graph_remote_cache=False,
                                   autotune_local_cache=True, autotune_remote_cache=False,
                                   bundle_triton_into_fx_graph_cache=True))
        stack.enter_context(_patch(functorch_config, enable_autograd_cache=True,
                                   enable_remote_autograd_cache=False))
        stack.enter_context(_patch(compiler_config, cache_key_tag=tag))
        stack.enter_context(_env(env))
        _clear_inductor_memory_caches()
        try:
            yield
        finally:
            _clear_inductor_memory_caches()


def inductor_counters() -> dict:
    """Inductor's FX-graph and AOTAutograd cache hit/miss counters (for hit validation)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return {}
    return {"fx_hit": counters["inductor"]["fxgraph_cache_hit"],
            "fx_miss": counters["inductor"]["fxgraph_cache_miss"],
            "aot_hit": counters["aot_autograd"]["autograd_cache_hit"],
            "aot_miss": counters["aot_autograd"]["autograd_cache_miss"]}
