"""Graph breaks in the user's step, reported once with the line (issue 13, point 6).

A verify step that Dynamo splits (`.item()`, `.nonzero()`, `if tensor:`, boolean-mask
indexing, `repeat_interleave`) reaches the backend as several graphs, and a verify idiom
spanning the split cannot become one npuspec op: each piece still computes what eager does,
only unfused. The backend calls `note_graph_break()` for every graph Dynamo hands it; when the
graph ended at a break (not at the frame's return) it logs once per source line, naming the
file, the line and Dynamo's reason with its hint, and bumps `counters["graph_breaks"]`.

Dynamo's own capture flags cover some of these (`torch._dynamo.config.capture_scalar_outputs`
for `.item()`, `capture_dynamic_output_shape_ops` for `nonzero` and mask indexing); they change
how every compile in the process traces, so npuspec names them in the message and leaves the
choice to the user.
"""
from __future__ import annotations

import logging
import threading
from typing import Optional

from npuspec._counters import counters

log = logging.getLogger("npuspec")

_RETURNS = ("RETURN_VALUE", "RETURN_CONST")
_JUMPS = ("POP_JUMP_IF_FALSE", "POP_JUMP_IF_TRUE", "POP_JUMP_FORWARD_IF_FALSE",
          "POP_JUMP_FORWARD_IF_TRUE", "POP_JUMP_BACKWARD_IF_FALSE", "POP_JUMP_BACKWARD_IF_TRUE",
          "JUMP_IF_FALSE_OR_POP", "JUMP_IF_TRUE_OR_POP")
_seen: set = set()
_reasons_seen: set = set()
_lock = threading.Lock()


def _break_site() -> Optional[tuple[str, int, str]]:
    """(file, line, opname) where Dynamo stopped tracing this graph, when it is not a return."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        tx = InstructionTranslator.current_tx()
        inst = tx.current_instruction
        site = (tx.f_code.co_filename, int(tx.lineno), inst.opname)
    except Exception:  # not inside Dynamo (a direct backend call) or another torch's layout
        return None
    return None if site[2] in _RETURNS else site


def _new_reason() -> Optional[str]:
    """The first line and the hint of a Dynamo graph-break reason not reported yet."""
    try:
        from torch._dynamo.utils import counters as dynamo_counters
        reasons = list(dynamo_counters["graph_break"])
    except Exception:
        return None
    for r in reversed(reasons):
        if r in _reasons_seen:
            continue
        _reasons_seen.add(r)
        lines = [ln.strip() for ln in r.splitlines() if ln.strip()]
        hint = next((ln for ln in lines if ln.startswith("Hint:")), None)
        return lines[0] + (f" ({hint})" if hint else "") if lines else None
    return None


def note_graph_break() -> Optional[str]:
    """Log (once per source line) and count a graph break that ended the graph being compiled.
    Returns the message when one was logged."""
    site = _break_site()
    if site is None:
        return None
    file, line, opname = site
    with _lock:
        if (file, line) in _seen:
            return None
        _seen.add((file, line))
        reason = _new_reason()
    if reason is None:
        reason = ("branching on a tensor's value (`if tensor:`); compute both sides and use "
                  "torch.where" if opname in _JUMPS else
                  "see TORCH_LOGS=graph_breaks for Dynamo's reason")
    counters.bump("graph_breaks")
    msg = (f"npuspec: Dynamo breaks the graph at {file}:{line}: {reason}. The code before and "
           f"after that line compiles as separate graphs, so a verify step spanning it is not "
           f"fused into one npuspec op (each part still computes what eager does). "
           f"torch._dynamo.config.capture_scalar_outputs (for .item()) and "
           f"capture_dynamic_output_shape_ops (for nonzero, mask indexing) let Dynamo trace "
           f"some of these.")
    log.warning(msg)
    return msg
