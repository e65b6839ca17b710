"""The graph cache's entry point: load-or-compile one backend graph through the shared cache
directory (docs/cache.md).

    fn = cached_lower(gm, example_inputs, opts, lowering.lower)   # the backend's hook
    record_artifact("capture_plan", {...}); load_artifact("capture_plan")  # JSON artifacts

It lives in npuspec.compilation, above the lowering and the passes, because its key
(cache_keys.py) names a compilation; the store it reads and writes, with its trust rules, is
npuspec.graphs.cache, which knows nothing of compiling.

1. Key the graph (cache_keys.py). No cache_dir: just lower.
2. A verified entry exists: load it. For Inductor (and torchair on npu), the entry's executable
   part is trust-checked, copied into a private 0700 temp dir from the bytes that were hashed,
   and Inductor (GE's compile cache) is pointed there: Inductor's FX graph and AOTAutograd
   caches then hit, nothing is generated or built; GE loads the .om instead of compiling.
3. Otherwise take the key's lock. Whoever gets it re-checks (another process may have published
   while it waited), quarantines a bad entry, compiles with Inductor (GE) pointed at a fresh
   private dir, then stages and publishes the entry atomically. GE compiles at the graph's first
   call, so a torchair entry is published after that call, and the lock is held until then.
   Waiters that time out (NPUSPEC_CACHE_LOCK_TIMEOUT) compile privately and write nothing.
Every fault (bad or wrong-typed entry, lock or hit file, untrusted path anywhere on the way to
or inside the cache, read-only or full directory, lock timeout) is logged once, counted, and
followed by a correct compile; none raises. An untrusted cache is read for JSON only and never
written; the CacheDir's descriptors are closed when the backend call returns (and reopened,
re-checked, by a later write).
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import errno
import json
import logging
import shutil
import tempfile
import threading
import weakref
from typing import Any, Callable, Optional, Sequence

from npuspec import counters, envs
from npuspec.compilation import cache_keys as _keys
from npuspec.graphs.cache import torchair as _torchair
from npuspec.graphs.cache import trust as _trust
from npuspec.graphs.cache.inductor import inductor_cache_dir, inductor_counters
from npuspec.graphs.cache.store import CacheCorrupt, CacheDir

log = logging.getLogger("npuspec.cache")

# Lowerings whose own artifacts npuspec caches (executable: trust rules apply): Inductor's
# pickles, generated code and .so files; torchair's GE compile cache (.om model files).
EXEC_LOWERINGS = ("inductor", "torchair")

_logged: set = set()
_private_dirs: list[str] = []
_local = threading.local()


def _once(level: int, tag: str, msg: str, *args: Any) -> None:
    if tag in _logged:
        return
    _logged.add(tag)
    log.log(level, msg, *args)


def _private_dir(lowering: str = "inductor") -> str:
    d = tempfile.mkdtemp(prefix=f"npuspec-{lowering}-")  # 0700, local disk
    _private_dirs.append(d)
    return d


@atexit.register
def _cleanup_private_dirs() -> None:
    for d in _private_dirs:
        shutil.rmtree(d, ignore_errors=True)


@dataclasses.dataclass
class Session:
    """The cache state of the current backend call (see record_artifact / load_artifact)."""
    cache: Optional[CacheDir]
    key: str
    parts: Any
    writable: bool = False
    state: str = "none"  # none | building | published | private | loaded
    loaded_json: dict = dataclasses.field(default_factory=dict)
    pending_json: dict = dataclasses.field(default_factory=dict)
    rejected: bool = False
    fault: str = ""  # the verification failure to log once
    entry_refused: bool = False  # an entry exists that we may not load (trust): do not publish


def current() -> Optional[Session]:
    return getattr(_local, "session", None)


# -- JSON artifacts (capture plan, pattern-match results, dynamic-K table, autotune choices,
#    verify kernel config): recorded by whoever computes them during a backend call --------

def record_artifact(name: str, obj: Any) -> None:
    """Store a JSON artifact in the current backend call's cache entry (no-op without a cache).

    During lowering it goes into the entry being built; after the entry is published it is
    added under the key's lock. Never pickle: `obj` must be JSON-serialisable.
    """
    if not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"npuspec cache: artifact name {name!r} must be letters, digits, '_' "
                         f"or '-' (it becomes json/{name}.json)")
    try:
        json.dumps(obj)
    except (TypeError, ValueError) as e:
        raise TypeError(f"npuspec cache: artifact {name!r} is not JSON-serialisable ({e}); "
                        f"convert tensors and tuples to lists first") from None
    s = current()
    if s is None or s.cache is None:
        return
    if s.state == "building":
        s.pending_json[name] = obj
        return
    if name in s.loaded_json:
        return  # the entry already holds it (a warm start computes the same value)
    s.loaded_json[name] = obj
    if s.state in ("published", "loaded") and s.writable:
        try:
            with s.cache.lock(s.key, timeout=min(envs.cache_lock_timeout(), 30.0)) as got:
                if got:
                    s.cache.add_json(s.key, name, obj)
        except (OSError, CacheCorrupt) as e:
            _once(logging.WARNING, f"addjson:{s.key}", "npuspec cache: could not add %s to entry "
                  "%s (%s); it stays in memory", name, s.key[:12], e)
        finally:
            s.cache.close()


def load_artifact(name: str, default: Any = None) -> Any:
    """A JSON artifact of the current backend call's entry, if a verified one was found."""
    s = current()
    if s is None:
        return default
    return s.loaded_json.get(name, default)


