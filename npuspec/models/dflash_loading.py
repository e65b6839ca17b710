"""Read and write DFlash and DSpark drafter checkpoints (drafters.md §1.3, §1.7, §7.1, §8.2).

`draft_loading.load_draft` / `save_draft` call `load` / `export` for the two methods (the
shared helpers are in draft_io.py):

    dflash "zlab"        architectures [DFlashDraftModel], model_type qwen3|llama, block_size,
                         num_target_layers, dflash_config {mask_token_id, target_layer_ids,
                         causal?, use_aux_hidden_state?}; tensors layers.{i}.* (or midlayer.*),
                         fc, hidden_norm, norm, optional d2t + lm_head [Vd, H] (draft_vocab_size),
                         optional embed_tokens; mask_embedding.pt (or a mask_embedding tensor)
           "speculators" speculators_model_type "dflash", transformer_layer_config {...},
                         aux_hidden_state_layer_ids (vLLM ids, taken as is), mask_token_id,
                         block_size, sample_from_anchor, draft_vocab_size, target_hidden_size
    dspark "deepspec"    architectures [Qwen3DSparkModel] (or SpecForge DSparkDraftModel):
                         block_size, target_layer_ids, mask_token_id, markov_rank,
                         markov_head_type "vanilla", confidence_head_with_markov, ... (top level
                         or in dflash_config); the DFlash tensors plus markov_head.markov_w{1,2},
                         confidence_head.proj.*, optional embed_tokens / lm_head / d2t

HF `target_layer_ids` name the layer whose OUTPUT is read (hidden_states[id+1]); our
`aux_layer_ids` are vLLM's (the residual stream entering layer i), so aux = id + 1. Any tensor
may carry a `model.` prefix. An embed_tokens / lm_head equal to the target's is dropped and the
target's is shared. The confidence head is kept in fp32 whatever the load/save dtype (vLLM).
"""
from __future__ import annotations

import logging
import os

import torch

from npuspec.models.config import ModelConfig
from npuspec.models.draft_config import DraftConfig, default_block_aux_ids
from npuspec.models.draft_io import (
    _check_layer_config, _check_same, _check_vocab_map, _layer_dict, _layer_fields, _load_pickle,
    _materialize, _model_config, _nested, _rename, _shared, _strip, _target_embed, _target_head,
    _unknown_format, _wrong_method)

log = logging.getLogger(__name__)

_FP32 = ("confidence_head.",)  # vLLM builds this head with params_dtype=float32
_ALIASES = [("midlayer.", "layers.0."), ("encoder.output_norm_enc.", "hidden_norm."),
            ("encoder.fc.", "fc.")]  # vLLM's hf_to_vllm_mapper for DFlash drafts
_TRAINING_ONLY = ("verifier_norm.weight", "verifier_lm_head.weight")  # speculators
_DSPARK_ARCHS = ("Qwen3DSparkModel", "DSparkDraftModel")


def _get(d: dict, key: str, default=None):
    """(value, the key's name in config.json): dflash_config first, then the top level, the
    order z-lab's `_draft_value` and vLLM read them in."""
    sub = d.get("dflash_config") or {}  # load() checked that it is a dict
    if sub.get(key) is not None:
        return sub[key], f"dflash_config.{key}"
    if d.get(key) is not None:
        return d[key], key
    return default, key


def _reject(source: str, key: str, value, why: str, fix: str):
    return ValueError(f"{source}: {key}={value!r}: {why}; {fix}.")


