"""The torchair lowering's GE compile cache in the shared graph cache, with a FAKE torchair.

There is no NPU, torch_npu or torchair here. `FakeGE` and `fake_torchair` stand in for them,
following what torchair's source and CANN's documentation say (never checked on an NPU):
- torchair's CompilerConfig refuses unknown attributes; its as_dict() returns (local, global)
  GE options, and the local ones reach GE when the graph is loaded;
- get_npu_backend(compiler_config=...) returns a backend; the graph it returns compiles at its
  first call;
- GE's graph compile cache: with both `ge.graph_compiler_cache_dir` (must exist) and
  `ge.graph_key` set, a key already in the directory is loaded from its .om file; otherwise GE
  compiles and writes an .om and an index JSON there.
Each test runs the real npuspec path: cached_lower -> compilation.lowering.lower_torchair (AOT
tracing, the verify passes) -> the fake backend.
"""
import dataclasses
import hashlib
import importlib.machinery
import json
import os
import stat
import sys
import threading
import time
import types

import pytest
import torch

from npuspec.compilation import cache as core
from npuspec.compilation import cache_keys as keys
from npuspec.compilation import lowering
from npuspec.compilation.cache import cached_lower, current, load_artifact
from npuspec.graphs.cache import CacheDir
from npuspec.graphs.cache import torchair as cache_torchair
from npuspec.platform import Platform

from cache_helpers import opts


# -- the fake ----------------------------------------------------------------------------------

@dataclasses.dataclass
class FakeGE:
    """GE's graph compile cache as documented; counts what it compiled and what it loaded."""
    compiled: int = 0
    loaded: int = 0
    options: list = dataclasses.field(default_factory=list)  # local options of each first call
    ignore_cache: bool = False  # a GE that never finds the graph (to test the miss check)
    fail: bool = False          # the first call raises (a GE compile error)

    def first_call(self, fw: torch.fx.GraphModule, local: dict) -> None:
        self.options.append(dict(local))
        if self.fail:
            raise RuntimeError("fake GE: graph compile failed")
        d, key = local.get("ge.graph_compiler_cache_dir"), local.get("ge.graph_key")
        model = b"fake-om:" + hashlib.sha256(fw.code.encode()).hexdigest().encode()
        if not (d and key):
            self.compiled += 1  # the cache is off: compile, write nothing
            return
        if not os.path.isdir(d):
            raise RuntimeError(f"fake GE: ge.graph_compiler_cache_dir {d} does not exist")
        index = os.path.join(d, f"{key}_index.json")
        if os.path.exists(index) and not self.ignore_cache:
            with open(index) as f:
                entries = [e for e in json.load(f)["cache_file_list"] if e["graph_key"] == key]
            # resolved against the configured directory (files may have been moved there)
            with open(os.path.join(d, os.path.basename(entries[0]["cache_file_name"])), "rb") as f:
                if f.read() != model:
                    raise RuntimeError("fake GE: the .om model file is damaged")
            self.loaded += 1
            return
        self.compiled += 1
        om = f"graph_{key}_{time.strftime('%Y%m%d%H%M%S')}.om"
        with open(os.path.join(d, om), "wb") as f:
            f.write(model)
        with open(index, "w") as f:
            json.dump({"cache_file_list": [{"cache_file_name": f"./{om}", "graph_key": key}]}, f)


def fake_torchair(ge: FakeGE) -> types.ModuleType:
    """A module with torchair's CompilerConfig / get_npu_backend surface, backed by `ge`."""
    class _GEConfig:
        def __init__(self):
            self.oo_level = "O3"

    class CompilerConfig:
        def __init__(self):
            self.ge_config = _GEConfig()
            self.mode = "max-autotune"
            self._fixed_attrs = ["ge_config", "mode"]

        def __setattr__(self, key, value):  # like torchair's NpuBaseConfig
            if "_fixed_attrs" in self.__dict__ and key not in self._fixed_attrs:
                raise ValueError(f"CompilerConfig has no option {key}")
            object.__setattr__(self, key, value)

        def as_dict(self):
            return {"ge.topoSortingMode": "1"}, {"ge.oo.level": self.ge_config.oo_level}

    def get_npu_backend(*, compiler_config=None, custom_decompositions={}):
        config = compiler_config or CompilerConfig()

        def backend(fw, example_inputs):
            first = [True]

            def run(*args):
                if first[0]:  # GE loads the graph with the config's local options and compiles
                    local, _ = config.as_dict()
                    ge.first_call(fw, local)
                    first[0] = False
                return fw(*args)
            return run
        return backend

    m = types.ModuleType("torch_npu.dynamo.torchair")
    m.CompilerConfig, m.get_npu_backend = CompilerConfig, get_npu_backend
    return m


