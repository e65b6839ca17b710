"""Load and save drafter checkpoints: EAGLE, EAGLE-3, Medusa, MTP, DFlash, DSpark (drafters.md
§2, §3, §5-8).

    draft = load_draft(method, path, target_config, target, dtype=..., device=...)
    save_draft(draft, out_dir, fmt=...)      # an HF-format directory load_draft reads back

Formats read unchanged (config.json + *.safetensors; pickles only as described below):

    eagle   "eagle"        EAGLE-LLaMA3.1 style: plain Llama config, fc [H, 2H] (+ fc.bias),
                           layers.{i}.* (layer 0 without input_layernorm), optional
                           embed_tokens; any tensor may carry a `model.` prefix
            "speculators"  speculators_model_type "eagle": fusion_fc.*, transformer.*
    eagle3  "yuhuili"      LlamaForCausalLM + draft_vocab_size: midlayer.*, fc [H, n*Ht],
                           norm, lm_head [Vd, H], d2t [Vd], t2d [V], optional embed_tokens
            "specforge"    LlamaForCausalLMEagle3 (+ target_hidden_size, aux layer ids,
                           eagle_config, norm_before_residual): midlayer.* or layers.{i}.*
            "speculators"  speculators_model_type "eagle3", transformer_layer_config{...},
                           layers.{i}.*; norm_before_residual defaults to TRUE here (vLLM)
    medusa  "fasterdecoding" medusa_num_heads / medusa_num_layers: {h}.{l}.linear.{weight,bias},
                           {h}.{num_layers}.weight (medusa_lm_head.pt or a safetensors)
            "vllm"         MedusaConfig: num_heads, num_hidden_layers, medusa_fc_bias (False),
                           truncated_vocab_size, original_lm_head: blocks.{h}.layers.{l}.*,
                           lm_heads.{h}.weight | lm_head.weight, token_map; optional
                           `medusa_heads.` prefix
    mtp     "deepseek"     `path` is the TARGET checkpoint: num_nextn_predict_layers, tensors
                           model.layers.{L+i}.{enorm,hnorm,eh_proj,shared_head.norm,...}
    dflash  "zlab"         DFlashDraftModel: block_size, num_target_layers, dflash_config
                           {mask_token_id, target_layer_ids (HF ids, aux = id + 1), causal};
                           layers.{i}.* | midlayer.*, fc, hidden_norm, norm, optional lm_head +
                           d2t, embed_tokens; mask_embedding.pt or a mask_embedding tensor
            "speculators"  speculators_model_type "dflash", transformer_layer_config{...},
                           aux_hidden_state_layer_ids (vLLM ids), mask_token_id, block_size
    dspark  "deepspec"     Qwen3DSparkModel | SpecForge DSparkDraftModel: the DFlash keys and
                           tensors + markov_rank, markov_head_type "vanilla", confidence head
                           (markov_head.markov_w{1,2}, confidence_head.proj.*, kept fp32)
    (details: npuspec.models.dflash_loading)

A tensor equal to the target's (embed_tokens, an MTP shared_head.head) is dropped and the
target's is used; a different one is kept as the draft's own. Pickles (pytorch_model.bin,
medusa_lm_head.pt) load with torch.load(weights_only=True), and only when neither the file nor
its directory is writable by group or others. `draft_model_config={"hf_config": {...}}`
overrides config.json keys (vLLM's meaning).
"""
from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os
import re
import stat
from typing import Any, Callable, Optional

import torch

from npuspec.models.config import ModelConfig, read_config_json
from npuspec.models.dflash import DFlashDraft, DSparkDraft
from npuspec.models.eagle import Eagle3Draft, EagleDraft
from npuspec.models.medusa import MedusaHeads
from npuspec.models.mtp import MTPDraft

log = logging.getLogger(__name__)

