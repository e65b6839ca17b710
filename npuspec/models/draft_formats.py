"""Read and write EAGLE, EAGLE-3, Medusa and MTP drafter checkpoints in their public formats
(the table in draft_loading.py's docstring; DFlash and DSpark: dflash_loading.py).
`draft_loading.load_draft` / `save_draft` dispatch here by method."""
from __future__ import annotations

import glob
import json
import logging
import os
import re
from typing import Callable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from npuspec.models.config import ModelConfig
from npuspec.models.draft_config import DraftConfig, default_aux_layer_ids
from npuspec.models.draft_io import (
    _IGNORED, _check_layer_config, _check_same, _check_vocab_map, _layer_dict, _layer_fields,
    _materialize, _model_config, _nested, _read_tensors, _rename, _shared, _strip, _target_embed,
    _target_head, _unknown_format, _wrong_method)

log = logging.getLogger(__name__)

_MTP_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


# ---- reading ---------------------------------------------------------------------------------
def load_eagle(d, tensors, tcfg: ModelConfig, source, **kw):
    spec = d.get("speculators_model_type")
    if spec not in (None, "eagle"):
        raise _wrong_method(source, "eagle", f"a speculators {spec!r}", spec)
    if spec == "eagle":
        fmt, pairs = "speculators", [("fusion_fc.", "fc."), ("transformer.", "layers.0.")]
        if d.get("layernorms"):
            raise ValueError(f"{source}: layernorms=true (speculators EAGLE with extra layernorms) "
                             "is not supported; only layernorms=false checkpoints load.")
        layer_d = _nested(d, "transformer_layer_config", source)
    else:
        fmt, pairs, layer_d = "eagle", [], d
    tensors = _strip(tensors)
    if any(n.startswith("midlayer.") or n.endswith("hidden_norm.weight") for n in tensors):
        raise _wrong_method(source, "eagle", "an EAGLE-3", "eagle3")
    orig = {_rename(n, pairs): n for n in tensors}
    sd = {_rename(n, pairs): t for n, t in tensors.items()}
    if sd.pop("layers.0.input_layernorm.weight", None) is not None and fmt == "eagle":
        # EAGLE-1 never applies layer 0's input norm (some exporters still save one)
        log.warning("%s: ignoring layers.0.input_layernorm.weight: EAGLE-1's first layer has no "
                    "input norm", source)
    if "fc.weight" not in sd:
        raise _unknown_format(source, "eagle", "no fc.weight / fusion_fc.weight tensor")
    mc = _model_config(layer_d, source)
    _check_same(source, "hidden_size", mc.hidden_size, tcfg.hidden_size, "hidden_size")
    _check_layer_config(source, layer_d, mc, tcfg)
    own_embed = not _shared([sd.get("embed_tokens.weight")], _target_embed(kw["target"]))
    if not own_embed:
        sd.pop("embed_tokens.weight", None)
    cfg = DraftConfig(method="eagle", **_layer_fields(mc, sd), fc_bias="fc.bias" in sd,
                      para_norm=bool(d.get("add_para_norm")), own_embed=own_embed, format=fmt)
    back = [(b, a) for a, b in pairs]
    return _materialize(cfg, sd, lambda n: _rename(n, back), source, orig=orig, **kw)


def _aux_ids(d: dict, L: int, source: str) -> tuple:
    ec = d.get("eagle_config") if isinstance(d.get("eagle_config"), dict) else {}
    ids = (d.get("eagle_aux_hidden_state_layer_ids") or ec.get("eagle_aux_hidden_state_layer_ids")
           or ec.get("layer_ids"))
    if not ids:
        ids = default_aux_layer_ids(L)
        log.warning("%s: no eagle_aux_hidden_state_layer_ids in config.json; using vLLM's default "
                    "%s. Acceptance will be low if the draft was trained on other layers; set "
                    "eagle_aux_hidden_state_layer_ids.", source, list(ids))
    ids = tuple(ids)
    if not all(isinstance(i, int) and 0 <= i <= L for i in ids):
        raise ValueError(f"{source}: eagle_aux_hidden_state_layer_ids={list(ids)}: each id must be "
                         f"an int in 0..{L} (the target has num_hidden_layers={L}; id i is the "
                         f"residual stream entering layer i, {L} the final one).")
    return ids


