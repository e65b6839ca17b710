"""Trust faults, by class: links planted in the cache, a root reached through a link into an
unsafe directory, and things of the wrong type. Each asserts that nothing outside the cache
changed or appeared (an `outside` dir next to it stands for the rest of the machine), the
message or the resulting cache state, that the result equals eager, and how the next start
ends.

The checks are on mode bits and owners, so they mean the same run as root (CI) or not; the
cases that need a file owned by someone else chown to `nobody` and need root.
"""
import os
import re
import stat
import subprocess

import pytest

from npuspec.compilation.cache import current
from npuspec.graphs.cache import CacheDir

from cache_helpers import (FakeInductor, eager_lower, key_of, run_cached, run_worker, snapshot,
                           wait_worker)

WARM, COLD = (2, 4, 8), (3, 4, 8)  # shapes: one with an entry, one without


@pytest.fixture
def world(tmp_path):
    """A cache with one entry (WARM) and, beside it, an `outside` dir with a victim file."""
    root, outside = tmp_path / "cache", tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_bytes(b"precious\n")
    return root, outside


def lowering_fns(lowering):
    fake = FakeInductor()
    return (fake if lowering == "inductor" else eager_lower), fake


def messages(cache_log, text):
    return [r.getMessage() for r in cache_log.records if text in r.getMessage()]


def apply_fix(msg):
    """Run the chmod/chown the refusal names (proves the printed fix is the fix)."""
    cmd = re.search(r"Fix: ((?:chmod|chown) .*?)(?:\n|  \(|, or |$)", msg).group(1)
    one = r"(?:chmod|chown) (?:-[Rh] )?[-\w,+]+ [^ ;|&]+"
    assert re.fullmatch(rf"{one}(?: && {one})*", cmd), cmd
    subprocess.run(cmd, shell=True, check=True)  # a chain of chmod/chown only, as checked


def quarantined(root):
    return sorted(os.listdir(root / "quarantine"))


# -- links planted in a layout directory others can write to ---------------------------------

def plant_links(root, outside, sub, warm, cold):
    """What a user who can write `sub` would plant: links under the names npuspec touches,
    pointing at the victim file or at paths that do not exist yet."""
    d = root / sub
    names = {"hits": [warm], "locks": [cold + ".lock"], "entries": [cold],
             "tmp": [cold, ".probe"], "quarantine": [warm]}[sub]
    for i, n in enumerate(names):
        target = outside / "victim" if i == 0 and sub == "hits" else outside / f"new-{sub}-{i}"
        os.symlink(target, d / n)
    os.chmod(d, 0o777)


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
@pytest.mark.parametrize("sub", ["hits", "locks", "entries", "tmp", "quarantine"])
def test_links_in_a_world_writable_subdir(world, sub, lowering, fresh_counters, cache_log):
    root, outside = world
    lower, fake = lowering_fns(lowering)
    warm = run_cached(root, lower, lowering, WARM)
    cold = key_of(COLD, lowering)
    plant_links(root, outside, sub, warm, cold)
    before, entries = snapshot(outside), snapshot(root / "entries")
    fresh_counters.reset()
    run_cached(root, lower, lowering, WARM)
    run_cached(root, lower, lowering, COLD)
    assert snapshot(outside) == before  # the victim is byte-for-byte intact, nothing new
    assert snapshot(root / "entries") == entries  # nothing published, nothing moved
    d = fresh_counters()
    assert d.get("cache_rejected") == 2 and d.get("cache_misses", 0) + d.get("cache_hits", 0) == 2
    if lowering == "inductor":
        assert fake.loaded == 0  # nothing executable read from an untrusted cache
    (msg,) = messages(cache_log, "refusing to use")
    r = "-R " if sub == "entries" else ""
    assert f"{root / sub}: it is writable by every user (mode 0777)" in msg
    assert f"Fix: chmod {r}o-w {root / sub} && chmod {r}g-w {root / sub}\n" in msg
    assert "writes nothing" in msg

    apply_fix(msg)  # now trusted: the planted links are quarantined, not followed
    fresh_counters.reset()
    cache_log.clear()
    run_cached(root, lower, lowering, WARM)
    run_cached(root, lower, lowering, COLD)
    assert snapshot(outside) == before
    assert sorted(CacheDir(str(root)).keys()) == sorted([warm, cold])
    fresh_counters.reset()
    run_cached(root, lower, lowering, WARM)
    run_cached(root, lower, lowering, COLD)
    assert fresh_counters() == {"cache_hits": 2}  # repaired: both load
    assert snapshot(outside) == before
    for q in quarantined(root):  # what was moved there is still the link itself
        assert os.path.islink(root / "quarantine" / q), q


