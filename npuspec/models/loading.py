"""Load HF-format checkpoints (config.json + *.safetensors [+ tokenizer.json]), or llama.cpp GGUF
files (npuspec.models.gguf), into DecoderLM."""
from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import re

import torch

from npuspec.models import quant
from npuspec.models.config import ModelConfig, read_config
from npuspec.models.decoder import DecoderLM
from npuspec.models.gguf import (find_gguf, load_gguf_tokenizer, read_gguf, read_gguf_config,
                                 read_gguf_types)

log = logging.getLogger(__name__)

TINY_MODEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny")

# HF name (inside model.layers.N.) -> (our name, index into the fused tensor or None)
_LAYER_MAP = {
    "self_attn.q_proj": ("wqkv", 0), "self_attn.k_proj": ("wqkv", 1), "self_attn.v_proj": ("wqkv", 2),
    "self_attn.o_proj": ("wo", None),
    "mlp.gate_proj": ("w13", 0), "mlp.up_proj": ("w13", 1), "mlp.down_proj": ("w2", None),
    "input_layernorm": ("attn_norm", None), "post_attention_layernorm": ("mlp_norm", None),
    "self_attn.q_norm": ("q_norm", None), "self_attn.k_norm": ("k_norm", None),
}
_FUSED_PARTS = {"wqkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                "w13": ("mlp.gate_proj", "mlp.up_proj")}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")


def resolve_model_dir(path: str) -> str:
    if path in ("tiny", None):
        return TINY_MODEL_DIR
    path = os.path.expanduser(str(path))
    if os.path.isfile(path) and path.lower().endswith(".gguf"):
        raise ValueError(
            f"model path {path!r} is a GGUF file, and this entry point reads HF checkpoint directories "
            "only; load GGUF files with npuspec.LLM(model=path) or npuspec.models.load_model(path).")
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"model path {path!r} is not a directory; pass a local HF checkpoint directory "
            "(config.json + *.safetensors), a llama.cpp .gguf file, or 'tiny' for the embedded model.")
    return path


def hf_to_npuspec(hf: dict[str, torch.Tensor], cfg: ModelConfig, source: str = "checkpoint") -> dict[str, torch.Tensor]:
    """Rename (and fuse q|k|v, gate|up) HF tensors into DecoderLM's state_dict names."""
    out, parts, unknown = {}, {}, []
    for name, t in hf.items():
        m = _LAYER_RE.match(name)
        if name == "model.embed_tokens.weight":
            out["embed.weight"] = t
        elif name == "model.norm.weight":
            out["norm.weight"] = t
        elif name == "lm_head.weight":
            if not cfg.tie_word_embeddings:
                out["lm_head.weight"] = t
        elif m and m.group(2) in _LAYER_MAP:
            ours, idx = _LAYER_MAP[m.group(2)]
            key = f"layers.{m.group(1)}.{ours}.{m.group(3)}"
            if idx is None:
                out[key] = t
            else:
                parts.setdefault(key, {})[idx] = t
        elif not _IGNORED.search(name):
            unknown.append(name)
    if unknown:
        raise ValueError(f"{source}: unexpected tensors {unknown[:5]}{' ...' if len(unknown) > 5 else ''} "
                         f"for a {cfg.model_type} checkpoint; the config and weights do not match "
                         "(or the model uses a feature npuspec's decoder does not implement).")
    for key, p in parts.items():
        n = 3 if ".wqkv." in key else 2
        missing = [i for i in range(n) if i not in p]
        assert not missing, f"{source}: {key} is missing parts {missing}"
        out[key] = _cat_rows([p[i] for i in range(n)], key)
    return out


def _cat_rows(parts: list, key: str):
    """Fuse q|k|v or gate|up. Quantized parts of one format stay quantized; a mix (a Q4_K_M
    file's Q4_K q beside a Q6_K v) is dequantised, which `quant.note_dequantised` reports."""
    if not any(isinstance(p, quant.QWeight) for p in parts):
        return torch.cat(parts, dim=0)
    if all(isinstance(p, quant.QWeight) for p in parts):
        fused = quant.cat_rows(parts)
        if fused is not None:
            return fused
    quant.note_dequantised("+".join(sorted({getattr(p, "kind", "float") for p in parts})), key)
    return torch.cat([p.dequantize() if isinstance(p, quant.QWeight) else p for p in parts])


