"""The pass manager: order, uuid() cache keys, debug dumps, configs, the Inductor cache."""
import dataclasses
import os

import pytest
import torch

from npuspec import counters
from npuspec.passes import (GreedyAccept, GreedyVerify, InductorVerifyPass, PassManager, RatioAccept,
                            Residual, SampleVerify, default_patterns, manager)
from passes_helpers import aten_graph, compact, compile_npuspec, three_way


def count(logits, drafts):
    t = logits.argmax(-1)
    return t, (drafts == t[:, :-1]).cumprod(dim=-1).sum(dim=-1)


def step(logits, drafts):
    t = logits.argmax(-1)
    n = (drafts == t[:, :-1]).cumprod(dim=-1).sum(dim=-1)
    return t.gather(1, n[:, None]).squeeze(1), n


def _args(seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 5, 17, generator=g)
    return logits, logits.argmax(-1)[:, :4].clone()


def test_order_is_supersets_first():
    assert [p.name for p in default_patterns()] == [
        "greedy_verify", "sample_verify", "sample_verify", "greedy_accept", "ratio_accept",
        "residual", "given_residual"]  # sample_verify twice: the default accept test, then the other modes
    # the whole step wins over the narrow count when both could apply
    gm = aten_graph(step, *_args())
    assert PassManager().run(gm, flavor="aten") == {"greedy_verify": 1}
    # ... and with the superset left out, the narrow op takes the count
    gm = aten_graph(step, *_args())
    assert PassManager([GreedyAccept()]).run(gm, flavor="aten") == {"greedy_accept": 1}
    assert "npuspec.greedy_accept" in compact(gm)


def test_uuid_hashes_config_and_source():
    p = GreedyAccept()
    assert p.uuid() == GreedyAccept().uuid()                      # deterministic
    edited = GreedyAccept(dataclasses.replace(p.config, id_dtypes=("int64",)))
    assert edited.uuid() != p.uuid()                              # config edit -> new uuid
    assert PassManager([edited]).uuid() != PassManager([p]).uuid()
    assert (InductorVerifyPass(PassManager([edited])).uuid()
            != InductorVerifyPass(PassManager([p])).uuid())

    class PatchedGreedyAccept(GreedyAccept):                     # source edit -> new uuid
        def extra_check(self, match):
            return False

    assert PatchedGreedyAccept().uuid() != p.uuid()
    uuids = {q.uuid() for q in (GreedyVerify(), SampleVerify(), GreedyAccept(), RatioAccept(),
                                Residual())}
    assert len(uuids) == 5


def test_config_is_honoured():
    args = _args(1)
    off = GreedyAccept(dataclasses.replace(GreedyAccept().config, enabled=False))
    gm = aten_graph(count, *args)
    assert PassManager([off]).run(gm, flavor="aten") == {}
    only64 = GreedyAccept(dataclasses.replace(GreedyAccept().config, id_dtypes=("int32",)))
    gm = aten_graph(count, *args)                                  # int64 ids: now refused
    assert PassManager([only64]).run(gm, flavor="aten") == {}
    gm = aten_graph(count, *args)
    assert PassManager([GreedyAccept()]).run(gm, flavor="aten") == {"greedy_accept": 1}
    assert torch.equal(gm(*args)[1], count(*args)[1])


def test_debug_dump_writes_numbered_before_after(tmp_path, monkeypatch):
    monkeypatch.setenv("NPUSPEC_DEBUG_DUMP", str(tmp_path))
    gm = aten_graph(count, *_args())
    PassManager().run(gm, flavor="aten")
    gm2 = aten_graph(lambda x: x.sin(), torch.randn(3))
    PassManager().run(gm2, flavor="aten")
    files = sorted(os.listdir(tmp_path))
    assert len(files) == 4 and files[0].endswith("_before.txt") and files[1].endswith("_after.txt")
    assert int(files[2][:4]) == int(files[0][:4]) + 1            # numbered per run
    first = [(tmp_path / f).read_text() for f in files[:2]]
    assert "aten.cumprod" in first[0] and "npuspec.greedy_accept" not in first[0]
    assert "npuspec.greedy_accept" in first[1] and "aten.cumprod" not in first[1]
    last = [(tmp_path / f).read_text() for f in files[2:]]
    assert last[0] == last[1]                                      # nothing matched: unchanged


def test_no_verify_graph_compiles_and_runs_unchanged(no_fx_cache):
    def mlp(x, w):
        h = torch.relu(x @ w)
        return h.argmax(-1), h.sum(-1)
    x, w = torch.randn(4, 6), torch.randn(6, 5)
    for lowering in ("eager", "inductor"):
        torch._dynamo.reset()
        got, graphs = three_way(mlp, (x, w), lowering=lowering, matched=0, gone=["npuspec."],
                                float_tol=1e-5)
        assert [h[1] for h in manager.HISTORY] == [{}]  # the passes ran, matched nothing


