"""May we load executable artifacts (pickles, generated Python, shared objects) from a path?

Inductor's caches unpickle and import what they find, so a cache another user can write to
is a code-execution hole. A path is trusted when
- it is owned by this user or by root, or, with NPUSPEC_CACHE_TRUSTED_GROUP set, by a member
  of that group whose gid the path carries;
- it is not writable by others (o+w), ever;
- it is not writable by its group (g+w) unless that group is the trusted group.
The cache root's ancestors must not let others replace the root: none may be world- or
untrusted-group-writable without the sticky bit (like /tmp).
npuspec's JSON artifacts are plain data and are read without these checks.
"""
from __future__ import annotations

import grp
import os
import pwd
import stat
from typing import Iterable, Optional

from npuspec import envs


class CacheTrustError(RuntimeError):
    """A cache path fails the trust rules; the message names the path and the fix."""

    def __init__(self, path: str, problem: str, fix: str):
        self.path, self.problem, self.fix = path, problem, fix
        super().__init__(f"npuspec cache: refusing to load executable artifacts from {path}: "
                         f"{problem}. Fix: {fix}")


def trusted_gid() -> Optional[int]:
    """The gid named by NPUSPEC_CACHE_TRUSTED_GROUP (a name or a number), or None."""
    g = envs.cache_trusted_group()
    if g is None:
        return None
    if g.isdigit():
        return int(g)
    try:
        return grp.getgrnam(g).gr_gid
    except KeyError:
        raise ValueError(f"NPUSPEC_CACHE_TRUSTED_GROUP={g!r}: no such group; set it to an "
                         f"existing group name or numeric gid, or unset it") from None


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _group(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def _in_group(uid: int, gid: int) -> bool:
    try:
        pw = pwd.getpwuid(uid)
    except KeyError:
        return False
    if pw.pw_gid == gid:
        return True
    try:
        return pw.pw_name in grp.getgrgid(gid).gr_mem
    except KeyError:
        return False


def check_path(path: str, st: Optional[os.stat_result] = None, *,
               gid: Optional[int] = None, recursive_fix: bool = False) -> None:
    """Raise CacheTrustError unless `path` itself passes the rules (lstat; links are refused)."""
    st = st or os.lstat(path)
    uid = os.geteuid()
    r = "-R " if recursive_fix else ""
    if stat.S_ISLNK(st.st_mode):
        raise CacheTrustError(path, "it is a symbolic link inside the cache",
                              f"rm {path}  (npuspec never writes links; the entry is rebuilt)")
    group_ok = gid is not None and st.st_gid == gid
    if st.st_uid not in (uid, 0) and not (group_ok and _in_group(st.st_uid, gid)):
        who = _user(uid)
        extra = (f", or add {_user(st.st_uid)} to group {_group(gid)} and chgrp {r}{_group(gid)} {path}"
                 if gid is not None else
                 "; to share a cache between accounts, set NPUSPEC_CACHE_TRUSTED_GROUP to a "
                 "group containing them")
        you = f"you ({who}, uid {uid})" + ("" if uid == 0 else " or root")
        raise CacheTrustError(path, f"it is owned by {_user(st.st_uid)} (uid {st.st_uid}), "
                                    f"not by {you}",
                              f"chown {r}{who} {path}{extra}")
    mode = stat.S_IMODE(st.st_mode)
    if mode & stat.S_IWOTH:
        raise CacheTrustError(path, f"it is writable by every user (mode {mode:04o})",
                              f"chmod {r}o-w {path}")
    if mode & stat.S_IWGRP and not group_ok:
        hint = (f" (or set NPUSPEC_CACHE_TRUSTED_GROUP={_group(st.st_gid)} if every member of "
                f"that group may run code as you)")
        raise CacheTrustError(path, f"it is writable by group {_group(st.st_gid)} "
                                    f"(mode {mode:04o}), which is not trusted",
                              f"chmod {r}g-w {path}{hint}")


def check_ancestors(root: str, gid: Optional[int] = None) -> None:
    """No ancestor of `root` may let others rename or replace it (sticky dirs are fine)."""
    p = os.path.dirname(os.path.abspath(root))
    while True:
        st = os.stat(p)
        mode = stat.S_IMODE(st.st_mode)
        sticky = bool(mode & stat.S_ISVTX)
        if mode & stat.S_IWOTH and not sticky:
            raise CacheTrustError(p, f"this parent of the cache directory is writable by every "
                                     f"user without the sticky bit (mode {mode:04o}), so anyone "
                                     f"can replace the cache", f"chmod o-w {p}  (or chmod +t {p})")
        if mode & stat.S_IWGRP and not sticky and not (gid is not None and st.st_gid == gid) \
                and st.st_uid != 0 and st.st_uid != os.geteuid():
            raise CacheTrustError(p, f"this parent of the cache directory is owned by "
                                     f"{_user(st.st_uid)} and writable by group "
                                     f"{_group(st.st_gid)} (mode {mode:04o})",
                                  f"chmod g-w {p}")
        parent = os.path.dirname(p)
        if parent == p:
            return
        p = parent


def check_tree(paths: Iterable[str], gid: Optional[int] = None) -> None:
    """Check every path (an entry dir and its files)."""
    for p in paths:
        check_path(p, gid=gid)


def check_root(root: str) -> None:
    """The cache root and its ancestors; raises CacheTrustError."""
    gid = trusted_gid()
    check_ancestors(root, gid)
    check_path(root, os.stat(root), gid=gid, recursive_fix=True)
    entries = os.path.join(root, "entries")  # whoever can write here can swap entries
    if os.path.lexists(entries):
        check_path(entries, gid=gid, recursive_fix=True)