# -- the load-or-compile path ----------------------------------------------------------------

def cached_lower(gm: Any, example_inputs: Sequence[Any], opts: Any,
                 lower: Callable[[Any, list, Any], Callable]) -> Callable:
    root = getattr(opts, "cache_dir", None)
    if not root:
        _local.session = None
        return lower(gm, list(example_inputs), opts)
    parts = _keys.key_parts(gm, example_inputs, opts)
    key = _keys.cache_key(parts)
    cache = CacheDir(root, _trust.trusted_gid())
    sess = Session(cache, key, parts)
    _local.session = sess
    executable = getattr(opts, "lowering", None) in EXEC_LOWERINGS

    def repaired(tag: str, msg: str) -> None:  # something of the wrong type was quarantined
        sess.rejected = True
        _once(logging.WARNING, f"repair:{tag}", "%s", msg)

    cache.on_repair = repaired
    try:
        return _load_or_compile(sess, lower, gm, example_inputs, opts, executable)
    finally:
        cache.close()  # later writes (record_artifact, torchair's publish) open it again


def _load_or_compile(sess: Session, lower, gm, example_inputs, opts, executable: bool) -> Callable:
    cache, key = sess.cache, sess.key
    try:
        sess.writable = cache.open()
    except OSError as e:
        _once(logging.WARNING, f"open:{cache.root}", "npuspec cache: cannot use %s (%s); "
              "running without a persistent cache", cache.root, e)
        return _finish_miss(sess, lower, gm, example_inputs, opts, executable, publish=False)
    # An untrusted path anywhere (the way to the root, the root, a layout directory) is refused
    # for every lowering: nothing executable is loaded and nothing is written, since others
    # could redirect the writes; npuspec's JSON artifacts are still read.
    trusted = cache.untrusted is None
    if not trusted:
        sess.rejected = True
        # The fix ends the first line, so that it can be copied as it is.
        _once(logging.ERROR, f"trust:{cache.real}", "%s\nUntil then npuspec compiles without "
              "the cache's executable artifacts and writes nothing to it (npuspec's JSON "
              "artifacts are still read).", cache.untrusted)
    elif not sess.writable:
        _once(logging.WARNING, f"ro:{cache.real}", "npuspec cache: %s is not writable (read-only "
              "or full); existing entries are still used, new compilations stay in memory",
              cache.real)
    fn = _try_hit(sess, lower, gm, example_inputs, opts, executable, trusted, locked=False)
    if fn is not None:
        return fn
    if not (sess.writable and trusted and not sess.entry_refused):
        return _finish_miss(sess, lower, gm, example_inputs, opts, executable, publish=False)
    timeout = envs.cache_lock_timeout()
    stack = contextlib.ExitStack()
    try:
        got = stack.enter_context(cache.lock(key, timeout))
    except OSError as e:  # lock file not creatable: behave like a read-only directory
        _once(logging.WARNING, f"lock:{cache.root}", "npuspec cache: cannot lock %s (%s); "
              "compiling without writing", cache.root, e)
        return _finish_miss(sess, lower, gm, example_inputs, opts, executable, publish=False)
    with stack:  # a compile error inside propagates unchanged (and releases the lock)
        if got:
            fn = _try_hit(sess, lower, gm, example_inputs, opts, executable, trusted,
                          locked=True)
            if fn is not None:
                return fn
            return _finish_miss(sess, lower, gm, example_inputs, opts, executable,
                                publish=not sess.entry_refused, lock=stack)
    _once(logging.WARNING, f"timeout:{key}", "npuspec cache: waited %.0f s for another process "
          "compiling entry %s (NPUSPEC_CACHE_LOCK_TIMEOUT); compiling privately without writing",
          timeout, key[:12])
    return _finish_miss(sess, lower, gm, example_inputs, opts, executable, publish=False)


