"""Drafter checkpoints (EAGLE, EAGLE-3, Medusa, MTP) on the embedded tiny target.

Every public format is written by hand here (its config keys and tensor names pin the public
layout), loaded, checked against an independent dense computation from the raw tensors (SDPA
is_causal, hand-written RMSNorm/RoPE) on a prompt whose K/V all sits in the paged pool, and
round-tripped through save_draft. The load errors and the dynamic-batch compile:
test_draft_checkpoint_errors.py; the shared writers: draft_ckpt_helpers.py."""
import json
import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from draft_ckpt_helpers import (ATOL, BS, D, EPS, H, I, NH, NKV, THETA, V, VD, Weights,
                                eagle3_weights, gen, llama_cfg, vocab_map, write)
from npuspec.models import AttnMetadata, DecoderLM, ModelConfig, load_model, save_model
from npuspec.models.draft_loading import load_draft, save_draft
from npuspec.models.loading import TINY_MODEL_DIR


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


# ---- the independent dense oracle ----------------------------------------------------------------
def rms(x, w, eps=EPS):
    x = x.float()
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def lin(x, t, name):
    y = x @ t[name + ".weight"].T
    return y + t[name + ".bias"] if name + ".bias" in t else y


def rope(x, pos):  # x [B, T, heads, D], non-interleaved halves (HF Llama)
    inv = THETA ** (-torch.arange(0, D, 2).float() / D)
    ang = pos[..., None].float() * inv
    c, s = ang.cos()[:, :, None], ang.sin()[:, :, None]
    x1, x2 = x[..., :D // 2], x[..., D // 2:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def dense_layer(t, p, x, residual, pos, qk_norm=False):
    B, T, _ = x.shape
    q = lin(x, t, p + "self_attn.q_proj").view(B, T, NH, D)
    k = lin(x, t, p + "self_attn.k_proj").view(B, T, NKV, D)
    v = lin(x, t, p + "self_attn.v_proj").view(B, T, NKV, D)
    if qk_norm:
        q, k = rms(q, t[p + "self_attn.q_norm.weight"]), rms(k, t[p + "self_attn.k_norm.weight"])
    q, k = rope(q, pos), rope(k, pos)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       is_causal=True, enable_gqa=True)
    h = residual + lin(o.transpose(1, 2).reshape(B, T, NH * D), t, p + "self_attn.o_proj")
    m = rms(h, t[p + "post_attention_layernorm.weight"])
    return h + lin(F.silu(lin(m, t, p + "mlp.gate_proj")) * lin(m, t, p + "mlp.up_proj"),
                   t, p + "mlp.down_proj")


def scatter_vocab(ld, target_ids):
    out = torch.full((*ld.shape[:-1], V), float("-inf"))
    out[..., target_ids] = ld
    return out


# ---- the paged run: a 12-token prompt from position 0 in two chunks, random block tables ----------
B, T, SPLIT = 2, 12, 7