def test_links_in_trusted_subdirs_are_quarantined(world, fresh_counters, cache_log):
    """Links under names npuspec touches, in directories only we can write (left by a tool or a
    user who had access): never followed; moved to quarantine/, and the start still ends with a
    valid entry and a counted hit."""
    root, outside = world
    fake = FakeInductor()
    warm = run_cached(root, fake, "inductor", WARM)
    cold = key_of(COLD, "inductor")
    os.symlink(outside / "victim", root / "hits" / warm)
    os.symlink(outside / "new-lock", root / "locks" / (cold + ".lock"))
    before = snapshot(outside)
    fresh_counters.reset()
    run_cached(root, fake, "inductor", WARM)
    run_cached(root, fake, "inductor", COLD)
    assert snapshot(outside) == before
    assert fresh_counters() == {"cache_hits": 1, "cache_misses": 1, "cache_rejected": 2}
    assert fake.loaded == 1
    assert CacheDir(str(root)).hits(warm) == 1  # counted in a fresh file
    q = quarantined(root)
    assert len(q) == 2 and all(os.path.islink(root / "quarantine" / n) for n in q), q
    assert len(messages(cache_log, "a symbolic link to")) == 2


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
def test_entry_replaced_by_a_link_is_quarantined(world, lowering, fresh_counters, cache_log):
    """entries/<key> -> a copy of the entry outside the cache: not read (before, the eager
    lowering followed it and the Inductor one refused it on every start); quarantined and
    rebuilt, then hit."""
    root, outside = world
    lower, fake = lowering_fns(lowering)
    key = run_cached(root, lower, lowering, WARM)
    os.rename(root / "entries" / key, outside / "entry")
    os.symlink(outside / "entry", root / "entries" / key)
    before = snapshot(outside)
    fresh_counters.reset()
    run_cached(root, lower, lowering, WARM)
    assert fresh_counters() == {"cache_misses": 1, "cache_rejected": 1}
    assert snapshot(outside) == before
    (msg,) = messages(cache_log, "failed verification")
    assert "is a symbolic link, not an entry directory" in msg and "moved to" in msg
    assert [os.path.islink(root / "quarantine" / q) for q in quarantined(root)] == [True]
    fresh_counters.reset()
    run_cached(root, lower, lowering, WARM)
    assert fresh_counters() == {"cache_hits": 1}
    assert fake.loaded == (1 if lowering == "inductor" else 0)


@pytest.mark.parametrize("where", ["json/key.json", "inductor/fxgraph", "inductor"])
def test_link_inside_an_entry_is_quarantined(world, where, fresh_counters, cache_log):
    root, outside = world
    fake = FakeInductor()
    key = run_cached(root, fake, "inductor", WARM)
    p = root / "entries" / key / where
    os.rename(p, outside / "moved")
    os.symlink(outside / "moved", p)
    before = snapshot(outside)
    fresh_counters.reset()
    run_cached(root, fake, "inductor", WARM)
    assert fresh_counters() == {"cache_misses": 1, "cache_rejected": 1}
    assert fake.loaded == 0 and snapshot(outside) == before
    (msg,) = messages(cache_log, "failed verification")
    assert f"{p} is a symbolic link" in msg, msg
    fresh_counters.reset()
    run_cached(root, fake, "inductor", WARM)
    assert fresh_counters() == {"cache_hits": 1} and fake.loaded == 1


@pytest.mark.parametrize("sub", ["hits", "locks", "tmp", "entries", "quarantine"])
def test_layout_dir_replaced_by_a_link(world, sub, fresh_counters, cache_log):
    """root/<sub> -> a directory outside (for entries/, one holding a copy of the entries):
    nothing is created in or read from it; the link is moved aside and <sub>/ made anew."""
    root, outside = world
    fake = FakeInductor()
    run_cached(root, fake, "inductor", WARM)
    os.rename(root / sub, outside / sub)
    os.symlink(outside / sub, root / sub)
    before = snapshot(outside)
    fresh_counters.reset()
    run_cached(root, fake, "inductor", WARM)
    run_cached(root, fake, "inductor", COLD)
    assert snapshot(outside) == before
    assert os.path.isdir(root / sub) and not os.path.islink(root / sub)
    want_hit = sub != "entries"  # the entries behind the link are not ours any more
    d = fresh_counters()
    want = {"cache_hits": int(want_hit), "cache_misses": 2 - want_hit, "cache_rejected": 1}
    assert d == {k: v for k, v in want.items() if v}, d
    (msg,) = messages(cache_log, f"{root / sub} was a symbolic link to {outside / sub}")
    assert ("removed it" if sub == "quarantine" else "moved it to") in msg
    fresh_counters.reset()
    run_cached(root, fake, "inductor", WARM)
    run_cached(root, fake, "inductor", COLD)
    assert fresh_counters() == {"cache_hits": 2}
    assert snapshot(outside) == before