def _try_hit(sess: Session, lower, gm, example_inputs, opts, executable: bool,
             trusted: bool, locked: bool) -> Optional[Callable]:
    cache, key = sess.cache, sess.key
    top = cache.entry(key)
    try:
        st = cache.entry_stat(key)
    except OSError as e:
        _once(logging.WARNING, f"stat:{key}", "npuspec cache: cannot read %s (%s)", top, e)
        return None
    if st is None:
        return None
    load_exec = executable and trusted
    priv = _private_dir(opts.lowering) if load_exec else None
    try:
        res = cache.verify(key, executable=load_exec, copy_exec_to=priv, trust_check=True)
    except CacheCorrupt as e:
        # Logged once when the call settles (_finish_miss), with where the entry went.
        sess.rejected = True
        sess.fault = f"npuspec cache: entry {key[:12]} failed verification: {e}; recompiling"
        if locked and sess.writable:
            try:
                where = cache.quarantine(key, (st.st_dev, st.st_ino))
            except OSError as qe:  # e.g. quarantine/ gone meanwhile: publishing then fails too
                sess.fault += f" (it could not be moved to quarantine/: {qe})"
            else:
                if where:
                    sess.fault += f" (the entry was moved to {where})"
        return None
    except _trust.CacheTrustError as e:
        sess.rejected = True
        sess.entry_refused = True
        _once(logging.ERROR, f"trust:{key}", "%s\nUntil then npuspec compiles without this "
              "entry.", e)
        return None
    except OSError as e:
        _once(logging.WARNING, f"read:{key}", "npuspec cache: cannot read entry %s (%s); "
              "recompiling", key[:12], e)
        return None
    sess.loaded_json = dict(res["json"])
    if executable and not load_exec:
        return None  # JSON read from an untrusted dir; the lowering compiles privately
    if load_exec and not cache.has_exec(res["manifest"]):
        return None  # an entry without the lowering's artifacts (e.g. a run that fell back)
    if load_exec and opts.lowering == "torchair":
        with _torchair.torchair_cache_dir(priv, key):
            fn = lower(gm, list(example_inputs), opts)
        fn = _check_ge_loaded(key, fn, priv, top)  # GE loads (or compiles) at the first call
    elif load_exec:
        before = inductor_counters()
        with inductor_cache_dir(priv, _keys.fingerprint_tag(sess.parts.fingerprint)):
            fn = lower(gm, list(example_inputs), opts)
        after = inductor_counters()
        if after.get("fx_miss", 0) > before.get("fx_miss", 0) or \
                after.get("aot_miss", 0) > before.get("aot_miss", 0):
            _once(logging.WARNING, f"inductor-miss:{key}", "npuspec cache: entry %s is valid but "
                  "Inductor did not find this graph in it and compiled it again (is "
                  "torch._inductor.config the same in every deployment?)", key[:12])
            counters.bump("cache_misses")
            sess.state = "private"
            return fn
    else:
        fn = lower(gm, list(example_inputs), opts)
    sess.state = "loaded"
    if sess.writable:
        try:
            cache.bump_hits(key)  # first: a wrong-typed hit file it repairs counts as rejected
        except OSError:
            pass
    counters.bump("cache_hits")
    if sess.rejected:
        counters.bump("cache_rejected")
    if sess.fault:
        _once(logging.WARNING, f"corrupt:{key}", "%s", sess.fault)
    return fn


def _check_ge_loaded(key: str, fn: Callable, priv: str, entry: str) -> Callable:
    """After the first call: a new .om in the private copy means GE compiled after all."""
    before = _torchair.om_files(priv)

    def after() -> None:
        if _torchair.om_files(priv) - before:
            _once(logging.WARNING, f"ge-miss:{key}", "npuspec cache: entry %s is valid but GE "
                  "did not find this graph in it and compiled it again (are the torchair "
                  "options the same in every deployment?)", key[:12])
            counters.bump("cache_misses")

    def failed(e: BaseException) -> None:
        _once(logging.ERROR, f"ge-load:{key}", "npuspec cache: the first run of a graph loaded "
              "from %s failed (%s). Its files match their hashes; if GE cannot load them, remove "
              "the entry (rm -r %s) and the next start recompiles it", entry, e, entry)

    return _torchair.after_first_call(fn, after, failed)


