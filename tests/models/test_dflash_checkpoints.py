"""DFlash / DSpark drafter checkpoints on the embedded tiny target (4 layers, hidden 128, V 1024).

The public layouts are written by hand here (z-lab, speculators, DeepSpec / SpecForge config keys
and HF tensor names), loaded, and compared with a drafter built directly from the same tensors
under our names with its own copies of the target's embedding / head: equal forwards show the
names, the aux ids, the block settings and the sharing are wired right. save_draft -> load_draft
round trips must reproduce state dicts and forwards exactly. Every rejected setting names its key
and the fix."""
import dataclasses
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from npuspec.models import AttnMetadata, load_model
from npuspec.models.dflash import DFlashDraft, DSparkDraft
from npuspec.models.draft_loading import DraftConfig, load_draft, save_draft

V, H, NH, NKV, D, I = 1024, 128, 4, 2, 32, 256
EPS, THETA, L = 1e-5, 10000.0, 4
MASK, R, VD = V - 5, 16, 512
PAGE = 4  # paged KV block size


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def backbone(seed=0, layers=2, n_aux=2):
    """HF-named DFlash tensors (Qwen3 layers with q/k norms)."""
    g, t = _gen(seed), {}

    def lin(name, o, i):
        t[name + ".weight"] = torch.randn(o, i, generator=g) / i ** 0.5

    def norm(name, n=H):
        t[name + ".weight"] = 1 + 0.1 * torch.randn(n, generator=g)

    for i in range(layers):
        p = f"layers.{i}."
        norm(p + "input_layernorm")
        norm(p + "post_attention_layernorm")
        for proj, n in (("q", NH), ("k", NKV), ("v", NKV)):
            lin(f"{p}self_attn.{proj}_proj", n * D, H)
        lin(p + "self_attn.o_proj", H, NH * D)
        norm(p + "self_attn.q_norm", D)
        norm(p + "self_attn.k_norm", D)
        lin(p + "mlp.gate_proj", I, H)
        lin(p + "mlp.up_proj", I, H)
        lin(p + "mlp.down_proj", H, I)
    lin("fc", H, n_aux * H)
    norm("hidden_norm")
    norm("norm")
    return t


def dspark_heads(t, seed=1, vd=V, with_markov=True):
    g = _gen(seed)
    t["markov_head.markov_w1.weight"] = 0.1 * torch.randn(V, R, generator=g)
    t["markov_head.markov_w2.weight"] = 0.1 * torch.randn(vd, R, generator=g)
    t["confidence_head.proj.weight"] = torch.randn(1, H + (R if with_markov else 0), generator=g)
    t["confidence_head.proj.bias"] = torch.randn(1, generator=g)
    return t


def layer_cfg(layers=2, **over):
    return {"model_type": "qwen3", "hidden_size": H, "num_hidden_layers": layers,
            "num_attention_heads": NH, "num_key_value_heads": NKV, "head_dim": D,
            "intermediate_size": I, "rms_norm_eps": EPS, "rope_theta": THETA, "vocab_size": V,
            "max_position_embeddings": 2048, "hidden_act": "silu", "tie_word_embeddings": False,
            "attention_bias": False, "layer_types": ["full_attention"] * layers, **over}


def zlab_cfg(layers=2, ids=(0, 2), **over):
    return {**layer_cfg(layers), "architectures": ["DFlashDraftModel"],
            "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "block_size": 8,
            "num_target_layers": L,
            "dflash_config": {"mask_token_id": MASK, "target_layer_ids": list(ids)}, **over}


def dspark_cfg(**over):
    return {**layer_cfg(2), "architectures": ["Qwen3DSparkModel"], "block_size": 7,
            "num_target_layers": L, "target_layer_ids": [0, 2], "mask_token_id": MASK,
            "num_anchors": 512, "markov_rank": R, "markov_head_type": "vanilla",
            "enable_confidence_head": True, "confidence_head_with_markov": True, **over}


def write(path, config, tensors):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    save_file({k: v.contiguous() for k, v in tensors.items()},
              os.path.join(path, "model.safetensors"))
    return str(path)


