"""`npuspec.compile`: torch.compile with backend="npuspec" and Dynamo's capture flags on for one
function only (issue 37, point 4).

Verify steps written for eager PyTorch break Dynamo's graph at `.item()` (gpt-fast's
`rejected_locations[0].item()`), `nonzero()` and boolean-mask indexing. Dynamo traces through
them when `capture_scalar_outputs` (`.item()` becomes an unbacked SymInt) and
`capture_dynamic_output_shape_ops` (`nonzero` and mask indexing get an unbacked size) are on,
but those are process-wide settings: turning them on for everyone changes how every other
compile in the process traces. `npuspec.compile(fn)` sets them only while its own function is
traced, by patching Dynamo's config around each call, and leaves them as they were after.
A data-dependent `if` (`if tensor:`, `if n < K:` on an unbacked size) still breaks the graph,
and the backend names it once with its line (compilation/graph_breaks.py).
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

CAPTURE_FLAGS = {"capture_scalar_outputs": True, "capture_dynamic_output_shape_ops": True}


def compile(fn: Optional[Callable] = None, *, options: Optional[dict] = None,  # noqa: A001
            dynamic: Optional[bool] = None, fullgraph: bool = False,
            capture: bool = True) -> Callable:
    """torch.compile(fn, backend="npuspec", options=options) with Dynamo's capture flags
    (`CAPTURE_FLAGS`) on while fn is traced. `capture=False` leaves them as they are.
    Usable as `npuspec.compile(fn)`, `@npuspec.compile` or `@npuspec.compile(options=...)`."""
    if fn is None:
        return functools.partial(compile, options=options, dynamic=dynamic,
                                 fullgraph=fullgraph, capture=capture)
    if not callable(fn):
        raise TypeError(f"npuspec.compile: fn={fn!r} is not callable; pass the function or "
                        f"module to compile")
    compiled = torch.compile(fn, backend="npuspec", options=options, dynamic=dynamic,
                             fullgraph=fullgraph)
    if not capture:
        return compiled

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with torch._dynamo.config.patch(**CAPTURE_FLAGS):
            return compiled(*args, **kwargs)

    run._npuspec_compiled = compiled  # the torch.compile'd callable (e.g. for _dynamo.reset)
    return run