def load_eagle3(d, tensors, tcfg: ModelConfig, source, **kw):
    spec = d.get("speculators_model_type")
    if spec not in (None, "eagle3"):
        raise _wrong_method(source, "eagle3", f"a speculators {spec!r}", spec)
    if (d.get("eagle_config") or {}).get("use_aux_hidden_state") is False:
        raise ValueError(f"{source}: eagle_config.use_aux_hidden_state=false is not supported; "
                         "EAGLE-3 drafts read the target's aux hidden states.")
    tensors = _strip(tensors)
    arch = " ".join(d.get("architectures") or [])
    midlayer = any(n.startswith("midlayer.") for n in tensors)
    if spec == "eagle3":
        fmt, layer_d, nbr = "speculators", _nested(d, "transformer_layer_config", source), True
    elif midlayer or "Eagle3" in arch or "layers.0.hidden_norm.weight" in tensors:
        fmt = "specforge" if "Eagle3" in arch else "yuhuili"
        layer_d, nbr = d, False
    else:
        if "fc.weight" in tensors and "layers.0.self_attn.q_proj.weight" in tensors:
            raise _wrong_method(source, "eagle3", "an EAGLE-1 (no hidden_norm)", "eagle")
        raise _unknown_format(source, "eagle3", "no midlayer.* / layers.0.hidden_norm tensors")
    pairs = [("midlayer.", "layers.0.")] if midlayer else []
    t2d = tensors.pop("t2d", None)
    for name in ("verifier_norm.weight", "verifier_lm_head.weight"):  # speculators training-only
        if tensors.pop(name, None) is not None:
            log.info("%s: skipping %s (used in training only)", source, name)
    orig = {_rename(n, pairs): n for n in tensors}
    sd = {_rename(n, pairs): t for n, t in tensors.items()}
    mc = _model_config({**layer_d, "vocab_size": layer_d.get("vocab_size", d.get("vocab_size"))},
                       source)
    Ht = d.get("target_hidden_size") or layer_d.get("target_hidden_size")
    if Ht is not None:
        _check_same(source, "target_hidden_size", Ht, tcfg.hidden_size, "hidden_size")
    else:
        _check_same(source, "hidden_size", mc.hidden_size, tcfg.hidden_size, "hidden_size")
    _check_layer_config(source, {"vocab_size": mc.vocab_size}, mc, tcfg)
    Vd = d.get("draft_vocab_size") or layer_d.get("draft_vocab_size") or mc.vocab_size
    nbr = d.get("norm_before_residual", layer_d.get("norm_before_residual", nbr))
    if "embed_tokens.weight" not in sd and mc.hidden_size != tcfg.hidden_size:
        raise ValueError(f"{source}: hidden_size={mc.hidden_size} differs from the target's "
                         f"hidden_size={tcfg.hidden_size}, so the draft needs its own "
                         f"embed_tokens.weight [{mc.vocab_size}, {mc.hidden_size}], which the "
                         "checkpoint lacks.")
    own_embed = not _shared([sd.get("embed_tokens.weight")], _target_embed(kw["target"]))
    if not own_embed:
        sd.pop("embed_tokens.weight", None)
    d2t = sd.setdefault("d2t", torch.zeros(Vd, dtype=torch.long))
    cfg = DraftConfig(
        method="eagle3", **_layer_fields(mc, sd), draft_vocab_size=Vd,
        aux_layer_ids=_aux_ids(d, tcfg.num_layers, source), norm_before_residual=bool(nbr),
        target_hidden_size=tcfg.hidden_size, fc_bias="fc.bias" in sd,
        norm_before_fc="input_norm.weight" in sd, own_embed=own_embed, own_lm_head=True,
        format=fmt)
    if d2t.dim() == 1 and d2t.numel() == Vd:
        _check_vocab_map(source, "d2t", torch.arange(Vd) + d2t.long(), t2d, mc.vocab_size)
        if "d2t" not in orig and Vd < mc.vocab_size:
            log.warning("%s: draft_vocab_size=%d < vocab_size=%d but no d2t tensor: draft id i is "
                        "taken as target id i", source, Vd, mc.vocab_size)
    back = [(b, a) for a, b in pairs]
    return _materialize(cfg, sd, lambda n: _rename(n, back), source, orig=orig, **kw)