# -- the root reached through a link ----------------------------------------------------------

@pytest.mark.parametrize("exists", [True, False])
def test_root_link_into_a_world_writable_parent(tmp_path, exists, fresh_counters, cache_log):
    """cache -> ww/real with ww mode 0777 and not sticky: anyone could swap `real`. Refused
    with the fix; nothing created or written there; after the fix the cache is used."""
    ww = tmp_path / "ww"
    ww.mkdir()
    link = tmp_path / "cache"
    os.symlink(ww / "real", link)
    fake = FakeInductor()
    if exists:
        run_cached(link, fake, "inductor", WARM)  # built while ww was still safe
    os.chmod(ww, 0o777)
    before = snapshot(ww)
    fresh_counters.reset()
    run_cached(link, fake, "inductor", WARM)
    assert snapshot(ww) == before
    assert fake.loaded == 0
    assert fresh_counters() == {"cache_misses": 1, "cache_rejected": 1}
    (msg,) = messages(cache_log, "refusing to use")
    assert f"refusing to use {ww}: this directory on the way to the cache is writable by " \
           f"every user without the sticky bit (mode 0777)" in msg
    # (with `&& chmod g-w` too unless ww's group is private to its owner, as root's is here)
    assert f"Fix: chmod o-w {ww}" in msg and f"  (or chmod +t {ww})" in msg
    apply_fix(msg)
    fresh_counters.reset()
    run_cached(link, fake, "inductor", WARM)
    assert fresh_counters() == ({"cache_hits": 1} if exists else {"cache_misses": 1})
    assert CacheDir(str(link)).keys() == [current().key]


def test_root_link_into_a_sticky_world_writable_parent_is_fine(tmp_path, fresh_counters):
    """Like /tmp: others may create there but not replace what is ours."""
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)
    os.symlink(sticky / "real", tmp_path / "cache")
    fake = FakeInductor()
    run_cached(tmp_path / "cache", fake, "inductor", WARM)
    run_cached(tmp_path / "cache", fake, "inductor", WARM)
    assert fresh_counters() == {"cache_misses": 1, "cache_hits": 1} and fake.loaded == 1


def test_link_in_a_world_writable_dir_is_refused(tmp_path, fresh_counters, cache_log):
    """The link itself in a 0777 dir: anyone could re-point it."""
    (tmp_path / "safe").mkdir()
    ww = tmp_path / "ww"
    ww.mkdir()
    os.symlink(tmp_path / "safe" / "real", ww / "cache")
    os.chmod(ww, 0o777)
    run_cached(ww / "cache")
    (msg,) = messages(cache_log, "refusing to use")
    assert f"Fix: chmod o-w {ww}" in msg
    assert not os.path.exists(tmp_path / "safe" / "real")  # not even created


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown to nobody")


@needs_root
def test_link_owned_by_another_user_is_refused(tmp_path, cache_log):
    import pwd
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "cache")
    os.lchown(tmp_path / "cache", pwd.getpwnam("nobody").pw_uid, -1)
    run_cached(tmp_path / "cache")
    (msg,) = messages(cache_log, "refusing to use")
    assert "symbolic link on the way to the cache is owned by nobody" in msg
    assert f"Fix: chown -h root {tmp_path / 'cache'}" in msg
    assert os.listdir(tmp_path / "real") == []


@needs_root
def test_parent_owned_by_another_user_is_refused(tmp_path, cache_log):
    import pwd
    parent = tmp_path / "theirs"
    parent.mkdir()
    os.chown(parent, pwd.getpwnam("nobody").pw_uid, -1)
    run_cached(parent / "cache")
    (msg,) = messages(cache_log, "refusing to use")
    assert f"{parent}: this directory on the way to the cache is owned by nobody" in msg
    assert f"Fix: chown root {parent}" in msg
    assert not os.path.exists(parent / "cache")


# -- wrong file types --------------------------------------------------------------------------

def _file(p):
    p.write_bytes(b"not what belongs here")


def _dir(p):
    p.mkdir()
    (p / "junk").write_bytes(b"x")


def _fifo(p):
    os.mkfifo(p)


# (where, how to damage it, shape whose start meets it, what the message says)
WRONG = [
    ("entries/{warm}", _file, WARM, "is a regular file, not an entry directory"),
    ("entries/{warm}/manifest.json", _dir, WARM, "manifest.json is a directory, not a file"),
    ("entries/{warm}/json", _file, WARM, "manifest lists 'json/"),
    ("entries/{warm}/json/key.json", _fifo, WARM, "key.json is a FIFO"),
    ("locks/{cold}.lock", _dir, COLD, ".lock was a directory, not a regular file"),
    ("locks/{cold}.lock", _fifo, COLD, ".lock was a FIFO, not a regular file"),
    ("hits/{warm}", _dir, WARM, "was a directory, not a regular file"),
    ("locks", _file, COLD, "locks was a regular file"),
    ("hits", _file, WARM, "hits was a regular file"),
    ("tmp", _file, COLD, "tmp was a regular file"),
    ("entries", _file, WARM, "entries was a regular file"),
    ("quarantine", _file, WARM, "quarantine was a regular file"),
]