def npuspec_to_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Inverse of hf_to_npuspec (used to save the trained tiny model in HF format)."""
    H, Hkv, D, I = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    inv = {ours: hf for hf, (ours, idx) in _LAYER_MAP.items() if idx is None}
    out = {}
    for name, t in sd.items():
        if name == "inv_freq":
            continue
        if name == "embed.weight":
            out["model.embed_tokens.weight"] = t
        elif name == "norm.weight":
            out["model.norm.weight"] = t
        elif name == "lm_head.weight":
            out[name] = t
        else:
            _, i, ours, kind = name.split(".")
            prefix = f"model.layers.{i}."
            if ours in _FUSED_PARTS:
                sizes = [H * D, Hkv * D, Hkv * D] if ours == "wqkv" else [I, I]
                for hf, piece in zip(_FUSED_PARTS[ours], t.split(sizes, dim=0)):
                    out[f"{prefix}{hf}.{kind}"] = piece.contiguous()
            else:
                out[f"{prefix}{inv[ours]}.{kind}"] = t
    return out


def save_model(model: DecoderLM, out_dir: str, tokenizer=None, dtype: torch.dtype | None = None,
               extra_config: dict | None = None) -> str:
    """Write `model` as an HF-format checkpoint (config.json, model.safetensors, and
    tokenizer.json when a `tokenizers.Tokenizer` is given) that both npuspec and transformers load.
    `dtype` converts the stored weights (e.g. float16 to keep a checkpoint small)."""
    from safetensors.torch import save_file

    cfg = model.config
    os.makedirs(out_dir, exist_ok=True)
    hf = {k: v.detach().to(dtype or v.dtype).contiguous()
          for k, v in npuspec_to_hf(model.state_dict(), cfg).items()}
    weights = os.path.join(out_dir, "model.safetensors")
    save_file(hf, weights, metadata={"format": "pt"})
    os.chmod(weights, 0o644)  # package data and shared checkpoints: world-readable
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump({**cfg.to_hf_dict(), **(extra_config or {})}, f, indent=2)
        f.write("\n")
    if tokenizer is not None:
        tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
    return str(out_dir)


def load_model(path: str = "tiny", dtype: torch.dtype = torch.float32, device="cpu",
               quantization: str | None = None) -> tuple[ModelConfig, DecoderLM]:
    """Read config.json and every *.safetensors shard of an HF checkpoint directory, or a
    llama.cpp GGUF file (a `.gguf` path, or a directory holding one GGUF and no safetensors;
    its tensors are dequantised to float32, see npuspec.models.gguf).
    `quantization` (npuspec.models.quant): "gguf" keeps a GGUF file's Q8_0/Q4_0/Q4_1/Q4_K
    weights as stored; "int8"/"int4" quantize the projections and the LM head after loading."""
    if quantization is not None and quantization not in quant.QUANTIZATIONS:
        raise ValueError(f"quantization={quantization!r}: use None, "
                         f"{', '.join(repr(q) for q in quant.QUANTIZATIONS)}")
    gguf_file = find_gguf(path)
    if quantization == "gguf" and gguf_file is None:
        raise ValueError(f"quantization='gguf': {path} is not a GGUF file; use 'int8' or 'int4' to "
                         "quantize an HF checkpoint at load")
    if gguf_file is not None:
        cfg, hf = read_gguf(gguf_file, as_stored=quantization == "gguf")
        if quantization is None:
            _hint_as_stored(gguf_file, hf)
        cfg, model = _build_model(cfg, hf_to_npuspec(hf, cfg, source=gguf_file), gguf_file,
                                  "the GGUF metadata", dtype, device)
        return cfg, _quantized(model, quantization, dtype)

    model_dir = resolve_model_dir(path)
    cfg = read_config(model_dir)
    shards = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not shards:
        raise FileNotFoundError(f"{model_dir} has no *.safetensors files; npuspec loads safetensors only "
                                "(convert with model.save_pretrained(dir, safe_serialization=True)).")
    hf = {}
    for shard in shards:
        hf.update(read_safetensors(shard))
    if _num_nextn_layers(model_dir):
        # next-n (MTP) layers model.layers.{L+i}.* are a drafter's: npuspec.models.draft_loading
        hf = {k: v for k, v in hf.items() if not _is_extra_layer(k, cfg.num_layers)}
    cfg, model = _build_model(cfg, hf_to_npuspec(hf, cfg, source=model_dir), model_dir, "config.json",
                              dtype, device)
    return cfg, _quantized(model, quantization, dtype)


def _hint_as_stored(path: str, hf: dict) -> None:
    """One line when a GGUF file's weights were quantized and are now held as floats."""
    kinds = read_gguf_types(path)
    stored = sorted(k for k in kinds if k in quant.GGUF_TYPES)
    if stored and path not in _HINTED:
        _HINTED.add(path)
        log.info("npuspec: %s holds %s weights, dequantised to float at load (%d MB); "
                 "LLM(quantization='gguf') runs them as stored", os.path.basename(path),
                 "/".join(stored), sum(t.numel() * 4 for t in hf.values()) >> 20)


_HINTED: set = set()


def _quantized(model: DecoderLM, quantization: str | None, dtype: torch.dtype) -> DecoderLM:
    if quantization in quant.SCHEMES:
        quant.quantize_model(model, quantization)
    device = model.norm.weight.device
    if quantization is not None and device.type == "npu":
        quant.place_on_npu(model, dtype, device)
    return model


REFETCH = "re-download it (or re-convert the checkpoint)"


