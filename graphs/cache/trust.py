"""May we use a cache path: load executable artifacts from it, or write into it?

Inductor's caches unpickle and import what they find, so a cache another user can write to
is a code-execution hole; and a directory others can write to lets them plant links that
redirect npuspec's own writes. A path is trusted when
- it is owned by this user or by root, or, with NPUSPEC_CACHE_TRUSTED_GROUP set, by a member
  of that group whose gid the path carries;
- it is not writable by others (o+w), ever;
- it is not writable by its group (g+w) unless that group is the trusted group.
That holds for the root, each layout directory (SUBDIRS) and, for executable loads, every
entry directory and file. The way to the root (resolve_root, after ssh's StrictModes) must not
let others replace the root: every directory a name is looked up in while resolving it, links
included, is owned by this user, root or a trusted-group member and not writable by others or
an untrusted group without the sticky bit (like /tmp); every link on the way is owned likewise.
npuspec's JSON artifacts are plain data and are still read from an untrusted cache.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import grp
import os
import pwd
import stat
from typing import Optional

from npuspec import envs


class CacheTrustError(RuntimeError):
    """A cache path fails the trust rules; the message names the path and the fix."""

    def __init__(self, path: str, problem: str, fix: str):
        self.path, self.problem, self.fix = path, problem, fix
        super().__init__(f"npuspec cache: refusing to use {path}: {problem}. Fix: {fix}")


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
        # With an untrusted g+w too, o-w alone would only trade this refusal for the next one.
        also = f" && chmod {r}g-w {path}" if mode & stat.S_IWGRP and not group_ok else ""
        raise CacheTrustError(path, f"it is writable by every user (mode {mode:04o})",
                              f"chmod {r}o-w {path}{also}")
    if mode & stat.S_IWGRP and not group_ok:
        hint = (f" (or set NPUSPEC_CACHE_TRUSTED_GROUP={_group(st.st_gid)} if every member of "
                f"that group may run code as you)")
        raise CacheTrustError(path, f"it is writable by group {_group(st.st_gid)} "
                                    f"(mode {mode:04o}), which is not trusted",
                              f"chmod {r}g-w {path}{hint}")


def _owner_ok(st_uid: int, gid: Optional[int]) -> bool:
    return st_uid in (os.geteuid(), 0) or (gid is not None and _in_group(st_uid, gid))


def _private_group(st: os.stat_result) -> bool:
    """The directory's group is its owner's own group with no other members (user private
    groups, as ssh's StrictModes allows): group write then gives nobody else access."""
    try:
        pw, gr = pwd.getpwuid(st.st_uid), grp.getgrgid(st.st_gid)
    except KeyError:
        return False
    if pw.pw_gid != st.st_gid or not set(gr.gr_mem) <= {pw.pw_name}:
        return False
    # members by primary group are not listed in the group: look for other accounts with it
    return not any(u.pw_gid == st.st_gid and u.pw_uid != st.st_uid for u in pwd.getpwall())


def check_parent(p: str, st: os.stat_result, gid: Optional[int] = None) -> None:
    """A directory on the way to the cache root (ssh StrictModes): whoever can rename entries
    in it can replace the cache, so it must be owned by you, root or a trusted-group member, and
    not writable by others or an untrusted group unless it is sticky (like /tmp)."""
    mode = stat.S_IMODE(st.st_mode)
    sticky = bool(mode & stat.S_ISVTX)
    uid = os.geteuid()
    if not _owner_ok(st.st_uid, gid):
        you = f"{_user(uid)}" + ("" if uid == 0 else " or root")
        raise CacheTrustError(p, f"this directory on the way to the cache is owned by "
                                 f"{_user(st.st_uid)} (uid {st.st_uid}), not by {you}, so that "
                                 f"user can replace the cache",
                              f"chown root {p}, or put the cache in a directory owned by "
                              f"{you}")
    group_bad = not sticky and bool(mode & stat.S_IWGRP) \
        and not (gid is not None and st.st_gid == gid) and not _private_group(st)
    if mode & stat.S_IWOTH and not sticky:
        also = f" && chmod g-w {p}" if group_bad else ""
        raise CacheTrustError(p, f"this directory on the way to the cache is writable by every "
                                 f"user without the sticky bit (mode {mode:04o}), so anyone "
                                 f"can replace the cache",
                              f"chmod o-w {p}{also}  (or chmod +t {p})")
    if group_bad:
        raise CacheTrustError(p, f"this directory on the way to the cache is writable by group "
                                 f"{_group(st.st_gid)} (mode {mode:04o}), so its members can "
                                 f"replace the cache",
                              f"chmod g-w {p}  (or set NPUSPEC_CACHE_TRUSTED_GROUP="
                              f"{_group(st.st_gid)} if every member may run code as you)")


def check_link(p: str, st: os.stat_result, gid: Optional[int] = None) -> None:
    """A symbolic link on the way to the root: its owner decides where the cache is."""
    if not _owner_ok(st.st_uid, gid):
        who = _user(os.geteuid())
        raise CacheTrustError(p, f"this symbolic link on the way to the cache is owned by "
                                 f"{_user(st.st_uid)} (uid {st.st_uid}), who can point it "
                                 f"anywhere", f"chown -h {who} {p}")


@dataclasses.dataclass
class Resolved:
    """Where a cache root really is, and whether the way there is safe."""
    real: str                      # the root's real path (with its missing tail)
    existing: str                  # the deepest directory of it that exists
    existing_st: os.stat_result    # its lstat, to compare with the descriptor opened later
    missing: list                  # names to create below `existing`, in order
    problem: Optional[CacheTrustError]  # the first unsafe directory or link, if any


_MAX_LINKS = 40  # as the kernel's own limit on links followed in one path


def resolve_root(root: str, gid: Optional[int] = None) -> Resolved:
    """Resolve `root` one component at a time (like realpath) and check every directory a name
    was looked up in (check_parent) and every link followed (check_link): with a root that
    goes through links, the real path's parents are checked, not just the ones spelled out.
    Raises OSError only for paths that cannot be resolved (a file in the middle, a link loop)."""
    todo = [n for n in os.path.abspath(root).split(os.sep) if n]
    cur, links, problem = "/", 0, None
    while todo:
        name = todo.pop(0)
        if name in ("", "."):
            continue
        if name == "..":
            cur = os.path.dirname(cur)  # `cur` has no links left, so this is the real parent
            continue
        here = os.lstat(cur)
        if problem is None:
            try:
                check_parent(cur, here, gid)
            except CacheTrustError as e:
                problem = e
        p = os.path.join(cur, name)
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            missing = [name] + [n for n in todo if n not in ("", ".")]
            if ".." in missing:
                raise FileNotFoundError(f"{root}: cannot create {p}/{'/'.join(todo)} (it "
                                        f"goes through '..' below a missing directory)") from None
            return Resolved(os.path.join(cur, *missing), cur, here, missing, problem)
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if links > _MAX_LINKS:
                raise OSError(errno.ELOOP, f"{root}: more than {_MAX_LINKS} symbolic links")
            if problem is None:
                try:
                    check_link(p, st, gid)
                except CacheTrustError as e:
                    problem = e
            target = os.readlink(p)
            if target.startswith(os.sep):
                cur = "/"
            todo = [n for n in target.split(os.sep) if n] + todo
            continue
        cur = p
    return Resolved(cur, cur, os.lstat(cur), [], problem)


SUBDIRS = ("quarantine", "entries", "locks", "hits", "tmp")  # the layout below the root


def check_subdir(path: str, st: os.stat_result, gid: Optional[int] = None) -> None:
    """A directory of the layout (SUBDIRS). entries/ gets the recursive fix: its entries were
    created with the same modes, so whatever opened it up opened them too."""
    check_path(path, st, gid=gid, recursive_fix=os.path.basename(path) == "entries")


def check_root(root: str) -> str:
    """The way to the cache root, the root and its layout directories (by lstat; the cache
    itself checks the descriptors it opens, store.CacheDir.open). Returns the real path;
    raises CacheTrustError."""
    gid = trusted_gid()
    r = resolve_root(root, gid)
    if r.problem is not None:
        raise r.problem
    if r.missing:
        return r.real
    check_path(r.real, r.existing_st, gid=gid, recursive_fix=True)
    for sub in SUBDIRS:
        p = os.path.join(r.real, sub)
        with contextlib.suppress(FileNotFoundError):
            check_subdir(p, os.lstat(p), gid)
    return r.real
