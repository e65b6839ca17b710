"""The NPU paged-attention path against a FAKE torch_npu (no Ascend hardware here).

The fake `npu_fused_infer_attention_score` implements the documented semantics in plain PyTorch
(TND query, paged kv `(blocknum, blocksize, Hkv*D)` read through `block_table`, cumulative
`actual_seq_lengths`, per-row `actual_seq_lengths_kv`, sparse_mode=3 rightDownCausal with the
2048x2048 mask) and asserts the argument types, so equality with `reference_paged_attention`
checks that npuspec passes API-true arguments. Queries FIA leaves undefined (nothing visible,
rows past the last query end) come out NaN, so npuspec must zero them itself. The fake ACL graph
records aten ops and FIA tasks in order, honours task-group handles, update begin/end and
ExternalEvents, and refuses to run a captured FIA task whose event nobody recorded.

Everything here is unverified on Ascend hardware; the `npu`-marked test runs the same checks on a
real NPU when one is present.
"""
import contextlib
import sys
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from npuspec.kernels import paged_attention_npu as pan
from npuspec.kernels.paged_attention import reference_paged_attention, use_impl

# Keyword names of torch_npu.npu_fused_infer_attention_score (torch_npu API doc).
FIA_KWARGS = {
    "pse_shift", "atten_mask", "actual_seq_lengths", "actual_seq_lengths_kv", "dequant_scale1",
    "quant_scale1", "dequant_scale2", "quant_scale2", "quant_offset2", "antiquant_scale",
    "antiquant_offset", "block_table", "query_padding_size", "kv_padding_size",
    "key_antiquant_scale", "key_antiquant_offset", "value_antiquant_scale",
    "value_antiquant_offset", "key_shared_prefix", "value_shared_prefix",
    "actual_shared_prefix_len", "query_rope", "key_rope", "key_rope_antiquant_scale",
    "num_heads", "scale", "pre_tokens", "next_tokens", "input_layout", "num_key_value_heads",
    "sparse_mode", "inner_precise", "block_size", "antiquant_mode", "softmax_lse_flag",
    "key_antiquant_mode", "value_antiquant_mode"}


def _int_list(x, name):
    assert isinstance(x, list) and all(type(v) is int for v in x), (name, x)