@pytest.mark.parametrize("flavor", ["aten", "inductor"])
def test_a_matched_graph_is_rewritten_once_on_a_copy_and_taken_over_in_place(flavor, monkeypatch):
    """The families run once per graph (on a copy); a match replaces the graph's nodes with the
    copy's in place: same Graph object, same placeholder nodes, one fused op, eager's values."""
    calls = []
    real = PassManager._rewrite
    monkeypatch.setattr(PassManager, "_rewrite",
                        lambda self, g, fl: calls.append(g) or real(self, g, fl))
    args = _args(1)
    gm = aten_graph(step, *args)
    graph, placeholders = gm.graph, gm.graph.find_nodes(op="placeholder")
    found = PassManager().run(gm, flavor=flavor)
    assert found == {"greedy_verify": 1}
    assert len(calls) == 1 and calls[0] is not graph  # once, and on the copy
    assert gm.graph is graph and graph.find_nodes(op="placeholder") == placeholders
    graph.lint()
    assert "npuspec.rejection_sample" in compact(gm)
    assert all(torch.equal(a, b) for a, b in zip(gm(*args), step(*args)))


def _forward_like(x, w, attention_mask):
    # what a model forward holds: a cumsum of its mask compared with a literal (HF's position
    # ids), masks of the sequence's length, a softmax; no accept test, no race, no max(d, 0)
    pos = (attention_mask != 0).cumsum(-1) - 1                       # [1, S]
    causal = torch.arange(x.shape[1])[None, :] <= torch.arange(x.shape[1])[:, None]
    h = x @ w + pos[..., None].float()                               # [1, S, D]
    s = (h @ h.transpose(1, 2)).masked_fill(~causal, float("-inf"))  # [1, S, S]
    return torch.softmax(s, -1) @ h


@pytest.mark.parametrize("flavor", ["aten", "inductor"])
def test_a_graph_that_cannot_match_is_neither_copied_nor_rewritten(flavor, monkeypatch):
    args = (torch.randn(1, 20, 8), torch.randn(8, 8), torch.ones(1, 20, dtype=torch.long))
    gm = aten_graph(_forward_like, *args)
    assert not manager.could_match(gm.graph)
    monkeypatch.setattr(manager, "_copy", lambda g: pytest.fail("copied a graph that cannot match"))
    before = str(gm.graph)
    assert PassManager().run(gm, flavor=flavor) == {}
    assert str(gm.graph) == before


@pytest.mark.parametrize("fn", [count, step])
def test_verify_steps_pass_the_cheap_filter(fn):
    assert manager.could_match(aten_graph(fn, *_args()).graph)

    def loop_count(logits, drafts):  # a count of `&` and `+` only: its [B, K] mask is the signal
        ok = drafts == logits.argmax(-1)[:, :-1]
        alive, n = torch.ones_like(ok[:, 0]), torch.zeros(ok.shape[0], dtype=torch.long)
        for i in range(ok.shape[1]):
            alive = alive & ok[:, i]
            n = n + alive.long()
        return n

    gm = aten_graph(loop_count, *_args())
    assert manager.could_match(gm.graph)
    assert PassManager().run(gm, flavor="aten") == {"greedy_accept": 1}


def test_bad_flavor_names_the_value():
    with pytest.raises(ValueError, match="flavor='torchair'"):
        PassManager().run(aten_graph(count, *_args()), flavor="torchair")


def test_inductor_fx_graph_cache_hits_and_keys_on_pass_uuid(tmp_path, monkeypatch):
    """The passes are part of Inductor's FX graph cache key: a second compile of the same graph
    hits the cache; a pass whose config changed misses it."""
    from torch._dynamo.utils import counters as dcounters
    from torch._inductor import config
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    args = _args(2)

    def compile_once():
        torch._dynamo.reset()
        before = dict(dcounters["inductor"])
        got = compile_npuspec(count, "inductor")(*args)
        assert torch.equal(got[1], count(*args)[1])
        after = dcounters["inductor"]
        return {k: after[k] - before.get(k, 0) for k in ("fxgraph_cache_hit", "fxgraph_cache_miss")}

    with config.patch(fx_graph_cache=True, fx_graph_remote_cache=False):
        c0 = counters.snapshot()
        assert compile_once() == {"fxgraph_cache_hit": 0, "fxgraph_cache_miss": 1}
        assert counters.delta(c0).get("verify_patterns_matched") == 1
        assert compile_once() == {"fxgraph_cache_hit": 1, "fxgraph_cache_miss": 0}
        edited = [GreedyAccept(dataclasses.replace(GreedyAccept().config, id_dtypes=("int64",)))]
        monkeypatch.setattr(manager, "default_patterns", lambda: edited)
        assert compile_once() == {"fxgraph_cache_hit": 0, "fxgraph_cache_miss": 1}


