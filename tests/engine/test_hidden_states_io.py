"""The storage side of extract_hidden_states: kv_transfer_config parsing and the per-request
.safetensors files (npuspec/spec_decode/extract_files.py)."""
import dataclasses
import fcntl
import glob
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import npuspec.spec_decode.extract_files as H
from npuspec.spec_decode.extract_config import (KVTransferConfig, check_with_spec,
                                                parse_kv_transfer_config)
from npuspec.spec_decode.extract_files import (
    HiddenStatesWriteError, HiddenStatesWriter, cleanup_hidden_states, escape_request_id,
    load_hidden_states)

CONN = "ExampleHiddenStatesConnector"


def kv(path, **extra):
    return {"kv_connector": CONN, "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": str(path), **extra}}


def sample(n=6, layers=3, hidden=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 1000, (n,), generator=g).tolist(),
            torch.randn(n, layers, hidden, generator=g).to(dtype))


# --------------------------------------------------------------------------------------------
# config


def test_parse_defaults_and_forms(tmp_path):
    assert parse_kv_transfer_config(None) is None
    cfg = parse_kv_transfer_config({"kv_connector": CONN, "kv_role": "kv_producer"})
    assert cfg == KVTransferConfig()
    assert (cfg.shared_storage_path, cfg.num_writer_threads, cfg.use_synchronization_lock,
            cfg.allow_custom_save_path) == ("/tmp", 8, True, False)
    d = kv(tmp_path, num_writer_threads=2, use_synchronization_lock=False,
           allow_custom_save_path=True)
    cfg = parse_kv_transfer_config(d)
    assert cfg.shared_storage_path == str(tmp_path) and cfg.num_writer_threads == 2
    assert not cfg.use_synchronization_lock and cfg.allow_custom_save_path
    assert parse_kv_transfer_config(cfg) is cfg
    assert parse_kv_transfer_config(json.dumps(d)) == cfg
    assert parse_kv_transfer_config(cfg.to_dict()) == cfg
    assert parse_kv_transfer_config(kv(tmp_path)).shared_storage_path == str(tmp_path)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.num_writer_threads = 3


@pytest.mark.parametrize("d, needles", [
    ({"kv_connector": "SharedStorageConnector", "kv_role": "kv_producer"},
     ["kv_connector", "'SharedStorageConnector'", CONN]),
    ({"kv_connector": CONN, "kv_role": "kv_consumer"}, ["kv_role", "'kv_consumer'", "kv_producer"]),
    ({"kv_role": "kv_producer"}, ["kv_connector", "required", CONN]),
    ({"kv_connector": CONN}, ["kv_role", "required", "kv_producer"]),
    ({"kv_conector": CONN, "kv_role": "kv_producer"},
     ["'kv_conector'", "did you mean 'kv_connector'", "kv_connector_extra_config"]),
    ({"kv_connector": CONN, "kv_role": "kv_producer", "zzz": 1},
     ["'zzz'", "valid keys: kv_connector, kv_role, kv_connector_extra_config"]),
    (kv("/tmp", shared_storge_path="/x"),
     ["kv_connector_extra_config", "'shared_storge_path'", "did you mean 'shared_storage_path'",
      "num_writer_threads", "allow_custom_save_path"]),
    (kv("/tmp", num_writer_thread=2), ["did you mean 'num_writer_threads'"]),
    (kv("/tmp", num_writer_threads=0), ["num_writer_threads=0", ">= 1"]),
    (kv("/tmp", num_writer_threads="8"), ["num_writer_threads='8'", "integer"]),
    (kv("/tmp", num_writer_threads=True), ["num_writer_threads=True", "integer"]),
    (kv("/tmp", use_synchronization_lock="yes"),
     ["use_synchronization_lock='yes'", "True or False"]),
    (kv("/tmp", allow_custom_save_path=1), ["allow_custom_save_path=1", "True or False"]),
    ({"kv_connector": CONN, "kv_role": "kv_producer",
      "kv_connector_extra_config": {"shared_storage_path": ""}}, ["shared_storage_path=''"]),
    ({"kv_connector": CONN, "kv_role": "kv_producer",
      "kv_connector_extra_config": {"shared_storage_path": 3}}, ["shared_storage_path=3"]),
    ({"kv_connector": CONN, "kv_role": "kv_producer", "kv_connector_extra_config": [1]},
     ["kv_connector_extra_config=[1]", "shared_storage_path"]),
    ([CONN], ["kv_transfer_config=", CONN, "kv_producer"]),
    ("{not json", ["kv_transfer_config=", "JSON", CONN]),
])
def test_config_errors(d, needles):
    with pytest.raises(ValueError) as ei:
        parse_kv_transfer_config(d)
    msg = str(ei.value)
    for n in needles:
        assert n in msg, (n, msg)


