"""Every key component changes the key; the fingerprint holds what the issue lists."""
import dataclasses
import sys
import types

import torch

from npuspec.config import SpeculativeConfig
from npuspec.compilation import cache_keys as keys
from npuspec.platform import Platform

from cache_helpers import opts, tiny_graph


def base_parts():
    gm, inputs = tiny_graph()
    spec = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3}, device="cpu")
    o = dataclasses.replace(opts("/x", "inductor"), speculative_config=spec, capture_sizes=(4, 8))
    return keys.key_parts(gm, inputs, o, passes=["p1", "p2"])


def test_key_is_stable_and_hex():
    a, b = keys.cache_key(base_parts()), keys.cache_key(base_parts())
    assert a == b and len(a) == 64 and int(a, 16) >= 0


def test_every_component_changes_the_key():
    p = base_parts()
    k0 = keys.cache_key(p)
    fp = dict(p.fingerprint)
    variants = {
        "graph": dataclasses.replace(p, graph="0" * 64),
        "inputs": dataclasses.replace(p, inputs=p.inputs[:1]),
        "passes": dataclasses.replace(p, passes=("p1", "p2-changed")),
        "pass order": dataclasses.replace(p, passes=("p2", "p1")),
        "capture plan": dataclasses.replace(p, capture={**p.capture, "sizes": [4, 8, 16]}),
        "capture mode": dataclasses.replace(p, capture={**p.capture, "mode": "lazy"}),
        "NPUSPEC_CAPTURE_SIZES": dataclasses.replace(p, capture={**p.capture, "env_sizes": [8]}),
        "K set": dataclasses.replace(p, ks=(2, 3)),
        "spec": dataclasses.replace(p, spec={**p.spec, "rejection_sample_method": "synthetic"}),
        "lowering": dataclasses.replace(p, lowering={"name": "eager", "mode": None}),
        "inductor mode": dataclasses.replace(p, lowering={"name": "inductor", "mode": "max-autotune"}),
    }
    for field in ("device", "device_name", "torch", "triton", "npuspec", "python"):
        variants[f"fingerprint.{field}"] = dataclasses.replace(p, fingerprint={**fp, field: "other"})
    variants["fingerprint.torch_npu"] = dataclasses.replace(p, fingerprint={**fp, "torch_npu": "2.6"})
    variants["fingerprint.cann"] = dataclasses.replace(p, fingerprint={**fp, "cann": "8.1.RC1"})
    seen = {k0: "base"}
    for name, v in variants.items():
        k = keys.cache_key(v)
        assert k not in seen, f"{name} gives the same key as {seen[k]}"
        seen[k] = name


def test_components_come_from_the_inputs(monkeypatch):
    monkeypatch.delenv("NPUSPEC_CAPTURE_SIZES", raising=False)
    gm, inputs = tiny_graph()
    o = opts("/x", "inductor")
    p = keys.key_parts(gm, inputs, o, passes=[])
    monkeypatch.setenv("NPUSPEC_CAPTURE_SIZES", "4,8")
    assert keys.key_parts(gm, inputs, o, passes=[]).capture != p.capture
    monkeypatch.delenv("NPUSPEC_CAPTURE_SIZES")
    # the graph code
    gm2, _ = tiny_graph()
    gm2.graph.call_function(torch.neg, (next(iter(gm2.graph.nodes)),))
    gm2.recompile()
    assert keys.key_parts(gm2, inputs, o, passes=[]).graph != p.graph
    # the input shapes (not visible in the code)
    _, inputs3 = tiny_graph((3, 4, 8))
    assert keys.key_parts(gm, inputs3, o, passes=[]).inputs != p.inputs
    # spec: compile-relevant fields only
    s1 = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3}, device="cpu")
    s2 = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4}, device="cpu")
    s3 = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3,
                                      "prompt_lookup_max": 7}, device="cpu")
    ps = [keys.key_parts(gm, inputs, dataclasses.replace(o, speculative_config=s), passes=[])
          for s in (s1, s2, s3)]
    assert ps[0].spec != ps[1].spec and ps[0].ks == (3,) and ps[1].ks == (4,)
    assert ps[0].spec == ps[2].spec, "proposer-only settings must not split the cache"
    # the capture plan
    o4 = dataclasses.replace(o, capture_sizes=(4,))
    assert keys.key_parts(gm, inputs, o4, passes=[]).capture != p.capture