# ---- reading ----------------------------------------------------------------------------------
def load(method: str, d: dict, model_dir: str, tensors: dict, tcfg: ModelConfig, *, target,
         dtype, device):
    source = model_dir
    if not isinstance(d.get("dflash_config") or {}, dict):
        raise _reject(source, "dflash_config", d["dflash_config"], "it must be an object",
                      "write it as {\"mask_token_id\": ..., \"target_layer_ids\": [...]}")
    arch = " ".join(d.get("architectures") or [])
    spec = d.get("speculators_model_type")
    if method == "dflash":
        if spec not in (None, "dflash"):
            raise _wrong_method(source, "dflash", f"a speculators {spec!r}", spec)
        if any(a in arch for a in _DSPARK_ARCHS) or any(n.endswith("markov_w1.weight")
                                                       for n in tensors):
            raise _wrong_method(source, "dflash", "a DSpark", "dspark")
        fmt = "speculators" if spec else "zlab"
    else:
        if spec is not None:
            raise ValueError(f"{source}: speculators_model_type={spec!r}: the speculators DSpark "
                             "format is not supported; only DeepSpec / SpecForge checkpoints "
                             "(architectures Qwen3DSparkModel or DSparkDraftModel) load: use "
                             "one of those.")
        if "DFlashDraftModel" in arch:
            raise _wrong_method(source, "dspark", "a DFlash", "dflash")
        fmt = "deepspec"
    if "DFlash2" in arch:
        raise _reject(source, "architectures", d["architectures"], "DFlash2 drafts (dynamic "
                      "convolutions, candidate selector) are a different model",
                      "use a DFlash (DFlashDraftModel) checkpoint")
    layer_d = _nested(d, "transformer_layer_config", source) if fmt == "speculators" else d
    sd, orig, t2d = _tensors(tensors, source, method)
    mc = _model_config(_rope_default(layer_d), source)
    _check_layers(source, {**layer_d, **d} if fmt == "speculators" else d, mc)
    _check_layer_config(source, layer_d, mc, tcfg)
    n, _ = _get(d, "num_target_layers")
    _check_same(source, "num_target_layers", n, tcfg.num_layers, "num_hidden_layers")
    Ht = d.get("target_hidden_size")
    if Ht is not None:
        _check_same(source, "target_hidden_size", Ht, tcfg.hidden_size, "hidden_size")
    elif mc.hidden_size != tcfg.hidden_size:
        raise ValueError(f"{source}: hidden_size={mc.hidden_size} differs from the target's "
                         f"hidden_size={tcfg.hidden_size} and config.json has no "
                         "target_hidden_size; add target_hidden_size (the width of each target "
                         "feature fc.weight reads).")
    aux = _aux_ids(d, fmt, tcfg.num_layers, mc.num_layers, source)
    _check_fc(sd, aux, tcfg.hidden_size, fmt, source)
    fields = _block_fields(method, d, fmt, mc, source)
    fields.update(_heads(sd, t2d, mc, tcfg, target, d, source))
    if method == "dspark":
        fields.update(_dspark_fields(d, sd, mc, source))
    _mask_embedding(model_dir, sd, mc.hidden_size, fields["mask_token_id"], source)
    lf = _layer_fields(mc, sd)
    lf["qk_norm"] = lf["qk_norm"] or any(k.endswith("self_attn.q_norm.weight") for k in sd)
    cfg = DraftConfig(method=method, **lf, aux_layer_ids=aux, target_hidden_size=tcfg.hidden_size,
                      own_mask_embedding="mask_embedding" in sd, format=fmt, **fields)
    back = [("layers.0.", "midlayer.")] if "midlayer." in " ".join(orig.values()) else []
    return _materialize(cfg, sd, lambda k: _rename(k, back), source, target=target, dtype=dtype,
                        device=device, orig=orig, fp32=_FP32)


def _tensors(tensors: dict, source: str, method: str):
    """Our names -> tensors, our -> checkpoint names, and the t2d map (training only)."""
    tensors = _strip(tensors)
    if any(n.endswith("layers.0.hidden_norm.weight") or n == "midlayer.hidden_norm.weight"
           for n in tensors):
        raise _wrong_method(source, method, "an EAGLE-3 (layer 0 has a hidden_norm)", "eagle3")
    t2d = tensors.pop("t2d", None)
    for name in _TRAINING_ONLY:
        if tensors.pop(name, None) is not None:
            log.info("%s: skipping %s (used in training only)", source, name)
    sd, orig = {}, {}
    for name, t in tensors.items():
        ours = _rename(name, _ALIASES)
        if ours in sd:
            raise ValueError(f"{source}: tensors {orig[ours]!r} and {name!r} are the same weight "
                             f"({ours}); remove one of them.")
        sd[ours], orig[ours] = t, name
    if "fc.weight" not in sd or "hidden_norm.weight" not in sd:
        raise _unknown_format(source, method, "no fc.weight / hidden_norm.weight tensors")
    return sd, orig, t2d


