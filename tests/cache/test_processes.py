"""Whole processes on one cache directory: cold then warm (Inductor), and eight cold starts at
once. Each worker compiles a tiny verify step with torch.compile(backend="npuspec")."""
import json
import os


import pytest

from npuspec.graphs.cache import CacheCorrupt, CacheDir

from cache_helpers import run_worker, wait_worker


def result(path):
    with open(path) as f:
        r = json.load(f)
    r["counters"] = {k: v for k, v in r["counters"].items() if k.startswith("cache_")}
    return r


def test_cold_then_warm_process_inductor(tmp_path):
    cache = tmp_path / "cache"
    wait_worker(run_worker(tmp_path / "cold.json", cache, "inductor"))
    cold = result(tmp_path / "cold.json")
    assert cold["equal"] and cold["counters"].get("cache_misses") == 1, cold
    assert cold["inductor"].get("fxgraph_cache_miss") == 1, cold  # it really compiled
    (key,) = CacheDir(str(cache)).keys()
    CacheDir(str(cache)).verify(key, executable=True)

    wait_worker(run_worker(tmp_path / "warm.json", cache, "inductor"))
    warm = result(tmp_path / "warm.json")
    assert warm["keys"] == cold["keys"] == [key], (cold["keys"], warm["keys"], key,
                                                   "npuspec sources edited between the runs?")
    assert warm["equal"], warm
    assert warm["counters"].get("cache_hits") == 1 and "cache_misses" not in warm["counters"], warm
    # compiled nothing: Inductor's FX-graph and AOTAutograd caches hit, no codegen, no C++ build
    assert warm["inductor"].get("fxgraph_cache_hit") == 1, warm
    assert not warm["inductor"].get("fxgraph_cache_miss"), warm
    assert warm["aot"].get("autograd_cache_hit") == 1 and not warm["aot"].get("autograd_cache_miss")
    assert CacheDir(str(cache)).hits(key) == 1

    # a flipped byte in a compiled shared object is caught before anything is loaded (the
    # quarantine-and-recompile path is covered in-process by test_faults.py)
    top = os.path.join(cache, "entries", key, "inductor")
    so = sorted(os.path.join(d, f) for d, _, fs in os.walk(top) for f in fs if f.endswith(".so"))[0]
    with open(so, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(CacheCorrupt, match=os.path.basename(so) + ".*sha256"):
        CacheDir(str(cache)).verify(key, executable=True, copy_exec_to=str(tmp_path / "copy"))
    assert not os.path.exists(tmp_path / "copy" / os.path.relpath(so, top))


@pytest.mark.parametrize("n", [pytest.param(8, marks=pytest.mark.slow), 4])
def test_cold_processes_at_once(tmp_path, n):
    """Two keys (two batch sizes) compiled by n processes started together: one compile per
    key in total, the others wait on the lock and load; one valid entry per key; all equal eager.
    Lowering is eager with a 1.5 s delay, so the compile is long enough for the others to wait
    (Inductor would add minutes on two cores and nothing to what this checks). Eight processes
    take ~75 s on two cores, so CI runs four (-m slow runs eight)."""
    cache = tmp_path / "cache"
    procs = [run_worker(tmp_path / f"w{i}.json", cache, "eager", "--barrier", tmp_path / "ready", n,
                        "--slow", 1.5, "--shapes", 2) for i in range(n)]
    try:
        for p in procs:
            wait_worker(p)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    res = [result(tmp_path / f"w{i}.json") for i in range(n)]
    assert len({tuple(r["keys"]) for r in res}) == 1, "every process must derive the same keys"
    assert all(r["equal"] for r in res), res
    misses = sum(r["counters"].get("cache_misses", 0) for r in res)
    hits = sum(r["counters"].get("cache_hits", 0) for r in res)
    assert (misses, hits) == (2, 2 * n - 2), [r["counters"] for r in res]
    assert not any(r["counters"].get("cache_rejected") for r in res)
    c = CacheDir(str(cache))
    keys = c.keys()
    assert sorted(keys) == sorted(res[0]["keys"]), keys
    for k in keys:
        c.verify(k, executable=True)
    assert os.listdir(cache / "tmp") == [] and os.listdir(cache / "quarantine") == []
