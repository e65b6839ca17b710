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

The readers and writers per format: draft_formats.py (eagle, eagle3, medusa, mtp) and
dflash_loading.py (dflash, dspark), on the shared helpers of draft_io.py; `DraftConfig` is in
draft_config.py.

A tensor equal to the target's (embed_tokens, an MTP shared_head.head) is dropped and the
target's is used; a different one is kept as the draft's own. Pickles (pytorch_model.bin,
medusa_lm_head.pt) load with torch.load(weights_only=True), and only when neither the file nor
its directory is writable by group or others. `draft_model_config={"hf_config": {...}}`
overrides config.json keys (vLLM's meaning).
"""
from __future__ import annotations

from typing import Optional

import torch

from npuspec.models import dflash_loading, draft_formats
from npuspec.models.config import ModelConfig
from npuspec.models.draft_config import FORMATS, DraftConfig, default_format
from npuspec.models.draft_io import (_CLASSES, _read_config, _read_tensors, _write,
                                     check_finished_training, check_tokenizer)
from npuspec.models.loading import resolve_model_dir

_LOADERS = {"eagle": draft_formats.load_eagle, "eagle3": draft_formats.load_eagle3,
            "medusa": draft_formats.load_medusa}
_EXPORTERS = {"eagle": draft_formats.export_eagle, "eagle3": draft_formats.export_eagle3,
              "medusa": draft_formats.export_medusa}


def load_draft(method: str, path: str, target_config: ModelConfig, target=None, *,
               dtype: torch.dtype = torch.float32, device="cpu",
               draft_model_config: Optional[dict] = None, target_dir: Optional[str] = None):
    """Load the drafter of `method` from the checkpoint directory `path` (for "mtp", the
    target's own checkpoint directory) for the target `target` (a DecoderLM with config
    `target_config`; its embedding / LM head are shared, not copied). -> EagleDraft |
    Eagle3Draft | MedusaHeads | MTPDraft | DFlashDraft | DSparkDraft, on `device` in `dtype`
    (a DSpark confidence head in fp32), in eval mode. `target_dir`: the target's checkpoint
    (directory or GGUF), to check a head trained here against its tokenizer. Refused: a
    directory of an interrupted `npuspec train-draft` run, and a head made for another target
    (hidden size, vocabulary, RoPE, tokenizer), each naming the key and both values."""
    if method not in _CLASSES:
        raise ValueError(f"load_draft: method={method!r} has no checkpoint loader; model-based "
                         f"drafters are {', '.join(_CLASSES)}.")
    if path is None and method != "mtp":
        raise ValueError(f"load_draft: method {method!r} needs the draft checkpoint directory "
                         "(speculative_config.model).")
    model_dir = resolve_model_dir(path)
    check_finished_training(model_dir)
    d = _read_config(model_dir, draft_model_config)
    check_tokenizer(f"{method} draft {model_dir}", d, target_dir)
    kw = dict(target=target, dtype=dtype, device=device)
    if method == "mtp":
        return draft_formats.load_mtp(d, model_dir, target_config, **kw)
    tensors = _read_tensors(model_dir)
    if method in ("dflash", "dspark"):
        return dflash_loading.load(method, d, model_dir, tensors, target_config, **kw)
    return _LOADERS[method](d, tensors, target_config, model_dir, **kw)


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
        return _write(out_dir, *dflash_loading.export(module, fmt, dtype, extra_config or {}))
    sd = {k: v.detach().to(dtype if dtype and v.is_floating_point() else v.dtype).contiguous().cpu()
          for k, v in module.state_dict().items()}
    extra = extra_config or {}
    if method == "mtp":
        return draft_formats.save_mtp(cfg, sd, out_dir, extra)
    return _write(out_dir, *_EXPORTERS[method](cfg, sd, fmt, extra))
