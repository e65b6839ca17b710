"""Fault injection, one test each: every fault is logged once, counted, and followed by a
correct run; none crashes or changes a result."""
import errno
import json
import os
import shutil
import stat
import subprocess
import sys
import time

import pytest
import torch

from npuspec.compilation.cache import cached_lower, current, load_artifact, record_artifact
from npuspec.graphs.cache import CacheDir
from npuspec.graphs.cache import store

from cache_helpers import FakeInductor, eager_lower, opts, tiny_graph


def run(cache_dir, lower=eager_lower, lowering="eager", shape=(2, 4, 8)):
    gm, inputs = tiny_graph(shape)
    want = gm(*inputs)
    fn = cached_lower(gm, inputs, opts(cache_dir, lowering), lower)
    assert torch.equal(fn(*inputs), want)
    return current().key


def only_entry(root):
    keys = CacheDir(str(root)).keys()
    assert len(keys) == 1, keys
    return keys[0], os.path.join(str(root), "entries", keys[0])


def assert_valid(root, key, executable=False):
    CacheDir(str(root)).verify(key, executable=executable)


# -- the basics ------------------------------------------------------------------------------

def test_miss_then_hit_with_json_artifacts(tmp_path, fresh_counters):
    def lower(gm, inputs, o):
        record_artifact("verify_kernel_config", {"block": 128, "num_warps": 4})
        return gm.forward

    k1 = run(tmp_path, lower)
    assert fresh_counters() == {"cache_misses": 1}
    record_artifact("capture_plan", {"3": [4, 8, 16]})  # after publish: added under the lock
    assert_valid(tmp_path, k1)
    k2 = run(tmp_path)
    assert k1 == k2 and fresh_counters() == {"cache_misses": 1, "cache_hits": 1}
    assert load_artifact("verify_kernel_config") == {"block": 128, "num_warps": 4}
    assert load_artifact("capture_plan") == {"3": [4, 8, 16]}
    assert CacheDir(str(tmp_path)).hits(k1) == 1


def test_record_artifact_rejects_non_json(tmp_path):
    run(tmp_path)
    with pytest.raises(TypeError, match="'bad'.*not JSON-serialisable"):
        record_artifact("bad", torch.zeros(2))
    with pytest.raises(ValueError, match="artifact name '../x'"):
        record_artifact("../x", 1)


def test_no_cache_dir_means_plain_lowering(fresh_counters):
    gm, inputs = tiny_graph()
    fn = cached_lower(gm, inputs, opts("", "eager"), eager_lower)
    assert torch.equal(fn(*inputs), gm(*inputs)) and fresh_counters() == {}


def test_inductor_artifacts_load_from_a_private_copy(tmp_path, fresh_counters):
    fake = FakeInductor()
    run(tmp_path, fake, "inductor")
    run(tmp_path, fake, "inductor")
    assert (fake.compiled, fake.loaded) == (1, 1)
    assert fresh_counters() == {"cache_misses": 1, "cache_hits": 1}
    root = os.path.realpath(str(tmp_path))
    for d in fake.dirs:  # Inductor never reads or writes the shared directory itself
        assert not os.path.realpath(d).startswith(root), d
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    key, top = only_entry(tmp_path)
    assert os.path.exists(os.path.join(top, "inductor", "fxgraph", "ab", "graph.bin"))
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ or \
        not os.environ["TORCHINDUCTOR_CACHE_DIR"].startswith(tuple(fake.dirs))


# -- corrupted entries: detected, quarantined, recompiled ------------------------------------

def corrupt_and_rerun(tmp_path, fresh_counters, cache_log, damage, lowering="eager"):
    fake = FakeInductor()
    lower = fake if lowering == "inductor" else eager_lower
    run(tmp_path, lower, lowering)
    key, top = only_entry(tmp_path)
    damage(top)
    fresh_counters.reset()
    run(tmp_path, lower, lowering)
    d = fresh_counters()
    assert d == {"cache_rejected": 1, "cache_misses": 1}, d
    q = os.listdir(tmp_path / "quarantine")
    assert len(q) == 1 and q[0].startswith(key), q
    assert_valid(tmp_path, key, executable=lowering == "inductor")  # rebuilt
    msgs = [r.getMessage() for r in cache_log.records if "failed verification" in r.getMessage()]
    assert len(msgs) == 1, msgs
    return msgs[0], fake