def reference(method, tensors, target, aux=(1, 3), block_size=8, anchor=False, vd=V, d2t=None,
              mask_embedding=None, causal=False, with_markov=True):
    """The drafter built straight from `tensors` (our names), with its own copies of the
    target's embedding and head."""
    embed = target.embed.weight
    cfg = DraftConfig(method=method, hidden_size=H, num_heads=NH, num_kv_heads=NKV, head_dim=D,
                      intermediate_size=I, rms_norm_eps=EPS, rope_theta=THETA,
                      num_layers=len({k.split(".")[1] for k in tensors if k.startswith("layers.")}),
                      vocab_size=V, draft_vocab_size=vd, aux_layer_ids=aux, target_hidden_size=H,
                      qk_norm=True, model_type="qwen3", own_embed=True, own_lm_head=True,
                      block_size=block_size, mask_token_id=MASK, sample_from_anchor=anchor,
                      draft_causal=causal, own_mask_embedding=mask_embedding is not None,
                      markov_rank=R if method == "dspark" else 0,
                      confidence_with_markov=with_markov)
    module = (DSparkDraft if method == "dspark" else DFlashDraft)(cfg)
    sd = {"embed_tokens.weight": embed, "lm_head.weight": embed,
          "d2t": torch.zeros(V, dtype=torch.long), **tensors}
    if d2t is not None:
        sd["d2t"] = d2t
    if mask_embedding is not None:
        sd["mask_embedding"] = mask_embedding
    module.load_state_dict(sd, strict=True)
    module.init_buffers()
    module.bind_target(target)
    return module.eval().requires_grad_(False)


def run(draft, seed=3, B=2, T=6, K=3):
    """Context over T target positions, then one block of K drafts right after it -> the block's
    hidden states, its logits, and for DSpark the Markov-walked logits and confidences."""
    g = _gen(seed)
    feats = torch.randn(B, T, len(draft.aux_layer_ids) * H, generator=g).to(draft.fc.weight.dtype)
    S = draft.block_len(K)
    cache = draft.allocate_paged_cache(2 + B * 4, PAGE)
    table = (torch.randperm(B * 4, generator=g) + 1).view(B, 4).int()

    def meta(pos):
        slots = table.long().gather(1, pos // PAGE) * PAGE + pos % PAGE
        return AttnMetadata(slots, table, (pos[:, -1] + 1).int())

    pos = torch.arange(T).expand(B, T)
    draft.write_context(draft.context(feats), pos, meta(pos), cache)
    ids = torch.full((B, S), MASK)
    ids[:, 0] = torch.randint(0, V, (B,), generator=g)
    h = draft(ids, torch.arange(T, T + S).expand(B, S), meta(torch.arange(T, T + S).expand(B, S)),
              cache)
    out = [h, draft.logits(h)]
    if draft.method == "dspark":
        prev = torch.cat([ids[:, :1], torch.randint(0, V, (B, S - 1), generator=g)], 1)
        out += [draft.slot_logits(h, prev), draft.confidence(h, prev)]
    return out


def assert_same_forward(a, b, exact=True):
    for x, y in zip(run(a), run(b)):
        if exact:
            assert torch.equal(x, y)
        else:
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)


def assert_holds(draft, tensors):
    sd = draft.state_dict()
    for k, t in tensors.items():
        assert torch.equal(sd[k], t.to(sd[k].dtype)), k


# ---- z-lab DFlash ------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["plain", "model-prefix", "midlayer", "default-ids",
                                     "mask-pt", "mask-pt-dict", "reduced-vocab", "causal"])
