"""Graph runners: the ACL runner against a fake torch.npu that records and replays aten ops
(so replay never calls Python), the CPU runner, and real CUDA graphs (marked cuda)."""
import contextlib
import itertools
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from npuspec.graphs import AclGraphRunner, CpuRunner, GraphSet, make_runner, runners, token


class _Tape(TorchDispatchMode):
    def __init__(self, tape):
        super().__init__()
        self.tape = tape

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.tape.append((func, args, kwargs or {}, out))
        return out


class FakeGraph:
    """Replays the recorded aten ops on the same tensors: static addresses, like a device graph."""
    def __init__(self):
        self.tape, self.replays, self.pool = [], 0, None

    def replay(self):
        self.replays += 1
        for func, args, kwargs, out in self.tape:
            res = func(*args, **kwargs)
            for o, r in zip(tree_leaves(out), tree_leaves(res)):
                if isinstance(o, torch.Tensor) and o is not r:
                    o.copy_(r)


def fake_npu():
    pools = itertools.count()
    calls = []

    class Stream:
        def wait_stream(self, other):
            calls.append("wait_stream")

    @contextlib.contextmanager
    def graph(g, pool=None, stream=None):
        calls.append(("graph", pool))
        g.pool = pool
        with _Tape(g.tape):
            yield

    return types.SimpleNamespace(
        NPUGraph=FakeGraph, graph=graph, graph_pool_handle=lambda: ("pool", next(pools)),
        Stream=Stream, current_stream=Stream, stream=lambda s: contextlib.nullcontext(),
        synchronize=lambda: calls.append("sync"), calls=calls)


@pytest.fixture
def npu(monkeypatch):
    fake = fake_npu()
    monkeypatch.setattr(torch, "npu", fake, raising=False)
    monkeypatch.setattr(runners, "_POOLS", {})
    return fake


W = torch.randn(6, 5, generator=torch.Generator().manual_seed(0))


def test_acl_runner_api_shape(npu, delta):
    calls = []

    def fn(x):
        calls.append(1)
        return torch.tanh(x @ W) + 1, x.sum(-1)

    x = torch.randn(4, 6)
    r = make_runner("acl")
    assert isinstance(r, AclGraphRunner)
    outs = r.capture(fn, [x])
    assert len(calls) == runners.WARMUP_RUNS + 1  # warm-up runs, then one run under capture
    assert isinstance(r.graph, FakeGraph) and r.graph.pool == ("pool", 0)
    assert ("graph", ("pool", 0)) in npu.calls and "sync" in npu.calls
    x.copy_(torch.randn(4, 6))
    again = r.replay()
    assert again is outs and len(calls) == runners.WARMUP_RUNS + 1  # replay ran no Python
    assert torch.allclose(outs[0], torch.tanh(x @ W) + 1) and torch.allclose(outs[1], x.sum(-1))
    r2 = make_runner("acl")
    r2.capture(fn, [x])
    assert r2.graph.pool == r.graph.pool  # one shared pool for every graph
    assert delta() == {"graphs_captured": 2, "graph_replays": 1}


def test_acl_graph_set_pads_through_replays(npu, delta):
    """The whole dispatcher on the (fake) ACL runner: copy-in, replay, slice; largest first."""
    def step(tokens, rows):
        B = rows.shape[0]
        h = torch.tanh(tokens.view(B, 3, 6) @ W).sum(1)  # [B, 5]
        return h + rows[:, None], (h > 0).sum(-1)

    gs = GraphSet(step, [token(coef=3), token()], [1, 2, 4, 8], runner="acl")
    for B in (3, 1, 8, 5, 2, 7):
        tokens, rows = torch.randn(B * 3, 6), torch.randn(B)
        out, ref = gs.run(tokens, rows), step(tokens, rows)
        assert torch.allclose(out[0], ref[0], atol=1e-6) and torch.equal(out[1], ref[1]), B
    order = [c[1] for c in npu.calls if isinstance(c, tuple)]
    assert len(order) == 4 and len(set(order)) == 1  # four captures, one pool
    assert [e.units for e in gs.entries.values()] == [8, 4, 2, 1]  # captured largest first
    assert delta() == {"graphs_captured": 4, "graph_replays": 6}