@pytest.fixture
def install(monkeypatch):
    """install(ge) makes `from torch_npu.dynamo import torchair` return a fake backed by ge."""
    from npuspec.platform import current_platform

    current_platform()  # detected (cpu) before a fake torch_npu is importable
    pinned = keys.pass_uuids()  # they hash the pass sources, which may be edited meanwhile
    monkeypatch.setattr(keys, "pass_uuids", lambda: pinned)

    def _install(ge: FakeGE, version: str = "2.5.1.fake"):
        npu = types.ModuleType("torch_npu")
        npu.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
        npu.__version__ = version
        dynamo = types.ModuleType("torch_npu.dynamo")
        dynamo.__spec__ = importlib.machinery.ModuleSpec("torch_npu.dynamo", None)
        dynamo.torchair = fake_torchair(ge)
        npu.dynamo = dynamo
        for name, mod in (("torch_npu", npu), ("torch_npu.dynamo", dynamo),
                          ("torch_npu.dynamo.torchair", dynamo.torchair)):
            monkeypatch.setitem(sys.modules, name, mod)
        return ge
    return _install


class Step(torch.nn.Module):
    def forward(self, x, drafts):
        target = (x * 2 + 1).argmax(-1)                                       # [B, K+1]
        return (target[:, :-1] == drafts).int().cumprod(-1).sum(-1), target   # [B], [B, K+1]


def compile_step(root, shape=(2, 4, 8)):
    """cached_lower with the torchair lowering; returns (fn, inputs, eager outputs, key)."""
    torch.manual_seed(0)
    gm = torch.fx.symbolic_trace(Step())
    x = torch.randn(*shape)
    d = torch.randint(0, shape[-1], (shape[0], shape[1] - 1))
    fn = cached_lower(gm, [x, d], opts(root, "torchair"), lowering.lower)
    return fn, [x, d], gm(x, d), current().key


def run_step(root, shape=(2, 4, 8)):
    fn, inputs, want, key = compile_step(root, shape)
    got = fn(*inputs)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    return key


def cached(delta):
    """The cache counters of a counter delta (the verify passes add their own)."""
    return {k: v for k, v in delta().items() if k.startswith("cache_")}


def om_files(top):
    return sorted(os.path.relpath(os.path.join(d, f), top)
                  for d, _, fs in os.walk(top) for f in fs if f.endswith(".om"))


# -- tests -------------------------------------------------------------------------------------

def test_cold_then_warm_loads_the_ge_model(tmp_path, install, fresh_counters, cache_log):
    cold = install(FakeGE())
    fn, inputs, want, key = compile_step(tmp_path)
    c = CacheDir(str(tmp_path))
    assert c.keys() == []  # GE compiles at the first call: nothing to publish yet
    with c.lock(key, timeout=0.1) as got:
        assert not got  # the compiling process holds the key's lock until then
    assert all(torch.equal(g, w) for g, w in zip(fn(*inputs), want))
    assert (cold.compiled, cold.loaded) == (1, 0)
    assert cached(fresh_counters) == {"cache_misses": 1}
    assert c.keys() == [key]
    with c.lock(key, timeout=0.1) as got:
        assert got  # released after publishing
    files = c.verify(key, executable=True)["manifest"]["files"]  # every file hashed, verified
    ge_files = sorted(f for f in files if f.startswith("torchair/"))
    assert [f.endswith(".om") for f in ge_files] == [False, True], ge_files  # index + model
    assert "json/key.json" in files
    # GE got the npuspec key and a private 0700 directory, never the shared one
    ge_dir, ge_key = cold.options[0]["ge.graph_compiler_cache_dir"], cold.options[0]["ge.graph_key"]
    assert ge_key == key and cold.options[0]["ge.topoSortingMode"] == "1"  # torchair's own kept
    assert not os.path.realpath(ge_dir).startswith(os.path.realpath(str(tmp_path)))

    # warm: a fresh GE and fresh in-memory state, as in a new process
    core._logged.clear()
    fresh_counters.reset()
    warm = install(FakeGE())
    run_step(tmp_path)
    counts = cached(fresh_counters)
    assert (warm.compiled, warm.loaded) == (0, 1), (warm, counts)  # compiled nothing
    assert counts == {"cache_hits": 1}
    assert warm.options[0]["ge.graph_key"] == key
    wdir = warm.options[0]["ge.graph_compiler_cache_dir"]
    assert wdir != ge_dir and not os.path.realpath(wdir).startswith(os.path.realpath(str(tmp_path)))
    assert stat.S_IMODE(os.stat(wdir).st_mode) == 0o700
    assert load_artifact("key")["lowering"]["name"] == "torchair"
    assert not [r for r in cache_log.records if "npuspec cache" in r.getMessage()]


