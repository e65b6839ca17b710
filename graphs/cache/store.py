"""The on-disk cache directory: atomic entries with sha256 manifests, per-key locks, quarantine.

Layout (docs/cache.md):

    <root>/entries/<key>/manifest.json     format, key, npuspec version, fingerprint, files{sha256,size}
    <root>/entries/<key>/json/<name>.json  npuspec's own artifacts (plain JSON, never pickle)
    <root>/entries/<key>/inductor/...      Inductor's cache tree for this key (executable)
    <root>/entries/<key>/torchair/...      or, on npu, GE's compile cache (.om + index; executable)
    <root>/locks/<key>.lock                fcntl lock: one process compiles a key at a time
    <root>/hits/<key>                      one byte appended per hit (size = hit count)
    <root>/quarantine/<key>.<time>.<pid>/  entries that failed verification, kept for inspection
    <root>/tmp/                            staging; an entry appears only by one rename

An entry is staged under tmp/ (every file written to a temp name, fsynced, renamed), its manifest
written last, and the whole directory renamed into entries/ in one step, so a reader sees either
no entry or a complete one. A second publisher's rename fails (the key exists) and it drops its
copy: there is never more than one entry per key.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import stat
import threading
import time
import uuid
from typing import Any, Callable, Iterator, Optional

FORMAT = 1
MANIFEST = "manifest.json"
EXEC_DIR = "inductor"  # executable part of an entry: trust-checked, never read when untrusted
EXEC_DIRS = (EXEC_DIR, "torchair")  # one per executable lowering (torchair: GE's .om cache)
JSON_DIR = "json"


class CacheCorrupt(Exception):
    """An entry failed verification (truncated, flipped, manifest mismatch, foreign version)."""


def _npuspec_version() -> str:
    import npuspec
    return npuspec.__version__


# -- low-level file operations (tests inject faults through _write_fd) -----------------------

def _write_fd(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on directories; the rename still happened
        pass
    finally:
        os.close(fd)


def write_atomic(path: str, data: bytes, mode: int = 0o644) -> None:
    """Write to a temp file in the same directory, fsync, rename into place, fsync the dir."""
    d, name = os.path.split(path)
    tmp = os.path.join(d, f".{name}.tmp.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        try:
            _write_fd(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.chmod(tmp, mode)  # exact bits, whatever the umask
        os.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(d)


def sha256_file(path: str) -> tuple[str, int, bytes]:
    with open(path, "rb") as f:
        data = f.read()
    return hashlib.sha256(data).hexdigest(), len(data), data


def dir_size(path: str) -> int:
    total = 0
    for dp, _dn, fns in os.walk(path):
        for fn in fns:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dp, fn)).st_size
    return total


def list_files(top: str) -> list[str]:
    """Relative paths of every non-directory under `top`, sorted (links included, to be refused)."""
    out = []
    for dp, dns, fns in os.walk(top):
        for n in fns + [d for d in dns if os.path.islink(os.path.join(dp, d))]:
            out.append(os.path.relpath(os.path.join(dp, n), top))
    return sorted(out)


# -- the directory ----------------------------------------------------------------------------

_thread_locks: dict[str, threading.Lock] = {}
_thread_locks_guard = threading.Lock()


class CacheDir:
    def __init__(self, root: str, group_gid: Optional[int] = None):
        self.root = os.path.abspath(os.path.expanduser(root))
        self.gid = group_gid  # trusted group: new files get it and g+w

    # paths
    def path(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    def entry(self, key: str) -> str:
        return self.path("entries", key)

    @property
    def dir_mode(self) -> int:
        return 0o2775 if self.gid is not None else 0o755

    @property
    def file_mode(self) -> int:
        return 0o664 if self.gid is not None else 0o644

    def _mkdir(self, path: str) -> None:
        try:
            os.mkdir(path, self.dir_mode)
        except FileExistsError:
            return
        os.chmod(path, self.dir_mode)
        if self.gid is not None:
            with contextlib.suppress(OSError):
                os.chown(path, -1, self.gid)

    def open(self) -> bool:
        """Create the layout if needed; True when the directory is writable by us."""
        try:
            if not os.path.isdir(self.root):
                os.makedirs(os.path.dirname(self.root), exist_ok=True)
                self._mkdir(self.root)
            for sub in ("entries", "locks", "hits", "quarantine", "tmp"):
                self._mkdir(self.path(sub))
            probe = self.path("tmp", f".probe.{os.getpid()}.{uuid.uuid4().hex[:8]}")
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.close(fd)
            os.unlink(probe)
            return True
        except OSError as e:
            if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT):
                return False
            raise

    def keys(self) -> list[str]:
        try:
            return sorted(k for k in os.listdir(self.path("entries")) if not k.startswith("."))
        except FileNotFoundError:
            return []

    # manifest and verification
    def read_manifest(self, key: str) -> dict:
        p = os.path.join(self.entry(key), MANIFEST)
        try:
            with open(p, "rb") as f:
                m = json.loads(f.read())
        except FileNotFoundError:
            raise CacheCorrupt(f"{p} is missing") from None
        except (ValueError, UnicodeDecodeError) as e:
            raise CacheCorrupt(f"{p} is not valid JSON ({e})") from None
        if not isinstance(m, dict) or not isinstance(m.get("files"), dict):
            raise CacheCorrupt(f"{p} has no 'files' table")
        if m.get("format") != FORMAT:
            raise CacheCorrupt(f"{p}: entry format {m.get('format')!r}, this npuspec reads {FORMAT}")
        if m.get("npuspec") != _npuspec_version():
            raise CacheCorrupt(f"{p}: written by npuspec {m.get('npuspec')!r}, this is "
                               f"{_npuspec_version()}")
        if m.get("key") != key:
            raise CacheCorrupt(f"{p}: manifest key {m.get('key')!r} does not match the directory")
        return m

    def verify(self, key: str, *, executable: bool,
               copy_exec_to: Optional[str] = None,
               trust_check: Optional[Callable[[str, bool], None]] = None) -> dict:
        """Check every file against the manifest; return {"manifest", "json": {name: obj}}.

        With `executable`, the executable part is trust-checked (every dir and file) and copied,
        from the very bytes that were hashed, into `copy_exec_to` (a private directory), so
        nothing can be swapped between the check and the load. Without it, the executable part
        is not opened at all. Raises CacheCorrupt or CacheTrustError.
        """
        top = self.entry(key)
        st = os.lstat(top)
        if executable and trust_check:
            trust_check(top, True)
        m = self.read_manifest(key)
        files: dict = m["files"]
        listed = set(files)
        present = set(list_files(top)) - {MANIFEST}
        missing = sorted(listed - present)
        if missing:
            raise CacheCorrupt(f"{top}: manifest lists {missing[0]!r} but it is missing")
        extra = sorted(p for p in present - listed if _exec_top(p))
        if extra:
            raise CacheCorrupt(f"{top}: {extra[0]!r} is not in the manifest")
        out: dict[str, Any] = {"manifest": m, "json": {}, "inode": (st.st_dev, st.st_ino)}
        for rel in sorted(listed):
            is_exec = _exec_top(rel) is not None
            if is_exec and not executable:
                continue
            path = os.path.join(top, rel)
            if is_exec and trust_check:
                trust_check(path, False)
                for parent in _parents_within(top, rel):
                    trust_check(parent, False)
            digest, size, data = sha256_file(path)
            want = files[rel]
            if size != want.get("size"):
                raise CacheCorrupt(f"{path}: {size} bytes, manifest says {want.get('size')} "
                                   f"(truncated or rewritten)")
            if digest != want.get("sha256"):
                raise CacheCorrupt(f"{path}: sha256 {digest[:12]}... does not match the manifest "
                                   f"({str(want.get('sha256'))[:12]}...)")
            if is_exec and copy_exec_to is not None:
                dst = os.path.join(copy_exec_to, os.path.relpath(rel, _exec_top(rel)))
                os.makedirs(os.path.dirname(dst), mode=0o700, exist_ok=True)
                with open(dst, "wb") as f:
                    f.write(data)
            elif rel.startswith(JSON_DIR + os.sep) and rel.endswith(".json"):
                try:
                    out["json"][os.path.basename(rel)[:-5]] = json.loads(data)
                except ValueError as e:
                    raise CacheCorrupt(f"{path}: not valid JSON ({e})") from None
        return out

    def has_exec(self, manifest: dict) -> bool:
        return any(_exec_top(p) for p in manifest["files"])

    # writing
    def stage(self, key: str, json_artifacts: dict, exec_src: Optional[str],
              meta: dict, exec_dir: str = EXEC_DIR) -> str:
        """Build a complete entry under tmp/; returns its path (the caller publishes it).
        `exec_src`'s files go under `exec_dir` (one of EXEC_DIRS)."""
        assert exec_dir in EXEC_DIRS, exec_dir
        st = self.path("tmp", f"{key}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
        self._mkdir(st)
        try:
            files: dict[str, dict] = {}
            self._mkdir(os.path.join(st, JSON_DIR))
            for name, obj in sorted(json_artifacts.items()):
                data = json.dumps(obj, sort_keys=True, indent=1).encode()
                rel = os.path.join(JSON_DIR, f"{name}.json")
                self._put(st, rel, data, files)
            if exec_src is not None:
                for rel in list_files(exec_src):
                    src = os.path.join(exec_src, rel)
                    if _skip_exec_file(rel) or not stat.S_ISREG(os.lstat(src).st_mode):
                        continue
                    with open(src, "rb") as f:
                        data = f.read()
                    self._put(st, os.path.join(exec_dir, rel), data, files)
            manifest = {"format": FORMAT, "key": key, "npuspec": _npuspec_version(),
                        "created": time.time(), "pid": os.getpid(), **meta, "files": files}
            write_atomic(os.path.join(st, MANIFEST),
                         json.dumps(manifest, sort_keys=True, indent=1).encode(), self.file_mode)
            fsync_dir(st)
            return st
        except BaseException:
            shutil.rmtree(st, ignore_errors=True)
            raise

    def _put(self, top: str, rel: str, data: bytes, files: dict) -> None:
        d = os.path.dirname(os.path.join(top, rel))
        parts = os.path.relpath(d, top).split(os.sep)
        cur = top
        for p in parts:
            if p in ("", "."):
                continue
            cur = os.path.join(cur, p)
            self._mkdir(cur)
        write_atomic(os.path.join(top, rel), data, self.file_mode)
        files[rel] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}

    def publish(self, key: str, staged: str) -> bool:
        """Rename the staged entry into place; False (and the copy dropped) if the key exists."""
        try:
            os.rename(staged, self.entry(key))
        except OSError as e:
            shutil.rmtree(staged, ignore_errors=True)
            if e.errno in (errno.EEXIST, errno.ENOTEMPTY):
                return False
            raise
        fsync_dir(self.path("entries"))
        return True

    def add_json(self, key: str, name: str, obj: Any) -> None:
        """Add one JSON artifact to a published entry (hold the key's lock). An existing one is
        kept: files of a published entry never change, so a reader holding the previous
        manifest still sees exactly the bytes it lists."""
        top = self.entry(key)
        m = self.read_manifest(key)
        if os.path.join(JSON_DIR, f"{name}.json") in m["files"]:
            return
        data = json.dumps(obj, sort_keys=True, indent=1).encode()
        self._put(top, os.path.join(JSON_DIR, f"{name}.json"), data, m["files"])
        write_atomic(os.path.join(top, MANIFEST), json.dumps(m, sort_keys=True, indent=1).encode(),
                     self.file_mode)

    def quarantine(self, key: str, expect_inode: Optional[tuple] = None) -> Optional[str]:
        """Move an entry to quarantine/ (hold the key's lock). Skips it if the entry was replaced
        since it was checked (`expect_inode`). Returns the new path, or None."""
        src = self.entry(key)
        try:
            st = os.lstat(src)
        except FileNotFoundError:
            return None
        if expect_inode is not None and (st.st_dev, st.st_ino) != tuple(expect_inode):
            return None
        dst = self.path("quarantine", f"{key}.{int(time.time())}.{os.getpid()}")
        os.rename(src, dst)
        fsync_dir(self.path("entries"))
        return dst

    def bump_hits(self, key: str) -> None:
        fd = os.open(self.path("hits", key), os.O_WRONLY | os.O_CREAT | os.O_APPEND, self.file_mode)
        try:
            os.write(fd, b".")
        finally:
            os.close(fd)

    def hits(self, key: str) -> int:
        try:
            return os.stat(self.path("hits", key)).st_size
        except OSError:
            return 0

    def remove(self, key: str) -> None:
        """Delete an entry: rename it out of entries/ first so no reader sees it half-deleted."""
        src = self.entry(key)
        gone = self.path("tmp", f".rm.{key}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
        try:
            os.rename(src, gone)
        except FileNotFoundError:
            return
        shutil.rmtree(gone, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.unlink(self.path("hits", key))

    # locking
    @contextlib.contextmanager
    def lock(self, key: str, timeout: float, poll: float = 0.05) -> Iterator[bool]:
        """Hold the key's fcntl lock; yields False if `timeout` seconds pass first.

        POSIX record locks (lockf) are used because NFS (v3 with lockd, v4) supports them across
        clients; they are per process, so a thread lock guards the key inside one process too.
        """
        with _thread_locks_guard:
            tl = _thread_locks.setdefault(os.path.join(self.root, key), threading.Lock())
        deadline = time.monotonic() + timeout
        if not tl.acquire(timeout=max(timeout, 0.0)):
            yield False
            return
        fd = -1
        try:
            fd = os.open(self.path("locks", f"{key}.lock"), os.O_RDWR | os.O_CREAT, self.file_mode)
            got = False
            while not got:
                try:
                    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    got = True
                except OSError as e:
                    if e.errno == errno.ENOLCK:  # e.g. an NFS mount with `nolock`
                        _log_no_locks(self.root)
                        got = True  # go on unlocked: the atomic rename still keeps one entry
                        break
                    if e.errno not in (errno.EAGAIN, errno.EACCES):
                        raise
                    if time.monotonic() >= deadline:
                        break
                    time.sleep(poll)
            yield got
        finally:
            if fd >= 0:
                os.close(fd)  # closing the descriptor drops the lockf lock
            tl.release()


_no_lock_logged: set = set()


def _log_no_locks(root: str) -> None:
    if root not in _no_lock_logged:
        _no_lock_logged.add(root)
        logging.getLogger("npuspec.cache").warning(
            "npuspec cache: %s does not support fcntl locks (ENOLCK); processes may compile the "
            "same key at once (one entry still wins). Mount it with locking (e.g. NFS without "
            "`nolock`) to avoid duplicate work.", root)


def _exec_top(rel: str) -> Optional[str]:
    """The executable directory `rel` lies in (one of EXEC_DIRS), or None."""
    top = rel.split(os.sep, 1)[0]
    return top if top in EXEC_DIRS and rel != top else None


def _parents_within(top: str, rel: str) -> list[str]:
    out = []
    d = os.path.dirname(rel)
    while d:
        out.append(os.path.join(top, d))
        d = os.path.dirname(d)
    return out


def _skip_exec_file(rel: str) -> bool:
    """Lock files and Inductor's own half-written temp files (".<pid>.<tid>.tmp") are not
    artifacts."""
    name = os.path.basename(rel)
    return (rel.split(os.sep)[0] == "locks" or name.endswith(".lock")
            or (name.startswith(".") and name.endswith(".tmp")))