def load_medusa(d, tensors, tcfg: ModelConfig, source, **kw):
    tensors = _strip(tensors, ("medusa_heads.", "medusa_head."))
    V, H = tcfg.vocab_size, tcfg.hidden_size
    _check_same(source, "hidden_size", d.get("hidden_size"), H, "hidden_size")
    _check_same(source, "vocab_size", d.get("vocab_size"), V, "vocab_size")
    if "num_heads" in d or any(n.startswith(("blocks.", "lm_heads.")) for n in tensors):
        fmt = "vllm"
        n_heads = (d.get("num_heads") or d.get("medusa_num_heads")
                   or len({n.split(".")[1] for n in tensors if n.startswith("blocks.")}))
        n_layers = d.get("num_hidden_layers") or d.get("medusa_num_layers") or 1
        bias, Vt = bool(d.get("medusa_fc_bias", False)), d.get("truncated_vocab_size") or V
        original = bool(d.get("original_lm_head", False))
        sd, orig = dict(tensors), {n: n for n in tensors}
        if original and "lm_head.weight" not in sd and "lm_heads.0.weight" in sd:
            sd["lm_head.weight"] = sd.pop("lm_heads.0.weight")
            orig["lm_head.weight"] = "lm_heads.0.weight"
        to_ckpt = lambda n: n  # noqa: E731
    elif "medusa_num_heads" in d or any(re.match(r"^\d+\.\d+\.", n) for n in tensors):
        fmt, bias, Vt, original = "fasterdecoding", True, V, False
        n_heads = d.get("medusa_num_heads") or len({n.split(".")[0] for n in tensors})
        n_layers = d.get("medusa_num_layers", 1)
        sd, orig = {}, {}
        for n, t in tensors.items():
            ours = _medusa_fd_to_ours(n, n_layers)
            sd[ours], orig[ours] = t, n
        to_ckpt = lambda n: _medusa_ours_to_fd(n, n_layers)  # noqa: E731
    else:
        raise _unknown_format(source, "medusa", "neither num_heads nor medusa_num_heads in "
                                                "config.json, nor Medusa tensor names")
    own_head = original is False or "lm_head.weight" in sd
    if Vt < V:
        if "token_map" not in sd:
            raise ValueError(f"{source}: truncated_vocab_size={Vt} < vocab_size={V} needs the "
                             "token_map tensor [truncated_vocab_size], which is missing.")
        tm = sd["token_map"].long()
        _check_vocab_map(source, "token_map", tm, None, V)
        for k in [k for k in sd if k.startswith("lm_head")]:  # full-vocab heads: keep the map's rows
            if sd[k].dim() == 2 and sd[k].shape[0] == V and tm.shape == (Vt,):
                sd[k] = sd[k][tm]
    elif "token_map" in sd:
        log.info("%s: ignoring token_map (truncated_vocab_size == vocab_size)", source)
        sd.pop("token_map")
    cfg = DraftConfig(method="medusa", hidden_size=H, vocab_size=V, draft_vocab_size=Vt,
                      num_layers=n_layers, medusa_num_heads=n_heads, fc_bias=bias,
                      own_lm_head=own_head, original_lm_head=original, format=fmt)
    return _materialize(cfg, sd, to_ckpt, source, orig=orig, **kw)


def _medusa_fd_to_ours(name: str, n_layers: int) -> str:
    m = re.match(r"^(\d+)\.(\d+)\.(?:linear\.)?(weight|bias)$", name)
    if not m:
        return name
    h, l, kind = m.group(1), int(m.group(2)), m.group(3)
    if l == n_layers and ".linear." not in name:
        return f"lm_heads.{h}.{kind}"
    return f"blocks.{h}.layers.{l}.{kind}"


def _medusa_ours_to_fd(name: str, n_layers: int) -> str:
    m = re.match(r"^blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)$", name)
    if m:
        return f"{m.group(1)}.{m.group(2)}.linear.{m.group(3)}"
    m = re.match(r"^lm_heads\.(\d+)\.weight$", name)
    return f"{m.group(1)}.{n_layers}.weight" if m else name