def test_acl_capture_restores_mutated_state(npu, delta):
    """A device capture runs the step (warm-ups, and the fake graph runs under capture too):
    state the step mutates by reference is put back, so each call bumps it once, as eager."""
    from npuspec.graphs import STATIC, Slot

    def step(x, count):
        count.add_(1)
        return x * count

    count = torch.zeros(())
    gs = GraphSet(step, [token(), Slot(STATIC, restore=True)], [1, 2, 4], runner="acl")
    for i, B in enumerate((3, 1, 2, 4), start=1):
        x = torch.randn(B, 5)
        assert torch.equal(gs.run(x, count), x * i) and count.item() == i, (B, count)
    assert delta() == {"graphs_captured": 3, "graph_replays": 4}


def test_static_graph_on_a_device_captured_on_its_second_call(npu, delta, monkeypatch,
                                                             fresh_dynamo):
    """A graph with nothing to pad, on a (fake) device: its first call at a shape runs the
    compiled graph, the second captures, later ones replay; a shape seen once costs no capture
    (HF generate's KV length grows every step)."""
    import dataclasses

    from npuspec.compilation import backend
    plat = dataclasses.replace(backend.current_platform(), graph_runner="acl")
    monkeypatch.setattr(backend, "current_platform", lambda: plat)
    f = torch.compile(lambda x, w: (x @ w).relu(), backend="npuspec", options={"lowering": "eager"})
    w = torch.randn(6, 3)
    for n in (4, 4, 4, 5, 6, 7):  # 5, 6, 7: a dynamic dim 1 (not a batch dim), each seen once
        x = torch.randn(2, n, 6)
        assert torch.allclose(f(x, w), (x @ w).relu()), n
    assert delta() == {"graphs_captured": 1, "graph_replays": 2}


def test_acl_runner_without_torch_npu(monkeypatch):
    monkeypatch.delattr(torch, "npu", raising=False)
    monkeypatch.setitem(__import__("sys").modules, "torch_npu", None)  # import fails
    with pytest.raises(RuntimeError, match=r"npuspec\[npu\]"):
        AclGraphRunner.module()


def test_cpu_runner_static_outputs(delta):
    x = torch.randn(3, 6)
    r = CpuRunner()
    outs = r.capture(lambda a: (a @ W,), [x])
    x.mul_(2)
    assert r.replay() is outs and torch.allclose(outs[0], x @ W)
    with pytest.raises(ValueError, match="must be one of"):
        make_runner("tpu")


@pytest.mark.cuda
def test_cuda_graphs_match_eager_and_share_memory(delta, monkeypatch):
    dev = "cuda"
    Wd = torch.randn(256, 32768, device=dev) / 64

    def step(tokens, rows):
        B = rows.shape[0]
        h = torch.relu(tokens.view(B, 4, 256) @ Wd)  # big intermediate: 32 MiB at B=64
        return (h @ Wd.T).sum(1) + rows[:, None], h.amax((-1, -2))

    units = [1, 2, 4, 8, 16, 32, 64]
    gen = torch.Generator(device=dev).manual_seed(0)

    def reserved_by(gs, B):
        monkeypatch.setattr(runners, "_POOLS", {})  # a fresh pool for this set
        torch.cuda.synchronize()
        before = torch.cuda.memory_reserved()
        gs.run(torch.randn(B * 4, 256, device=dev, generator=gen), torch.randn(B, device=dev))
        torch.cuda.synchronize()
        return torch.cuda.memory_reserved() - before

    mem_one = reserved_by(GraphSet(step, [token(coef=4), token()], [64], runner="cuda"), 64)
    gs = GraphSet(step, [token(coef=4), token()], units, runner="cuda")
    mem_all = reserved_by(gs, 5)  # captures all seven sizes, largest first, one pool
    # without sharing, the intermediates alone would need ~2x the largest graph's
    assert mem_all <= 1.5 * mem_one, (mem_all, mem_one)
    for B in (5, 64, 1, 33, 17, 2):
        tokens = torch.randn(B * 4, 256, device=dev, generator=gen)
        rows = torch.randn(B, device=dev, generator=gen)
        out, ref = gs.run(tokens, rows), step(tokens, rows)
        torch.testing.assert_close(out[0], ref[0])
        torch.testing.assert_close(out[1], ref[1])
    assert delta()["graphs_captured"] == 1 + len(units)
