"""The graph cache directory shared across deployments (docs/cache.md).

    fn = cached_lower(gm, example_inputs, opts, lowering.lower)   # the backend's hook
    record_artifact("capture_plan", {...}); load_artifact("capture_plan")  # JSON artifacts

Modules: keys (key derivation, platform fingerprint), store (writing entries, locks, hit
counts), entries (reading and verifying them), layout (opening and checking the root and its
directories, quarantine), fsafe (dir-fd operations that never follow a link), trust
(ownership/permission rules, resolving the way to the root), inductor and torchair (pointing
the lowering at an entry), core (load-or-compile).
"""
from npuspec.graphs.cache.core import (EXEC_LOWERINGS, Session, cached_lower, current,
                                       load_artifact, record_artifact)
from npuspec.graphs.cache.keys import (COMPILE_FIELDS, KEY_FORMAT, KeyParts, cache_key,
                                       fingerprint, key_parts)
from npuspec.graphs.cache.store import CacheCorrupt, CacheDir
from npuspec.graphs.cache.trust import CacheTrustError, check_path, check_root

__all__ = ["cached_lower", "record_artifact", "load_artifact", "current", "Session",
           "KeyParts", "cache_key", "key_parts", "fingerprint", "COMPILE_FIELDS", "KEY_FORMAT",
           "CacheDir", "CacheCorrupt", "CacheTrustError", "check_path", "check_root",
           "EXEC_LOWERINGS"]