def test_truncated_file(tmp_path, fresh_counters, cache_log):
    def damage(top):
        p = os.path.join(top, "inductor", "fxgraph", "ab", "graph.bin")
        with open(p, "r+b") as f:
            f.truncate(5)
    msg, fake = corrupt_and_rerun(tmp_path, fresh_counters, cache_log, damage, "inductor")
    assert "truncated" in msg and "graph.bin" in msg and "moved to" in msg
    assert fake.compiled == 2 and fake.loaded == 0  # the bad bytes never reached the lowering


def test_flipped_byte(tmp_path, fresh_counters, cache_log):
    def damage(top):
        p = os.path.join(top, "inductor", "fxgraph", "ab", "graph.bin")
        with open(p, "r+b") as f:
            b = f.read(1)
            f.seek(0)
            f.write(bytes([b[0] ^ 0x01]))
    msg, fake = corrupt_and_rerun(tmp_path, fresh_counters, cache_log, damage, "inductor")
    assert "sha256" in msg and fake.loaded == 0


def test_manifest_mismatch(tmp_path, fresh_counters, cache_log):
    def damage(top):
        p = os.path.join(top, "manifest.json")
        m = json.load(open(p))
        m["files"]["json/pattern_matches.json"] = {"sha256": "0" * 64, "size": 3}
        open(p, "w").write(json.dumps(m))
    msg, _ = corrupt_and_rerun(tmp_path, fresh_counters, cache_log, damage)
    assert "pattern_matches.json" in msg and "missing" in msg


def test_file_not_in_manifest(tmp_path, fresh_counters, cache_log):
    def damage(top):
        with open(os.path.join(top, "inductor", "fxgraph", "ab", "extra.py"), "w") as f:
            f.write("import os\n")
    msg, _ = corrupt_and_rerun(tmp_path, fresh_counters, cache_log, damage, "inductor")
    assert "extra.py" in msg and "not in the manifest" in msg


def test_wrong_version(tmp_path, fresh_counters, cache_log):
    def damage(top):
        p = os.path.join(top, "manifest.json")
        m = json.load(open(p))
        m["npuspec"] = "0.0.1"
        open(p, "w").write(json.dumps(m))
    msg, _ = corrupt_and_rerun(tmp_path, fresh_counters, cache_log, damage)
    assert "0.0.1" in msg


def test_unreadable_manifest(tmp_path, fresh_counters, cache_log):
    def damage(top):
        open(os.path.join(top, "manifest.json"), "w").write('{"format": 1, "fi')
    msg, _ = corrupt_and_rerun(tmp_path, fresh_counters, cache_log, damage)
    assert "not valid JSON" in msg


# -- disk and directory faults ---------------------------------------------------------------

def test_simulated_enospc_keeps_the_result_in_memory(tmp_path, fresh_counters, cache_log,
                                                      monkeypatch):
    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store, "_write_fd", full)
    run(tmp_path)
    assert fresh_counters() == {"cache_misses": 1}
    assert CacheDir(str(tmp_path)).keys() == []
    assert os.listdir(tmp_path / "tmp") == []  # the half-staged entry was removed
    assert any("disk is full" in r.getMessage() and "in memory" in r.getMessage()
               for r in cache_log.records)
    monkeypatch.undo()
    run(tmp_path)  # space is back: the next start publishes
    assert len(CacheDir(str(tmp_path)).keys()) == 1


def _tree(root):
    return sorted((os.path.relpath(os.path.join(d, f), root), os.stat(os.path.join(d, f)).st_size)
                  for d, _, fs in os.walk(root) for f in fs)


