"""`npuspec cache`'s actions: ls, verify, prune, clear (its flags and documentation:
npuspec/cli/cache.py)."""
from __future__ import annotations

import functools
import json
import os
import shutil
import time
from typing import Optional

from npuspec import envs
from npuspec.bench.table import print_table
from npuspec.cli_util.errors import EXIT_FAIL, EXIT_OK
from npuspec.graphs.cache import trust
from npuspec.graphs.cache.store import CacheCorrupt, CacheDir, dir_size


def _root(args) -> str:
    d = args.dir or envs.cache_dir()
    if not d:
        raise ValueError("no cache directory; pass --dir DIR or set NPUSPEC_CACHE_DIR")
    d = os.path.abspath(os.path.expanduser(d))
    if not os.path.isdir(d):
        raise FileNotFoundError(f"{d} is not a directory; pass --dir DIR or set "
                                f"NPUSPEC_CACHE_DIR to an existing cache")
    return d


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    if seconds < 172800:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


def _manifest(cache, key: str) -> Optional[dict]:
    try:
        with open(os.path.join(cache.entry(key), "manifest.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _last_used(cache, key: str, m: Optional[dict]) -> float:
    t = (m or {}).get("created") or 0.0
    for p in (cache.path("hits", key), cache.entry(key)):
        try:
            t = max(t, os.stat(p).st_mtime)
        except OSError:
            pass
    return t


def cmd_ls(cache) -> int:
    now = time.time()
    rows = []
    for key in cache.keys():
        m = _manifest(cache, key)
        low = (m or {}).get("lowering") or {}
        rows.append({"key": key[:16], "size": _human(dir_size(cache.entry(key))),
                     "age": _age(now - (m or {}).get("created", now)) if m else "?",
                     "platform": (m or {}).get("platform", "? (no manifest)"),
                     "lowering": low.get("name", "?") if isinstance(low, dict) else str(low),
                     "hits": cache.hits(key)})
    if not rows:
        print(f"{cache.root}: no entries")
        return EXIT_OK
    print_table(rows, ["key", "size", "age", "platform", "lowering", "hits"],
                title=f"npuspec cache {cache.root}")
    q = [n for n in os.listdir(cache.path("quarantine"))] if os.path.isdir(cache.path("quarantine")) else []
    if q:
        print(f"{len(q)} quarantined entr{'y' if len(q) == 1 else 'ies'} in {cache.path('quarantine')}")
    return EXIT_OK


def cmd_verify(cache, quarantine: bool) -> int:
    bad = 0
    try:
        trust.check_root(cache.root)
        root_ok = True
    except trust.CacheTrustError as e:
        print(f"UNTRUSTED {e}")
        root_ok = False
        bad += 1
    check = functools.partial(_check, gid=cache.gid)
    for key in cache.keys():
        try:
            cache.verify(key, executable=True, trust_check=check if root_ok else None)
            print(f"ok        {key}")
        except (CacheCorrupt, trust.CacheTrustError, OSError) as e:
            bad += 1
            kind = "UNTRUSTED" if isinstance(e, trust.CacheTrustError) else "BAD"
            print(f"{kind:9s} {key}: {e}")
            if quarantine and isinstance(e, CacheCorrupt):
                with cache.lock(key, timeout=envs.cache_lock_timeout()) as got:
                    where = cache.quarantine(key) if got else None
                print(f"          moved to {where}" if where else "          could not lock it; left in place")
    n = len(cache.keys())
    print(f"{n} entr{'y' if n == 1 else 'ies'} checked, {bad} problem{'' if bad == 1 else 's'}")
    return EXIT_FAIL if bad else EXIT_OK


def _check(path: str, recursive: bool, gid=None) -> None:
    trust.check_path(path, gid=gid, recursive_fix=recursive)


def cmd_prune(cache, days: float) -> int:
    if days < 0:
        raise ValueError(f"--older-than {days}: must be >= 0 days")
    cutoff = time.time() - days * 86400
    removed = 0
    for key in cache.keys():
        if _last_used(cache, key, _manifest(cache, key)) < cutoff:
            with cache.lock(key, timeout=envs.cache_lock_timeout()) as got:
                if got:
                    cache.remove(key)
                    removed += 1
                    print(f"removed   {key}")
                else:
                    print(f"busy      {key} (another process holds its lock); kept")
    for sub in ("quarantine", "tmp"):
        d = cache.path(sub)
        for n in (os.listdir(d) if os.path.isdir(d) else []):
            p = os.path.join(d, n)
            try:
                if os.lstat(p).st_mtime < cutoff:
                    shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.unlink(p)
            except OSError:
                pass
    print(f"pruned {removed} entr{'y' if removed == 1 else 'ies'} older than {days:g} days; "
          f"{len(cache.keys())} left")
    return EXIT_OK


def cmd_clear(cache) -> int:
    n = 0
    for key in cache.keys():
        cache.remove(key)
        n += 1
    for sub in ("quarantine", "tmp", "hits"):
        d = cache.path(sub)
        for name in (os.listdir(d) if os.path.isdir(d) else []):
            p = os.path.join(d, name)
            shutil.rmtree(p, ignore_errors=True) if os.path.isdir(p) and not os.path.islink(p) \
                else os.unlink(p)
    print(f"cleared {n} entr{'y' if n == 1 else 'ies'} from {cache.root}")
    return EXIT_OK


def run(args) -> int:
    """One action on the cache directory (`args.cache_command`, which cache.run checked is set)."""
    action = args.cache_command
    envs.cache_lock_timeout()  # a bad value fails now, not at the first lock mid-prune
    cache = CacheDir(_root(args), trust.trusted_gid())
    if action == "ls":
        return cmd_ls(cache)
    if action == "verify":
        return cmd_verify(cache, args.quarantine)
    if action == "prune":
        return cmd_prune(cache, args.older_than)
    return cmd_clear(cache)


