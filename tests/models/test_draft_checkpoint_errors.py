"""Drafter checkpoints: the user-facing load errors (each names the tensor, key, file or fix),
and a dynamic-batch compile of every drafter without graph breaks. The hand-written formats and
their numerics: test_draft_checkpoints.py."""
import os
import shutil

import pytest
import torch

from draft_ckpt_helpers import BS, CLASSES, H, I, V, VD, Weights, eagle3_weights, llama_cfg, vocab_map, write
from npuspec.models import AttnMetadata, load_model
from npuspec.models.draft_loading import DraftConfig, load_draft


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


# ---- errors ----------------------------------------------------------------------------------------
def _eagle_ckpt(tmp_path, cfg=None, **tensors):
    w = Weights(1).layer("layers.0.", input_norm=False)
    w.linear("fc", H, 2 * H)
    w.update(tensors)
    return write(tmp_path / "bad", cfg or llama_cfg(), {k: v for k, v in w.items() if v is not None})


def test_wrong_shape_names_tensor_and_shapes(tiny, tmp_path):
    path = _eagle_ckpt(tmp_path, **{"fc.weight": torch.zeros(H, 3 * H)})
    with pytest.raises(ValueError, match=r"'fc\.weight' has shape \[128, 384\], expected \[128, 256\]"):
        load_draft("eagle", path, *tiny)


def test_missing_and_unknown_tensors_listed(tiny, tmp_path):
    path = _eagle_ckpt(tmp_path, **{"layers.0.mlp.up_proj.weight": None, "extra.weight": torch.zeros(2)})
    with pytest.raises(ValueError, match="missing") as e:
        load_draft("eagle", path, *tiny)
    assert "layers.0.mlp.up_proj.weight" in str(e.value) and "extra.weight" in str(e.value)
    # an EAGLE-3 checkpoint without its final norm: the midlayer name is reported
    w = eagle3_weights()
    t = {k.replace("layers.0.", "midlayer."): v for k, v in w.items() if k != "norm.weight"}
    path = write(tmp_path / "e3", llama_cfg(draft_vocab_size=VD), t)
    with pytest.raises(ValueError, match=r"missing \['norm\.weight'\]"):
        load_draft("eagle3", path, *tiny)


@pytest.mark.parametrize("over, key, found", [
    ({"hidden_size": 256}, "hidden_size", "256"),
    ({"vocab_size": 2048}, "vocab_size", "2048"),
    ({"rope_theta": 500000.0}, "rope_theta", "500000.0"),
    ({"target_hidden_size": 4096}, "target_hidden_size", "4096"),
])
def test_target_mismatch_names_key_and_values(tiny, tmp_path, over, key, found):
    method = "eagle3" if key == "target_hidden_size" else "eagle"
    if method == "eagle3":
        w = eagle3_weights()
        path = write(tmp_path / "m", llama_cfg(architectures=["LlamaForCausalLMEagle3"],
                                               draft_vocab_size=VD, **over), dict(w))
    else:
        path = _eagle_ckpt(tmp_path, llama_cfg(**over))
    with pytest.raises(ValueError, match=f"{key}={found}") as e:
        load_draft(method, path, *tiny)
    target_value = {"rope_theta": "10000.0", "vocab_size": "1024"}.get(key, "128")
    assert "target's" in str(e.value) and target_value in str(e.value)


def test_unknown_format_and_wrong_method(tiny, tmp_path):
    path = write(tmp_path / "x", llama_cfg(), {"foo.weight": torch.zeros(3)})
    with pytest.raises(ValueError, match="supported: .*SpecForge"):
        load_draft("eagle3", path, *tiny)
    with pytest.raises(ValueError, match="supported: .*FasterDecoding"):
        load_draft("medusa", path, *tiny)
    with pytest.raises(ValueError, match="method 'eagle'"):
        load_draft("eagle3", _eagle_ckpt(tmp_path), *tiny)
    e3 = write(tmp_path / "e3", llama_cfg(draft_vocab_size=VD),
               {k.replace("layers.0.", "midlayer."): v for k, v in eagle3_weights().items()})
    with pytest.raises(ValueError, match="method 'eagle3'"):
        load_draft("eagle", e3, *tiny)