def _rope_default(d: dict) -> dict:
    # vLLM's DFlash layers default rope_theta to 1e6 (set_default_rope_theta), not HF's 1e4
    given = d.get("rope_theta") is not None or any(
        isinstance(d.get(k), dict) and d[k].get("rope_theta") is not None
        for k in ("rope_scaling", "rope_parameters"))
    if given:
        return d
    log.info("no rope_theta in config.json: using vLLM's DFlash default 1e6")
    return {**d, "rope_theta": 1e6}


def _check_layers(source: str, d: dict, mc: ModelConfig) -> None:
    """What the draft layers compute must be what DraftLayer computes."""
    if d.get("is_neox_style", True) is False:
        raise _reject(source, "is_neox_style", False, "interleaved (GPT-J) RoPE is not "
                      "supported, npuspec's drafters rotate halves (neox style) and a mismatch "
                      "silently collapses acceptance", "use a draft trained with neox-style RoPE")
    types = d.get("layer_types")
    if types is not None and any(t != "full_attention" for t in types):
        raise _reject(source, "layer_types", types, "sliding-window draft layers are not "
                      "supported", "use a draft whose layer_types are all 'full_attention'")
    for key, ok in (("use_swa", False), ("attention_sink_bias", False),
                    ("use_aux_hidden_state", True)):
        v, name = _get(d, key)
        if v is not None and bool(v) != ok:
            raise _reject(source, name, v, "only full-attention drafts without attention sinks "
                          "that read the target's aux hidden states are supported",
                          f"set {name} to {str(ok).lower()} or use another draft")
    for key, neutral in (("input_embedding_scale", 1.0), ("output_multiplier", 1.0),
                         ("logit_scale", 1.0), ("final_logit_softcapping", 0.0)):
        v, name = _get(d, key)
        if v is not None and float(v) != neutral:
            raise _reject(source, name, v, "scaled embeddings / logits are not supported",
                          f"remove {name} (or set it to {neutral}) if the draft was trained "
                          "without it")
    proj, pkey = _get(d, "projector_type", "dflash")
    if proj not in ("dflash", "dspark"):
        raise _reject(source, pkey, proj, "only the plain DFlash "
                      "projector is supported (Domino adds a correction head)",
                      "use a projector_type 'dflash' checkpoint")
    if d.get("shift_label"):
        raise _reject(source, "shift_label", True, "label-shifted block training is not "
                      "supported", "use a checkpoint trained with shift_label false")


def _aux_ids(d: dict, fmt: str, L: int, n_draft: int, source: str) -> tuple:
    """vLLM aux ids: speculators' aux_hidden_state_layer_ids as is (vLLM #40727), HF
    target_layer_ids + 1 otherwise (z-lab's default spacing when absent)."""
    if fmt == "speculators":
        key = "aux_hidden_state_layer_ids"
        ids, lo, hi, shift = d.get(key), 0, L, 0
        if not ids:
            raise ValueError(f"{source}: aux_hidden_state_layer_ids is missing; the speculators "
                             "DFlash format requires it (the target layers the draft reads).")
    else:
        ids, key = _get(d, "target_layer_ids")
        lo, hi, shift = -1, L - 1, 1  # -1: the embedding output (DeepSpec)
        if not ids:
            aux = default_block_aux_ids(L, n_draft)
            log.warning("%s: no target_layer_ids in config.json (dflash_config); using z-lab's "
                        "default %s for %d draft layers. Acceptance will be low if the draft "
                        "was trained on other layers; set dflash_config.target_layer_ids.",
                        source, [i - 1 for i in aux], n_draft)
            return aux
    if not isinstance(ids, list) or not all(isinstance(i, int) and lo <= i <= hi for i in ids):
        raise ValueError(f"{source}: {key}={ids!r}: each id must be an int in {lo}..{hi} (the "
                         f"target has num_hidden_layers={L}); fix {key} in config.json.")
    return tuple(i + shift for i in ids)


