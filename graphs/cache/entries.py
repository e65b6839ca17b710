"""Reading and verifying cache entries, never through a link (docs/cache.md, "Layout").

Every file of an entry is opened relative to the entry's descriptor, one component at a time
with O_NOFOLLOW, type-checked and (for executable parts) trust-checked on the descriptor that is
then read and hashed: nothing can be swapped between the check and the read. A link, a FIFO, a
directory where a file belongs or a file where the entry directory belongs is corruption
(CacheCorrupt), which the caller quarantines like a bad hash.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
from typing import Any, Optional

import npuspec
from npuspec.graphs.cache import fsafe
from npuspec.graphs.cache import trust
from npuspec.graphs.cache.fsafe import kind, lstat_at
from npuspec.graphs.cache.layout import Layout, serial

FORMAT = 1
MANIFEST = "manifest.json"
EXEC_DIR = "inductor"  # executable part of an entry: trust-checked, never read when untrusted
EXEC_DIRS = (EXEC_DIR, "torchair")  # one per executable lowering (torchair: GE's .om cache)
JSON_DIR = "json"


class CacheCorrupt(Exception):
    """An entry failed verification (truncated, flipped, manifest mismatch, foreign version,
    wrong file type)."""


def _npuspec_version() -> str:
    return npuspec.__version__


class EntryReader(Layout):
    """Reading entries (see the module doc); store.CacheDir adds the writing."""

    def _open_entry(self, key: str) -> tuple[int, os.stat_result]:
        efd = self._fd("entries")
        st = lstat_at(efd, key)
        if st is None:
            raise FileNotFoundError(errno.ENOENT, f"{self.entry(key)}: no such entry")
        if not stat.S_ISDIR(st.st_mode):
            raise CacheCorrupt(f"{self.entry(key)} is {kind(st)}, not an entry directory")
        return fsafe.open_dir_at(efd, key, expect=st), st

    def _open_in(self, top_fd: int, top: str, rel: str) -> tuple[int, os.stat_result]:
        """Open a file of an entry for reading; a link, a directory or a missing component
        there is corruption."""
        p = os.path.join(top, rel)
        try:
            fd = fsafe.open_rel(top_fd, rel)
        except FileNotFoundError:
            raise CacheCorrupt(f"{p} is missing") from None
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR, errno.EISDIR):
                raise CacheCorrupt(f"{p} (or a directory above it) is a link or not of the "
                                   f"right type ({e.strerror})") from None
            raise
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise CacheCorrupt(f"{p} is {kind(st)}, not a file")
        return fd, st

    @serial
    def read_manifest(self, key: str) -> dict:
        fd, _ = self._open_entry(key)
        try:
            return self._manifest_at(fd, key)
        finally:
            os.close(fd)

    def _manifest_at(self, top_fd: int, key: str) -> dict:
        p = os.path.join(self.entry(key), MANIFEST)
        fd, _ = self._open_in(top_fd, self.entry(key), MANIFEST)
        try:
            data = fsafe.read_fd(fd)
        finally:
            os.close(fd)
        try:
            m = json.loads(data)
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

    @serial
    def verify(self, key: str, *, executable: bool, copy_exec_to: Optional[str] = None,
               trust_check: Any = None) -> dict:
        """Check every file against the manifest; return {"manifest", "json": {name: obj}}.

        With `executable`, the executable part is read and, if `trust_check` is truthy,
        trust-checked (the entry, every directory and file of it, on the descriptors that are
        then read: nothing can be swapped between the check and the read), and copied, from the
        very bytes that were hashed, into `copy_exec_to` (a private directory). Without it, the
        executable part is listed but not opened. (`trust_check` was a callable; any truthy
        value now turns the checks on, and it is not called.) Raises CacheCorrupt (also for a
        link or a wrong file type anywhere in the entry), CacheTrustError or OSError.
        """
        top = self.entry(key)
        fd, st = self._open_entry(key)
        try:
            check = executable and bool(trust_check)
            if check:
                trust.check_path(top, os.fstat(fd), gid=self.gid, recursive_fix=True)
            m = self._manifest_at(fd, key)
            files: dict = m["files"]
            present = set()
            for rel, lst in fsafe.walk(fd):
                if stat.S_ISDIR(lst.st_mode):
                    if check and rel.split(os.sep, 1)[0] in EXEC_DIRS:
                        trust.check_path(os.path.join(top, rel), lst, gid=self.gid)
                elif stat.S_ISREG(lst.st_mode):
                    present.add(rel)
                else:
                    raise CacheCorrupt(f"{os.path.join(top, rel)} is {kind(lst)}; an entry "
                                       f"holds only directories and regular files")
            present.discard(MANIFEST)
            listed = set(files)
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
                data = self._read_listed(fd, top, rel, files[rel], check and is_exec)
                if is_exec and copy_exec_to is not None:
                    dst = os.path.join(copy_exec_to, os.path.relpath(rel, _exec_top(rel)))
                    os.makedirs(os.path.dirname(dst), mode=0o700, exist_ok=True)
                    with open(dst, "wb") as f:  # our own 0700 temp dir
                        f.write(data)
                elif rel.startswith(JSON_DIR + os.sep) and rel.endswith(".json"):
                    try:
                        out["json"][os.path.basename(rel)[:-5]] = json.loads(data)
                    except ValueError as e:
                        raise CacheCorrupt(f"{os.path.join(top, rel)}: not valid JSON "
                                           f"({e})") from None
            return out
        finally:
            os.close(fd)

    def _read_listed(self, top_fd: int, top: str, rel: str, want: dict, check: bool) -> bytes:
        path = os.path.join(top, rel)
        fd, st = self._open_in(top_fd, top, rel)
        try:
            if check:
                trust.check_path(path, st, gid=self.gid)
            if st.st_size != want.get("size"):  # before reading: an oversized file is not read
                raise CacheCorrupt(f"{path}: {st.st_size} bytes, manifest says "
                                   f"{want.get('size')} (truncated or rewritten)")
            data = fsafe.read_fd(fd)
        finally:
            os.close(fd)
        if len(data) != want.get("size"):
            raise CacheCorrupt(f"{path}: {len(data)} bytes read, manifest says "
                               f"{want.get('size')} (rewritten while being read)")
        digest = hashlib.sha256(data).hexdigest()
        if digest != want.get("sha256"):
            raise CacheCorrupt(f"{path}: sha256 {digest[:12]}... does not match the manifest "
                               f"({str(want.get('sha256'))[:12]}...)")
        return data

    def has_exec(self, manifest: dict) -> bool:
        return any(_exec_top(p) for p in manifest["files"])


def _exec_top(rel: str) -> Optional[str]:
    """The executable directory `rel` lies in (one of EXEC_DIRS), or None."""
    top = rel.split(os.sep, 1)[0]
    return top if top in EXEC_DIRS and rel != top else None


