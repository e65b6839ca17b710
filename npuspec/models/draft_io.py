"""What every drafter checkpoint reader and writer shares (draft_formats.py, dflash_loading.py):
reading config.json and the tensors (safetensors; pickles only when no other user can write
them), renaming, checks against the target, building the module from a state dict
(`_materialize`), and writing a checkpoint directory."""
from __future__ import annotations

import glob
import json
import logging
import os
import re
import stat
from typing import Callable, Optional

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from npuspec.models.config import ModelConfig, read_config_json
from npuspec.models.dflash import DFlashDraft, DSparkDraft
from npuspec.models.draft_config import DraftConfig
from npuspec.models.eagle import Eagle3Draft, EagleDraft
from npuspec.models.loading import load_tokenizer, safetensors_error, tokenizer_fingerprint
from npuspec.models.medusa import MedusaHeads
from npuspec.models.mtp import MTPDraft

log = logging.getLogger(__name__)

_CLASSES = {"eagle": EagleDraft, "eagle3": Eagle3Draft, "medusa": MedusaHeads, "mtp": MTPDraft,
            "dflash": DFlashDraft, "dspark": DSparkDraft}
_FORMAT_HELP = {
    "eagle": "EAGLE-LLaMA3.1 style (Llama config.json, tensors fc.weight [H, 2H], layers.0.*) or "
             "speculators (speculators_model_type 'eagle', fusion_fc.*, transformer.*)",
    "eagle3": "yuhuili EAGLE3 (LlamaForCausalLM + draft_vocab_size, midlayer.*, fc, norm, lm_head, "
              "d2t), SpecForge (LlamaForCausalLMEagle3, midlayer.* or layers.0.*) or speculators "
              "(speculators_model_type 'eagle3', transformer_layer_config, layers.0.*)",
    "medusa": "FasterDecoding (medusa_num_heads, tensors {h}.{l}.linear.weight) or vLLM "
              "MedusaConfig (num_heads, tensors blocks.{h}.layers.{l}.weight, lm_heads.{h}.weight)",
    "dflash": "z-lab DFlash (architectures DFlashDraftModel, dflash_config {mask_token_id, "
              "target_layer_ids}, tensors fc.weight, hidden_norm.weight, layers.{i}.*, "
              "norm.weight) or speculators (speculators_model_type 'dflash', "
              "transformer_layer_config, aux_hidden_state_layer_ids, mask_token_id)",
    "dspark": "DeepSpec DSpark (architectures Qwen3DSparkModel or SpecForge DSparkDraftModel, "
              "target_layer_ids, mask_token_id, markov_rank; tensors fc.weight, "
              "hidden_norm.weight, layers.{i}.*, norm.weight, markov_head.markov_w{1,2}.weight, "
              "confidence_head.proj.{weight,bias})",
}
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")


# ---- reading ---------------------------------------------------------------------------------
def _read_config(model_dir: str, draft_model_config: Optional[dict]) -> dict:
    d = read_config_json(model_dir, "a draft checkpoint directory needs its config.json (copy "
                                    "it from the hub snapshot).")
    hf = (draft_model_config or {}).get("hf_config") or {}
    return {**d, **hf}


def _load_pickle(path: str, flat: bool = True):
    """torch.load(weights_only=True), refused when another user could have written the file.
    flat: the result must be a dict of tensors (else whatever weights_only allows)."""
    for p in (path, os.path.dirname(os.path.abspath(path))):
        mode = os.stat(p).st_mode
        if mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise PermissionError(
                f"{path}: refusing to load a pickle checkpoint because {p} is writable by group "
                f"or others (mode {stat.filemode(mode)}); npuspec never loads pickles from a "
                "place another user can write to. Convert it to safetensors, e.g. python -c "
                "\"import torch; from safetensors.torch import save_file; save_file(torch.load("
                f"'{os.path.basename(path)}', weights_only=True), 'model.safetensors')\", or "
                "remove group/other write permission (chmod go-w) if you trust it.")
    sd = torch.load(path, map_location="cpu", weights_only=True)
    if not flat:
        return sd
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise ValueError(f"{path}: expected a flat state dict of tensors; convert it to safetensors.")
    return sd


def _read_tensors(model_dir: str, keep: Callable[[str], bool] = lambda n: True) -> dict:
    out: dict[str, torch.Tensor] = {}
    where: dict[str, str] = {}
    shards = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    for shard in shards:
        try:
            tensors = _read_shard(shard, keep)
        except (SafetensorError, OSError) as e:  # truncated, damaged header, unreadable
            raise safetensors_error(shard, e) from None
        for name, t in tensors.items():
            if name in out:
                raise ValueError(f"tensor {name!r} is in both {where[name]} and {shard}; "
                                 "remove one of the copies.")
            out[name], where[name] = t, shard
    if shards:
        return out
    pickles = sorted(glob.glob(os.path.join(model_dir, "pytorch_model*.bin"))
                     + glob.glob(os.path.join(model_dir, "medusa_lm_head.pt")))
    if not pickles:
        raise FileNotFoundError(f"{model_dir} has no *.safetensors (nor pytorch_model.bin / "
                                "medusa_lm_head.pt) weight files.")
    for p in pickles:
        out.update({k: v for k, v in _load_pickle(p).items() if keep(k)})
    return out