def test_zlab_formats(tiny, tmp_path, variant, caplog):
    tcfg, target = tiny
    layers = 1 if variant in ("midlayer", "default-ids") else 2
    t = backbone(layers=layers, n_aux=1 if variant == "default-ids" else 2)
    cfg = zlab_cfg(layers)
    ref_kw = {}
    files = dict(t)
    if variant == "model-prefix":
        files = {"model." + k: v for k, v in t.items()}
    elif variant == "midlayer":
        files = {k.replace("layers.0.", "midlayer."): v for k, v in t.items()}
        cfg["dflash_config"]["target_layer_ids"] = [1, 3]
        ref_kw["aux"] = (2, 4)
    elif variant == "default-ids":  # z-lab's build_target_layer_ids(4, 1) = [L // 2]
        del cfg["dflash_config"]["target_layer_ids"]
        ref_kw["aux"] = (3,)
    elif variant.startswith("mask-pt"):
        emb = torch.randn(H, generator=_gen(8))
        obj = {"embedding": emb[None], "mask_token_id": MASK} if variant == "mask-pt-dict" else emb
        os.makedirs(tmp_path / variant)
        torch.save(obj, tmp_path / variant / "mask_embedding.pt")
        ref_kw["mask_embedding"] = emb
    elif variant == "reduced-vocab":
        used = torch.randperm(V, generator=_gen(4))[:VD].sort().values
        files["lm_head.weight"] = torch.randn(VD, H, generator=_gen(5)) / H ** 0.5
        files["d2t"] = used - torch.arange(VD)
        files["t2d"] = torch.zeros(V, dtype=torch.bool).index_fill_(0, used, True)
        cfg.update(draft_vocab_size=VD, target_hidden_size=H)
        ref_kw.update(vd=VD, d2t=files["d2t"])
        t = {**t, "lm_head.weight": files["lm_head.weight"]}
    elif variant == "causal":
        cfg["dflash_config"]["causal"] = True
        ref_kw["causal"] = True
    path = write(tmp_path / variant, cfg, files)
    with caplog.at_level("WARNING"):
        draft = load_draft("dflash", path, tcfg, target)
    assert ("target_layer_ids" in caplog.text) == (variant == "default-ids")
    c = draft.config
    assert c.format == "zlab" and c.block_size == 8 and c.mask_token_id == MASK
    assert not c.sample_from_anchor and c.draft_causal == (variant == "causal")
    assert draft.aux_layer_ids == ref_kw.get("aux", (1, 3)) and draft.final_feature is False
    assert draft.embed_tokens is None and not c.own_embed  # the target's embedding, shared
    assert (draft.lm_head is None) == (variant != "reduced-vocab")
    assert (draft.mask_embedding is not None) == variant.startswith("mask-pt")
    assert_holds(draft, t)
    ref = reference("dflash", t, target, **ref_kw)
    if variant == "reduced-vocab":  # the draft's own head: only the embedding is shared
        ref.lm_head.weight.copy_(files["lm_head.weight"])
    assert_same_forward(draft, ref, exact=False)
    logits = run(draft)[1]
    assert logits.shape == (2, 3 + 1, V) and logits.dtype == torch.float32
    if variant == "reduced-vocab":
        assert torch.isinf(logits[..., ~files["t2d"]]).all()
    again = load_draft("dflash", save_draft(draft, str(tmp_path / "saved")), tcfg, target)
    assert again.state_dict().keys() == draft.state_dict().keys()
    assert all(torch.equal(again.state_dict()[k], v) for k, v in draft.state_dict().items())
    assert_same_forward(draft, again)


def test_speculators_dflash(tiny, tmp_path):
    """speculators: transformer_layer_config, vLLM aux ids taken as is, a reduced vocab."""
    tcfg, target = tiny
    t = backbone()
    used = torch.randperm(V, generator=_gen(4))[:VD].sort().values
    t["lm_head.weight"] = torch.randn(VD, H, generator=_gen(5)) / H ** 0.5
    files = {**t, "d2t": used - torch.arange(VD), "verifier_norm.weight": torch.ones(H)}
    cfg = {"architectures": ["DFlashSpeculator"], "speculators_model_type": "dflash",
           "transformer_layer_config": layer_cfg(), "draft_vocab_size": VD, "block_size": 4,
           "target_hidden_size": H, "aux_hidden_state_layer_ids": [2, 4], "mask_token_id": MASK,
           "sample_from_anchor": False, "sliding_window_non_causal": False,
           "speculators_config": {"algorithm": "dflash", "proposal_methods": [
               {"proposal_type": "greedy", "speculative_tokens": 3}], "verifier": {}}}
    draft = load_draft("dflash", write(tmp_path / "spec", cfg, files), tcfg, target)
    assert draft.config.format == "speculators" and draft.aux_layer_ids == (2, 4)
    assert draft.config.block_size == 4 and draft.drafts_per_block == 3
    ref = reference("dflash", t, target, aux=(2, 4), block_size=4, vd=VD, d2t=files["d2t"])
    ref.lm_head.weight.copy_(t["lm_head.weight"])
    assert_same_forward(draft, ref, exact=False)
    for fmt in ("speculators", "zlab"):
        again = load_draft("dflash", save_draft(draft, str(tmp_path / fmt), fmt), tcfg, target)
        assert again.config.format == fmt and again.aux_layer_ids == (2, 4)
        assert_same_forward(draft, again)


# ---- DeepSpec DSpark ---------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["deepspec-copies", "bare", "own-head", "reduced-vocab",
                                     "specforge", "conf-without-markov"])