def read_safetensors(path: str) -> dict[str, torch.Tensor]:
    """safetensors' load_file, with its errors (which name no file) turned into ValueErrors
    naming the file, what is wrong with it and the fix."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not os.path.isfile(path):
        raise ValueError(f"{path} is not a regular file; {REFETCH}")
    size = os.path.getsize(path)
    if size == 0:
        raise ValueError(f"{path} is empty (0 bytes): an interrupted download or copy; {REFETCH}")
    try:
        return load_file(path)
    except (SafetensorError, OSError) as e:  # a truncated file or a damaged header
        raise safetensors_error(path, e) from None


def safetensors_error(path: str, e: Exception) -> ValueError:
    """The error for a safetensors file that safetensors could not read (`e`)."""
    if isinstance(e, OSError):
        return ValueError(f"{path}: cannot be read ({e}); check the file, or {REFETCH}")
    size = os.path.getsize(path) if os.path.isfile(path) else 0
    what = "empty (0 bytes)" if size == 0 else f"not a valid safetensors file ({e})"
    return ValueError(f"{path} ({size} bytes) is {what}: it is truncated or corrupt; {REFETCH}")


def _num_nextn_layers(model_dir: str) -> int:
    with open(os.path.join(model_dir, "config.json")) as f:
        n = json.load(f).get("num_nextn_predict_layers")
    return n if isinstance(n, int) and n > 0 else 0


def _is_extra_layer(name: str, num_layers: int) -> bool:
    m = re.match(r"^model\.layers\.(\d+)\.", name)
    return bool(m) and int(m.group(1)) >= num_layers


def _build_model(cfg: ModelConfig, sd: dict[str, torch.Tensor], source: str, config_name: str,
                 dtype: torch.dtype, device) -> tuple[ModelConfig, DecoderLM]:
    """DecoderLM(cfg) holding `sd` (npuspec names), after checking names and shapes."""
    with torch.device("meta"):
        model = DecoderLM(cfg)
    expected = set(model.state_dict()) - {"inv_freq"}
    missing, extra = sorted(expected - set(sd)), sorted(set(sd) - expected)
    if missing or extra:
        fix = ("check attention_bias / tie_word_embeddings / num_key_value_heads in config.json."
               if config_name == "config.json" else
               f"the file is incomplete or not a plain {cfg.model_type} model.")
        raise ValueError(f"{source}: checkpoint does not match {config_name}: missing {missing[:5]}, "
                         f"unexpected {extra[:5]}; {fix}")
    for name, t in sd.items():
        want = model.state_dict()[name].shape
        if t.shape != want:
            raise ValueError(f"{source}: tensor {name} has shape {tuple(t.shape)}, {config_name} implies "
                             f"{tuple(want)}; the config does not describe these weights.")
    stored = {k: sd.pop(k) for k in [k for k, v in sd.items() if isinstance(v, quant.QWeight)]}
    _attach_stored(model, stored, dtype)
    model.load_state_dict({k: v.to(dtype) for k, v in sd.items()}, strict=False, assign=True)
    model.init_buffers()  # they were built on the meta device
    model.to(device=device)
    model.eval().requires_grad_(False)
    return cfg, model


def _attach_stored(model: DecoderLM, stored: dict, dtype: torch.dtype) -> None:
    """Put a GGUF file's quantized weights (`QWeight`, by state_dict name) in their layers.
    A tied embedding is the quantized LM head; an untied one is dequantised (a lookup reads a
    few rows, so only memory is at stake)."""
    for name, q in stored.items():
        owner, _, leaf = name.rpartition(".")
        assert leaf == "weight", name
        if owner == "embed" and model.lm_head is not None:
            model.embed.weight = torch.nn.Parameter(q.dequantize().to(dtype), requires_grad=False)
        elif owner in ("embed", "lm_head"):
            quant.set_head(model, q)
        else:
            quant.attach(model.get_submodule(owner), q)


def read_model_config(path: str = "tiny") -> ModelConfig:
    """The ModelConfig of whatever `load_model(path)` would load (HF directory or GGUF), without
    reading the weights."""
    gguf_file = find_gguf(path)
    if gguf_file is not None:
        return read_gguf_config(gguf_file)
    return read_config(resolve_model_dir(path))


def tokenizer_fingerprint(tok) -> str:
    """sha256 of a tokenizer's token -> id map (added tokens included), so it does not depend
    on the file's formatting. A trained head
    records its target's (config.json "npuspec_target"), and loading it beside another
    tokenizer is refused: the ids it learned would mean other tokens."""
    items = sorted(tok.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(items, ensure_ascii=False).encode()).hexdigest()


def load_tokenizer(path: str = "tiny"):
    """tokenizers.Tokenizer from `tokenizer.json` (or a GGUF file's tokenizer metadata), or None
    when there is none."""
    gguf_file = find_gguf(path)
    if gguf_file is not None:
        return load_gguf_tokenizer(gguf_file)
    model_dir = resolve_model_dir(path)
    tok_path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(tok_path):
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(tok_path)
    except Exception as e:  # tokenizers raises a bare Exception ('EOF while parsing a value')
        raise ValueError(f"{tok_path} cannot be read by the tokenizers library ({e}): it is "
                         f"truncated, corrupt or not a tokenizers JSON file; re-download it from "
                         f"the model's repository (or delete it and pass token ids)") from None
