"""torch.compile for the engine's own steps, keyed by input signature, without Dynamo's guards.

Dynamo checks a compiled frame's guards on every call: each input's dtype, shape and strides,
the module's attributes, globals. On a small model at one request this is ~70 us of a ~1.1 ms
step (measured on the embedded model, 2-vCPU CPU). The engine builds every input itself, so
it can tell cheaply which compiled graph a call needs, as vLLM's dispatcher does: the key here
is each input's dtype, device, rank and its shape past the token dim (dim 0, which the engine
marks unbacked, so one graph serves every row count), plain values as they are, and the
grad / inference mode. Each key gets a compiled function of its own, compiled with
`guard_filter_fn=torch.compiler.skip_all_guards_unsafe`, so Dynamo checks nothing at call time.

What the key leaves out stays fixed for one engine: parameters (their shapes; they are read
afresh at each call), the module's settings, contiguous inputs (the engine makes them, and
the graph dispatcher copies into buffers of the compiled strides). Only for those callers.
"""
from __future__ import annotations

import types
import weakref
from typing import Any, Callable

import torch

from npuspec.graphs.layout import TOKEN_DIM_ATTR


def _part(v: Any):
    if isinstance(v, torch.Tensor):
        shape = tuple(v.shape[1:]) if getattr(v, TOKEN_DIM_ATTR, None) == 0 else tuple(v.shape)
        return (v.dtype, v.device.type, v.dim(), shape, v.is_contiguous())
    if v is None or isinstance(v, (bool, int, float, str)):
        return (type(v), v)
    return (type(v), id(v))


def signature(args: tuple, kwargs: dict) -> tuple:
    """The key of a call (see the module docstring)."""
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
            tuple(map(_part, args)), tuple((k, _part(v)) for k, v in kwargs.items()))


def own_code(fn: Callable, name: str | None = None) -> Callable:
    """`fn` with a code object of its own (named `name`). Dynamo keeps its compiled entries,
    and counts recompiles, on the code object: a function of its own has a cache of its own
    (and without guards, the first entry would serve every function sharing the code).

    And with globals of its own: the builtins and the module globals its code names, as they
    are now (the engine's step functions read only their closures). Dynamo installs each
    compiled graph's function in the frame's globals (`__compiled_fn_<n>_<uuid>`) and never
    removes it: in the module's globals that kept every engine's compiled steps alive, and
    with them its KV pool and weights, for the life of the process (~1.5-2.4 GiB per SmolLM2
    engine at 32 requests; `bench dynk` on SmolLM2 at 64 requests could not build its second
    method's engines). Dynamo's guards keep the globals dict itself (a finalizer on a
    `torch.library.Library` holds them), so CompiledBySignature also empties it of compiled
    functions when it goes (`drop_compiled`)."""
    g = fn.__globals__
    own = {k: g[k] for k in fn.__code__.co_names if k in g}
    own.update(__builtins__=g.get("__builtins__", __builtins__), __name__=g.get("__name__"))
    new = types.FunctionType(fn.__code__.replace(), own, name or fn.__name__,
                             fn.__defaults__, fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    return new


class CompiledBySignature:
    """`fn` (a plain function) compiled with backend="npuspec" and `options` once per input
    signature, each copy with a code object of its own."""

    def __init__(self, fn: Callable, options: dict):
        self.fn, self.options = fn, dict(options)
        self.fns: dict[tuple, Callable] = {}
        self._globals: list[dict] = []  # each copy's globals, emptied when this object goes
        weakref.finalize(self, drop_compiled, self._globals)

    def __call__(self, *args, **kwargs):
        key = signature(args, kwargs)
        fn = self.fns.get(key)
        if fn is None:
            # torch.compile pops guard_filter_fn from the dict it is given: a new one each time
            opts = dict(self.options, guard_filter_fn=torch.compiler.skip_all_guards_unsafe)
            raw = own_code(self.fn)
            self._globals.append(raw.__globals__)
            fn = self.fns[key] = torch.compile(raw, backend="npuspec", options=opts,
                                               dynamic=None)
        return fn(*args, **kwargs)


def drop_compiled(globals_dicts: list) -> None:
    """Drop Dynamo's compiled functions (`__compiled_fn_*`, and the resumes after a graph
    break, `__resume_at_*`) from the globals of `own_code` copies (see own_code). The names
    stay, bound to None: Dynamo's own clean-up deletes them when its code object goes."""
    for g in globals_dicts:
        for k in [k for k in g if k.startswith(("__compiled_fn", "__resume_at"))]:
            g[k] = None