def test_dspark_formats(tiny, tmp_path, variant):
    tcfg, target = tiny
    vd = VD if variant == "reduced-vocab" else V
    t = dspark_heads(backbone(), vd=vd, with_markov=variant != "conf-without-markov")
    files, cfg, ref_kw = dict(t), dspark_cfg(), {"block_size": 7, "anchor": True}
    own_head = variant in ("own-head", "reduced-vocab")
    if variant == "deepspec-copies":  # DeepSpec ships frozen copies: equal, so shared
        files["embed_tokens.weight"] = target.embed.weight.clone()
        files["lm_head.weight"] = target.embed.weight.clone()  # the tied target's head
        files = {"model." + k if k != "lm_head.weight" else k: v for k, v in files.items()}
    elif variant == "own-head":
        t["lm_head.weight"] = files["lm_head.weight"] = torch.randn(V, H, generator=_gen(6)) / 12
    elif variant == "reduced-vocab":
        used = torch.randperm(V, generator=_gen(4))[:VD].sort().values
        t["lm_head.weight"] = files["lm_head.weight"] = torch.randn(VD, H, generator=_gen(6)) / 12
        files["d2t"] = used - torch.arange(VD)
        cfg["draft_vocab_size"] = VD
        ref_kw.update(vd=VD, d2t=files["d2t"])
    elif variant == "specforge":  # DSparkDraftModel with its DSpark keys under dflash_config
        cfg = {**layer_cfg(), "architectures": ["DSparkDraftModel"], "block_size": 7,
               "num_target_layers": L, "dflash_config": {
                   "mask_token_id": MASK, "target_layer_ids": [0, 2], "projector_type": "dspark",
                   "markov_rank": R, "markov_head_type": "vanilla", "enable_confidence_head": True,
                   "confidence_head_with_markov": True}}
    elif variant == "conf-without-markov":  # no key: the head's width [1, H] says so
        del cfg["confidence_head_with_markov"]
        ref_kw["with_markov"] = False
    draft = load_draft("dspark", write(tmp_path / variant, cfg, files), tcfg, target)
    c = draft.config
    assert c.format == "deepspec" and c.sample_from_anchor and c.block_size == 7
    assert c.markov_rank == R and c.confidence_with_markov == (variant != "conf-without-markov")
    assert draft.drafts_per_block == 7 and draft.aux_layer_ids == (1, 3)
    assert draft.embed_tokens is None and (draft.lm_head is not None) == own_head
    assert_holds(draft, t)
    ref = reference("dspark", t, target, **ref_kw)
    if own_head:
        ref.lm_head.weight.copy_(t["lm_head.weight"])
    assert_same_forward(draft, ref, exact=False)
    again = load_draft("dspark", save_draft(draft, str(tmp_path / "saved")), tcfg, target)
    assert all(torch.equal(again.state_dict()[k], v) for k, v in draft.state_dict().items())
    assert again.state_dict().keys() == draft.state_dict().keys()
    assert_same_forward(draft, again)


def test_confidence_head_stays_fp32(tiny, tmp_path):
    tcfg, target = tiny
    path = write(tmp_path / "ds", dspark_cfg(), dspark_heads(backbone()))
    draft = load_draft("dspark", path, tcfg, target, dtype=torch.bfloat16)
    for name, p in draft.named_parameters():
        fp32 = name.startswith("confidence_head.")
        assert p.dtype == (torch.float32 if fp32 else torch.bfloat16), name
    conf = run(draft)[-1]
    assert conf.dtype == torch.float32 and ((conf > 0) & (conf < 1)).all()
    out = save_draft(draft, str(tmp_path / "bf16"), dtype=torch.bfloat16)
    saved = load_file(os.path.join(out, "model.safetensors"))
    assert saved["confidence_head.proj.weight"].dtype == torch.float32
    assert saved["fc.weight"].dtype == torch.bfloat16


