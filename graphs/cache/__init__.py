"""The graph cache directory shared across deployments: its on-disk store (docs/cache.md).

    CacheDir(root, gid).verify(key, ...); .stage(...); .publish(key, staged)

Modules: store (writing entries, locks, hit counts), entries (reading and verifying them),
layout (opening and checking the root and its directories, quarantine), fsafe (dir-fd
operations that never follow a link), trust (ownership/permission rules, resolving the way to
the root), inductor and torchair (pointing a lowering at an entry's directory).

What goes in an entry and when is the compile side's: the key (npuspec.compilation.cache_keys)
hashes the passes and the lowering, and load-or-compile (npuspec.compilation.cache.cached_lower)
calls the lowering. This package sits below both and knows nothing of compiling.
"""
from npuspec.graphs.cache.store import CacheCorrupt, CacheDir
from npuspec.graphs.cache.trust import CacheTrustError, check_path, check_root

__all__ = ["CacheDir", "CacheCorrupt", "CacheTrustError", "check_path", "check_root"]
