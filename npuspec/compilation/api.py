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

Some code PyTorch cannot compile with those flags on where it can without them: a Python list
indexed by an `.item()` value (flashinfer's reference: IndexError on a SymInt while Dynamo
traces), or a tensor sliced at one in a frame resumed after a break (HF's
`q[:, n_matches, :]`: GuardOnDataDependentSymNode in AOT autograd; `backend="inductor"` fails
the same way). Without `fullgraph`, Dynamo's `suppress_errors` is on for the call too, so such
a frame runs eagerly, on its own: frames before it have run once and are not repeated (a
retry of the whole call would draw their random numbers twice). Each is counted
(`npuspec_compile.eager_frames`) and named once, with the error; Dynamo's own pages of
traceback for it are dropped. `fullgraph=True` raises instead, as torch.compile does.
"""
from __future__ import annotations

import functools
import logging
from typing import Callable, Optional

import torch

from npuspec._counters import counters

log = logging.getLogger("npuspec.compile")

CAPTURE_FLAGS = {"capture_scalar_outputs": True, "capture_dynamic_output_shape_ops": True}
_DYNAMO_LOG = logging.getLogger("torch._dynamo.convert_frame")
_WONT = "WON'T CONVERT "


class _EagerFrames(logging.Filter):
    """Dynamo's report of a frame it runs eagerly after a suppressed compile error: counted,
    named once per frame with the error's first line, and not passed on."""

    def __init__(self):
        super().__init__()
        self.named: set = set()

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        if record.levelno < logging.WARNING or not msg.startswith(_WONT):
            return True
        counters.bump("npuspec_compile.eager_frames")
        frame = msg.splitlines()[0][len(_WONT):].strip()   # "name file line N"
        if frame not in self.named:
            self.named.add(frame)
            err = record.exc_info[1] if record.exc_info else None
            # BackendCompilerFailed wraps what the backend met (its own message is a header)
            err = getattr(err, "inner_exception", None) or err
            why = (f"{type(err).__name__}: {str(err).strip().splitlines()[0][:200]}"
                   if err is not None else "an error")
            log.warning("npuspec.compile: %s does not compile with Dynamo's capture flags on "
                        "(%s); that frame runs eagerly (counted in npuspec_compile."
                        "eager_frames). torch.compile(fn, backend='npuspec') compiles it with "
                        "graph breaks at its .item() calls instead", frame, why)
        return False


_EAGER_FRAMES = _EagerFrames()


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

    flags = dict(CAPTURE_FLAGS, **({} if fullgraph else {"suppress_errors": True}))

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with torch._dynamo.config.patch(**flags):
            _DYNAMO_LOG.addFilter(_EAGER_FRAMES)
            try:
                return compiled(*args, **kwargs)
            finally:
                _DYNAMO_LOG.removeFilter(_EAGER_FRAMES)

    run._npuspec_compiled = compiled  # the torch.compile'd callable (e.g. for _dynamo.reset)
    return run
