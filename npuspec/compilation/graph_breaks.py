"""Graph breaks in the user's step, reported once with the line (issue 13, point 6).

A verify step that Dynamo splits (`.item()`, `.nonzero()`, `if tensor:`, boolean-mask
indexing, `repeat_interleave`) reaches the backend as several graphs, and a verify idiom
spanning the split cannot become one npuspec op: each piece still computes what eager does,
only unfused. The backend calls `note_graph_break(gm)` for every graph Dynamo hands it; when the graph
ended at a break (not at the frame's return) it logs once per source line, naming the file,
the line and Dynamo's reason with its hint, and bumps `counters["graph_breaks"]`.

Dynamo's own capture flags cover some of these (`torch._dynamo.config.capture_scalar_outputs`
for `.item()`, `capture_dynamic_output_shape_ops` for `nonzero` and mask indexing); they change
how every compile in the process traces, so the backend never sets them: the message points to
`npuspec.compile(fn)` (compilation/api.py), which sets them while fn alone is traced.
"""
from __future__ import annotations

import logging
from typing import Optional

from npuspec._counters import counters, first_time

log = logging.getLogger("npuspec")



def _break_of(gm) -> Optional[tuple[str, int, str]]:
    """(file, line, reason) when Dynamo ended `gm` at a graph break. Dynamo attaches why it
    compiled the graph (`compile_subgraph_reason`: the reason and the user's stack); a graph
    that reached the frame's return is not a break."""
    why = getattr(gm, "compile_subgraph_reason", None)
    if why is None or not getattr(why, "graph_break", False):
        return None
    stack = getattr(why, "user_stack", None) or []
    if not stack:
        return None
    lines = [ln.strip() for ln in str(getattr(why, "reason", "")).splitlines() if ln.strip()]
    hint = next((ln for ln in lines if ln.startswith("Hint:")), None)
    reason = (lines[0] if lines else "no reason given") + (f" ({hint})" if hint else "")
    if reason.startswith("generic_jump"):  # Dynamo's name for `if tensor:` / `while tensor:`
        reason = ("branching on a tensor's value (`if tensor:`); compute both sides and pick "
                  "with torch.where")
    return stack[-1].filename, int(stack[-1].lineno), reason


def note_graph_break(gm) -> Optional[str]:
    """Log (once per source line) and count a graph break that ended the graph `gm`.
    Returns the message when one was logged."""
    site = _break_of(gm)
    if site is None:
        return None
    file, line, reason = site
    if not first_time(("graph_break", file, line)):
        return None
    counters.bump("graph_breaks")
    msg = (f"npuspec: Dynamo breaks the graph at {file}:{line}: {reason}. The code before and "
           f"after that line compiles as separate graphs, so a verify step spanning it is not "
           f"fused into one npuspec op (each part still computes what eager does). "
           f"npuspec.compile(fn) traces fn with Dynamo's capture_scalar_outputs (for .item()) "
           f"and capture_dynamic_output_shape_ops (for nonzero, mask indexing) on, for fn "
           f"only; a data-dependent `if` still breaks.")
    log.warning(msg)
    return msg
