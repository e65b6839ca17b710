"""The cache directory's layout, opened safely: root resolution and trust, the layout
directories, quarantine (docs/cache.md, "Trust rules" and "Faults").

`Layout.open()` resolves and checks the way to the root (trust.resolve_root), opens the root and
each layout directory once with O_NOFOLLOW and checks what it opened (fstat); every later read,
write, rename and removal is relative to those descriptors (fsafe.py). Something of the wrong
type in the layout (a link, or a file where a directory belongs) is moved to quarantine/ and
made anew when the cache is trusted and writable; an untrusted cache is never written.
"""
from __future__ import annotations

import contextlib
import errno
import functools
import logging
import threading
import os
import stat
import time
import uuid
import weakref
from typing import Callable, Optional

from npuspec.graphs.cache import fsafe
from npuspec.graphs.cache import trust
from npuspec.graphs.cache.fsafe import kind, lstat_at

SUBDIRS = trust.SUBDIRS  # quarantine/ first: the others' repairs move things into it
# What a write into a read-only or full cache fails with: the cache is then used read-only.
NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT)
log = logging.getLogger("npuspec.cache")


def _close_fds(fds: dict) -> None:
    for fd in fds.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()


def _default_repair(tag: str, msg: str) -> None:
    log.warning("%s", msg)