def inputs(feat_dim, seed=3):
    g = gen(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    return ids, torch.randn(B, T, feat_dim, generator=g), torch.arange(T).expand(B, T)


def run_paged(draft, ids, feats):
    num_blocks = 12
    cache = draft.allocate_paged_cache(num_blocks, BS)
    per_row = -(-T // BS)
    table = (torch.randperm(num_blocks - 1, generator=gen(5))[:B * per_row] + 1).view(B, per_row).int()
    hidden = draft.first_hidden(feats)
    outs = []
    for s, e in ((0, SPLIT), (SPLIT, T)):
        pos = torch.arange(s, e).expand(B, -1)
        slots = table.long().gather(1, pos // BS) * BS + pos % BS
        meta = AttnMetadata(slots, table, torch.full((B,), e, dtype=torch.int32))
        outs.append(draft(ids[:, s:e], hidden[:, s:e], pos, meta, cache))
    lh, nh = (torch.cat(x, dim=1) for x in zip(*outs))
    return lh, nh, draft.logits(lh)


def check_roundtrip(draft, tmp_path, fmt, method, tiny, ids, feats, **kw):
    out = save_draft(draft, str(tmp_path / f"saved-{fmt}"), fmt)
    again = load_draft(method, out, tiny[0], tiny[1], **kw)
    assert again.config.format == fmt
    for a, b in zip(run_paged(draft, ids, feats), run_paged(again, ids, feats)):
        assert torch.equal(a, b)
    return again


# ---- EAGLE-1 ---------------------------------------------------------------------------------------
def eagle_oracle(t, ids, hidden, pos, embed, head):
    e = embed[ids]
    if "embedding_layernorm.weight" in t:  # HASS add_para_norm
        e, hidden = rms(e, t["embedding_layernorm.weight"]), rms(hidden, t["hidden_states_layernorm.weight"])
    h0 = lin(torch.cat([e, hidden], -1), t, "fc")
    h = dense_layer(t, "layers.0.", h0, h0, pos)  # layer 0: no input_layernorm
    return h, h @ head.T


@pytest.mark.parametrize("variant", ["plain", "prefix+bias", "bin+own_embed", "hass", "speculators"])
def test_eagle_formats(tiny, tmp_path, variant):
    tcfg, target = tiny
    w = Weights(1).layer("layers.0.", input_norm=False)
    w.linear("fc", H, 2 * H, bias=variant != "plain")
    cfg, weights = llama_cfg(bias=variant != "plain"), "model.safetensors"
    if variant == "hass":
        w.norm("embedding_layernorm")
        w.norm("hidden_states_layernorm")
        cfg["add_para_norm"] = True
    t = dict(w)
    embed = target.embed.weight
    if variant == "prefix+bias":
        t = {"model." + k: v for k, v in t.items()}
        t["model.embed_tokens.weight"] = target.embed.weight.clone()  # equal: shared, dropped
    elif variant == "bin+own_embed":
        weights = "pytorch_model.bin"
        embed = t["embed_tokens.weight"] = 0.5 * torch.randn(V, H, generator=gen(9))
    elif variant == "speculators":
        t = {k.replace("layers.0.", "transformer.").replace("fc.", "fusion_fc."): v
             for k, v in t.items()}
        cfg = {"speculators_model_type": "eagle", "architectures": ["EagleSpeculator"],
               "layernorms": False, "fusion_bias": True, "transformer_layer_config": llama_cfg()}
    path = write(tmp_path / variant, cfg, t, weights)
    draft = load_draft("eagle", path, tcfg, target)
    assert draft.config.own_embed == (variant == "bin+own_embed")
    assert draft.target_features == ((), True) and draft.aux_layer_ids == () and draft.final_feature
    assert not any(k.startswith("_target") for k in draft.state_dict())
    assert (draft.fc.bias is not None) == (variant != "plain")

    ids, feats, pos = inputs(H)
    lh, nh, logits = run_paged(draft, ids, feats)
    assert lh.shape == nh.shape == (B, T, H) and logits.shape == (B, T, V) and logits.isfinite().all()
    want_h, want_logits = eagle_oracle(dict(w), ids, feats, pos, embed, target.embed.weight)
    torch.testing.assert_close(nh, want_h, atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(logits, want_logits, atol=ATOL, rtol=1e-4)
    assert torch.equal(lh, nh)
    check_roundtrip(draft, tmp_path, "speculators" if variant == "speculators" else "eagle",
                    "eagle", tiny, ids, feats)


# ---- EAGLE-3 ---------------------------------------------------------------------------------------
def eagle3_oracle(t, ids, feats, pos, embed, used, nbr, layers=1, qk_norm=False):
    g = lin(feats, t, "fc")
    hn = rms(g, t["layers.0.hidden_norm.weight"])
    x = torch.cat([rms(embed[ids], t["layers.0.input_layernorm.weight"]), hn], -1)
    h = dense_layer(t, "layers.0.", x, hn if nbr else g, pos, qk_norm)
    for i in range(1, layers):
        h = dense_layer(t, f"layers.{i}.", rms(h, t[f"layers.{i}.input_layernorm.weight"]), h, pos,
                        qk_norm)
    return h, scatter_vocab(rms(h, t["norm.weight"]) @ t["lm_head.weight"].T, used)


@pytest.mark.parametrize("fmt", ["yuhuili", "specforge", "speculators"])
def test_eagle3_formats(tiny, tmp_path, fmt, caplog):
    tcfg, target = tiny
    used, d2t, t2d = vocab_map()
    layers, qk_norm, aux = (2, False, [1, 2, 4]) if fmt == "specforge" else (1, fmt == "speculators", None)
    w = eagle3_weights(layers=layers, qk_norm=qk_norm)
    t = {**w, "d2t": d2t, "t2d": t2d}
    nbr = fmt == "speculators"  # the speculators default
    if fmt == "yuhuili":
        t = {k.replace("layers.0.", "midlayer."): v for k, v in t.items()}
        cfg = llama_cfg(draft_vocab_size=VD)
    elif fmt == "specforge":
        t["embed_tokens.weight"] = target.embed.weight.clone()  # frozen copy: shared, dropped
        cfg = llama_cfg(architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=2,
                        draft_vocab_size=VD, target_hidden_size=H, norm_before_residual=False,
                        eagle_aux_hidden_state_layer_ids=aux,
                        eagle_config={"eagle_aux_hidden_state_layer_ids": aux,
                                      "use_aux_hidden_state": True})
    else:
        t["verifier_norm.weight"] = torch.ones(H)  # training-only, skipped
        cfg = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
               "transformer_layer_config": llama_cfg(model_type="qwen3"),
               "draft_vocab_size": VD, "target_hidden_size": H,
               "eagle_aux_hidden_state_layer_ids": [2, 2, 1],
               "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                      "proposal_methods": [{"proposal_type": "greedy",
                                                            "speculative_tokens": 3}],
                                      "verifier": {"name_or_path": None, "architectures": []}}}
    path = write(tmp_path / fmt, cfg, t)
    with caplog.at_level("WARNING"):
        draft = load_draft("eagle3", path, tcfg, target)
    assert draft.config.format == fmt and draft.config.norm_before_residual == nbr
    want_aux = tuple(aux) if aux else (2, 2, 1)  # yuhuili: vLLM's default (2, L//2, L-3), warned
    assert draft.aux_layer_ids == want_aux and draft.final_feature is False
    assert ("eagle_aux_hidden_state_layer_ids" in caplog.text) == (fmt == "yuhuili")
    assert not draft.config.own_embed

    ids, _, pos = inputs(H)
    _, feats = target.forward_causal(ids, aux_ids=draft.aux_layer_ids)  # [B, T, 3H]
    lh, nh, logits = run_paged(draft, ids, feats)
    assert lh.shape == nh.shape == (B, T, H) and logits.shape == (B, T, V)
    want_h, want_logits = eagle3_oracle(dict(w), ids, feats, pos, target.embed.weight, used, nbr,
                                        layers, qk_norm)
    torch.testing.assert_close(nh, want_h, atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(logits, want_logits, atol=ATOL, rtol=1e-4)
    # d2t scatter: -inf exactly outside the draft vocab, argmax lands on a target id in it
    assert torch.isinf(logits[..., ~t2d]).all() and logits[..., t2d].isfinite().all()
    assert t2d[logits.argmax(-1)].all()
    for out_fmt in {fmt, "specforge"} if fmt != "speculators" else {fmt}:
        check_roundtrip(draft, tmp_path, out_fmt, "eagle3", tiny, ids, feats)


def test_eagle3_identity_vocab_and_own_embed(tiny, tmp_path):
    """No d2t and Vd == V: no scatter; an embed_tokens that differs from the target's is kept."""
    tcfg, target = tiny
    w = Weights(6).layer("layers.0.", in_dim=2 * H, hidden_norm=True)
    w.linear("fc", H, 3 * H)
    w.norm("norm")
    w.linear("lm_head", V, H)
    embed = 0.5 * torch.randn(V, H, generator=gen(7))
    path = write(tmp_path / "e3", llama_cfg(architectures=["LlamaForCausalLMEagle3"],
                                            eagle_aux_hidden_state_layer_ids=[1, 2, 3]),
                 {**w, "embed_tokens.weight": embed})
    draft = load_draft("eagle3", path, tcfg, target)
    assert draft.vocab_index is None and draft.config.own_embed
    ids, feats, pos = inputs(3 * H)
    _, nh, logits = run_paged(draft, ids, feats)
    want_h, _ = eagle3_oracle(dict(w), ids, feats, pos, embed, torch.arange(V), False)
    torch.testing.assert_close(nh, want_h, atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(logits, rms(nh, w["norm.weight"]) @ w["lm_head.weight"].T,
                               atol=ATOL, rtol=1e-4)


# ---- Medusa ----------------------------------------------------------------------------------------
def medusa_oracle(blocks, heads, h, token_map=None):
    out = []
    for k, (ws, lm) in enumerate(zip(blocks, heads)):
        x = h
        for wt, b in ws:
            x = x + F.silu(x @ wt.T + (0 if b is None else b))
        lk = x @ lm.T
        out.append(lk if token_map is None else scatter_vocab(lk, token_map))
    return torch.stack(out, 1)


@pytest.mark.parametrize("variant", ["fasterdecoding-pt", "fasterdecoding-st", "vllm-truncated",
                                     "vllm-original", "vllm-target-head"])
def test_medusa_formats(tiny, tmp_path, variant):
    tcfg, target = tiny
    g = gen(11)
    n_heads, n_layers = 3, 2
    bias = variant.startswith("fasterdecoding")
    Vt = VD if variant == "vllm-truncated" else V
    blocks = [[(torch.randn(H, H, generator=g) / H ** 0.5,
                0.1 * torch.randn(H, generator=g) if bias else None)
               for _ in range(n_layers)] for _ in range(n_heads)]
    heads = [torch.randn(Vt, H, generator=g) / H ** 0.5 for _ in range(n_heads)]
    token_map = torch.randperm(V, generator=g)[:VD] if Vt < V else None
    if bias:  # FasterDecoding: {h}.{l}.linear.*, {h}.{num_layers}.weight
        t = {f"{k}.{l}.linear.{n}": x for k in range(n_heads) for l in range(n_layers)
             for n, x in zip(("weight", "bias"), blocks[k][l])}
        t.update({f"{k}.{n_layers}.weight": heads[k] for k in range(n_heads)})
        cfg = {"medusa_num_heads": n_heads, "medusa_num_layers": n_layers,
               "base_model_name_or_path": "tiny"}
        weights = "medusa_lm_head.pt" if variant.endswith("pt") else "medusa_lm_head.safetensors"
    else:  # vLLM MedusaConfig, with the medusa_heads. prefix
        t = {f"medusa_heads.blocks.{k}.layers.{l}.weight": blocks[k][l][0]
             for k in range(n_heads) for l in range(n_layers)}
        cfg = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": H,
               "vocab_size": V, "num_heads": n_heads, "num_hidden_layers": n_layers,
               "truncated_vocab_size": Vt}
        if variant == "vllm-truncated":
            t.update({f"medusa_heads.lm_heads.{k}.weight": heads[k] for k in range(n_heads)})
            t["medusa_heads.token_map"] = token_map
        elif variant == "vllm-original":
            cfg["original_lm_head"] = True
            t["medusa_heads.lm_head.weight"] = heads[0]
            heads = [heads[0]] * n_heads
        else:
            cfg["original_lm_head"] = True
            heads = [target.embed.weight] * n_heads
        weights = "model.safetensors"
    path = write(tmp_path / variant, cfg, t, weights)
    draft = load_draft("medusa", path, tcfg, target)
    assert draft.num_heads == n_heads and draft.aux_layer_ids == () and draft.final_feature
    h = torch.randn(5, H, generator=g)
    logits = draft(h)
    assert logits.shape == (5, n_heads, V) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, medusa_oracle(blocks, heads, h, token_map),
                               atol=ATOL, rtol=1e-4)
    draft.check_k(n_heads)
    with pytest.raises(ValueError, match=f"num_speculative_tokens={n_heads}") as e:
        draft.check_k(n_heads + 1)
    assert f"num_speculative_tokens={n_heads + 1}" in str(e.value) and f"{n_heads} heads" in str(e.value)
    fmts = ["vllm"] + (["fasterdecoding"] if bias else [])
    for fmt in fmts:
        out = save_draft(draft, str(tmp_path / f"saved-{fmt}"), fmt)
        assert torch.equal(load_draft("medusa", out, tcfg, target)(h), logits)