def _check_fc(sd: dict, aux: tuple, Ht: int, fmt: str, source: str) -> None:
    fc = sd["fc.weight"]
    key = "aux_hidden_state_layer_ids" if fmt == "speculators" else "target_layer_ids"
    if fc.dim() != 2 or fc.shape[1] != len(aux) * Ht:
        raise ValueError(f"{source}: tensor 'fc.weight' has shape {list(fc.shape)} but {key} "
                         f"names {len(aux)} layers of the target's hidden size {Ht}, so it must "
                         f"read {len(aux) * Ht} features; {key} in config.json does not match "
                         "the weights.")


def _block_fields(method: str, d: dict, fmt: str, mc: ModelConfig, source: str) -> dict:
    dspark = method == "dspark"
    mask, mkey = _get(d, "mask_token_id")
    if not isinstance(mask, int) or not 0 <= mask < mc.vocab_size:
        raise ValueError(f"{source}: {mkey}={mask!r}: the MASK input id must be an int in "
                         f"0..{mc.vocab_size - 1}; set dflash_config.mask_token_id (the id the "
                         "draft was trained with, e.g. the tokenizer's <|MASK|>).")
    anchor, _ = _get(d, "sample_from_anchor", dspark)  # vllm-ascend's DSpark default: True
    bs, bkey = _get(d, "block_size")
    if bs is None:
        if dspark:
            raise ValueError(f"{source}: block_size is missing; set it to the block size the "
                             "DSpark draft was trained with (7 for DeepSpec's *_block7).")
        bs = 8 if fmt == "speculators" else 16  # the speculators / z-lab defaults
        log.info("%s: no block_size in config.json; using the %s default %d", source, fmt, bs)
    if not isinstance(bs, int) or bs < (1 if anchor else 2):
        raise ValueError(f"{source}: {bkey}={bs!r}: a block needs at least "
                         f"{1 if anchor else 2} slots ({'' if anchor else 'the anchor and '}one "
                         "draft); fix block_size in config.json.")
    causal = d.get("is_causal")  # vLLM: is_causal, then dflash_config.causal
    if causal is None:
        causal = (d.get("dflash_config") or {}).get("causal", False)
    return dict(block_size=bs, mask_token_id=mask, sample_from_anchor=bool(anchor),
                draft_causal=bool(causal))


def _heads(sd: dict, t2d, mc: ModelConfig, tcfg: ModelConfig, target, d: dict,
           source: str) -> dict:
    """Own or shared embedding / LM head (drafters.md §1.7); fills d2t for an own head."""
    V, H = tcfg.vocab_size, mc.hidden_size
    Vd = d.get("draft_vocab_size") or V
    if not isinstance(Vd, int) or Vd > V:
        raise ValueError(f"{source}: draft_vocab_size={Vd!r} must be an int <= vocab_size={V}; "
                         "fix draft_vocab_size in config.json.")
    head, d2t = sd.get("lm_head.weight"), sd.get("d2t")
    if Vd < V and (head is None or d2t is None):
        raise ValueError(f"{source}: draft_vocab_size={Vd} < vocab_size={V} needs the draft's own "
                         f"lm_head.weight [{Vd}, {H}] and the d2t tensor [{Vd}], but "
                         f"{'lm_head.weight' if head is None else 'd2t'} is missing; a reduced-"
                         "vocabulary draft cannot share the target's head.")
    if d2t is not None and head is None:
        raise ValueError(f"{source}: the checkpoint has a d2t tensor but no lm_head.weight; "
                         "d2t maps the draft's own head's ids, so ship both or neither.")
    if head is not None and d2t is None and _shared([head], _target_head(target)):
        del sd["lm_head.weight"]  # a copy of the target's head (DeepSpec initialises from it)
    own_head = "lm_head.weight" in sd
    if own_head:
        d2t = sd.setdefault("d2t", torch.zeros(Vd, dtype=torch.long))
        if d2t.shape != (Vd,):
            raise ValueError(f"{source}: tensor 'd2t' has shape {list(d2t.shape)}, expected "
                             f"[{Vd}] (draft_vocab_size); fix draft_vocab_size in config.json "
                             "to the size of the draft's own head.")
        _check_vocab_map(source, "d2t", torch.arange(Vd) + d2t.long(), t2d, V)
    own_embed = not _shared([sd.get("embed_tokens.weight")], _target_embed(target))
    if not own_embed:
        sd.pop("embed_tokens.weight", None)
    for own, what in ((own_embed, "embed_tokens.weight"), (own_head, "lm_head.weight")):
        if not own and H != tcfg.hidden_size:
            raise ValueError(f"{source}: hidden_size={H} differs from the target's hidden_size="
                             f"{tcfg.hidden_size}, so the draft needs its own {what}, which the "
                             "checkpoint lacks; use a draft made for this target.")
    return dict(draft_vocab_size=Vd, own_embed=own_embed, own_lm_head=own_head)