def test_writable_pickle_is_refused(tiny, tmp_path):
    w = Weights(1).layer("layers.0.", input_norm=False)
    w.linear("fc", H, 2 * H)
    path = write(tmp_path / "pkl", llama_cfg(), dict(w), "pytorch_model.bin")
    load_draft("eagle", path, *tiny)  # 0644 in a 0700 directory: fine
    f = os.path.join(path, "pytorch_model.bin")
    os.chmod(f, 0o664)
    with pytest.raises(PermissionError, match="pytorch_model.bin.*safetensors"):
        load_draft("eagle", path, *tiny)
    os.chmod(f, 0o644)
    os.chmod(path, 0o777)
    try:
        with pytest.raises(PermissionError, match="writable by group or others"):
            load_draft("eagle", path, *tiny)
    finally:
        os.chmod(path, 0o755)


# ---- compile: dynamic batch, no graph breaks ----------------------------------------------------------
@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp", "medusa"])
def test_compiles_with_dynamic_batch_without_graph_breaks(tiny, method):
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend

    tcfg, target = tiny
    cfg = DraftConfig.from_target(method, tcfg, intermediate_size=I,
                                  **({"draft_vocab_size": VD} if method == "eagle3" else {}))
    draft = CLASSES[method](cfg).eval().requires_grad_(False)
    draft.bind_target(target)
    if method == "eagle3":
        draft.d2t.copy_(vocab_map()[1])
        draft.init_buffers()
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")  # the eager backend, counting compiled graphs
    if method == "medusa":
        fn = torch.compile(draft, backend=counter, fullgraph=True)
        for b in (2, 3):
            h = torch.randn(b, H)
            torch._dynamo.mark_dynamic(h, 0)
            torch.testing.assert_close(fn(h), draft(h))
        assert counter.frame_count == 1  # one graph for both batch sizes
        return
    cache = draft.allocate_paged_cache(16, BS)

    def step(ids, feats, pos, slots, table, lens):
        lh, nh = draft(ids, draft.first_hidden(feats), pos, AttnMetadata(slots, table, lens), cache)
        return draft.logits(lh), nh

    fn = torch.compile(step, backend=counter, fullgraph=True)  # a graph break raises
    F_in = 3 * H if method == "eagle3" else H
    for b in (2, 3):
        t = 3
        ids = torch.randint(0, V, (b, t))
        pos = torch.arange(t).expand(b, t).contiguous()
        table = (torch.arange(b * 2) + 1).view(b, 2).int()
        slots = table.long()[:, :1] * BS + pos
        args = [ids, torch.randn(b, t, F_in), pos, slots, table, torch.full((b,), t, dtype=torch.int32)]
        for a in args:
            torch._dynamo.mark_dynamic(a, 0)
        got = fn(*args)
        want = step(*args)  # rewrites the same K/V, so eager sees the same pool
        for x, y in zip(got, want):
            torch.testing.assert_close(x, y)
    assert counter.frame_count == 1  # one graph for both batch sizes


@pytest.mark.parametrize("damage", ["truncated", "empty"])
def test_damaged_draft_weights_name_the_file(damage, tmp_path):
    from npuspec.spec_decode.heads import resolve_draft
    cfg, target = load_model("tiny")
    d = tmp_path / "head"
    shutil.copytree(resolve_draft("tiny-eagle3"), d)
    p = d / "model.safetensors"
    b = p.read_bytes()
    p.write_bytes(b[:len(b) // 2] if damage == "truncated" else b"")
    with pytest.raises(ValueError, match=rf"{p}.*(truncated or corrupt).*re-download it"):
        load_draft("eagle3", str(d), cfg, target)