FORMATS = {
    "eagle": ("eagle", "speculators"),
    "eagle3": ("specforge", "yuhuili", "speculators"),
    "medusa": ("vllm", "fasterdecoding"),
    "mtp": ("deepseek",),
    "dflash": ("zlab", "speculators"),
    "dspark": ("deepspec",),
}
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
_MTP_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    """Everything a drafter module is built from. Attention fields follow HF Llama names;
    `vocab_size` is always the TARGET vocabulary."""
    method: str                      # "eagle" | "eagle3" | "medusa" | "mtp" | "dflash" | "dspark"
    hidden_size: int
    num_heads: int = 1
    num_kv_heads: int = 1
    head_dim: int = 2
    intermediate_size: int = 1
    num_layers: int = 1              # decoder layers (MTP: next-n layers; Medusa: ResBlocks per head)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    vocab_size: int = 0              # target V
    draft_vocab_size: int = 0        # EAGLE-3 Vd, Medusa truncated_vocab_size (= V when full)
    aux_layer_ids: tuple = ()        # EAGLE-3: DecoderLM.forward_features(aux_ids=...)
    norm_before_residual: bool = False
    target_hidden_size: int = 0      # Ht (EAGLE-3 fc input is len(aux_layer_ids) * Ht)
    attention_bias: bool = False     # q/k/v biases
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False            # qwen3 per-head q/k RMSNorm
    fc_bias: bool = False            # EAGLE fc / Medusa ResBlock bias
    norm_before_fc: bool = False     # speculators EAGLE-3 input_norm over the aux features
    para_norm: bool = False          # HASS add_para_norm
    own_embed: bool = False          # the checkpoint's embedding differs from the target's
    own_lm_head: bool = False        # EAGLE-3 always; MTP shared_head.head; Medusa heads
    original_lm_head: bool = False   # Medusa: one LM head for all heads
    medusa_num_heads: int = 0
    model_type: str = "llama"
    max_position_embeddings: int = 2048
    format: str = ""                 # the checkpoint format it was read from
    # DFlash / DSpark (drafters.md §7-8)
    block_size: int = 0              # query slots of one block ("-b16" = 16)
    mask_token_id: int = -1          # the input id of the block's MASK slots
    sample_from_anchor: bool = False  # DSpark: slot j predicts anchor+j+1 (K = block_size drafts)
    draft_causal: bool = False       # dflash_config.causal: a causal query block
    own_mask_embedding: bool = False  # a trained MASK embedding [H] instead of embed(mask id)
    markov_rank: int = 0             # DSpark Markov head rank r (0 = none)
    confidence_with_markov: bool = True  # DSpark confidence head input: [h; W1[prev]] or h

    @classmethod
    def from_target(cls, method: str, target: ModelConfig, **overrides) -> "DraftConfig":
        """A draft config sized like `target` (a fresh drafter to train, tests)."""
        if method not in _CLASSES:
            raise ValueError(f"method={method!r}: choose one of {', '.join(_CLASSES)}")
        d: dict[str, Any] = dict(
            method=method, hidden_size=target.hidden_size, num_heads=target.num_heads,
            num_kv_heads=target.num_kv_heads, head_dim=target.head_dim,
            intermediate_size=target.intermediate_size, rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta, vocab_size=target.vocab_size,
            draft_vocab_size=target.vocab_size, target_hidden_size=target.hidden_size,
            max_position_embeddings=target.max_position_embeddings, format=default_format(method))
        if method == "eagle3":
            d.update(aux_layer_ids=default_aux_layer_ids(target.num_layers), own_lm_head=True)
        elif method == "mtp":
            d.update(model_type=target.model_type, qk_norm=target.qk_norm,
                     attention_bias=target.attention_bias, o_bias=target.o_bias,
                     mlp_bias=target.mlp_bias)
        elif method == "medusa":
            d.update(medusa_num_heads=3, fc_bias=True, own_lm_head=True)
        elif method in ("dflash", "dspark"):
            d.update(aux_layer_ids=default_block_aux_ids(target.num_layers, 1),
                     model_type=target.model_type, qk_norm=target.qk_norm,
                     block_size=16 if method == "dflash" else 7,
                     sample_from_anchor=method == "dspark",
                     mask_token_id=target.vocab_size - 1, own_mask_embedding=True)
            if method == "dspark":
                d.update(markov_rank=min(256, target.hidden_size))
        d.update(overrides)
        if "aux_layer_ids" in overrides:
            d["aux_layer_ids"] = tuple(d["aux_layer_ids"])
        return cls(**d)

    def summary(self) -> str:
        s = (f"hidden_size={self.hidden_size}, vocab_size={self.vocab_size}")
        if self.method == "medusa":
            return s + f", heads={self.medusa_num_heads}, truncated_vocab_size={self.draft_vocab_size}"
        s += (f", num_attention_heads={self.num_heads}, num_key_value_heads={self.num_kv_heads}, "
              f"head_dim={self.head_dim}, intermediate_size={self.intermediate_size}")
        if self.method in ("eagle3", "dflash", "dspark"):
            s += (f", draft_vocab_size={self.draft_vocab_size}, target_hidden_size="
                  f"{self.target_hidden_size}, aux layers {list(self.aux_layer_ids)}")
        if self.method in ("dflash", "dspark"):
            s += f", block_size={self.block_size}, num_hidden_layers={self.num_layers}"
        if self.method == "dspark":
            s += f", markov_rank={self.markov_rank}"
        return s