# ---- round trips of fresh modules --------------------------------------------------------------
@pytest.mark.parametrize("method, fmt, over", [
    ("dflash", "zlab", {}),
    ("dflash", "zlab", {"draft_causal": True, "own_embed": True, "own_lm_head": True,
                        "draft_vocab_size": VD, "sample_from_anchor": True}),
    ("dflash", "speculators", {"own_mask_embedding": False}),
    ("dspark", "deepspec", {}),
    ("dspark", "deepspec", {"markov_rank": 0, "own_mask_embedding": False}),
])
def test_roundtrip_fresh_module(tiny, tmp_path, method, fmt, over):
    tcfg, target = tiny
    cfg = DraftConfig.from_target(method, tcfg, intermediate_size=I, num_layers=2,
                                  aux_layer_ids=(0, 4), **over)
    torch.manual_seed(0)
    draft = (DSparkDraft if method == "dspark" else DFlashDraft)(cfg)
    with torch.no_grad():
        for p in draft.parameters():
            p.normal_(0, 0.05)
        if cfg.own_lm_head and cfg.draft_vocab_size < V:
            draft.d2t.copy_(torch.randperm(V)[:VD].sort().values - torch.arange(VD))
    draft.init_buffers()
    draft.bind_target(target)
    draft.eval().requires_grad_(False)
    out = save_draft(draft, str(tmp_path / "out"), fmt)
    with open(os.path.join(out, "config.json")) as f:
        saved = json.load(f)
    if fmt == "speculators":  # vLLM ids as is
        assert saved["aux_hidden_state_layer_ids"] == [0, 4] and "num_target_layers" not in saved
    else:  # HF ids: aux - 1 (-1 = the embedding output)
        hf = saved["dflash_config" if fmt == "zlab" else "target_layer_ids"]
        assert (hf["target_layer_ids"] if fmt == "zlab" else hf) == [-1, 3]
        assert saved["num_target_layers"] == L and saved["block_size"] == cfg.block_size
    again = load_draft(method, out, tcfg, target)
    # a rank-0 DSpark's confidence head reads h alone whatever the flag said
    with_markov = cfg.confidence_with_markov and (method == "dflash" or cfg.markov_rank > 0)
    want = dataclasses.replace(cfg, format=fmt, confidence_with_markov=with_markov)
    assert again.config == want
    a, b = draft.state_dict(), again.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert_same_forward(draft, again)
    assert oct(os.stat(os.path.join(out, "model.safetensors")).st_mode & 0o777) == "0o644"


# ---- rejected checkpoints ----------------------------------------------------------------------
def _dc(**kw):  # a dflash_config with changes (None deletes)
    d = {"mask_token_id": MASK, "target_layer_ids": [0, 2], **kw}
    return {k: v for k, v in d.items() if v is not None}