def test_pass_uuids_for_cache_keys(monkeypatch):
    from npuspec.passes import pass_uuids
    u = pass_uuids()
    assert len(u) == 1 + len(default_patterns()) and u == pass_uuids()
    edited = [GreedyAccept(dataclasses.replace(GreedyAccept().config, tails=("cumprod",)))]
    monkeypatch.setattr(manager, "default_patterns", lambda: edited)
    assert pass_uuids()[0] != u[0]


def test_a_family_that_does_not_apply_is_never_compiled(monkeypatch):
    """The other-modes sample_verify instance (108 spellings) is skipped, and never traced,
    for a graph without a tensor `>` or a negated `>=`: here a greedy step."""
    from npuspec.passes import manager
    from npuspec.passes.patterns_sample import OTHER_MODES
    other = default_patterns()[2]
    assert other.name == "sample_verify" and other.config.modes == OTHER_MODES
    seen = []
    real = manager.compiled
    monkeypatch.setattr(manager, "compiled", lambda p, fl: (seen.append(p), real(p, fl))[1])
    gm = aten_graph(step, *_args())
    assert PassManager([GreedyAccept(), other]).run(gm, flavor="aten") == {"greedy_accept": 1}
    assert other not in seen and seen


def test_sample_verify_gates():
    """A model forward (no argmax, no count) holds no sampling step: neither sample_verify
    instance applies. Nor does a greedy step (argmax + cumprod, but no argmax of a division:
    every sampling spelling races p / E). A one-hot sampling step with `>=` takes the default
    instance only (the other needs a `>` or a negated comparison)."""
    ge, other = default_patterns()[1:3]

    def forward(x, w):
        return torch.softmax(x @ w, dim=-1)

    fwd = aten_graph(forward, torch.randn(3, 8), torch.randn(8, 5)).graph
    assert not ge.applies(fwd) and not other.applies(fwd)
    greedy = aten_graph(step, *_args()).graph
    assert not ge.applies(greedy) and not other.applies(greedy)

    def sample(p, ids, u, e):                                       # p [B, K+1, V]
        px = p[:, :-1].gather(-1, ids[..., None]).squeeze(-1)       # [B, K]
        n = (px >= u).cumprod(-1).sum(-1)                           # [B]
        return n, (p[:, -1] / e).argmax(-1)

    B, K, V = 2, 3, 7
    sampled = aten_graph(sample, torch.rand(B, K + 1, V), torch.randint(0, V, (B, K)),
                         torch.rand(B, K), torch.rand(B, V)).graph
    assert ge.applies(sampled) and not other.applies(sampled)


@pytest.mark.parametrize("flavor", ["aten", "inductor"])
def test_registration_traces_real_examples_as_fakes_to_the_same_graph(flavor):
    """trace_canonical turns a registration's real example tensors into fakes under one mode
    (each value traced from a real tensor built its own FakeTensorMode, which walks the
    stack): the graph, literals included, is the one traced from the real tensors."""
    from torch._inductor.pattern_matcher import fwd_only
    from torch._subclasses.fake_tensor import FakeTensor
    from npuspec.passes import canonical, manager
    table = manager.decomp_table(flavor)
    for pattern in PassManager().patterns:
        sp = next(iter(pattern.spellings()))
        ex = sp.example()
        assert any(isinstance(a, torch.Tensor) and not isinstance(a, FakeTensor) for a in ex)
        ref = fwd_only(sp.search, ex, get_decomp_fn=lambda: table)
        canonical.canonicalize(ref.graph)
        got = manager.trace_canonical(sp.search, ex, get_decomp_fn=lambda: table)
        assert str(got.graph) == str(ref.graph), pattern.name
        vals = [n.meta["val"] for n in got.graph.nodes if isinstance(n.meta.get("val"), FakeTensor)]
        assert vals and len({id(v.fake_mode) for v in vals}) == 1, pattern.name


def test_the_passes_run_with_the_graph_s_fake_cache_off_and_restore_it(monkeypatch):
    from npuspec.passes import manager
    from torch._guards import detect_fake_mode
    seen = []
    rewrite = manager.PassManager._rewrite

    def spy(self, graph, flavor):
        vals = [n.meta["val"] for n in graph.find_nodes(op="placeholder")]
        seen.append((detect_fake_mode(vals), detect_fake_mode(vals).cache_enabled))
        return rewrite(self, graph, flavor)

    monkeypatch.setattr(manager.PassManager, "_rewrite", spy)
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 30, generator=g)
    drafts = logits.argmax(-1)[:, :4].clone()

    def step(logits, drafts):
        t = logits.argmax(-1)
        return t, (drafts == t[:, :-1]).cumprod(dim=1).sum(dim=1)

    three_way(step, (logits, drafts), family="greedy_accept", appear=["npuspec.greedy_accept"])
    assert seen and all(not enabled for _, enabled in seen)
    assert all(mode.cache_enabled for mode, _ in seen)  # as Dynamo made it, after the passes
