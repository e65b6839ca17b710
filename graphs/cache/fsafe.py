"""File operations relative to open directory descriptors that never follow a symbolic link.

The cache opens its root once (after trust.resolve_root checked the way there) and every
directory below it with O_NOFOLLOW, and names everything else relative to those descriptors.
A link planted anywhere in the cache then fails the open (ELOOP) or shows up in an lstat
instead of redirecting a read or a write outside the cache; a rename or unlink acts on the
link itself. Files are only ever written by creating a fresh name (O_CREAT | O_EXCL) and
renaming it into place, so an existing inode (say, a hard link to a file elsewhere) is never
written into; the one exception, the hit counter's append, checks the inode first (store.py).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import stat
import uuid
from typing import Callable, Iterator, Optional

O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: opening a FIFO planted where a file should be must not hang; its type is then
# seen by fstat and refused.
O_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
O_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def kind(st: os.stat_result) -> str:
    """What `st` is, for messages ("a symbolic link", ...)."""
    m = st.st_mode
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISREG, "a regular file"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(m):
            return name
    return f"a file of type {stat.S_IFMT(m):o}"


def same(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def lstat_at(dfd: int, name: str) -> Optional[os.stat_result]:
    """lstat of `name` in `dfd`, or None if it does not exist."""
    try:
        return os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def open_dir_at(dfd: int, name: str, expect: Optional[os.stat_result] = None) -> int:
    """Open the directory `name` (never through a link). With `expect` (its lstat), refuse a
    directory swapped in between the lstat and the open."""
    fd = os.open(name, O_DIR, dir_fd=dfd)
    if expect is not None and not same(os.fstat(fd), expect):
        os.close(fd)
        raise FileNotFoundError(f"{name} was replaced while it was being opened")
    return fd


def open_rel(top: int, rel: str, flags: int = O_READ) -> int:
    """Open `rel` (a relative path of plain names) below `top`, one component at a time, each
    with O_NOFOLLOW."""
    parts = rel.split(os.sep)
    assert parts and all(p not in ("", ".", "..") for p in parts), rel
    fd = top
    try:
        for p in parts[:-1]:
            nxt = os.open(p, O_DIR, dir_fd=fd)
            if fd != top:
                os.close(fd)
            fd = nxt
        return os.open(parts[-1], flags, dir_fd=fd)
    finally:
        if fd != top:
            os.close(fd)


def read_fd(fd: int) -> bytes:
    chunks = []
    while True:
        b = os.read(fd, 1 << 20)
        if not b:
            return b"".join(chunks)
        chunks.append(b)


def walk(dfd: int, prefix: str = "") -> Iterator[tuple[str, os.stat_result]]:
    """(relative path, lstat) of everything below `dfd`, sorted, depth first; descends only
    into real directories."""
    for name in sorted(os.listdir(dfd)):
        st = lstat_at(dfd, name)
        if st is None:
            continue  # removed meanwhile
        rel = os.path.join(prefix, name) if prefix else name
        yield rel, st
        if stat.S_ISDIR(st.st_mode):
            fd = open_dir_at(dfd, name, expect=st)
            try:
                yield from walk(fd, rel)
            finally:
                os.close(fd)


def mkdir_at(dfd: int, name: str, mode: int, gid: Optional[int] = None) -> int:
    """Create (or open an existing) directory `name` with exactly `mode`; returns its fd."""
    created = True
    try:
        os.mkdir(name, mode, dir_fd=dfd)
    except FileExistsError:
        created = False
    fd = os.open(name, O_DIR, dir_fd=dfd)
    if created:
        try:
            os.fchmod(fd, mode)  # exact bits, whatever the umask
            if gid is not None:
                with contextlib.suppress(OSError):
                    os.fchown(fd, -1, gid)
        except BaseException:
            os.close(fd)
            raise
    return fd


def write_atomic_at(dfd: int, name: str, data: bytes, mode: int,
                    write: Callable[[int, bytes], None]) -> None:
    """Write `data` to a fresh temp name in `dfd`, fsync, rename it to `name`, fsync `dfd`.
    `write(fd, data)` does the writing (store._write_fd: tests inject faults there)."""
    tmp = f".{name}.tmp.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    fd = os.open(tmp, O_NEW, mode, dir_fd=dfd)
    try:
        try:
            write(fd, data)
            os.fchmod(fd, mode)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dfd)
        raise
    fsync(dfd)


def fsync(fd: int) -> None:
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on directories; the rename still happened
        pass


def remove_at(dfd: int, name: str) -> None:
    """Remove `name` in `dfd`, whatever it is: a directory tree (shutil.rmtree with dir_fd
    never follows links inside it) or a single non-directory (a link itself, not its target)."""
    st = lstat_at(dfd, name)
    if st is None:
        return
    if stat.S_ISDIR(st.st_mode):
        assert shutil.rmtree.avoids_symlink_attacks, "needs fd-based rmtree (Linux)"
        shutil.rmtree(name, dir_fd=dfd, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=dfd)