# ---- MTP -------------------------------------------------------------------------------------------
def mtp_weights(p, inter, qk_norm=False, own_head=False, embed=None, seed=12):
    w = Weights(seed).layer(p, qk_norm=qk_norm, inter=inter)  # the target's MLP width
    w.norm(p + "enorm")
    w.norm(p + "hnorm")
    w.linear(p + "eh_proj", H, 2 * H)
    w.norm(p + "shared_head.norm")
    if own_head:
        w.linear(p + "shared_head.head", V, H)
    if embed is not None:
        w[p + "embed_tokens.weight"] = embed
    return w


def mtp_oracle(t, p, ids, hidden, pos, embed, head, qk_norm=False):
    e = embed[ids] * (pos != 0)[..., None]
    h0 = lin(torch.cat([rms(e, t[p + "enorm.weight"]), rms(hidden, t[p + "hnorm.weight"])], -1),
             t, p + "eh_proj")
    h = dense_layer(t, p, rms(h0, t[p + "input_layernorm.weight"]), h0, pos, qk_norm)
    out = rms(h, t[p + "shared_head.norm.weight"])
    return out, out @ head.T


def qwen3_target(tmp_path):
    cfg = ModelConfig.from_hf_dict({"model_type": "qwen3", "vocab_size": V, "hidden_size": H,
                                    "num_hidden_layers": 2, "num_attention_heads": NH,
                                    "num_key_value_heads": NKV, "head_dim": D,
                                    "intermediate_size": I, "rms_norm_eps": EPS,
                                    "rope_theta": THETA, "tie_word_embeddings": False})
    torch.manual_seed(0)
    model = DecoderLM(cfg)
    return save_model(model, str(tmp_path / "qwen3-target"))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_mtp_in_target_checkpoint(tiny, tmp_path, family):
    if family == "llama":  # the tiny target (tied) with a next-n layer sharing embed and head
        tdir = str(tmp_path / "target")
        shutil.copytree(TINY_MODEL_DIR, tdir)
        L, qk_norm, own_head = 4, False, False
        tcfg0, target0 = tiny
        w = mtp_weights(f"model.layers.{L}.", 384, embed=target0.embed.weight.clone())
        w[f"model.layers.{L}.shared_head.head.weight"] = target0.embed.weight.clone()
    else:  # Qwen3 (q/k norms, untied) with its own shared_head.head
        tdir = qwen3_target(tmp_path)
        L, qk_norm, own_head = 2, True, True
        w = mtp_weights(f"model.layers.{L}.", I, qk_norm=True, own_head=True)
    save_file(dict(w), os.path.join(tdir, "mtp.safetensors"))
    with open(os.path.join(tdir, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(tdir, "config.json"), "w") as f:
        json.dump({**cfg, "num_nextn_predict_layers": 1}, f)
    tcfg, target = load_model(tdir)  # the target still loads, the next-n tensors left aside
    if family == "llama":
        ids = torch.arange(10)[None]
        assert torch.equal(target.forward_causal(ids), tiny[1].forward_causal(ids))
    draft = load_draft("mtp", tdir, tcfg, target)
    assert draft.config.own_lm_head == own_head and not draft.config.own_embed
    assert draft.target_features == ((), True)

    p = f"model.layers.{L}."
    ids, feats, pos = inputs(H)
    lh, nh, logits = run_paged(draft, ids, feats)
    assert lh.shape == (B, T, H) and logits.shape == (B, T, V) and logits.isfinite().all()
    head = w[p + "shared_head.head.weight"] if own_head else _head_of(target)
    want_h, want_logits = mtp_oracle(dict(w), p, ids, feats, pos, target.embed.weight, head, qk_norm)
    torch.testing.assert_close(nh, want_h, atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(logits, want_logits, atol=ATOL, rtol=1e-4)
    assert torch.equal(lh, nh)

    # save_draft writes the layers into a fresh copy of the target directory
    fresh = str(tmp_path / "fresh")
    shutil.copytree(tdir, fresh, ignore=shutil.ignore_patterns("mtp.safetensors"))
    with open(os.path.join(fresh, "config.json"), "w") as f:
        json.dump(cfg, f)
    save_draft(draft, fresh)
    with open(os.path.join(fresh, "config.json")) as f:
        assert json.load(f)["num_nextn_predict_layers"] == 1
    again = load_draft("mtp", fresh, tcfg, target)
    for a, b in zip(run_paged(draft, ids, feats), run_paged(again, ids, feats)):
        assert torch.equal(a, b)


def _head_of(target):
    return target.embed.weight if target.lm_head is None else target.lm_head.weight


def test_mtp_needs_next_n_layers(tiny, tmp_path):
    # the embedded model ships an MTP layer: a copy of it without one
    import json
    from npuspec.models import TINY_MODEL_DIR
    d = tmp_path / "plain"
    shutil.copytree(TINY_MODEL_DIR, d)
    (d / "mtp.safetensors").unlink()
    cfg = json.loads((d / "config.json").read_text())
    del cfg["num_nextn_predict_layers"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="num_nextn_predict_layers") as e:
        load_draft("mtp", str(d), *tiny)
    assert "eagle3" in str(e.value)


def test_embedded_model_has_its_mtp_layer(tiny):
    assert load_draft("mtp", "tiny", *tiny).method == "mtp"