def _read_shard(shard: str, keep: Callable[[str], bool]) -> dict:
    with safe_open(shard, framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys() if keep(name)}


def _rename(name: str, pairs) -> str:
    for a, b in pairs:
        if name.startswith(a):
            return b + name[len(a):]
    return name


def _strip(tensors: dict, prefixes=("model.",)) -> dict:
    out = {}
    for name, t in tensors.items():
        if _IGNORED.search(name):
            continue  # computed buffers some exporters save
        out[_rename(name, [(p, "") for p in prefixes])] = t
    return out


# ---- checks against the target ------------------------------------------------------------------
def check_finished_training(model_dir: str) -> None:
    """Refuse a directory where `npuspec train-draft` stopped before writing its draft (it
    checkpoints to DIR/train_state every --save-every steps, and writes the draft at the end):
    its weights are missing, or a finished run's older ones, so loading would serve a draft
    that is not the one asked for. The message carries the command that finishes the run."""
    jpath = os.path.join(model_dir, "train_state", "state.json")
    if not os.path.isfile(jpath):
        return
    with open(jpath) as f:
        meta = json.load(f)
    step, steps = meta.get("step"), (meta.get("config") or {}).get("steps")
    cfg = os.path.join(model_dir, "config.json")
    # finished: the last step checkpointed, and the draft written after it (not an older run's)
    if (step is not None and step == steps and os.path.isfile(cfg)
            and os.path.getmtime(cfg) >= os.path.getmtime(jpath)):
        return
    cmd = meta.get("resume_command") or "its `npuspec train-draft` command with --resume"
    raise ValueError(f"{model_dir} holds an interrupted `npuspec train-draft` run (checkpoint "
                     f"at step {step} of {steps}), not a finished draft; finish it with: {cmd}")


def check_tokenizer(source: str, d: dict, target_dir: Optional[str]) -> None:
    """A head trained here records its target's tokenizer fingerprint ("npuspec_target" in
    config.json); another target's tokenizer is refused, naming both. Heads from elsewhere
    record none and are checked by vocab_size only."""
    rec = d.get("npuspec_target") or {}
    want = rec.get("tokenizer_sha256")
    if not want or target_dir is None:
        return
    tok = load_tokenizer(target_dir)
    if tok is None:
        return
    have = tokenizer_fingerprint(tok)
    if have != want:
        made_for = rec.get("name", "another model")
        raise ValueError(
            f"{source}: npuspec_target.tokenizer_sha256={want[:16]}... (the tokenizer of "
            f"{made_for}, which this draft was trained for) but the target's tokenizer has "
            f"{have[:16]}...: the same ids are other tokens. Use a draft trained for this "
            f"target (npuspec train-draft --target {target_dir}).")


def _check_same(source: str, key: str, value, target_value, what: str) -> None:
    if value is not None and value != target_value:
        raise ValueError(
            f"{source}: {key}={value} but the target's {what}={target_value}; this draft was made "
            f"for another target model. Use a draft trained for this target (or fix {key} in "
            f"config.json if it is wrong).")


def _check_layer_config(source: str, d: dict, mc: ModelConfig, target: ModelConfig) -> None:
    """vocab and RoPE must be the target's (hidden size is checked per method)."""
    _check_same(source, "vocab_size", d.get("vocab_size"), target.vocab_size, "vocab_size")
    _check_same(source, "rope_theta", float(mc.rope_theta), float(target.rope_theta), "rope_theta")


def _model_config(d: dict, source: str) -> ModelConfig:
    # EAGLE checkpoints are Llama configs; ModelConfig rejects what the layers cannot compute
    # (rope scaling, other activations) by name
    return ModelConfig.from_hf_dict({"model_type": "llama", **d}, source=source)


def _layer_fields(mc: ModelConfig, tensors: dict) -> dict:
    # biases follow the tensors (EAGLE configs often omit attention_bias / mlp_bias)
    has = lambda suffix: any(n.endswith(suffix) for n in tensors)  # noqa: E731
    return dict(hidden_size=mc.hidden_size, num_heads=mc.num_heads, num_kv_heads=mc.num_kv_heads,
                head_dim=mc.head_dim, intermediate_size=mc.intermediate_size,
                num_layers=mc.num_layers, rms_norm_eps=mc.rms_norm_eps, rope_theta=mc.rope_theta,
                vocab_size=mc.vocab_size, qk_norm=mc.qk_norm, model_type=mc.model_type,
                max_position_embeddings=mc.max_position_embeddings,
                attention_bias=has("self_attn.q_proj.bias"), o_bias=has("self_attn.o_proj.bias"),
                mlp_bias=has("mlp.gate_proj.bias"))


def _target_embed(target) -> Optional[torch.Tensor]:
    embed = getattr(target, "embed", None)
    return None if embed is None else embed.weight


