"""Source hashes, the stuff of every pass uuid (Inductor's FX graph cache and npuspec's graph
cache key both hold them): editing the code of a pass changes its uuid, so no cache serves a
graph that the edited pass would rewrite differently."""
from __future__ import annotations

import functools
import hashlib
import inspect


@functools.lru_cache(maxsize=None)
def source_hash(*objs) -> str:
    """sha256 of the objects' source. Cached: an engine's warm-up asks for every pass's
    uuid a few dozen times (cache keys, Inductor's FX cache), and reading the source of a
    module costs ~5 ms; a process's loaded source does not change under it."""
    h = hashlib.sha256()
    for o in objs:
        h.update(inspect.getsource(o).encode())
    return h.hexdigest()