@pytest.mark.parametrize("where,damage,shape,text", WRONG,
                         ids=[f"{w}:{d.__name__[1:]}" for w, d, _, _ in WRONG])
def test_wrong_type_is_quarantined_and_repaired(world, where, damage, shape, text,
                                                fresh_counters, cache_log):
    root, outside = world
    fake = FakeInductor()
    warm = run_cached(root, fake, "inductor", WARM)
    p = root / where.format(warm=warm, cold=key_of(COLD, "inductor"))
    if p.is_dir():
        os.rename(p, root / ".gone")  # keep nothing of the original under its name
    elif p.exists():
        p.unlink()
    damage(p)
    fresh_counters.reset()
    run_cached(root, fake, "inductor", shape)  # one start: repaired, correct result
    d = fresh_counters()
    assert d.get("cache_rejected") == 1, d
    assert d.get("cache_hits", 0) + d.get("cache_misses", 0) == 1, d
    assert messages(cache_log, text), [r.getMessage() for r in cache_log.records]
    assert stat.S_ISDIR(os.lstat(root / "quarantine").st_mode)
    if where != "quarantine":
        assert quarantined(root), "the damaged thing is kept for inspection"
    fresh_counters.reset()
    run_cached(root, fake, "inductor", shape)  # the next start hits
    assert fresh_counters() == {"cache_hits": 1}
    CacheDir(str(root)).verify(current().key, executable=True)


def test_hard_linked_hit_file_is_not_appended_to(world, fresh_counters, cache_log):
    """hits/<key> as a hard link to a file elsewhere (O_NOFOLLOW cannot see that): the link
    count gives it away; the name is quarantined and the victim keeps its bytes."""
    root, outside = world
    key = run_cached(root, shape=WARM)  # a miss: no hit file yet
    os.link(outside / "victim", root / "hits" / key)
    before = (outside / "victim").read_bytes()
    run_cached(root, shape=WARM)
    assert (outside / "victim").read_bytes() == before
    assert messages(cache_log, "with 2 hard links")
    assert CacheDir(str(root)).hits(key) == 1


# -- the same through real processes (torch.compile, the npuspec backend, eager lowering) -----

def result(path):
    import json
    with open(path) as f:
        return json.load(f)


def test_links_in_world_writable_dirs_through_real_starts(tmp_path):
    """The issue's probe: hits/ and locks/ world-writable, hits/<key> -> a file outside,
    locks/<key>.lock -> a path outside. Three processes: refused (victim intact, nothing
    created, results equal eager); after the fix, repaired and published; then all hits."""
    root, outside = tmp_path / "cache", tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_bytes(b"precious\n")
    wait_worker(run_worker(tmp_path / "w0.json", root, "eager", "--shapes", 2))
    k1, k2 = result(tmp_path / "w0.json")["keys"]
    CacheDir(str(root)).remove(k2)  # cold again: its lock will be taken
    os.symlink(outside / "victim", root / "hits" / k1)  # k1 was a miss: no hit file yet
    os.unlink(root / "locks" / f"{k2}.lock")
    os.symlink(outside / "created", root / "locks" / f"{k2}.lock")
    os.chmod(root / "hits", 0o777)
    os.chmod(root / "locks", 0o777)
    before = snapshot(outside)

    out = wait_worker(run_worker(tmp_path / "w1.json", root, "eager", "--shapes", 2))
    r = result(tmp_path / "w1.json")
    assert r["equal"] and snapshot(outside) == before, out
    assert r["counters"].get("cache_rejected") == 2
    assert f"Fix: chmod o-w {root / 'hits'}" in out or f"Fix: chmod o-w {root / 'locks'}" in out
    assert CacheDir(str(root)).keys() == [k1]

    os.chmod(root / "hits", 0o755)
    os.chmod(root / "locks", 0o755)
    wait_worker(run_worker(tmp_path / "w2.json", root, "eager", "--shapes", 2))
    r = result(tmp_path / "w2.json")
    assert r["equal"] and snapshot(outside) == before
    assert sorted(CacheDir(str(root)).keys()) == sorted([k1, k2])
    wait_worker(run_worker(tmp_path / "w3.json", root, "eager", "--shapes", 2))
    r = result(tmp_path / "w3.json")
    assert r["equal"] and r["counters"].get("cache_hits") == 2 and not r["counters"].get(
        "cache_misses") and not r["counters"].get("cache_rejected")
    assert snapshot(outside) == before
