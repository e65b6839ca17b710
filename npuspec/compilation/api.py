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

When the function's own frame compiled nothing with the flags on (Dynamo skips a whole frame
at a graph break inside a loop: EAGLE's `for b in range(bs): if finish_flag[b]` after an
`accept_length.tolist()` that no longer breaks first; or its error above), that first call has
run eagerly, and the later calls compile it without the flags, as torch.compile does
(`npuspec_compile.capture_dropped`, logged once).
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import types
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
        self.codes: list = []  # the frames' code objects, where Dynamo's caller shows them
        self.floor = 0  # records below this level are the user's silenced ones (`_listening`)

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        if record.levelno < logging.WARNING or not msg.startswith(_WONT):
            return record.levelno >= self.floor
        counters.bump("npuspec_compile.eager_frames")
        code = _converting_code()
        if code is not None:
            self.codes.append(code)
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


@contextlib.contextmanager
def _listening():
    """`_EAGER_FRAMES` on Dynamo's convert_frame logger, which is made to emit WARNING for the
    call even where the user silenced it (a filter sees only records the level lets through);
    the records the user's level would have dropped are dropped by the filter instead."""
    level = _DYNAMO_LOG.level
    quiet = not _DYNAMO_LOG.isEnabledFor(logging.WARNING)
    if quiet:
        _EAGER_FRAMES.floor = _DYNAMO_LOG.getEffectiveLevel()
        _DYNAMO_LOG.setLevel(logging.WARNING)
    _DYNAMO_LOG.addFilter(_EAGER_FRAMES)
    try:
        yield
    finally:
        _DYNAMO_LOG.removeFilter(_EAGER_FRAMES)
        _EAGER_FRAMES.floor = 0
        if quiet:
            _DYNAMO_LOG.setLevel(level)


def _converting_code() -> Optional[types.CodeType]:
    """The code object Dynamo's convert_frame is reporting on (its local `code`, a few frames
    up from a log filter), or None where torch lays that out otherwise."""
    f = sys._getframe(1)
    for _ in range(16):
        if f is None:
            return None
        if f.f_code.co_filename.endswith(os.path.join("_dynamo", "convert_frame.py")):
            code = f.f_locals.get("code")
            if isinstance(code, types.CodeType):
                return code
        f = f.f_back
    return None


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
    code = getattr(fn, "__code__", None)  # a function's own frame (a module's: not checked)
    state = {"capture": True, "eager": []}  # eager: frames run eagerly after an error

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if not state["capture"]:
            return compiled(*args, **kwargs)
        seen = len(_EAGER_FRAMES.codes)
        with torch._dynamo.config.patch(**flags):
            with _listening():
                try:
                    return compiled(*args, **kwargs)
                finally:
                    state["eager"] += _EAGER_FRAMES.codes[seen:]
                    if not fullgraph and code is not None and _skipped(code):
                        state["capture"] = False
                        _drop_capture(code, state["eager"])

    run._npuspec_compiled = compiled  # the torch.compile'd callable (e.g. for _dynamo.reset)
    return run


def _skipped(code) -> bool:
    """Dynamo holds no compiled entry for the function's own frame after a call: it skipped
    the frame (a graph break inside a loop, which the capture flags can move there from an
    `.item()` or `.tolist()` before it) or ran it eagerly after an error."""
    return not torch._C._dynamo.eval_frame._debug_get_cache_entry_list(code)


def _drop_capture(code, eager: list) -> None:
    """The frame ran eagerly with the flags on; without them torch.compile would have compiled
    it, breaking at each `.item()`. Dynamo's decision to skip the frame is forgotten for this
    code object and for the frames it called that ran eagerly after an error (`eager`; a
    helper that fails with the flags only), and the later calls compile them without the
    flags. The call that found it is not repeated (its random draws are made)."""
    counters.bump("npuspec_compile.capture_dropped")
    for c in {code, *eager}:
        torch._C._dynamo.eval_frame.reset_code(c)
    log.warning("npuspec.compile: %s (%s:%d) compiled no graph with Dynamo's capture flags on "
                "and ran eagerly; later calls compile it without them, as "
                "torch.compile(fn, backend='npuspec') does (graph breaks at .item() and "
                ".tolist()); counted in npuspec_compile.capture_dropped", code.co_name,
                code.co_filename, code.co_firstlineno)