def test_corrupted_om_is_quarantined_and_recompiled(tmp_path, install, fresh_counters, cache_log):
    install(FakeGE())
    key = run_step(tmp_path)
    top = CacheDir(str(tmp_path)).entry(key)
    (om,) = om_files(top)
    with open(os.path.join(top, om), "r+b") as f:
        b = f.read(1)
        f.seek(0)
        f.write(bytes([b[0] ^ 0x01]))
    fresh_counters.reset()
    ge = install(FakeGE())
    assert run_step(tmp_path) == key
    assert (ge.compiled, ge.loaded) == (1, 0)  # the damaged model never reached GE
    assert cached(fresh_counters) == {"cache_rejected": 1, "cache_misses": 1}
    q = os.listdir(tmp_path / "quarantine")
    assert len(q) == 1 and q[0].startswith(key), q
    CacheDir(str(tmp_path)).verify(key, executable=True)  # republished, valid
    msgs = [r.getMessage() for r in cache_log.records if "failed verification" in r.getMessage()]
    assert len(msgs) == 1 and "sha256" in msgs[0] and os.path.basename(om) in msgs[0], msgs


def test_untrusted_directory_is_refused_for_ge_models(tmp_path, install, fresh_counters, cache_log):
    root = tmp_path / "cache"
    install(FakeGE())
    key = run_step(root)
    before = sorted(os.listdir(CacheDir(str(root)).entry(key)))
    os.chmod(root, 0o777)
    fresh_counters.reset()
    ge = install(FakeGE())
    run_step(root)
    assert (ge.compiled, ge.loaded) == (1, 0)  # no .om was read from it
    assert cached(fresh_counters) == {"cache_misses": 1, "cache_rejected": 1}
    msgs = [r.getMessage() for r in cache_log.records if "refusing" in r.getMessage()]
    assert len(msgs) == 1 and f"chmod -R o-w {root}" in msgs[0], msgs
    assert load_artifact("key") is not None  # npuspec's JSON is still read
    assert not ge.options[0]["ge.graph_compiler_cache_dir"].startswith(str(root))
    assert sorted(os.listdir(CacheDir(str(root)).entry(key))) == before  # nothing written
    os.chmod(root, 0o755)


def test_waiters_load_what_the_first_call_published(tmp_path, install, fresh_counters):
    """Two compiles of one key (threads standing in for processes): the second waits on the
    key's lock through the first one's first call, then loads; GE compiles once."""
    ge = install(FakeGE())
    fn, inputs, want, key = compile_step(tmp_path)
    out = {}
    t = threading.Thread(target=lambda: out.update(zip(("fn", "inputs", "want", "key"),
                                                       compile_step(tmp_path))))
    t.start()
    time.sleep(0.5)
    assert t.is_alive()  # waiting for the lock
    fn(*inputs)
    t.join(60)
    assert not t.is_alive()
    out["fn"](*out["inputs"])
    assert out["key"] == key and (ge.compiled, ge.loaded) == (1, 1)
    assert cached(fresh_counters) == {"cache_misses": 1, "cache_hits": 1}


def test_failed_first_call_releases_the_lock_and_publishes_nothing(tmp_path, install,
                                                                   fresh_counters):
    install(FakeGE(fail=True))
    fn, inputs, _, key = compile_step(tmp_path)
    with pytest.raises(RuntimeError, match="graph compile failed"):
        fn(*inputs)
    c = CacheDir(str(tmp_path))
    assert c.keys() == []
    with c.lock(key, timeout=0.1) as got:
        assert got
    ge = install(FakeGE())
    run_step(tmp_path)  # the next start compiles and publishes
    assert ge.compiled == 1 and c.keys() == [key]


def test_ge_miss_on_a_valid_entry_is_logged_and_counted(tmp_path, install, fresh_counters,
                                                        cache_log):
    install(FakeGE())
    run_step(tmp_path)
    fresh_counters.reset()
    ge = install(FakeGE(ignore_cache=True))
    run_step(tmp_path)
    assert (ge.compiled, ge.loaded) == (1, 0)
    assert cached(fresh_counters) == {"cache_hits": 1, "cache_misses": 1}
    assert sum("GE did not find this graph" in r.getMessage() for r in cache_log.records) == 1