def _mtp_filter(L: int) -> Callable[[str], bool]:
    def keep(name: str) -> bool:
        m = _MTP_RE.match(name)
        return bool(m) and int(m.group(1)) >= L
    return keep


def load_mtp(d, model_dir, tcfg: ModelConfig, **kw):
    source = model_dir
    n = d.get("num_nextn_predict_layers") or 0
    if not isinstance(n, int) or n < 1:
        raise ValueError(
            f"{source}/config.json: num_nextn_predict_layers={d.get('num_nextn_predict_layers')!r}: "
            "this target checkpoint has no MTP (next-n) layers, so method 'mtp' has nothing to "
            "load. Use 'eagle3' or 'eagle' with a separately trained draft "
            "(speculative_config.model), 'medusa', 'draft_model', or 'ngram' / 'suffix'.")
    L = tcfg.num_layers
    tensors = _read_tensors(model_dir, _mtp_filter(L))
    sd, orig = {}, {}
    for name, t in tensors.items():
        m = _MTP_RE.match(name)
        ours = f"layers.{int(m.group(1)) - L}.{m.group(2)}"
        if _IGNORED.search(name):
            continue
        sd[ours], orig[ours] = t, name
    target = kw["target"]
    embeds = [sd.get(f"layers.{i}.embed_tokens.weight") for i in range(n)]
    heads = [sd.get(f"layers.{i}.shared_head.head.weight") for i in range(n)]
    own_embed = not _shared(embeds, _target_embed(target))
    own_head = not _shared(heads, _target_head(target))
    for i in range(n):
        if not own_embed:
            sd.pop(f"layers.{i}.embed_tokens.weight", None)
        if not own_head:
            sd.pop(f"layers.{i}.shared_head.head.weight", None)
    cfg = DraftConfig.from_target("mtp", tcfg, num_layers=n, own_embed=own_embed,
                                  own_lm_head=own_head)
    return _materialize(cfg, sd, lambda k: _mtp_to_ckpt(k, L), source, orig=orig, **kw)


def _mtp_to_ckpt(name: str, L: int) -> str:
    # our layers.{i}.X -> the target checkpoint's model.layers.{L+i}.X
    _, i, rest = name.split(".", 2)
    return f"model.layers.{L + int(i)}.{rest}"


# ---- writing ---------------------------------------------------------------------------------
def export_eagle(cfg: DraftConfig, sd: dict, fmt: str, extra: dict):
    if fmt == "speculators":
        if cfg.num_layers != 1 or cfg.para_norm:
            raise ValueError("save_draft: the speculators EAGLE format holds one layer and no "
                             "HASS norms; save with fmt='eagle'.")
        tensors = {_rename(k, [("fc.", "fusion_fc."), ("layers.0.", "transformer.")]): v
                   for k, v in sd.items()}
        config = {"architectures": ["EagleSpeculator", "LlamaDecoderLayer"],
                  "speculators_model_type": "eagle", "layernorms": False,
                  "fusion_bias": cfg.fc_bias,
                  "transformer_layer_config": _layer_dict(cfg, "LlamaForCausalLM")}
    else:
        tensors = sd
        config = {**_layer_dict(cfg, "LlamaForCausalLM"), "bias": cfg.fc_bias}
        if cfg.para_norm:
            config["add_para_norm"] = True
    return tensors, {**config, **extra}