def _dspark_fields(d: dict, sd: dict, mc: ModelConfig, source: str) -> dict:
    r, rkey = _get(d, "markov_rank")
    if r is None:
        r, rkey = _get(d, "dspark_markov_rank")  # vllm-ascend's alternative name
    w1 = sd.get("markov_head.markov_w1.weight")
    if r is None:
        if w1 is None:
            raise ValueError(f"{source}: markov_rank is missing and there is no "
                             "markov_head.markov_w1.weight; set markov_rank (0 = no Markov head).")
        r = w1.shape[-1]
        log.info("%s: no markov_rank in config.json; %d from markov_w1's shape", source, r)
    if not isinstance(r, int) or r < 0:
        raise ValueError(f"{source}: {rkey}={r!r} must be an int >= 0; fix it in config.json.")
    htype, hkey = _get(d, "markov_head_type", "vanilla")
    if r > 0 and str(htype).lower() != "vanilla":
        raise _reject(source, hkey, htype, "only the vanilla (first-order) Markov head is "
                      "supported", "use a checkpoint trained with markov_head_type 'vanilla'")
    enabled, ekey = _get(d, "enable_confidence_head")
    conf = sd.get("confidence_head.proj.weight")
    if enabled is False or conf is None:
        why = (f"{ekey}=false" if enabled is False else
               "there is no confidence_head.proj.weight tensor")
        raise ValueError(f"{source}: {why}: npuspec's DSpark drafter needs the confidence head "
                         "(the engine reads it every round); use a checkpoint trained with it "
                         "(enable_confidence_head true, DeepSpec confidence_head_alpha > 0).")
    with_markov, wkey = _get(d, "confidence_head_with_markov")
    if with_markov is None:  # vLLM defaults to False; the head's width says which it is
        with_markov = r > 0 and conf.shape[-1] == mc.hidden_size + r
        log.info("%s: no confidence_head_with_markov in config.json; %s from "
                 "confidence_head.proj.weight's shape", source, with_markov)
    if with_markov and r == 0:
        raise _reject(source, wkey, with_markov, "the confidence head reads the Markov "
                      "embedding but markov_rank is 0", f"set {wkey} to false")
    return dict(markov_rank=r, confidence_with_markov=bool(with_markov))


def _mask_embedding(model_dir: str, sd: dict, H: int, mask_id: int, source: str) -> None:
    """A trained MASK embedding: the sidecar mask_embedding.pt (a tensor, or {embedding,
    mask_token_id} as vLLM reads it) or a `mask_embedding` tensor (what export writes)."""
    path = os.path.join(model_dir, "mask_embedding.pt")
    if os.path.isfile(path):
        obj = _load_pickle(path, flat=False)
        if isinstance(obj, dict):
            if obj.get("mask_token_id", mask_id) != mask_id:
                raise ValueError(f"{path}: mask_token_id={obj['mask_token_id']} but config.json "
                                 f"has mask_token_id={mask_id}; the embedding belongs to another "
                                 "MASK id: fix config.json or remove the file.")
            obj = obj.get("embedding")
        if not isinstance(obj, torch.Tensor):
            raise ValueError(f"{path}: expected a tensor [{H}] or {{'embedding': tensor, "
                             f"'mask_token_id': int}}, found {type(obj).__name__}; re-save it "
                             "in one of these forms.")
        if "mask_embedding" in sd:
            raise ValueError(f"{source}: a mask embedding is in both mask_embedding.pt and the "
                             "safetensors (mask_embedding); remove one of them.")
        sd["mask_embedding"] = obj
    t = sd.get("mask_embedding")
    if t is not None:
        if t.numel() != H:
            raise ValueError(f"{source}: the mask embedding has shape {list(t.shape)}, expected "
                             f"[{H}] (hidden_size); it belongs to another draft: remove it or "
                             "use this draft's own.")
        sd["mask_embedding"] = t.reshape(H)