def _finish_miss(sess: Session, lower, gm, example_inputs, opts, executable: bool,
                 publish: bool, lock: Optional[contextlib.ExitStack] = None) -> Callable:
    """Compile; publish the entry when allowed. Counts one miss (and one rejection if any).

    torchair: GE compiles at the first call, so the entry is published after it; `lock` (the
    held key lock) is taken over and released then, or if that call fails."""
    counters.bump("cache_misses")
    if sess.rejected:
        counters.bump("cache_rejected")
    if sess.fault:
        _once(logging.WARNING, f"corrupt:{sess.key}", "%s", sess.fault)
    cache = sess.cache
    sess.state = "building"
    sess.pending_json = {}
    _record_builtin_artifacts(sess, opts)
    staging = _private_dir(opts.lowering) if executable else None
    before = counters.snapshot()
    if executable and opts.lowering == "torchair":
        with _torchair.torchair_cache_dir(staging, sess.key):
            fn = lower(gm, list(example_inputs), opts)
    elif executable:
        with inductor_cache_dir(staging, _keys.fingerprint_tag(sess.parts.fingerprint)):
            fn = lower(gm, list(example_inputs), opts)
    else:
        fn = lower(gm, list(example_inputs), opts)
    delta = counters.delta(before)
    matches = {k: v for k, v in delta.items() if k.startswith("verify_patterns_matched")}
    if delta.get("inductor_fallbacks") and executable:  # lowered eagerly: nothing to share
        publish = False
    if matches:  # what the passes rewrote in this graph (for `npuspec cache ls` and debugging)
        sess.pending_json.setdefault("pattern_matches", matches)
    if executable and opts.lowering == "torchair" and publish and cache is not None:
        # JSON artifacts recorded until the first call still go into the entry (state building)
        held = lock.pop_all() if lock is not None else contextlib.ExitStack()
        done = threading.Lock()

        def release(*_: Any) -> None:
            if done.acquire(blocking=False):
                held.close()

        def after() -> None:
            try:
                if not _torchair.om_files(staging):
                    _once(logging.WARNING, f"ge-none:{sess.key}", "npuspec cache: GE wrote no "
                          "compile cache files for entry %s (is torchair in its GE mode, "
                          "max-autotune?); only npuspec's JSON artifacts are cached", sess.key[:12])
                _publish(sess, staging, "torchair")
            finally:
                release()
                cache.close()

        def failed(e: BaseException) -> None:
            sess.loaded_json = {**sess.loaded_json, **sess.pending_json}
            sess.state = "private"
            release()

        wrapped = _torchair.after_first_call(fn, after, failed)
        weakref.finalize(wrapped, release)  # never called: the lock goes with the function
        return wrapped
    sess.loaded_json = {**sess.loaded_json, **sess.pending_json}
    sess.state = "private"
    if not publish or cache is None:
        return fn
    _publish(sess, staging, "inductor")
    return fn


def _publish(sess: Session, staging: Optional[str], exec_dir: str) -> None:
    """Stage the entry (JSON artifacts; the lowering's files in `staging` go under `exec_dir`)
    and rename it into place."""
    cache = sess.cache
    sess.loaded_json = {**sess.loaded_json, **sess.pending_json}
    sess.state = "private"
    meta = {"platform": _platform_line(sess.parts.fingerprint),
            "fingerprint": sess.parts.fingerprint, "lowering": sess.parts.lowering,
            "ks": list(sess.parts.ks)}
    try:
        staged = cache.stage(sess.key, sess.pending_json, staging, meta, exec_dir=exec_dir)
        if cache.publish(sess.key, staged):
            sess.state = "published"
        else:
            log.info("npuspec cache: entry %s was published by another process", sess.key[:12])
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            why = "the disk is full"
        elif e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            why = "it is not writable"
        else:
            why = "writing failed"
        _once(logging.WARNING, f"write:{cache.root}:{e.errno}", "npuspec cache: could not write "
              "entry %s to %s: %s (%s); keeping the compiled graph in memory only",
              sess.key[:12], cache.root, why, e)


def _record_builtin_artifacts(sess: Session, opts: Any) -> None:
    """What the backend itself knows: the key's components and the dynamic-K table."""
    sess.pending_json["key"] = sess.parts.to_json()
    spec = getattr(opts, "speculative_config", None)
    if spec is not None:
        sess.pending_json["dynamic_k"] = {
            "k_values": list(spec.k_values()),
            "per_batch_size": [list(r) for r in spec.num_speculative_tokens_per_batch_size or ()],
            "num_speculative_tokens": spec.num_speculative_tokens,
        }


def _platform_line(fp: dict) -> str:
    name = fp.get("device_name") or fp.get("machine") or ""
    return f"{fp.get('device')}:{name} torch {fp.get('torch')}"