def export_eagle3(cfg: DraftConfig, sd: dict, fmt: str, extra: dict):
    d2t = sd["d2t"]
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[torch.arange(d2t.numel()) + d2t] = True
    tensors = {**sd, "t2d": t2d}
    aux = list(cfg.aux_layer_ids)
    if fmt == "speculators":
        config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                  "transformer_layer_config": _layer_dict(cfg, "LlamaForCausalLM"),
                  "draft_vocab_size": cfg.draft_vocab_size,
                  "target_hidden_size": cfg.target_hidden_size,
                  "norm_before_residual": cfg.norm_before_residual,
                  "eagle_aux_hidden_state_layer_ids": aux,
                  "speculators_config": {
                      "algorithm": "eagle3", "default_proposal_method": "greedy",
                      "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                      "verifier": {"name_or_path": None, "architectures": []}}}
        if cfg.norm_before_fc:
            config["norm_before_fc"] = True
        return tensors, {**config, **extra}
    if cfg.norm_before_fc:
        raise ValueError(f"save_draft: norm_before_fc (input_norm) exists only in the speculators "
                         f"format, not {fmt!r}; save with fmt='speculators'.")
    if cfg.num_layers == 1:  # both SpecForge and the EAGLE repo name the single layer midlayer
        tensors = {_rename(k, [("layers.0.", "midlayer.")]): v for k, v in tensors.items()}
    arch = "LlamaForCausalLMEagle3" if fmt == "specforge" else "LlamaForCausalLM"
    config = {**_layer_dict(cfg, arch), "draft_vocab_size": cfg.draft_vocab_size,
              "target_hidden_size": cfg.target_hidden_size,
              "eagle_aux_hidden_state_layer_ids": aux}
    if fmt == "specforge" or cfg.norm_before_residual:
        config["norm_before_residual"] = cfg.norm_before_residual
    if fmt == "specforge":
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux,
                                  "use_aux_hidden_state": True}
    return tensors, {**config, **extra}


def export_medusa(cfg: DraftConfig, sd: dict, fmt: str, extra: dict):
    if fmt == "vllm":
        config = {"architectures": ["MedusaModel"], "model_type": "medusa",
                  "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
                  "num_heads": cfg.medusa_num_heads, "num_hidden_layers": cfg.num_layers,
                  "truncated_vocab_size": cfg.draft_vocab_size, "medusa_fc_bias": cfg.fc_bias,
                  "original_lm_head": cfg.original_lm_head}
        return sd, {**config, **extra}
    if not (cfg.fc_bias and cfg.own_lm_head and not cfg.original_lm_head
            and cfg.draft_vocab_size == cfg.vocab_size):
        raise ValueError("save_draft: the FasterDecoding Medusa format has biased ResBlocks and "
                         "one full-vocabulary LM head per head; this module differs (shared or "
                         "truncated head, or no bias): save with fmt='vllm'.")
    tensors = {_medusa_ours_to_fd(k, cfg.num_layers): v for k, v in sd.items()}
    config = {"medusa_num_heads": cfg.medusa_num_heads, "medusa_num_layers": cfg.num_layers,
              "base_model_name_or_path": None, "hidden_size": cfg.hidden_size,
              "vocab_size": cfg.vocab_size}
    return tensors, {**config, **extra}, "medusa_lm_head.safetensors"


def save_mtp(cfg: DraftConfig, sd: dict, out_dir: str, extra: dict) -> str:
    cpath = os.path.join(out_dir, "config.json")
    if not os.path.isfile(cpath):
        raise FileNotFoundError(f"save_draft(mtp): {cpath} does not exist; MTP layers are written "
                                "into an existing target checkpoint directory.")
    with open(cpath) as f:
        config = json.load(f)
    L = config["num_hidden_layers"]
    tensors = {_mtp_to_ckpt(k, L): v for k, v in sd.items()}
    keep = _mtp_filter(L)
    for shard in glob.glob(os.path.join(out_dir, "*.safetensors")):
        if os.path.basename(shard) == "mtp.safetensors":
            continue
        with safe_open(shard, framework="pt") as f:
            clash = [k for k in f.keys() if keep(k)]
        if clash:
            raise ValueError(f"save_draft(mtp): {shard} already holds next-n tensors "
                             f"({clash[:3]} ...); remove them first.")
    path = os.path.join(out_dir, "mtp.safetensors")
    save_file(tensors, path, metadata={"format": "pt"})
    os.chmod(path, 0o644)
    index = os.path.join(out_dir, "model.safetensors.index.json")
    if os.path.isfile(index):  # HF loaders read the index: list the new shard there too
        with open(index) as f:
            idx = json.load(f)
        idx.setdefault("weight_map", {}).update(dict.fromkeys(tensors, "mtp.safetensors"))
        with open(index, "w") as f:
            json.dump(idx, f, indent=2)
    config.update({"num_nextn_predict_layers": cfg.num_layers, **extra})
    with open(cpath, "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    os.chmod(cpath, 0o644)
    return out_dir