def serial(method: Callable) -> Callable:
    """Run a method under the object's I/O lock: close() (or a lazy re-open) from another
    thread must not close a descriptor an operation is using, whose number could then be
    reused for some other file."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self._io:
            return method(self, *args, **kwargs)
    return run


class Layout:
    """The root and its layout directories, as open descriptors (see the module doc)."""

    def __init__(self, root: str, group_gid: Optional[int] = None):
        self.root = os.path.abspath(os.path.expanduser(root))
        self.gid = group_gid  # trusted group: new files get it and g+w
        self.real = self.root  # the resolved root, once open() ran
        self.untrusted: Optional[trust.CacheTrustError] = None  # the first failed trust rule
        # Called as on_repair(tag, message) for each thing moved to quarantine/
        # (compilation/cache.py logs it once and counts it).
        self.on_repair: Callable[[str, str], None] = _default_repair
        self._fds: dict[str, int] = {}  # "" -> the root; "entries" etc. -> that directory
        self._opened = False
        self._io = threading.RLock()
        weakref.finalize(self, _close_fds, self._fds)

    # paths (for messages and the CLI; the operations go through descriptors)
    def path(self, *parts: str) -> str:
        return os.path.join(self.real, *parts)

    def entry(self, key: str) -> str:
        return self.path("entries", key)

    @property
    def dir_mode(self) -> int:
        return 0o2775 if self.gid is not None else 0o755

    @property
    def file_mode(self) -> int:
        return 0o664 if self.gid is not None else 0o644

    # opening and checking
    @serial
    def open(self, create: bool = True) -> bool:
        """Resolve, check and open the root and its layout; True when we may write to it.

        A trust failure anywhere (the way to the root, the root, a layout directory) is kept in
        `self.untrusted` (not raised): the directory is then read (JSON artifacts) but never
        created, repaired or written. With `create`, missing parts are made and wrong-typed
        layout entries quarantined and made anew. OSError: the root cannot be used at all."""
        _close_fds(self._fds)
        self._opened, self.untrusted = True, None
        r = trust.resolve_root(self.root, self.gid)
        self.real, self.untrusted = r.real, r.problem
        may_write = create and r.problem is None
        fd = self._open_root(r, may_write)
        if fd is None:
            return False
        self._fds[""] = fd
        self._trust(trust.check_path, self.real, os.fstat(fd), gid=self.gid, recursive_fix=True)
        found = {}
        for sub in SUBDIRS:
            st = found[sub] = lstat_at(fd, sub)
            if st is not None and stat.S_ISDIR(st.st_mode):
                sfd = self._fds[sub] = fsafe.open_dir_at(fd, sub, expect=st)
                self._trust(trust.check_subdir, self.path(sub), os.fstat(sfd), self.gid)
        if not may_write or self.untrusted is not None:
            return False
        try:
            for sub in SUBDIRS:
                st = found[sub]
                if st is not None and stat.S_ISDIR(st.st_mode):
                    continue
                if st is not None:
                    self._move_aside("", sub, st, "a directory")
                sfd = self._fds[sub] = fsafe.mkdir_at(fd, sub, self.dir_mode, self.gid)
                # a directory another process created meanwhile is checked like any other
                self._trust(trust.check_subdir, self.path(sub), os.fstat(sfd), self.gid)
            return self.untrusted is None and self._probe()
        except OSError as e:
            if e.errno in NOT_WRITABLE:
                return False
            raise

    def _open_root(self, r: trust.Resolved, may_write: bool) -> Optional[int]:
        try:
            fd = os.open(r.existing, fsafe.O_DIR)  # a real path: no link left on the way
        except NotADirectoryError:
            raise NotADirectoryError(errno.ENOTDIR, f"{r.existing} is {kind(r.existing_st)}, "
                                     f"not a directory; remove it or point cache_dir / "
                                     f"NPUSPEC_CACHE_DIR at a directory") from None
        if not fsafe.same(os.fstat(fd), r.existing_st):
            os.close(fd)
            raise FileNotFoundError(errno.ENOENT, f"{r.existing} was replaced while it was "
                                    f"being checked; try again")
        if not r.missing:
            return fd
        if not may_write:
            os.close(fd)
            return None
        try:
            for i, name in enumerate(r.missing):
                last = i == len(r.missing) - 1
                nfd = fsafe.mkdir_at(fd, name, self.dir_mode if last else 0o755,
                                     self.gid if last else None)
                os.close(fd)
                fd = nfd
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _trust(self, check: Callable, *args, **kw) -> None:
        try:
            check(*args, **kw)
        except trust.CacheTrustError as e:
            self.untrusted = self.untrusted or e

    def _probe(self) -> bool:
        """Can we create files here? By path rather than dir_fd, so that path-level fault
        injection (tests/cache/test_faults.py's simulated read-only filesystem) reaches it;
        O_CREAT | O_EXCL never follows a link, and the inode check proves the probe landed in
        the tmp/ that was checked."""
        name = f".probe.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        try:
            fd = os.open(self.path("tmp", name), fsafe.O_NEW, 0o600)
        except OSError as e:
            if e.errno in NOT_WRITABLE:
                return False
            raise
        try:
            here = lstat_at(self._fds["tmp"], name)
            ok = here is not None and fsafe.same(here, os.fstat(fd))
        finally:
            os.close(fd)
        if ok:
            os.unlink(name, dir_fd=self._fds["tmp"])
        return ok

    @serial
    def close(self) -> None:
        """Drop the descriptors (a held directory would keep its filesystem from being
        unmounted); the next operation opens and checks the cache again, without creating."""
        _close_fds(self._fds)
        self._opened = False

    def _fd(self, sub: str, write: bool = False) -> int:
        """The descriptor of a layout directory (opening the cache read-only if not done).
        `write`: refuse an untrusted cache (PermissionError with the fix), whoever asks."""
        if not self._opened:
            self.open(create=False)
        if write and self.untrusted is not None:
            raise PermissionError(errno.EACCES, f"nothing was written: {self.untrusted}")
        fd = self._fds.get(sub)
        if fd is None:
            raise FileNotFoundError(errno.ENOENT, f"{self.path(sub)} is missing or not a "
                                    f"directory (the next start with write access makes it)")
        return fd


    # quarantine
    def _to_quarantine(self, dfd: int, name: str, label: str) -> str:
        dst = f"{label}.{int(time.time())}.{os.getpid()}.{uuid.uuid4().hex[:6]}"
        os.rename(name, dst, src_dir_fd=dfd, dst_dir_fd=self._fd("quarantine", write=True))
        fsafe.fsync(dfd)
        return self.path("quarantine", dst)

    def _move_aside(self, sub: str, name: str, st: os.stat_result, want: str) -> None:
        """Quarantine `sub/name`, found to be `st` where `want` belongs, so it can be made anew.
        Without the key's lock: two processes repairing at once could move each other's fresh
        copy, which costs at most a duplicate compile (the entry rename still keeps one)."""
        dfd = self._fd(sub, write=True) if sub else self._fds[""]
        src = self.path(sub, name) if sub else self.path(name)
        now = lstat_at(dfd, name)
        if now is None or not fsafe.same(now, st):
            return  # someone else moved it already
        what = kind(st)
        if stat.S_ISLNK(st.st_mode):
            with contextlib.suppress(OSError):
                what += f" to {os.readlink(name, dir_fd=dfd)}"
        elif stat.S_ISREG(st.st_mode) and st.st_nlink != 1:
            what += f" with {st.st_nlink} hard links"
        elif stat.S_ISREG(st.st_mode):
            what += f" owned by uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):04o}"
        if not sub and name == "quarantine":  # nowhere to move it; not a directory, so no entry
            os.unlink(name, dir_fd=dfd)
            self.on_repair(f"{self.real}:{name}", f"npuspec cache: {src} was {what}, not "
                           f"{want}; removed it (nothing was read through it) and made a new one")
            return
        dst = self._to_quarantine(dfd, name, f"{sub}-{name}" if sub else name)
        self.on_repair(f"{self.real}:{sub}:{name}", f"npuspec cache: {src} was {what}, not "
                       f"{want}; moved it to {dst} (nothing was read or written through it) "
                       f"and made a new one")

    @serial
    def quarantine(self, key: str, expect_inode: Optional[tuple] = None) -> Optional[str]:
        """Move an entry (whatever its type) to quarantine/ (hold the key's lock). Skips it if it
        was replaced since it was checked (`expect_inode`). Returns the new path, or None."""
        efd = self._fd("entries", write=True)
        st = lstat_at(efd, key)
        if st is None:
            return None
        if expect_inode is not None and (st.st_dev, st.st_ino) != tuple(expect_inode):
            return None
        return self._to_quarantine(efd, key, key)

    # entries
    @serial
    def keys(self) -> list[str]:
        try:
            return sorted(k for k in os.listdir(self._fd("entries")) if not k.startswith("."))
        except FileNotFoundError:
            return []

    @serial
    def entry_stat(self, key: str) -> Optional[os.stat_result]:
        """lstat of entries/<key> (None when there is none, or no entries/ to look in)."""
        try:
            return lstat_at(self._fd("entries"), key)
        except FileNotFoundError:
            return None

