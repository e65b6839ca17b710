"""The on-disk cache directory: atomic entries with sha256 manifests, per-key locks, quarantine.

Layout (docs/cache.md):

    <root>/entries/<key>/manifest.json     format, key, npuspec version, fingerprint, files{sha256,size}
    <root>/entries/<key>/json/<name>.json  npuspec's own artifacts (plain JSON, never pickle)
    <root>/entries/<key>/inductor/...      Inductor's cache tree for this key (executable)
    <root>/entries/<key>/torchair/...      or, on npu, GE's compile cache (.om + index; executable)
    <root>/locks/<key>.lock                fcntl lock: one process compiles a key at a time
    <root>/hits/<key>                      one byte appended per hit (size = hit count)
    <root>/quarantine/<name>.<time>.<pid>.<rand>  what failed verification or had the wrong
                                           type (entries, locks, hit files, layout dirs), kept
    <root>/tmp/                            staging; an entry appears only by one rename

An entry is staged under tmp/ (every file written to a temp name, fsynced, renamed), its manifest
written last, and the whole directory renamed into entries/ in one step, so a reader sees either
no entry or a complete one. A second publisher's rename fails (the key exists) and it drops its
copy: there is never more than one entry per key.

Nothing follows a symbolic link: the layout is opened once and checked (layout.py), entries are
read and verified through descriptors (entries.py), and everything here writes by creating fresh
names relative to those descriptors and renaming them (fsafe.py). A lock or hit file of the
wrong type (a link, a directory, a hard-linked file) is quarantined and made anew.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import stat
import threading
import time
import uuid
from typing import Any, Iterator, Optional

from npuspec.graphs.cache import fsafe
from npuspec.graphs.cache import trust
# (FORMAT, MANIFEST, the EXEC_DIRS, CacheCorrupt, SUBDIRS: the names the rest of npuspec and
# the tests know from this module)
from npuspec.graphs.cache.entries import (EXEC_DIR, EXEC_DIRS, FORMAT, JSON_DIR, MANIFEST,
                                          CacheCorrupt, EntryReader, _npuspec_version)
from npuspec.graphs.cache.fsafe import lstat_at
from npuspec.graphs.cache.layout import SUBDIRS, serial

__all__ = ["CacheDir", "CacheCorrupt", "FORMAT", "MANIFEST", "EXEC_DIR", "EXEC_DIRS",
           "JSON_DIR", "SUBDIRS", "dir_size", "list_files"]


# -- low-level helpers (tests inject faults through _write_fd) -------------------------------

def _write_fd(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def dir_size(path: str) -> int:
    total = 0
    for dp, _dn, fns in os.walk(path):
        for fn in fns:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dp, fn)).st_size
    return total


def list_files(top: str) -> list[str]:
    """Relative paths of every non-directory under `top` (a private staging dir), sorted."""
    out = []
    for dp, dns, fns in os.walk(top):
        for n in fns + [d for d in dns if os.path.islink(os.path.join(dp, d))]:
            out.append(os.path.relpath(os.path.join(dp, n), top))
    return sorted(out)


_thread_locks: dict[str, threading.Lock] = {}
_thread_locks_guard = threading.Lock()


class CacheDir(EntryReader):
    """The cache directory: layout and trust (layout.Layout), reading entries
    (entries.EntryReader), and here writing entries, hit counts, locks."""

    # writing
    @serial
    def stage(self, key: str, json_artifacts: dict, exec_src: Optional[str],
              meta: dict, exec_dir: str = EXEC_DIR) -> str:
        """Build a complete entry under tmp/; returns its name there (the caller publishes
        it). `exec_src`'s files (a private directory) go under `exec_dir` (one of EXEC_DIRS)."""
        assert exec_dir in EXEC_DIRS, exec_dir
        tfd = self._fd("tmp", write=True)
        name = f"{key}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        sfd = fsafe.mkdir_at(tfd, name, self.dir_mode, self.gid)
        try:
            files: dict[str, dict] = {}
            for art, obj in sorted(json_artifacts.items()):
                data = json.dumps(obj, sort_keys=True, indent=1).encode()
                self._put(sfd, os.path.join(JSON_DIR, f"{art}.json"), data, files)
            if exec_src is not None:
                for rel in list_files(exec_src):
                    src = os.path.join(exec_src, rel)
                    if _skip_exec_file(rel) or not stat.S_ISREG(os.lstat(src).st_mode):
                        continue
                    with open(src, "rb") as f:
                        data = f.read()
                    self._put(sfd, os.path.join(exec_dir, rel), data, files)
            manifest = {"format": FORMAT, "key": key, "npuspec": _npuspec_version(),
                        "created": time.time(), "pid": os.getpid(), **meta, "files": files}
            fsafe.write_atomic_at(sfd, MANIFEST, json.dumps(manifest, sort_keys=True,
                                                            indent=1).encode(),
                                  self.file_mode, _write_fd)
            fsafe.fsync(sfd)
            return name
        except BaseException:
            fsafe.remove_at(tfd, name)
            raise
        finally:
            os.close(sfd)

    def _put(self, top_fd: int, rel: str, data: bytes, files: dict) -> None:
        parts = rel.split(os.sep)
        assert all(p not in ("", ".", "..") for p in parts), rel
        fds = [top_fd]
        try:
            for p in parts[:-1]:
                fds.append(fsafe.mkdir_at(fds[-1], p, self.dir_mode, self.gid))
            fsafe.write_atomic_at(fds[-1], parts[-1], data, self.file_mode, _write_fd)
        finally:
            for fd in fds[1:]:
                os.close(fd)
        files[rel] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}

    @serial
    def publish(self, key: str, staged: str) -> bool:
        """Rename the staged entry (its name under tmp/) into place; False (and the copy
        dropped) if the key exists."""
        tfd, efd = self._fd("tmp", write=True), self._fd("entries", write=True)
        try:
            os.rename(staged, key, src_dir_fd=tfd, dst_dir_fd=efd)
        except OSError as e:
            fsafe.remove_at(tfd, staged)
            if e.errno in (errno.EEXIST, errno.ENOTEMPTY):
                return False
            raise
        fsafe.fsync(efd)
        return True

    @serial
    def add_json(self, key: str, name: str, obj: Any) -> None:
        """Add one JSON artifact to a published entry (hold the key's lock). An existing one is
        kept: files of a published entry never change, so a reader holding the previous
        manifest still sees exactly the bytes it lists."""
        self._fd("entries", write=True)
        fd, _ = self._open_entry(key)
        try:
            m = self._manifest_at(fd, key)
            rel = os.path.join(JSON_DIR, f"{name}.json")
            if rel in m["files"]:
                return
            self._put(fd, rel, json.dumps(obj, sort_keys=True, indent=1).encode(), m["files"])
            fsafe.write_atomic_at(fd, MANIFEST, json.dumps(m, sort_keys=True, indent=1).encode(),
                                  self.file_mode, _write_fd)
        finally:
            os.close(fd)

    def _plain(self, st: os.stat_result) -> bool:
        """A lock or hit file we may write: a regular file, one link, passing the trust rules."""
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            return False
        try:
            trust.check_path("", st, gid=self.gid)
        except trust.CacheTrustError:
            return False
        return True

    @serial
    def _open_plain(self, sub: str, name: str, flags: int) -> int:
        """Open (creating) the lock or hit file sub/name; anything else found there is moved
        aside first, and the opened inode is checked again, so nothing is written through a
        link or into a hard-linked file."""
        dfd = self._fd(sub, write=True)
        st = lstat_at(dfd, name)
        if st is not None and not self._plain(st):
            self._move_aside(sub, name, st, "a regular file")
        fd = os.open(name, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     self.file_mode, dir_fd=dfd)
        st = os.fstat(fd)
        if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != self.file_mode \
                and stat.S_ISREG(st.st_mode):
            os.fchmod(fd, self.file_mode)  # the umask must not keep the trusted group out
            st = os.fstat(fd)
        if not self._plain(st):
            os.close(fd)
            raise OSError(errno.EEXIST, f"{self.path(sub, name)} was replaced while it was "
                                        f"being opened; not using it this time")
        return fd

    @serial
    def bump_hits(self, key: str) -> None:
        fd = self._open_plain("hits", key, os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, b".")
        finally:
            os.close(fd)

    @serial
    def hits(self, key: str) -> int:
        try:
            st = lstat_at(self._fd("hits"), key)
        except OSError:
            return 0
        return st.st_size if st is not None and stat.S_ISREG(st.st_mode) else 0

    @serial
    def remove(self, key: str) -> None:
        """Delete an entry: rename it out of entries/ first so no reader sees it half-deleted."""
        gone = f".rm.{key}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        tfd = self._fd("tmp", write=True)
        try:
            os.rename(key, gone, src_dir_fd=self._fd("entries", write=True), dst_dir_fd=tfd)
        except FileNotFoundError:
            return
        fsafe.remove_at(tfd, gone)
        with contextlib.suppress(OSError):
            fsafe.remove_at(self._fd("hits", write=True), key)

    # locking
    @contextlib.contextmanager
    def lock(self, key: str, timeout: float, poll: float = 0.05) -> Iterator[bool]:
        """Hold the key's fcntl lock; yields False if `timeout` seconds pass first.

        POSIX record locks (lockf) are used because NFS (v3 with lockd, v4) supports them across
        clients; they are per process, so a thread lock guards the key inside one process too.
        """
        fd = self._open_plain("locks", f"{key}.lock", os.O_RDWR)
        with _thread_locks_guard:
            tl = _thread_locks.setdefault(os.path.join(self.real, key), threading.Lock())
        deadline = time.monotonic() + timeout
        if not tl.acquire(timeout=max(timeout, 0.0)):
            os.close(fd)
            yield False
            return
        try:
            got = False
            while not got:
                try:
                    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    got = True
                except OSError as e:
                    if e.errno == errno.ENOLCK:  # e.g. an NFS mount with `nolock`
                        _log_no_locks(self.real)
                        got = True  # go on unlocked: the atomic rename still keeps one entry
                        break
                    if e.errno not in (errno.EAGAIN, errno.EACCES):
                        raise
                    if time.monotonic() >= deadline:
                        break
                    time.sleep(poll)
            yield got
        finally:
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


def _skip_exec_file(rel: str) -> bool:
    """Lock files and Inductor's own half-written temp files (".<pid>.<tid>.tmp") are not
    artifacts."""
    name = os.path.basename(rel)
    return (rel.split(os.sep)[0] == "locks" or name.endswith(".lock")
            or (name.startswith(".") and name.endswith(".tmp")))