def test_ge_load_error_on_a_verified_entry_names_the_entry(tmp_path, install, fresh_counters,
                                                          cache_log):
    install(FakeGE())
    key = run_step(tmp_path)
    install(FakeGE(fail=True))
    fn, inputs, _, _ = compile_step(tmp_path)
    with pytest.raises(RuntimeError, match="graph compile failed"):
        fn(*inputs)
    top = CacheDir(str(tmp_path)).entry(key)
    msgs = [r.getMessage() for r in cache_log.records if "first run" in r.getMessage()]
    assert len(msgs) == 1 and f"rm -r {top}" in msgs[0], msgs
    assert os.path.isdir(top)  # not deleted (torchair's own cache deletes itself here)


def test_ge_that_writes_nothing_is_reported(tmp_path, install, fresh_counters, cache_log):
    """A GE that ignores the cache options: logged once; the entry holds the JSON artifacts."""
    class NoCacheGE(FakeGE):
        def first_call(self, fw, local):
            super().first_call(fw, {k: v for k, v in local.items() if k != "ge.graph_key"})

    install(NoCacheGE())
    key = run_step(tmp_path)
    msgs = [r.getMessage() for r in cache_log.records if "GE wrote no" in r.getMessage()]
    assert len(msgs) == 1 and key[:12] in msgs[0], msgs
    files = CacheDir(str(tmp_path)).verify(key, executable=True)["manifest"]["files"]
    assert "json/key.json" in files and not any(f.startswith("torchair") for f in files)
    assert cached(fresh_counters) == {"cache_misses": 1}


def test_without_a_cache_dir_ge_gets_no_cache_options(install, fresh_counters):
    ge = install(FakeGE())
    gm = torch.fx.symbolic_trace(Step())
    x, d = torch.randn(2, 4, 8), torch.randint(0, 8, (2, 3))
    fn = cached_lower(gm, [x, d], opts("", "torchair"), lowering.lower)
    fn(x, d)
    assert ge.compiled == 1 and "ge.graph_key" not in ge.options[0]
    assert cache_torchair.ge_cache_options() == {} and cached(fresh_counters) == {}


def test_cann_or_torch_npu_upgrade_gives_a_new_entry(tmp_path, install, monkeypatch,
                                                     fresh_counters):
    """On npu the key holds the CANN and torch_npu versions (GE models are not portable across
    CANN versions), so an upgrade compiles into a new entry instead of loading the old .om."""
    import npuspec.platform

    npu = Platform("npu", "acl", True, 16, "Ascend910B3")
    monkeypatch.setattr(npuspec.platform, "current_platform", lambda: npu)
    monkeypatch.setattr(torch.version, "cann", "8.0.0", raising=False)
    keys._fingerprint.cache_clear()
    try:
        install(FakeGE(), version="2.5.1")
        k1 = run_step(tmp_path)
        fp = CacheDir(str(tmp_path)).read_manifest(k1)["fingerprint"]
        assert (fp["cann"], fp["torch_npu"], fp["device_name"]) == ("8.0.0", "2.5.1", "Ascend910B3")
        monkeypatch.setattr(torch.version, "cann", "8.1.RC1", raising=False)
        keys._fingerprint.cache_clear()
        ge = install(FakeGE(), version="2.5.1")
        k2 = run_step(tmp_path)
        keys._fingerprint.cache_clear()
        ge3 = install(FakeGE(), version="2.6.0")
        k3 = run_step(tmp_path)
    finally:
        keys._fingerprint.cache_clear()
    assert len({k1, k2, k3}) == 3 and (ge.compiled, ge.loaded, ge3.compiled) == (1, 0, 1)
    assert sorted(CacheDir(str(tmp_path)).keys()) == sorted([k1, k2, k3])


def test_compiler_config_adds_the_ge_options_to_torchairs_own(tmp_path):
    torchair = fake_torchair(FakeGE())
    assert cache_torchair.compiler_config(torchair).as_dict()[0] == {"ge.topoSortingMode": "1"}
    with cache_torchair.torchair_cache_dir(str(tmp_path), "abc123"):
        cfg = cache_torchair.compiler_config(torchair)
    local, global_ = cfg.as_dict()
    assert local == {"ge.topoSortingMode": "1", "ge.graph_compiler_cache_dir": str(tmp_path),
                     "ge.graph_key": "abc123"} and global_ == {"ge.oo.level": "O3"}
    assert isinstance(cfg, torchair.CompilerConfig)
    with pytest.raises(ValueError, match="no option"):  # still torchair's strict config
        cfg.unknown = 1