@pytest.mark.parametrize("method, over, drop, want", [
    ("dflash", {"num_target_layers": 36}, (), ["num_target_layers=36", "num_hidden_layers=4"]),
    ("dflash", {"dflash_config": [MASK]}, (), ["dflash_config=[1019]", "write it as"]),
    ("dflash", {"vocab_size": 2048}, (), ["vocab_size=2048", "vocab_size=1024"]),
    ("dflash", {"rope_theta": None}, (), ["rope_theta=1000000.0", "rope_theta=10000.0"]),
    ("dflash", {"target_hidden_size": 4096}, (), ["target_hidden_size=4096", "hidden_size=128"]),
    ("dflash", {"is_neox_style": False}, (), ["is_neox_style=False", "neox-style"]),
    ("dflash", {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 64}, (),
     ["layer_types=", "all 'full_attention'"]),
    ("dflash", {"dflash_config": _dc(use_swa=True)}, (), ["dflash_config.use_swa=True",
                                                           "set dflash_config.use_swa to false"]),
    ("dflash", {"dflash_config": _dc(use_aux_hidden_state=False)}, (),
     ["dflash_config.use_aux_hidden_state=False", "to true"]),
    ("dflash", {"dflash_config": _dc(input_embedding_scale=2.0)}, (),
     ["dflash_config.input_embedding_scale=2.0", "remove dflash_config.input_embedding_scale"]),
    ("dflash", {"dflash_config": _dc(target_layer_ids=[0, 9])}, (),
     ["target_layer_ids=[0, 9]", "-1..3", "fix dflash_config.target_layer_ids"]),
    ("dflash", {"dflash_config": _dc(target_layer_ids=[0, 1, 2])}, (),
     ["'fc.weight'", "384 features", "does not match"]),
    ("dflash", {"dflash_config": _dc(mask_token_id=None)}, (),
     ["mask_token_id=None", "set dflash_config.mask_token_id"]),
    ("dflash", {"dflash_config": _dc(mask_token_id=V)}, (), ["mask_token_id=1024", "0..1023"]),
    ("dflash", {"block_size": 1}, (), ["block_size=1", "fix block_size"]),
    ("dflash", {"draft_vocab_size": VD}, (), ["draft_vocab_size=512 < vocab_size=1024",
                                              "lm_head.weight [512, 128]"]),
    ("dflash", {"architectures": ["Qwen3DSparkModel"]}, (), ["method 'dspark'"]),
    ("dflash", {"architectures": ["DFlash2DraftModel"]}, (),
     ["architectures=", "DFlashDraftModel"]),
    ("dflash", {}, ("hidden_norm.weight",), ["supported: z-lab DFlash"]),
    ("dflash", {}, ("layers.1.self_attn.q_norm.weight",), ["missing ['layers.1.self_attn.q_norm"]),
    ("dspark", {"architectures": ["DFlashDraftModel"]}, (), ["method 'dflash'"]),
    ("dspark", {"markov_head_type": "rnn"}, (), ["markov_head_type='rnn'", "'vanilla'"]),
    ("dspark", {"enable_confidence_head": False}, (),
     ["enable_confidence_head=false", "confidence_head_alpha > 0"]),
    ("dspark", {}, ("confidence_head.proj.weight", "confidence_head.proj.bias"),
     ["no confidence_head.proj.weight", "enable_confidence_head true"]),
    ("dspark", {"block_size": None}, (), ["block_size is missing", "7 for DeepSpec"]),
    ("dspark", {"markov_rank": 0}, (), ["confidence_head_with_markov=True", "to false"]),
    ("dspark", {"num_target_layers": 36}, (), ["num_target_layers=36", "num_hidden_layers=4"]),
])
def test_rejected_settings_name_key_and_fix(tiny, tmp_path, method, over, drop, want):
    base = zlab_cfg() if method == "dflash" else dspark_cfg()
    cfg = {k: v for k, v in {**base, **over}.items() if v is not None}
    t = backbone() if method == "dflash" else dspark_heads(backbone())
    path = write(tmp_path / "bad", cfg, {k: v for k, v in t.items() if k not in drop})
    with pytest.raises(ValueError) as e:
        load_draft(method, path, *tiny)
    for w in want:
        assert w in str(e.value), (w, str(e.value))
    assert str(tmp_path / "bad") in str(e.value)


def test_rejected_vocab_maps_and_mask_files(tiny, tmp_path):
    t = backbone()
    t["lm_head.weight"] = torch.zeros(VD, H)
    bad = write(tmp_path / "d2t", zlab_cfg(draft_vocab_size=VD),
                {**t, "d2t": torch.full((VD,), V, dtype=torch.long)})
    with pytest.raises(ValueError, match=r"d2t maps draft ids to target ids outside \[0, 1024\)"):
        load_draft("dflash", bad, *tiny)
    path = write(tmp_path / "m", zlab_cfg(), backbone())
    side = os.path.join(path, "mask_embedding.pt")
    torch.save({"embedding": torch.zeros(H), "mask_token_id": 7}, side)
    with pytest.raises(ValueError, match="mask_token_id=7 but config.json has mask_token_id=1019"):
        load_draft("dflash", path, *tiny)
    torch.save(torch.zeros(H + 1), side)
    with pytest.raises(ValueError, match=r"mask embedding has shape \[129\], expected \[128\]"):
        load_draft("dflash", path, *tiny)
    os.chmod(side, 0o666)  # another user could have written it
    with pytest.raises(PermissionError, match="chmod go-w"):
        load_draft("dflash", path, *tiny)
    os.remove(side)
    spec = write(tmp_path / "s", {"speculators_model_type": "dflash",
                                  "transformer_layer_config": layer_cfg(), "mask_token_id": MASK},
                 backbone())
    with pytest.raises(ValueError, match="aux_hidden_state_layer_ids is missing"):
        load_draft("dflash", spec, *tiny)


def test_save_rejects_what_speculators_cannot_hold(tiny, tmp_path):
    draft = DFlashDraft(DraftConfig.from_target("dflash", tiny[0], intermediate_size=I))
    with pytest.raises(ValueError, match="fmt='zlab'"):
        save_draft(draft, str(tmp_path / "x"), "speculators")  # it has a mask embedding
    with pytest.raises(ValueError, match="choose one of deepspec"):
        save_draft(DSparkDraft(DraftConfig.from_target("dspark", tiny[0])), str(tmp_path / "y"),
                   "zlab")