def _check_read_only_run(src, ro_root, cache_log, fresh_counters):
    """One entry exists; in the read-only dir it is used, a new key compiles in memory."""
    run(src, shape=(2, 4, 8))
    before = _tree(src)
    fresh_counters.reset()
    cache_log.clear()
    run(ro_root, shape=(2, 4, 8))  # hit from the read-only directory
    run(ro_root, shape=(3, 4, 8))  # new key: compiled, kept in memory
    assert fresh_counters() == {"cache_hits": 1, "cache_misses": 1}
    msgs = [r.getMessage() for r in cache_log.records]
    assert sum("not writable" in m for m in msgs) == 1, msgs
    assert _tree(src) == before  # nothing was written


def test_read_only_directory(tmp_path, fresh_counters, cache_log):
    """A real read-only directory: a read-only bind mount (root with CAP_SYS_ADMIN), or
    chmod a-w for an unprivileged user."""
    src, ro = tmp_path / "src", tmp_path / "ro"
    os.makedirs(src)
    os.makedirs(ro)
    if os.geteuid() != 0:
        run(src, shape=(2, 4, 8))
        for d, _, _ in os.walk(src):
            os.chmod(d, 0o555)
        try:
            fresh_counters.reset()
            _check_read_only_run(src, src, cache_log, fresh_counters)
        finally:
            for d, _, _ in os.walk(src):
                os.chmod(d, 0o755)
        return
    ok = subprocess.run(["mount", "--bind", str(src), str(ro)], capture_output=True).returncode == 0
    if ok:
        ok = subprocess.run(["mount", "-o", "remount,ro,bind", str(ro)],
                            capture_output=True).returncode == 0
        if not ok:
            subprocess.run(["umount", str(ro)], capture_output=True)
    if not ok:
        pytest.skip("root without mount privileges: no real read-only directory "
                    "(test_read_only_directory_simulated covers the logic)")
    try:
        run(src, shape=(2, 4, 8))  # layout and one entry, through the writable path
        _check_read_only_run(src, ro, cache_log, fresh_counters)
    finally:
        subprocess.run(["umount", str(ro)], capture_output=True)


def test_read_only_directory_simulated(tmp_path, fresh_counters, cache_log, monkeypatch):
    """EROFS from every write under the cache root (works without privileges)."""
    root = str(tmp_path)
    run(root, shape=(2, 4, 8))
    real_open, real_mkdir, real_rename = os.open, os.mkdir, os.rename

    def under(p):
        return os.path.abspath(os.fspath(p)).startswith(root)

    def ro_open(p, flags, *a, **k):
        if under(p) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(errno.EROFS, "Read-only file system", p)
        return real_open(p, flags, *a, **k)

    def ro_mkdir(p, *a, **k):
        if under(p):
            if os.path.isdir(p):
                raise FileExistsError(errno.EEXIST, "File exists", p)
            raise OSError(errno.EROFS, "Read-only file system", p)
        return real_mkdir(p, *a, **k)

    def ro_rename(a, b, *x, **k):
        if under(a) or under(b):
            raise OSError(errno.EROFS, "Read-only file system", a)
        return real_rename(a, b, *x, **k)

    monkeypatch.setattr(os, "open", ro_open)
    monkeypatch.setattr(os, "mkdir", ro_mkdir)
    monkeypatch.setattr(os, "rename", ro_rename)
    before = _tree(root)
    fresh_counters.reset()
    cache_log.clear()
    run(root, shape=(2, 4, 8))
    run(root, shape=(3, 4, 8))
    monkeypatch.undo()
    assert fresh_counters() == {"cache_hits": 1, "cache_misses": 1}
    assert sum("not writable" in r.getMessage() for r in cache_log.records) == 1
    assert _tree(root) == before


# -- trust -----------------------------------------------------------------------------------

def test_world_writable_directory_is_refused(tmp_path, fresh_counters, cache_log):
    fake = FakeInductor()
    root = tmp_path / "cache"
    run(root, fake, "inductor")                         # a good entry, with "executable" parts
    os.chmod(root, 0o777)
    fresh_counters.reset()
    run(root, fake, "inductor")
    assert fake.loaded == 0 and fake.compiled == 2      # nothing executable was read
    d = fresh_counters()
    assert d == {"cache_misses": 1, "cache_rejected": 1}, d
    msgs = [r.getMessage() for r in cache_log.records if "refusing" in r.getMessage()]
    assert len(msgs) == 1
    assert str(root) in msgs[0] and f"chmod -R o-w {root}" in msgs[0], msgs[0]
    assert load_artifact("key") is not None             # JSON artifacts are still read
    assert len(CacheDir(str(root)).keys()) == 1         # and nothing was written