def test_check_with_spec():
    cfg = KVTransferConfig()
    check_with_spec(cfg, "extract_hidden_states")
    check_with_spec(None, None)
    check_with_spec(None, "ngram")
    with pytest.raises(ValueError, match=r"method='ngram'.*ExampleHiddenStatesConnector.*"
                                         r"extract_hidden_states"):
        check_with_spec(cfg, "ngram")
    with pytest.raises(ValueError, match=r"method=None.*extract_hidden_states"):
        check_with_spec(cfg, None)
    with pytest.raises(ValueError) as ei:
        check_with_spec(None, "extract_hidden_states")
    msg = str(ei.value)
    assert "kv_transfer_config=" in msg and "'kv_role': 'kv_producer'" in msg
    assert "'shared_storage_path'" in msg and CONN in msg


# --------------------------------------------------------------------------------------------
# files


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip(tmp_path, dtype):
    toks, hs = sample(dtype=dtype)
    with HiddenStatesWriter(kv(tmp_path / "new" / "dir"), dtype) as w:
        p = w.submit("cmpl-abc-0", toks, hs)
        assert p == str(tmp_path / "new" / "dir" / "cmpl-abc-0.safetensors")
    out = load_hidden_states(p)
    assert set(out) == {"token_ids", "hidden_states"}
    assert out["token_ids"].dtype == torch.int64 and out["token_ids"].tolist() == toks
    assert out["hidden_states"].dtype == dtype and out["hidden_states"].shape == hs.shape
    assert torch.equal(out["hidden_states"], hs)
    # Any safetensors reader takes it, with the "pt" format metadata.
    with safe_open(p, "pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert sorted(f.keys()) == ["hidden_states", "token_ids"]
    assert torch.equal(load_file(p)["hidden_states"], hs)
    um = os.umask(0)
    os.umask(um)
    assert os.stat(p).st_mode & 0o777 == 0o644 & ~um
    assert os.stat(tmp_path / "new" / "dir").st_mode & 0o777 == 0o755 & ~um
    assert sorted(os.listdir(tmp_path / "new" / "dir")) == ["cmpl-abc-0.safetensors",
                                                            "cmpl-abc-0.safetensors.lock"]


def test_inputs_snapshot_cast_and_validate(tmp_path):
    w = HiddenStatesWriter(kv(tmp_path), torch.bfloat16)
    toks, hs = sample()
    src = hs.clone().transpose(0, 1).contiguous().transpose(0, 1)  # non-contiguous
    assert not src.is_contiguous()
    for i, t in enumerate([toks, np.array(toks, dtype=np.int32), torch.tensor(toks)]):
        w.submit(f"r{i}", t, src)
        src.zero_()  # the caller reuses its buffer at once
        src.copy_(hs)
    w.submit("empty", [], torch.zeros(0, 3, 8))
    w.close()
    for i in range(3):
        out = load_hidden_states(str(tmp_path / f"r{i}.safetensors"))
        assert out["token_ids"].tolist() == toks and out["token_ids"].dtype == torch.int64
        assert torch.equal(out["hidden_states"], hs.bfloat16())
        assert out["hidden_states"].is_contiguous()
    empty = load_hidden_states(str(tmp_path / "empty.safetensors"))
    assert empty["hidden_states"].shape == (0, 3, 8) and empty["token_ids"].shape == (0,)

    w = HiddenStatesWriter(kv(tmp_path))
    with pytest.raises(ValueError, match="token_ids.*one token id per row"):
        w.submit("a", toks[:-1], hs)
    with pytest.raises(ValueError, match="token_ids.*integer"):
        w.submit("a", [0.5] * 6, hs)
    with pytest.raises(ValueError, match="token_ids.*1-D"):
        w.submit("a", [toks], hs)
    with pytest.raises(ValueError, match=r"hidden_states.*num_tokens, num_layers, hidden_size"):
        w.submit("a", toks, hs[:, 0])
    w.close()
    with pytest.raises(RuntimeError, match="after close"):
        w.submit("a", toks, hs)


@pytest.mark.parametrize("rid", ["../evil", "/etc/passwd", "a/../../b", "..", ".", ".hidden",
                                 "a\0b", "x/y/z", "100%", "é日本", "\n", "-rf"])
def test_request_ids_never_escape(tmp_path, rid):
    d = tmp_path / "store"
    toks, hs = sample(n=2)
    with HiddenStatesWriter(kv(d)) as w:
        p = w.submit(rid, toks, hs)
    assert os.path.dirname(p) == str(d)
    base = os.path.basename(p)
    assert base.endswith(".safetensors") and not base.startswith(".")
    assert "/" not in base and "\0" not in base
    assert sorted(os.listdir(d)) == [base, base + ".lock"]
    assert sorted(os.listdir(tmp_path)) == ["store"]
    assert load_hidden_states(p)["token_ids"].tolist() == toks


def test_request_id_escaping_is_injective_and_checked():
    ids = ["a/b", "a%2Fb", "a_b", "a.b", ".a", "%2Ea", "a", "A"]
    assert len({escape_request_id(i) for i in ids}) == len(ids)
    assert escape_request_id("cmpl-0_1.x") == "cmpl-0_1.x"
    for bad in ["", None, 7]:
        with pytest.raises(ValueError, match="request_id"):
            escape_request_id(bad)
    with pytest.raises(ValueError, match="request_id.*too long"):
        escape_request_id("x" * 300)


def test_custom_save_path(tmp_path):
    toks, hs = sample()
    with HiddenStatesWriter(kv(tmp_path / "s")) as w:
        with pytest.raises(ValueError) as ei:
            w.submit("r", toks, hs, path=str(tmp_path / "mine.safetensors"))
    msg = str(ei.value)
    assert "kv_transfer_params.hidden_states_path" in msg and "allow_custom_save_path=True" in msg
    assert not (tmp_path / "mine.safetensors").exists()
    with HiddenStatesWriter(kv(tmp_path / "s", allow_custom_save_path=True)) as w:
        custom = tmp_path / "other" / "mine.safetensors"
        assert w.submit("r", toks, hs, path=str(custom)) == str(custom)
        assert w.submit("r2", toks, hs).startswith(str(tmp_path / "s"))
        with pytest.raises(ValueError, match="hidden_states_path"):
            w.submit("r", toks, hs, path="bad\0path")
    assert load_hidden_states(str(custom))["token_ids"].tolist() == toks


def test_many_concurrent_submits(tmp_path):
    cfg = kv(tmp_path, num_writer_threads=4)
    w = HiddenStatesWriter(cfg, torch.float16)
    expect = {}

    def producer(k):
        for i in range(25):
            toks, hs = sample(n=1 + (i % 7), seed=100 * k + i)
            expect[w.submit(f"t{k}-{i}", toks, hs)] = (toks, hs.half())

    threads = [threading.Thread(target=producer, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    w.flush(timeout=30)
    assert w.num_pending == 0
    assert len(expect) == 100
    assert len(glob.glob(str(tmp_path / "*.safetensors"))) == 100
    assert not glob.glob(str(tmp_path / ".*"))  # no temp files left behind
    for p, (toks, hs) in expect.items():
        out = load_hidden_states(p)
        assert out["token_ids"].tolist() == toks and torch.equal(out["hidden_states"], hs)
    w.close()


def test_same_path_rewrites_land_in_order(tmp_path):
    with HiddenStatesWriter(kv(tmp_path, num_writer_threads=4)) as w:
        for i in range(20):
            w.submit("same", [i], torch.full((1, 1, 2), float(i)))
    assert load_hidden_states(str(tmp_path / "same.safetensors"))["token_ids"].tolist() == [19]


def test_no_lock_mode(tmp_path):
    toks, hs = sample()
    with HiddenStatesWriter(kv(tmp_path, use_synchronization_lock=False)) as w:
        p = w.submit("r", toks, hs)
    assert os.listdir(tmp_path) == ["r.safetensors"]
    assert load_hidden_states(p)["token_ids"].tolist() == toks
    cleanup_hidden_states(p)
    assert os.listdir(tmp_path) == []


# --------------------------------------------------------------------------------------------
# crash safety


class Boom(RuntimeError):
    pass


def test_failed_write_leaves_old_file_intact(tmp_path, monkeypatch):
    toks, hs = sample(n=64, hidden=1024)  # several pieces
    with HiddenStatesWriter(kv(tmp_path)) as w:
        good = w.submit("r", toks, hs)
    before = open(good, "rb").read()

    real = H._write_all
    calls = []

    def flaky(fd, buf):
        calls.append(len(memoryview(buf)))
        if len(calls) == 2:  # after the header, part-way into the tensor data
            real(fd, memoryview(buf)[: len(memoryview(buf).cast("B")) // 2])
            raise Boom("disk on fire")
        real(fd, buf)

    monkeypatch.setattr(H, "_write_all", flaky)
    monkeypatch.setattr(H, "_CHUNK", 4096)
    w = HiddenStatesWriter(kv(tmp_path))
    assert w.submit("r", toks, hs * 2) == good
    with pytest.raises(HiddenStatesWriteError) as ei:
        w.flush(timeout=10)
    assert good in str(ei.value) and "disk on fire" in str(ei.value)
    assert ei.value.path == good and isinstance(ei.value.__cause__, Boom)
    w.flush(timeout=10)  # reported once
    w.close()
    assert len(calls) == 2
    assert open(good, "rb").read() == before
    assert torch.equal(load_hidden_states(good)["hidden_states"], hs)
    assert sorted(os.listdir(tmp_path)) == ["r.safetensors", "r.safetensors.lock"]


def test_failed_first_write_leaves_nothing(tmp_path, monkeypatch):
    def boom(fd, tensors, metadata):
        os.write(fd, b"partial")
        raise Boom("killed")

    monkeypatch.setattr(H, "_serialize", boom)
    w = HiddenStatesWriter(kv(tmp_path))
    p = w.submit("r", *sample())
    with pytest.raises(HiddenStatesWriteError, match="killed"):
        w.close()
    assert not os.path.exists(p)
    assert [f for f in os.listdir(tmp_path) if not f.endswith(".lock")] == []
    with pytest.raises(FileNotFoundError) as ei:
        load_hidden_states(p)
    assert p in str(ei.value) and "extract_hidden_states" in str(ei.value)
    assert "hidden_states_path" in str(ei.value)


KILLED_WRITER = textwrap.dedent("""
    import os, sys, time, torch
    import npuspec.spec_decode.extract_files as H
    real, n = H._write_all, [0]
    def slow(fd, buf):
        real(fd, buf)
        n[0] += 1
        if n[0] == 3:  # header and some data are on disk
            os.fsync(fd)
            print("mid-write", flush=True)
            time.sleep(60)
    H._write_all, H._CHUNK = slow, 1 << 16
    w = H.HiddenStatesWriter({"kv_connector": "ExampleHiddenStatesConnector",
                              "kv_role": "kv_producer",
                              "kv_connector_extra_config": {"shared_storage_path": sys.argv[1]}})
    w.submit("r", list(range(256)), torch.ones(256, 4, 256))
    w.flush()
""")


def test_sigkilled_writer_leaves_old_file_intact(tmp_path):
    toks, hs = sample()
    with HiddenStatesWriter(kv(tmp_path)) as w:
        good = w.submit("r", toks, hs)
    before = open(good, "rb").read()
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(tmp_path)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "mid-write"
        tmps = [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]
        assert len(tmps) == 1 and tmps[0].startswith(".")
        assert os.path.getsize(tmp_path / tmps[0]) > 0
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        proc.kill()
        proc.stdout.close()
    assert open(good, "rb").read() == before
    assert glob.glob(str(tmp_path / "*.safetensors")) == [good]
    out = load_hidden_states(good)  # the dead writer's lock went with it
    assert out["token_ids"].tolist() == toks and torch.equal(out["hidden_states"], hs)


# --------------------------------------------------------------------------------------------
# locking


def test_reader_lock_blocks_replace(tmp_path):
    toks, hs = sample()
    w = HiddenStatesWriter(kv(tmp_path))
    p = w.submit("r", toks, hs)
    w.flush(timeout=10)
    fd = os.open(p + ".lock", os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)  # a reader in the middle of reading the old file
    try:
        w.submit("r", [7] * len(toks), hs + 1)
        with pytest.raises(TimeoutError, match="1 write"):
            w.flush(timeout=0.5)
        assert load_hidden_states(p)["token_ids"].tolist() == toks  # shared locks coexist
        assert w.num_pending == 1
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    w.flush(timeout=10)
    out = load_hidden_states(p)
    assert out["token_ids"].tolist() == [7] * len(toks)
    assert torch.equal(out["hidden_states"], hs + 1)
    w.close()


def test_reader_waits_for_write_in_progress(tmp_path, monkeypatch):
    """The lock is taken in submit(), so a reader given the path waits for the file."""
    release = threading.Event()
    started = threading.Event()
    real = H.write_hidden_states_file

    def gated(path, tensors):
        started.set()
        assert release.wait(10)
        real(path, tensors)

    monkeypatch.setattr(H, "write_hidden_states_file", gated)
    toks, hs = sample()
    w = HiddenStatesWriter(kv(tmp_path))
    p = w.submit("r", toks, hs)
    result = {}
    reader = threading.Thread(target=lambda: result.update(load_hidden_states(p)))
    reader.start()
    assert started.wait(10)
    reader.join(0.3)
    assert reader.is_alive() and not os.path.exists(p)  # waiting on LOCK_SH
    release.set()
    reader.join(10)
    assert not reader.is_alive()
    assert result["token_ids"].tolist() == toks
    w.close()


def test_cleanup(tmp_path):
    toks, hs = sample()
    with HiddenStatesWriter(kv(tmp_path)) as w:
        p1, p2 = w.submit("a", toks, hs), w.submit("b", toks, hs)
    cleanup_hidden_states(p1, keep_hidden_states=True)
    assert sorted(os.listdir(tmp_path)) == ["a.safetensors", "b.safetensors", "b.safetensors.lock"]
    assert load_hidden_states(p1)["token_ids"].tolist() == toks  # re-creates the lock file
    cleanup_hidden_states(p1)
    cleanup_hidden_states(p2)
    cleanup_hidden_states(p2)  # already gone: fine
    assert os.listdir(tmp_path) == []
    with pytest.raises(FileNotFoundError, match="b.safetensors"):
        load_hidden_states(p2)
    assert os.listdir(tmp_path) == []  # a failed read leaves no lock file


def test_cleanup_waits_for_reader(tmp_path):
    toks, hs = sample()
    with HiddenStatesWriter(kv(tmp_path)) as w:
        p = w.submit("r", toks, hs)
    fd = os.open(p + ".lock", os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)
    t = threading.Thread(target=cleanup_hidden_states, args=(p,))
    t.start()
    t.join(0.3)
    assert t.is_alive() and os.path.exists(p)
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)
    t.join(10)
    assert not t.is_alive() and os.listdir(tmp_path) == []


def test_writer_rejects_unwritable_dir(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match="shared_storage_path"):
        HiddenStatesWriter(kv(f / "sub"))