def test_graph_hash_covers_tensor_constants():
    class C(torch.nn.Module):
        def __init__(self, v):
            super().__init__()
            self.register_buffer("c", torch.full((3,), v))

        def forward(self, x):
            return x + self.c

    a = keys.graph_hash(torch.fx.symbolic_trace(C(1.0)))
    b = keys.graph_hash(torch.fx.symbolic_trace(C(2.0)))
    assert a != b


def _dynamo_graphs(fn, *args) -> list:
    """The GraphModules Dynamo hands a backend for fn(*args), untouched."""
    got = []

    def grab(gm, example_inputs):
        got.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=grab)(*args)
    return got


def _add_one(x):
    return torch.relu(x) + 1.0


def _add_one_again(x):  # the same ops, from other source lines

    y = torch.relu(x)
    return y + 1.0


def _add_two(x):
    return torch.relu(x) + 2.0


def _mul_one(x):
    return torch.relu(x) * 1.0


def test_graph_keys_leave_dynamo_s_lazy_code_ungenerated():
    """Generating a lazy GraphModule's code is what keying on gm.code cost per compile (~70 ms
    for SmolLM2's forward), and Inductor generates it again for its own key."""
    from torch.fx._lazy_graph_module import _LazyGraphModule
    from npuspec.compilation import pass_counts

    (gm,) = _dynamo_graphs(_add_one, torch.randn(4))
    gm.recompile()  # as Dynamo hands it over (its trace logs, when on, generate the code)
    assert isinstance(gm, _LazyGraphModule) and gm._needs_recompile()
    keys.graph_hash(gm)
    pass_counts.graph_key(gm, [torch.randn(4)], {})
    assert gm._needs_recompile()


def test_graph_hash_tells_ops_and_literals_apart_not_source_lines_or_local_names():
    x = torch.randn(4)
    h = {f.__name__: keys.graph_hash(_dynamo_graphs(f, x)[0])
         for f in (_add_one, _add_one_again, _add_two, _mul_one)}
    assert h["_add_one"] == h["_add_one_again"]
    assert len({h["_add_one"], h["_add_two"], h["_mul_one"]}) == 3
    # the code does differ: its source comments (what a second install path changes) and the
    # node names Dynamo took from the locals
    a, b = _dynamo_graphs(_add_one, x)[0], _dynamo_graphs(_add_one_again, x)[0]
    assert a.code != b.code


def test_cpu_fingerprint_fields():
    fp = keys.fingerprint(Platform("cpu", "cpu", False, float("inf"), "x86_64"))
    for f in ("device", "device_name", "torch", "triton", "npuspec", "python", "cpu_isa"):
        assert f in fp, f
    assert fp["torch"] == torch.__version__
    import npuspec
    assert fp["npuspec"] == npuspec.__version__


def test_npu_fingerprint_has_torch_npu_and_cann(monkeypatch):
    fake = types.ModuleType("torch_npu")
    fake.__version__ = "2.5.1.post1"
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    monkeypatch.setattr(torch.version, "cann", "8.0.0", raising=False)
    keys._fingerprint.cache_clear()
    try:
        fp = keys.fingerprint(Platform("npu", "acl", True, 16, "Ascend910B3"))
        assert fp["torch_npu"] == "2.5.1.post1" and fp["cann"] == "8.0.0"
        assert fp["device"] == "npu" and fp["device_name"] == "Ascend910B3"
        monkeypatch.setattr(torch.version, "cann", "8.1.RC1", raising=False)
        keys._fingerprint.cache_clear()
        fp2 = keys.fingerprint(Platform("npu", "acl", True, 16, "Ascend910B3"))
        assert keys.fingerprint_tag(fp) != keys.fingerprint_tag(fp2)
    finally:
        keys._fingerprint.cache_clear()


def test_pass_uuids_from_the_pass_manager():
    u = keys.pass_uuids()
    assert isinstance(u, tuple)
    import npuspec.passes as passes
    if hasattr(passes, "pass_uuids"):
        assert u == tuple(passes.pass_uuids()) and len(u) >= 1
    elif hasattr(passes, "PassManager"):
        assert u == (passes.PassManager().uuid(),)