# ---- writing ----------------------------------------------------------------------------------
def export(module, fmt: str, dtype, extra: dict):
    """(tensors, config.json) of `module` in `fmt` (zlab / speculators / deepspec)."""
    cfg: DraftConfig = module.config
    sd = {}
    for k, v in module.state_dict().items():
        v = v.detach()
        if v.is_floating_point():
            v = v.float() if k.startswith(_FP32) else v.to(dtype or v.dtype)
        sd[k] = v.contiguous().cpu()
    Vd = cfg.draft_vocab_size or cfg.vocab_size
    if "d2t" in sd and Vd == cfg.vocab_size and not bool(sd["d2t"].any()):
        del sd["d2t"]  # the identity map: vLLM only has a d2t slot for a reduced vocabulary
    hf_ids = [i - 1 for i in cfg.aux_layer_ids]
    arch = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM"}.get(cfg.model_type,
                                                                         "LlamaForCausalLM")
    layer = {**_layer_dict(cfg, arch), "attention_bias": cfg.attention_bias,
             "layer_types": ["full_attention"] * cfg.num_layers}
    block = {"block_size": cfg.block_size, "target_hidden_size": cfg.target_hidden_size}
    if cfg.own_lm_head:
        block["draft_vocab_size"] = Vd
    target = getattr(module, "_target", None)
    if target is not None:  # load_draft checks it against the target it is served with
        block["num_target_layers"] = target.config.num_layers
    if fmt == "speculators":
        if cfg.own_embed or cfg.own_mask_embedding or cfg.draft_causal:
            raise ValueError("save_draft: the speculators DFlash format holds no embed_tokens, "
                             "mask embedding nor causal flag; this module has one: save with "
                             "fmt='zlab'.")
        block.pop("num_target_layers", None)
        config = {"architectures": ["DFlashSpeculator"], "speculators_model_type": "dflash",
                  "transformer_layer_config": layer, **block, "draft_vocab_size": Vd,
                  "aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
                  "mask_token_id": cfg.mask_token_id,
                  "sample_from_anchor": cfg.sample_from_anchor,
                  "speculators_config": {
                      "algorithm": "dflash", "default_proposal_method": "greedy",
                      "proposal_methods": [{"proposal_type": "greedy",
                                            "speculative_tokens": module.drafts_per_block}],
                      "verifier": {"name_or_path": None, "architectures": []}}}
        return sd, {**config, **extra}
    if fmt == "zlab":
        dc = {"mask_token_id": cfg.mask_token_id, "target_layer_ids": hf_ids}
        if cfg.draft_causal:
            dc["causal"] = True
        config = {**layer, "architectures": ["DFlashDraftModel"], **block, "dflash_config": dc}
        if cfg.sample_from_anchor:
            config["sample_from_anchor"] = True
        return sd, {**config, **extra}
    assert fmt == "deepspec", fmt
    r = cfg.markov_rank
    config = {**layer, "architectures": ["Qwen3DSparkModel"], **block,
              "target_layer_ids": hf_ids, "mask_token_id": cfg.mask_token_id,
              "sample_from_anchor": cfg.sample_from_anchor, "markov_rank": r,
              "enable_confidence_head": True,
              "confidence_head_with_markov": bool(cfg.confidence_with_markov and r > 0)}
    if r > 0:
        config["markov_head_type"] = "vanilla"
    if cfg.draft_causal:
        config["is_causal"] = True
    return sd, {**config, **extra}