def test_group_writable_needs_the_trusted_group(tmp_path, fresh_counters, cache_log, monkeypatch):
    import grp

    fake = FakeInductor()
    root = tmp_path / "cache"
    run(root, fake, "inductor")
    gid = os.stat(root).st_gid
    os.chmod(root, 0o775)
    run(root, fake, "inductor")
    msgs = [r.getMessage() for r in cache_log.records if "refusing" in r.getMessage()]
    assert len(msgs) == 1 and f"chmod -R g-w {root}" in msgs[0], msgs
    assert "NPUSPEC_CACHE_TRUSTED_GROUP" in msgs[0]
    monkeypatch.setenv("NPUSPEC_CACHE_TRUSTED_GROUP", grp.getgrgid(gid).gr_name)
    fresh_counters.reset()
    run(root, fake, "inductor")
    assert fake.loaded == 1 and fresh_counters() == {"cache_hits": 1}


def test_entry_owned_by_another_user_is_refused(tmp_path, fresh_counters, cache_log):
    if os.geteuid() != 0:
        pytest.skip("needs root to chown an entry to another user (CI runs as root)")
    import pwd

    nobody = pwd.getpwnam("nobody").pw_uid
    fake = FakeInductor()
    run(tmp_path, fake, "inductor")
    key, top = only_entry(tmp_path)
    for d, dirs, files in os.walk(top):
        for n in dirs + files:
            os.lchown(os.path.join(d, n), nobody, -1)
    os.lchown(top, nobody, -1)
    fresh_counters.reset()
    run(tmp_path, fake, "inductor")
    assert fake.loaded == 0 and fake.compiled == 2
    d = fresh_counters()
    assert d == {"cache_misses": 1, "cache_rejected": 1}, d
    msgs = [r.getMessage() for r in cache_log.records if "refusing" in r.getMessage()]
    assert len(msgs) == 1 and "owned by nobody" in msgs[0], msgs
    assert f"chown -R root {top}" in msgs[0], msgs[0]
    assert os.stat(top).st_uid == nobody  # left alone, not quarantined or overwritten
    assert os.listdir(tmp_path / "quarantine") == []


# -- locking ---------------------------------------------------------------------------------

def test_lock_timeout_compiles_privately(tmp_path, fresh_counters, cache_log, monkeypatch):
    gm, inputs = tiny_graph()
    from npuspec.compilation import cache_keys as keys
    key = keys.cache_key(keys.key_parts(gm, inputs, opts(tmp_path)))
    CacheDir(str(tmp_path)).open()
    holder = subprocess.Popen([sys.executable, "-c", f"""
import fcntl, os, sys, time
fd = os.open({str(tmp_path / 'locks' / (key + '.lock'))!r}, os.O_RDWR | os.O_CREAT)
fcntl.lockf(fd, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(30)
"""], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        monkeypatch.setenv("NPUSPEC_CACHE_LOCK_TIMEOUT", "0.3")
        t0 = time.monotonic()
        run(tmp_path)
        assert time.monotonic() - t0 < 20
    finally:
        holder.kill()
        holder.wait()
    assert fresh_counters() == {"cache_misses": 1}
    assert CacheDir(str(tmp_path)).keys() == []  # a waiter that timed out writes nothing
    assert any("NPUSPEC_CACHE_LOCK_TIMEOUT" in r.getMessage() for r in cache_log.records)


def test_world_writable_entries_dir_is_refused(tmp_path, fresh_counters, cache_log):
    fake = FakeInductor()
    run(tmp_path, fake, "inductor")
    os.chmod(tmp_path / "entries", 0o777)
    fresh_counters.reset()
    run(tmp_path, fake, "inductor")
    assert fake.loaded == 0 and fresh_counters() == {"cache_misses": 1, "cache_rejected": 1}
    assert any(f"chmod -R o-w {tmp_path / 'entries'}" in r.getMessage() for r in cache_log.records)
