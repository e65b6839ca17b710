"""Writes passes/pattern_traces.json.gz (passes/trace_store.py): every default family's
spellings, both flavours, traced in this process.

    python -m npuspec.passes.write_traces

Run it after editing a spelling, a family's config, the canonicaliser or trace_store, and
after moving to another torch; tests/passes/test_trace_store.py says when it is stale.
"""
from __future__ import annotations

import gzip
import json

from npuspec.passes import manager, trace_store
from npuspec.passes.patterns import default_patterns


def write(path: str = trace_store.PATH) -> int:
    """-> entries written. Every family is registered afresh here (a family registered
    earlier in the process would not trace again)."""
    manager._compiled.cache_clear()
    trace_store.recording = {}
    try:
        for flavor in manager.FLAVORS:
            for p in default_patterns():
                manager.compiled(p, flavor)
        entries = trace_store.recording
    finally:
        trace_store.recording = None
        manager._compiled.cache_clear()
    data = json.dumps({"file_key": trace_store.file_key(), "entries": entries},
                      separators=(",", ":")).encode()
    # no name and no time in the gzip header: the same traces give the same bytes
    with open(path, "wb") as raw, gzip.GzipFile("", "wb", 9, raw, mtime=0) as f:
        f.write(data)
    return len(entries)


if __name__ == "__main__":
    print(f"{write()} registration traces written to {trace_store.PATH}")