def fia_semantics(query, key, value, *, atten_mask, actual_seq_lengths, actual_seq_lengths_kv,
                  block_table, num_heads, scale, input_layout, num_key_value_heads, sparse_mode,
                  block_size, **rest):
    """Documented FIA, TND + page attention + sparse_mode 3, in fp32 on CPU."""
    assert set(rest) <= FIA_KWARGS, set(rest) - FIA_KWARGS
    assert input_layout == "TND" and sparse_mode == 3
    _int_list(actual_seq_lengths, "actual_seq_lengths")
    _int_list(actual_seq_lengths_kv, "actual_seq_lengths_kv")
    assert type(num_heads) is int and type(num_key_value_heads) is int
    assert type(block_size) is int and isinstance(scale, float)
    assert block_size % 128 == 0 and 128 <= block_size <= 512
    assert query.dim() == 3 and query.is_contiguous() and query.dtype in (torch.float16,
                                                                          torch.bfloat16)
    Ttot, H, D = query.shape
    assert H == num_heads and H % num_key_value_heads == 0
    nb, bs, HD = key.shape
    assert key.shape == value.shape and bs == block_size and HD == num_key_value_heads * D
    assert key.dtype == query.dtype and key.is_contiguous() and value.is_contiguous()
    assert block_table.dtype == torch.int32 and block_table.dim() == 2
    assert atten_mask.dtype == torch.int8 and atten_mask.shape == (2048, 2048)
    assert torch.equal(atten_mask, torch.triu(torch.ones_like(atten_mask), diagonal=1))
    B = len(actual_seq_lengths)
    assert len(actual_seq_lengths_kv) == B == block_table.shape[0]
    assert actual_seq_lengths == sorted(actual_seq_lengths) and actual_seq_lengths[-1] <= Ttot
    assert all(n >= 1 for n in actual_seq_lengths_kv)
    assert max(-(-n // bs) for n in actual_seq_lengths_kv) <= block_table.shape[1]
    Hkv, G = num_key_value_heads, H // num_key_value_heads
    out = torch.full((Ttot, H, D), float("nan"))
    start = 0
    for b in range(B):
        end, n = actual_seq_lengths[b], actual_seq_lengths_kv[b]
        ql = end - start
        blocks = block_table[b, :-(-n // bs)].long()
        assert int(blocks.max()) < nb
        k = key[blocks].reshape(-1, Hkv, D)[:n].float()
        v = value[blocks].reshape(-1, Hkv, D)[:n].float()
        qb = query[start:end].float().view(ql, Hkv, G, D)
        s = torch.einsum("tkgd,nkd->kgtn", qb, k) * scale
        # rightDownCausal: query i sees key j iff j <= n - ql + i
        seen = torch.arange(n)[None, :] <= (n - ql + torch.arange(ql))[:, None]
        p = torch.softmax(s.masked_fill(~seen, float("-inf")), -1)  # all-masked rows: NaN
        out[start:end] = torch.einsum("kgtn,nkd->tkgd", p, v).reshape(ql, H, D)
        start = end
    return out.to(query.dtype), torch.zeros(1, dtype=query.dtype)


class _Tape(TorchDispatchMode):
    def __init__(self, tape):
        super().__init__()
        self.tape = tape

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.tape.append(("aten", func, args, kwargs or {}, out))
        return out


class FakeGraph:
    """Replays recorded aten ops and FIA tasks in capture order, on the same tensors."""
    def __init__(self):
        self.tape, self.pool = [], None

    def replay(self):
        for entry in self.tape:
            kind = entry[0]
            if kind == "aten":
                _, func, args, kwargs, out = entry
                res = func(*args, **kwargs)
                for o, r in zip(tree_leaves(out), tree_leaves(res)):
                    if isinstance(o, torch.Tensor) and o is not r:
                        o.copy_(r)
            elif kind == "wait":
                assert entry[1].recorded, "captured FIA task ran without its update event"
            elif kind == "reset":
                entry[1].recorded = False
            else:  # FIA task with its (possibly updated) arguments
                task = entry[1]
                o, lse = fia_semantics(*task.args, **task.kwargs)
                task.out[0].copy_(o)
                task.out[1].copy_(lse)


class Task:
    def __init__(self, args, kwargs, out, workspace):
        self.args, self.kwargs, self.out, self.workspace = args, kwargs, out, workspace
        self.updates = []


def make_fakes():
    """A fake torch_npu module and a fake torch.npu namespace sharing one state."""
    st = types.SimpleNamespace(graph=None, group=None, updating=None, log=[], streams=[])

    class Stream:
        def __init__(self):
            st.streams.append(self)

        def wait_stream(self, other):
            st.log.append(("wait_stream", self, other))

    main = Stream()
    cur = [main]

    @contextlib.contextmanager
    def stream(s):
        old, cur[0] = cur[0], s
        try:
            yield
        finally:
            cur[0] = old

    @contextlib.contextmanager
    def graph(g, pool=None, stream=None):
        g.pool, st.graph = pool, g
        try:
            with _Tape(g.tape):
                yield
        finally:
            st.graph = None

    class ExternalEvent:
        def __init__(self):
            self.recorded = False

        def wait(self, s):
            assert st.graph is not None and s is cur[0]
            st.graph.tape.append(("wait", self))

        def reset(self, s):
            assert st.graph is not None
            st.graph.tape.append(("reset", self))

        def record(self, s):
            assert st.graph is None and s is cur[0]
            self.recorded = True
            st.log.append(("record", self, s))

    def group_begin(s):
        assert st.graph is not None and st.group is None and s is cur[0]
        st.group = []

    def group_end(s):
        assert st.group is not None and len(st.group) == 1, st.group
        (task,), st.group = st.group, None
        return task

    def update_begin(s, handle):
        assert st.graph is None and st.updating is None and s is cur[0] and s is not main
        st.updating = handle

    def update_end(s):
        assert st.updating is not None
        st.updating = None

    def fia(query, key, value, **kw):
        assert st.graph is None, "the plain FIA call must not be captured (host tiling)"
        st.log.append(("fia", kw["actual_seq_lengths"], kw["actual_seq_lengths_kv"]))
        return fia_semantics(query, key, value, **kw)

    def fia_out(query, key, value, *, workspace, out, **kw):
        assert isinstance(workspace, torch.Tensor) and isinstance(out, list) and len(out) == 2
        fia_semantics.__wrapped_check__(query, key, value, kw)
        if st.updating is not None:
            task = st.updating
            assert query is task.args[0] and workspace is task.workspace and out[0] is task.out[0]
            task.kwargs = dict(kw)
            task.updates.append((kw["actual_seq_lengths"], kw["actual_seq_lengths_kv"],
                                 kw["block_table"]))
            st.log.append(("update", task))
        elif st.graph is not None:
            assert st.group is not None, "FIA .out captured outside a task group"
            task = Task((query, key, value), dict(kw), out, workspace)
            st.group.append(task)
            st.graph.tape.append(("task", task))
        else:
            o, lse = fia_semantics(query, key, value, **kw)
            out[0].copy_(o)
            out[1].copy_(lse)

    def get_max_workspace(query, key, value, **kw):
        fia_semantics.__wrapped_check__(query, key, value, kw)
        st.log.append(("workspace",))
        return torch.empty(64, dtype=torch.uint8)

    fia.out = fia_out
    tnpu = types.ModuleType("torch_npu")
    tnpu.npu_fused_infer_attention_score = fia
    tnpu._npu_fused_infer_attention_score_get_max_workspace = get_max_workspace
    npu = types.SimpleNamespace(
        NPUGraph=FakeGraph, graph=graph, graph_pool_handle=lambda: ("pool", 0),
        Stream=Stream, current_stream=lambda: cur[0], stream=stream,
        synchronize=lambda: None, ExternalEvent=ExternalEvent,
        is_current_stream_capturing=lambda: st.graph is not None,
        graph_task_group_begin=group_begin, graph_task_group_end=group_end,
        graph_task_update_begin=update_begin, graph_task_update_end=update_end)
    return tnpu, npu, st


def _arg_check(query, key, value, kw):
    """Argument types only (no compute): usable while a graph is being captured."""
    assert set(kw) <= FIA_KWARGS, set(kw) - FIA_KWARGS
    assert kw["input_layout"] == "TND" and kw["sparse_mode"] == 3
    _int_list(kw["actual_seq_lengths"], "actual_seq_lengths")
    _int_list(kw["actual_seq_lengths_kv"], "actual_seq_lengths_kv")
    assert kw["block_table"].dtype == torch.int32 and query.dim() == 3 and key.dim() == 3


fia_semantics.__wrapped_check__ = _arg_check


@pytest.fixture
def fake(monkeypatch):
    tnpu, npu, st = make_fakes()
    monkeypatch.setitem(sys.modules, "torch_npu", tnpu)
    monkeypatch.setattr(torch, "npu", npu, raising=False)
    monkeypatch.setattr(pan, "GRAPH_UPDATES", pan.GraphUpdates())
    monkeypatch.setattr(pan, "_MASKS", {})
    return st


BS = 128


def make_case(B, T, H, Hkv, D, MB, gen, lens=None, dtype=torch.float16, L=2):
    nblocks = 1 + B * MB  # block 0: the scratch block
    q = torch.randn(B, T, H, D, generator=gen).to(dtype)
    k = torch.randn(L, nblocks * BS, Hkv, D, generator=gen).to(dtype)
    v = torch.randn(L, nblocks * BS, Hkv, D, generator=gen).to(dtype)
    perm = (torch.randperm(nblocks - 1, generator=gen) + 1).to(torch.int32)
    bt = perm[:B * MB].view(B, MB).contiguous()
    if lens is None:
        lens = torch.randint(1, MB * BS + 1, (B,), generator=gen).tolist()
    seq = torch.tensor(lens, dtype=torch.int32)
    bt[seq == 0] = 0
    return q, k, v, bt, seq


def fill_lens(B, T, MB, gen):
    """Random lengths with a padding row, a left-padded row (0 < n < T) and a full row."""
    lens = torch.randint(T, MB * BS + 1, (B,), generator=gen).tolist()
    lens[0] = 0
    if B > 1:
        lens[1] = max(1, T // 2) if T > 1 else 1
    if B > 2:
        lens[2] = MB * BS
    return lens


def _close(a, b):
    assert not torch.isnan(a).any()
    torch.testing.assert_close(a.float(), b.float(), atol=3e-3, rtol=3e-3)


@pytest.mark.parametrize("B,T,H,Hkv,D,MB", [(1, 1, 2, 2, 16, 1), (4, 4, 4, 2, 16, 3),
                                            (5, 16, 8, 2, 32, 2), (3, 7, 4, 4, 16, 2)])
def test_eager_matches_reference(fake, B, T, H, Hkv, D, MB):
    gen = torch.Generator().manual_seed(B * 100 + T)
    q, k, v, bt, seq = make_case(B, T, H, Hkv, D, MB, gen, fill_lens(B, T, MB, gen))
    scale = D ** -0.5
    for layer in range(k.shape[0]):
        out = pan.npu_paged_attention(q, k, v, layer, bt, seq, BS, scale)
        ref = reference_paged_attention(q, k, v, layer, bt, seq, BS, scale)
        assert out.shape == q.shape and out.dtype == q.dtype
        _close(out, ref)
    fia_calls = [c for c in fake.log if c[0] == "fia"]
    assert len(fia_calls) == k.shape[0]
    _, q_ends, kv = fia_calls[0]
    assert q_ends == [T * (b + 1) for b in range(B)]
    assert kv == [max(int(n), 1) for n in seq.tolist()]  # padding rows passed as 1


def test_through_the_custom_op_and_bf16(fake):
    gen = torch.Generator().manual_seed(7)
    q, k, v, bt, seq = make_case(3, 4, 4, 1, 16, 2, gen, [0, 200, 9], dtype=torch.bfloat16)
    with use_impl("npu"):
        out = torch.ops.npuspec.paged_attention(q, k, v, 1, bt, seq, BS, 0.25)
    ref = reference_paged_attention(q, k, v, 1, bt, seq, BS, 0.25)
    assert not torch.isnan(out).any() and (out[0] == 0).all()
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_unsupported_shapes_are_clear_errors(fake):
    gen = torch.Generator().manual_seed(1)
    q, k, v, bt, seq = make_case(2, 17, 2, 2, 16, 1, gen, [20, 30])
    with pytest.raises(ValueError, match="at most 16"):
        pan.npu_paged_attention(q, k, v, 0, bt, seq, BS, 1.0)
    q, k, v, bt, seq = make_case(2, 2, 2, 2, 16, 1, gen, [20, 30])
    with pytest.raises(ValueError, match="multiple of 128"):
        pan.npu_paged_attention(q, k, v, 0, bt, seq, 64, 1.0)
    with pytest.raises(TypeError, match="float16/bfloat16"):
        pan.npu_paged_attention(q.float(), k.float(), v.float(), 0, bt, seq, BS, 1.0)


def _capture(fake, key, fn):
    g = FakeGraph()
    with pan.GRAPH_UPDATES.capturing(key):
        with torch.npu.graph(g):
            outs = fn()
    return g, outs


def test_capture_records_and_update_reissues_new_lengths(fake):
    B, T, H, Hkv, D, MB = 4, 3, 4, 2, 16, 3
    gen = torch.Generator().manual_seed(3)
    q, k, v, bt, seq = make_case(B, T, H, Hkv, D, MB, gen, [5, 0, 300, 2])
    scale = D ** -0.5

    def step():  # two layers, as a decoder would capture them
        return [pan.npu_paged_attention(q, k, v, i, bt, seq, BS, scale) for i in range(2)]

    g, outs = _capture(fake, "g4", step)
    recs = pan.GRAPH_UPDATES.records("g4")
    assert len(recs) == 2 and [c[0] for c in fake.log].count("workspace") == 2
    assert all(r.args.B == B and r.args.T == T and r.seq_lens is seq for r in recs)
    assert not any(c[0] == "fia" for c in fake.log)  # nothing ran eagerly under capture
    with pytest.raises(AssertionError, match="without its update event"):
        g.replay()

    for step_i in range(3):  # the dispatcher refills the static buffers, then update + replay
        lens = fill_lens(B, T, MB, gen)
        seq.copy_(torch.tensor(lens, dtype=torch.int32))
        new_bt = (torch.randperm(B * MB, generator=gen) + 1).to(torch.int32).view(B, MB)
        new_bt[seq == 0] = 0
        bt.copy_(new_bt)
        q.copy_(torch.randn(q.shape, generator=gen).to(q.dtype))
        host = lens if step_i % 2 else None  # explicit host lists, or read from the buffer
        assert pan.GRAPH_UPDATES.before_replay("g4", host) == 2
        g.replay()
        for i, r in enumerate(recs):
            q_ends, kv, bt_used = r.handle.updates[-1]
            assert q_ends == [T * (b + 1) for b in range(B)]
            assert kv == [max(n, 1) for n in lens] and bt_used is bt
            _close(outs[i], reference_paged_attention(q, k, v, i, bt, seq, BS, scale))
    # updates went through the side stream, after it waited for the main stream
    upd = pan.GRAPH_UPDATES.update_stream()
    assert ("wait_stream", upd, fake.streams[0]) in fake.log
    assert [e for e in fake.log if e[0] == "record"][-1][2] is upd
    assert pan.GRAPH_UPDATES.before_replay("other-graph", [1]) == 0


def test_update_with_replacement_block_table_and_short_host_list(fake):
    B, T = 3, 2
    gen = torch.Generator().manual_seed(5)
    q, k, v, bt, seq = make_case(B, T, 2, 1, 16, 2, gen, [10, 20, 30])
    g, outs = _capture(fake, "k", lambda: pan.npu_paged_attention(q, k, v, 0, bt, seq, BS, 0.3))
    other = bt.flip(0).contiguous()
    seq.copy_(torch.tensor([40, 250, 0], dtype=torch.int32))
    other[2] = 0
    pan.GRAPH_UPDATES.before_replay("k", [40, 250], block_table=other)  # row 2 = padding
    g.replay()
    assert pan.GRAPH_UPDATES.records("k")[0].handle.updates[-1][1] == [40, 250, 1]
    _close(outs, reference_paged_attention(q, k, v, 0, other, seq, BS, 0.3))
    with pytest.raises(ValueError, match="captured"):
        pan.GRAPH_UPDATES.before_replay("k", None, block_table=other[:, :1])
    with pytest.raises(ValueError, match="seq_lens for a batch"):
        pan.GRAPH_UPDATES.before_replay("k", [1, 2, 3, 4])


def test_capture_without_registration_is_refused(fake):
    gen = torch.Generator().manual_seed(2)
    q, k, v, bt, seq = make_case(2, 2, 2, 2, 16, 1, gen, [3, 4])
    with pytest.raises(RuntimeError, match="GRAPH_UPDATES.capturing"):
        with torch.npu.graph(FakeGraph()):
            pan.npu_paged_attention(q, k, v, 0, bt, seq, BS, 1.0)
    pan.GRAPH_UPDATES.begin_capture("a")
    with pytest.raises(RuntimeError, match="while capturing"):
        pan.GRAPH_UPDATES.begin_capture("b")
    pan.GRAPH_UPDATES.end_capture("a")
    pan.GRAPH_UPDATES.drop("a")
    assert "a" not in pan.GRAPH_UPDATES.keys()


def test_acl_runner_hook(fake, monkeypatch):
    """The ACL runner's hook (graphs/runners.py), on the real AclGraphRunner class with the
    fake torch.npu: warm-up runs eagerly, capture records, replay updates."""
    from npuspec.graphs import runners

    monkeypatch.setattr(runners, "_POOLS", {})
    B, T, MB = 2, 4, 2
    gen = torch.Generator().manual_seed(11)
    q, k, v, bt, seq = make_case(B, T, 4, 2, 16, MB, gen, [7, 130])

    def fn(q_, bt_, seq_):
        return pan.npu_paged_attention(q_, k, v, 1, bt_, seq_, BS, 0.25) * 2

    r = runners.AclGraphRunner()
    (out,) = r.capture(fn, [q, bt, seq])
    assert [c[0] for c in fake.log].count("fia") == runners.WARMUP_RUNS  # eager warm-up
    assert len(pan.GRAPH_UPDATES.records(r)) == 1
    for lens in ([0, 256], [100, 3], [1, 1]):
        seq.copy_(torch.tensor(lens, dtype=torch.int32))
        q.copy_(torch.randn(q.shape, generator=gen).to(q.dtype))
        assert r.replay()[0] is out
        _close(out, 2 * reference_paged_attention(q, k, v, 1, bt, seq, BS, 0.25).float())


@pytest.mark.npu
def test_real_npu_matches_reference():  # pragma: no cover - needs Ascend + torch_npu
    torch_npu = pytest.importorskip("torch_npu")  # noqa: F841
    if not torch.npu.is_available():
        pytest.skip("no NPU")
    gen = torch.Generator().manual_seed(0)
    B, T, H, Hkv, D, MB = 4, 4, 8, 2, 128, 3
    q, k, v, bt, seq = make_case(B, T, H, Hkv, D, MB, gen, fill_lens(B, T, MB, gen))
    dev = [t.npu() for t in (q, k, v, bt, seq)]
    out = pan.npu_paged_attention(*dev[:3], 0, dev[3], dev[4], BS, D ** -0.5).cpu()
    _close(out, reference_paged_attention(q, k, v, 0, bt, seq, BS, D ** -0.5))
    # ACL graph with the task update
    g = torch.npu.NPUGraph()
    with pan.GRAPH_UPDATES.capturing("real"):
        with torch.npu.graph(g):
            static = pan.npu_paged_attention(*dev[:3], 0, dev[3], dev[4], BS, D ** -0.5)
    lens = fill_lens(B, T, MB, gen)
    dev[4].copy_(torch.tensor(lens, dtype=torch.int32))
    pan.GRAPH_UPDATES.before_replay("real", lens)
    g.replay()
    torch.npu.synchronize()
    seq = torch.tensor(lens, dtype=torch.int32)
    _close(static.cpu(), reference_paged_attention(q, k, v, 0, bt, seq, BS, D ** -0.5))
