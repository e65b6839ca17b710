"""The shipped registration traces (passes/trace_store.py): current for this torch, equal to
fresh traces node for node, read back exactly, and a miss traced as before."""
import gzip
import json
import logging
import operator

import pytest
import torch

from npuspec import counters
from npuspec.passes import manager, search_memo, trace_store
from npuspec.passes.patterns import default_patterns


@pytest.mark.slow  # ~1 min: every spelling traced again, witnesses included; the quick suite
def test_the_shipped_file_is_current(tmp_path):  # catches a stale key (test_registration_...)
    """The shipped entries are what tracing every default spelling gives now (stale after an
    edit to a spelling, a config, the canonicaliser or trace_store, or another torch: refresh
    with `python -m npuspec.passes.write_traces`), and each reads back to itself."""
    from npuspec.passes import write_traces
    shipped = trace_store._shipped()
    assert shipped, "pattern_traces.json.gz is missing or stale: python -m npuspec.passes.write_traces"
    fresh = tmp_path / "fresh.json.gz"
    assert write_traces.write(str(fresh)) == 878
    with gzip.open(fresh, "rt") as f:
        data = json.load(f)
    assert data["file_key"] == trace_store.file_key()
    assert sorted(data["entries"]) == sorted(shipped), "python -m npuspec.passes.write_traces"
    for key, entry in data["entries"].items():
        assert shipped[key] == entry, f"{key}: python -m npuspec.passes.write_traces"
        assert trace_store.encode(trace_store.decode(entry[0])) == entry[0], key


def test_round_trip_keeps_literals_kwargs_order_and_targets():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    m = g.call_function(torch.ops.aten.max.dim, (x, -1, True))
    v = g.call_function(operator.getitem, (m, 0))
    f = g.call_function(torch.ops.aten.full.default, ([2, 3], float("-inf")),
                        {"dtype": torch.float16, "layout": torch.strided,
                         "device": torch.device("cpu"), "pin_memory": False})
    c = g.call_function(torch.ops.aten.clamp.default, (v, -0.0, float("nan")))
    g.output((c, f, (v, None)))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    enc = trace_store.encode(gm)
    back = trace_store.decode(json.loads(json.dumps(enc)))
    assert str(back.graph) == str(gm.graph)
    assert search_memo.graph_key(back) == search_memo.graph_key(gm)
    lit = [n for n in back.graph.nodes if n.name == c.name][0].args[1]
    assert lit == 0.0 and str(lit) == "-0.0"
    assert list([n for n in back.graph.nodes if n.name == f.name][0].kwargs) == [
        "dtype", "layout", "device", "pin_memory"]


def test_what_cannot_be_stored_is_not():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_function(torch.sin, (x,)))       # a Python callable, not an op
    assert trace_store.encode(torch.fx.GraphModule(torch.nn.Module(), g)) is None
    with pytest.raises(AssertionError):
        trace_store.decode([["call_function", "y", "os.system.default", {"t": []}, {"d": []}]])


def test_a_key_the_file_lacks_is_traced_counted_and_logged(caplog):
    before = counters.snapshot()
    with caplog.at_level(logging.INFO, logger="npuspec.passes"):
        assert trace_store.load("inductor|no-such-uuid|s|()") == (None, None)
    assert counters.delta(before).get("pattern_trace_store.traced") == 1
    assert "no shipped trace" in caplog.text and "write_traces" in caplog.text


def test_a_file_for_another_torch_is_not_used(tmp_path, monkeypatch, caplog):
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"file_key": "torch 0.0.1; x", "entries": {"k": []}}, f)
    monkeypatch.setattr(trace_store, "PATH", str(path))
    trace_store._shipped.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="npuspec.passes"):
            assert trace_store._shipped() == {}
        assert "torch 0.0.1" in caplog.text and "write_traces" in caplog.text
    finally:
        monkeypatch.undo()
        trace_store._shipped.cache_clear()


def test_registration_reads_the_store_and_traces_nothing(monkeypatch):
    """Every default family registers from the store: no trace at registration."""
    calls = []
    real = trace_store.trace_canonical
    monkeypatch.setattr(manager, "trace_canonical",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    manager._compiled.cache_clear()
    before = counters.snapshot()
    try:
        for p in default_patterns():
            manager.compiled(p, "inductor")
    finally:
        manager._compiled.cache_clear()
    d = counters.delta(before)
    assert not calls and not d.get("pattern_trace_store.traced"), d
    assert d.get("pattern_trace_store.loaded") == 327, d


# mtime=0 and ids: a gzip header carries the time, and xdist workers must collect the same ids.
@pytest.mark.parametrize("content", [None, b"not gzip", gzip.compress(b"{not json", mtime=0)],
                         ids=["missing", "not_gzip", "not_json"])
def test_a_missing_or_broken_file_is_named_and_traced_around(tmp_path, monkeypatch, caplog,
                                                             content):
    path = tmp_path / "t.json.gz"
    if content is not None:
        path.write_bytes(content)
    monkeypatch.setattr(trace_store, "PATH", str(path))
    trace_store._shipped.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="npuspec.passes"):
            assert trace_store._shipped() == {}
            assert trace_store.load("inductor|u|s|()") == (None, None)
        assert str(path) in caplog.text and "write_traces" in caplog.text
    finally:
        monkeypatch.undo()
        trace_store._shipped.cache_clear()