def _target_head(target) -> Optional[torch.Tensor]:
    if target is None:
        return None
    if getattr(target, "lm_head", None) is not None:
        return target.lm_head.weight
    return _target_embed(target) if target.config.tie_word_embeddings else None


def _shared(ts: list, ref: Optional[torch.Tensor]) -> bool:
    """All of `ts` are (absent or) equal to the target's `ref`: use the target's."""
    ts = [t for t in ts if t is not None]
    if not ts:
        return True
    if ref is None:
        return False
    return all(t.shape == ref.shape and torch.equal(t.to(ref.dtype), ref) for t in ts)


def _wrong_method(source: str, method: str, found: str, use: str):
    return ValueError(f"{source}: this is {found} checkpoint, not a {method} one; load it with "
                      f"speculative_config method {use!r}.")


def _unknown_format(source: str, method: str, why: str):
    return ValueError(f"{source}: unknown {method} checkpoint format ({why}); supported: "
                      f"{_FORMAT_HELP[method]}.")


def _nested(d: dict, key: str, source: str) -> dict:
    sub = d.get(key)
    if not isinstance(sub, dict):
        raise ValueError(f"{source}: {key} must be an object holding the decoder layer's Llama "
                         f"config (found {sub!r}).")
    return sub


def _check_vocab_map(source, name, ids: torch.Tensor, t2d, V: int) -> None:
    """Draft ids must land on distinct target ids in [0, V); t2d, if shipped, must agree."""
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= V):
        raise ValueError(f"{source}: {name} maps draft ids to target ids outside [0, {V}) "
                         f"(min {int(ids.min())}, max {int(ids.max())}); the map does not belong "
                         "to this vocabulary.")
    if ids.unique().numel() != ids.numel():
        raise ValueError(f"{source}: {name} maps two draft ids to one target id.")
    if t2d is not None:
        if t2d.shape != (V,):
            raise ValueError(f"{source}: tensor 't2d' has shape {list(t2d.shape)}, expected [{V}].")
        if int(t2d.bool().sum()) != ids.numel() or not bool(t2d.bool()[ids].all()):
            log.warning("%s: t2d disagrees with %s; using %s", source, name, name)


# ---- building and writing ------------------------------------------------------------------------
def _materialize(cfg: DraftConfig, sd: dict, to_ckpt: Callable[[str], str], source: str,
                 target, dtype, device, orig: Optional[dict] = None, fp32: tuple = ()):
    """The module of cfg.method holding `sd` (our names), after checking names and shapes.
    `to_ckpt` maps our names back to the checkpoint's for messages; `orig` our -> read name;
    tensors whose names start with one of `fp32` stay float32 whatever `dtype` is."""
    orig = orig or {}
    with torch.device("meta"):
        module = _CLASSES[cfg.method](cfg)
    want = module.state_dict()
    missing = [to_ckpt(k) for k in want if k not in sd]
    unknown = [orig.get(k, to_ckpt(k)) for k in sd if k not in want]
    if missing or unknown:
        raise ValueError(
            f"{source}: the tensors do not match a {cfg.method} draft in {cfg.format} format "
            f"({cfg.summary()}): missing {sorted(missing)}, unknown {sorted(unknown)}. Check that "
            f"the checkpoint is a {cfg.method} draft and that config.json describes it.")
    for k, t in sd.items():
        if tuple(t.shape) != tuple(want[k].shape):
            raise ValueError(
                f"{source}: tensor {orig.get(k, to_ckpt(k))!r} has shape {list(t.shape)}, expected "
                f"{list(want[k].shape)} (from config.json: {cfg.summary()}); the config does not "
                "describe these weights.")
    sd = {k: (t.to(torch.float32 if k.startswith(fp32) else dtype) if t.is_floating_point()
              else t.long()) for k, t in sd.items()}
    module.load_state_dict(sd, strict=True, assign=True)
    module.init_buffers()  # they were built on the meta device
    module.to(device=device)
    module.eval().requires_grad_(False)
    module.bind_target(target)
    return module


def _layer_dict(cfg: DraftConfig, arch: str) -> dict:
    d = {"architectures": [arch], "model_type": cfg.model_type, "hidden_size": cfg.hidden_size,
         "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
         "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
         "intermediate_size": cfg.intermediate_size, "hidden_act": "silu",
         "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
         "max_position_embeddings": cfg.max_position_embeddings, "vocab_size": cfg.vocab_size,
         "tie_word_embeddings": False}
    if cfg.model_type != "qwen2":
        d["attention_bias"] = cfg.attention_bias
    if cfg.model_type == "llama":
        d["mlp_bias"] = cfg.mlp_bias
    return d


def _write(out_dir: str, tensors: dict, config: dict, weights: str = "model.safetensors") -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, weights)
    save_file(tensors, path, metadata={"format": "pt"})
    os.chmod(path, 0o644)  # shared checkpoints: world-readable
    cpath = os.path.join(out_dir, "config.json")
    with open(cpath, "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    os.chmod(cpath, 0o644)
    return out_dir