def default_format(method: str) -> str:
    return FORMATS[method][0]


def default_block_aux_ids(num_layers: int, num_draft_layers: int) -> tuple:
    """z-lab's `build_target_layer_ids` as vLLM aux ids (+1): HF layer ids evenly spaced over
    [1, L-3] for n draft layers, [L//2] for one."""
    L, n = num_layers, num_draft_layers
    if n == 1:
        hf = [L // 2]
    else:
        lo, hi = 1, L - 3
        hf = [round(lo + i * (hi - lo) / (n - 1)) for i in range(n)]
    return tuple(i + 1 for i in hf)


def default_aux_layer_ids(num_layers: int) -> tuple:
    """vLLM's default EAGLE-3 aux layers when a checkpoint names none: (2, L//2, L-3)."""
    return (2, num_layers // 2, num_layers - 3)


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
    from safetensors import SafetensorError

    out: dict[str, torch.Tensor] = {}
    where: dict[str, str] = {}
    shards = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    for shard in shards:
        try:
            tensors = _read_shard(shard, keep)
        except (SafetensorError, OSError) as e:  # truncated, damaged header, unreadable
            from npuspec.models.loading import safetensors_error
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
    from safetensors import safe_open

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


# ---- building ---------------------------------------------------------------------------------
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


def load_draft(method: str, path: str, target_config: ModelConfig, target=None, *,
               dtype: torch.dtype = torch.float32, device="cpu",
               draft_model_config: Optional[dict] = None):
    """Load the drafter of `method` from the checkpoint directory `path` (for "mtp", the
    target's own checkpoint directory) for the target `target` (a DecoderLM with config
    `target_config`; its embedding / LM head are shared, not copied). -> EagleDraft |
    Eagle3Draft | MedusaHeads | MTPDraft | DFlashDraft | DSparkDraft, on `device` in `dtype`
    (a DSpark confidence head in fp32), in eval mode."""
    if method not in _CLASSES:
        raise ValueError(f"load_draft: method={method!r} has no checkpoint loader; model-based "
                         f"drafters are {', '.join(_CLASSES)}.")
    from npuspec.models.loading import resolve_model_dir

    if path is None and method != "mtp":
        raise ValueError(f"load_draft: method {method!r} needs the draft checkpoint directory "
                         "(speculative_config.model).")
    model_dir = resolve_model_dir(path)
    d = _read_config(model_dir, draft_model_config)
    source = model_dir
    kw = dict(target=target, dtype=dtype, device=device)
    if method == "mtp":
        return _load_mtp(d, model_dir, target_config, **kw)
    tensors = _read_tensors(model_dir)
    if method in ("dflash", "dspark"):
        from npuspec.models import dflash_loading

        return dflash_loading.load(method, d, model_dir, tensors, target_config, **kw)
    return {"eagle": _load_eagle, "eagle3": _load_eagle3, "medusa": _load_medusa}[method](
        d, tensors, target_config, source, **kw)


def _wrong_method(source: str, method: str, found: str, use: str):
    return ValueError(f"{source}: this is {found} checkpoint, not a {method} one; load it with "
                      f"speculative_config method {use!r}.")


def _unknown_format(source: str, method: str, why: str):
    return ValueError(f"{source}: unknown {method} checkpoint format ({why}); supported: "
                      f"{_FORMAT_HELP[method]}.")


def _load_eagle(d, tensors, tcfg: ModelConfig, source, **kw):
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


def _nested(d: dict, key: str, source: str) -> dict:
    sub = d.get(key)
    if not isinstance(sub, dict):
        raise ValueError(f"{source}: {key} must be an object holding the decoder layer's Llama "
                         f"config (found {sub!r}).")
    return sub


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


def _load_eagle3(d, tensors, tcfg: ModelConfig, source, **kw):
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


def _load_medusa(d, tensors, tcfg: ModelConfig, source, **kw):
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


def _load_mtp(d, model_dir, tcfg: ModelConfig, **kw):
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


# ---- saving ---------------------------------------------------------------------------------
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
    from safetensors.torch import save_file

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


def save_draft(module, out_dir: str, fmt: Optional[str] = None, *,
               dtype: Optional[torch.dtype] = None, extra_config: Optional[dict] = None) -> str:
    """Write `module` (from load_draft or built from a DraftConfig) as a checkpoint directory
    `load_draft` reads back: eagle3 -> fmt "specforge" (default), "yuhuili", "speculators";
    eagle -> "eagle" (default), "speculators"; medusa -> "vllm" (default), "fasterdecoding";
    mtp -> "deepseek": `out_dir` is an existing TARGET checkpoint directory, the layers go to an
    extra shard mtp.safetensors and config.json gets num_nextn_predict_layers; dflash -> "zlab"
    (default), "speculators"; dspark -> "deepspec". `extra_config`
    is merged into config.json (e.g. base_model_name_or_path). Files are world-readable."""
    cfg: DraftConfig = module.config
    method = module.method
    fmt = fmt or default_format(method)
    if fmt not in FORMATS[method]:
        raise ValueError(f"save_draft: fmt={fmt!r} is not a {method} format; choose one of "
                         f"{', '.join(FORMATS[method])}.")
    if method in ("dflash", "dspark"):
        from npuspec.models import dflash_loading

        return _write(out_dir, *dflash_loading.export(module, fmt, dtype, extra_config or {}))
    sd = {k: v.detach().to(dtype if dtype and v.is_floating_point() else v.dtype).contiguous().cpu()
          for k, v in module.state_dict().items()}
    extra = extra_config or {}
    if method == "mtp":
        return _save_mtp(cfg, sd, out_dir, extra)
    if method == "eagle":
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
        return _write(out_dir, tensors, {**config, **extra})
    if method == "eagle3":
        return _write(out_dir, *_export_eagle3(cfg, sd, fmt, extra))
    return _write(out_dir, *_export_medusa(cfg, sd, fmt, extra))


def _export_eagle3(cfg: DraftConfig, sd: dict, fmt: str, extra: dict):
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


def _export_medusa(cfg: DraftConfig, sd: dict, fmt: str, extra: dict):
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


def _save_mtp(cfg: DraftConfig, sd: dict, out_dir: str, extra: dict) -> str:
    from safetensors import safe_open
    from safetensors.torch import save_file

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
