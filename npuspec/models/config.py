"""ModelConfig: the few numbers the decoder needs, read from an HF `config.json`.

Llama, Qwen2 and Qwen3 differ only in small switches (attention biases, Qwen3's per-head
q/k RMSNorm, the default head_dim), so one dataclass covers all three. Anything the compact
decoder does not implement (rope scaling, sliding windows, other activations) is rejected
by name instead of silently computing something else.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qk_norm: bool = False          # qwen3: RMSNorm over head_dim on q and k before RoPE
    attention_bias: bool = False   # bias on q/k/v projections (always on for qwen2)
    o_bias: bool = False           # bias on o_proj (llama/qwen3 `attention_bias`)
    mlp_bias: bool = False         # llama `mlp_bias`
    eos_token_id: int | list[int] | None = None
    bos_token_id: int | None = None
    model_type: str = "llama"

    def __post_init__(self):
        assert self.num_heads % self.num_kv_heads == 0, (self.num_heads, self.num_kv_heads)
        assert self.head_dim % 2 == 0, self.head_dim

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """eos_token_id as a tuple (HF allows an int, a list or null)."""
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        """Build from an HF config dict; unsupported settings raise ValueError naming the key."""
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"{source}: model_type={model_type!r} is not supported; npuspec's compact decoder "
                f"implements {', '.join(SUPPORTED_MODEL_TYPES)}. Use a checkpoint of one of these "
                f"families (or run other models through torch.compile(..., backend='npuspec') directly).")

        def need(key):
            if d.get(key) is None:
                raise ValueError(f"{source}: required key {key!r} is missing; "
                                 f"add it (HF {model_type} config) and retry.")
            return positive(key, d[key])

        def positive(key, v):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{source}: {key}={v!r} must be a positive integer; fix the "
                                 f"config (HF {model_type} config) and retry.")
            return v

        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{source}: hidden_act={act!r} is not supported; only 'silu' (SwiGLU) is.")
        if d.get("use_sliding_window"):
            raise ValueError(f"{source}: use_sliding_window=true is not supported; "
                             "set it to false (full attention) or use another runtime.")
        if d.get("pretraining_tp", 1) not in (1, None):
            raise ValueError(f"{source}: pretraining_tp={d['pretraining_tp']} is not supported; set it to 1.")
        rope_theta = _rope_theta(d, source)

        hidden, heads = need("hidden_size"), need("num_attention_heads")
        kv_heads = positive("num_key_value_heads", d.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ValueError(f"{source}: num_attention_heads={heads} is not a multiple of "
                             f"num_key_value_heads={kv_heads}; fix the config.")
        head_dim = positive("head_dim", d.get("head_dim") or hidden // heads)
        if model_type == "qwen3" and d.get("head_dim") is None:
            head_dim = 128  # Qwen3Config's default, independent of hidden_size
        if head_dim % 2:
            raise ValueError(f"{source}: head_dim={head_dim} must be even (rotary embeddings "
                             f"rotate pairs); fix the config.")
        eps = d.get("rms_norm_eps", 1e-6)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
            raise ValueError(f"{source}: rms_norm_eps={eps!r} must be a number in (0, 1), "
                             f"e.g. 1e-6; fix the config.")
        bias = bool(d.get("attention_bias", False))
        return cls(
            vocab_size=need("vocab_size"), hidden_size=hidden,
            num_layers=need("num_hidden_layers"), num_heads=heads, num_kv_heads=kv_heads,
            head_dim=head_dim, intermediate_size=need("intermediate_size"),
            rope_theta=float(rope_theta), rms_norm_eps=float(eps),
            max_position_embeddings=positive("max_position_embeddings",
                                             d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qk_norm=model_type == "qwen3",
            attention_bias=True if model_type == "qwen2" else bias,
            o_bias=False if model_type == "qwen2" else bias,
            mlp_bias=bool(d.get("mlp_bias", False)) if model_type == "llama" else False,
            eos_token_id=d.get("eos_token_id"), bos_token_id=d.get("bos_token_id"),
            model_type=model_type)

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF config.json for this config (used by train_tiny.py)."""
        d = {
            "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                               "qwen3": "Qwen3ForCausalLM"}[self.model_type]],
            "model_type": self.model_type, "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "intermediate_size": self.intermediate_size,
            "hidden_act": "silu", "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
        }
        if self.model_type == "llama":
            d["attention_bias"] = self.o_bias
            d["mlp_bias"] = self.mlp_bias
        elif self.model_type == "qwen3":
            d["attention_bias"] = self.o_bias
        return d


def _rope_theta(d: dict[str, Any], source: str) -> float:
    # transformers >= 5 writes `rope_parameters`; older checkpoints `rope_theta` + `rope_scaling`.
    theta = d.get("rope_theta")
    for key in ("rope_scaling", "rope_parameters"):
        params = d.get(key)
        if params is None:
            continue
        if not isinstance(params, dict):
            raise ValueError(f"{source}: {key}={params!r} must be an object or null.")
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"{source}: {key}.rope_type={rope_type!r} is not supported; only plain "
                             f"RoPE is (set {key} to null or rope_type 'default').")
        if params.get("rope_theta") is not None:
            theta = params["rope_theta"]
    theta = 10000.0 if theta is None else theta
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise ValueError(f"{source}: rope_theta={theta!r} must be a positive number, e.g. "
                         f"10000.0; fix the config.")
    return theta


def read_config_json(model_dir: str, missing: str) -> dict:
    """`model_dir`/config.json as a dict; `missing` ends the error when there is none."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} does not exist: {missing}")
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON ({e}); fix or re-download it.") from None


def read_config(model_dir: str) -> ModelConfig:
    d = read_config_json(model_dir, "a model directory needs an HF config.json (save one with "
                                    "model.save_pretrained(dir) or copy it from the hub snapshot).")
    return ModelConfig.from_hf_dict(d, source=os.path.join(model_dir, "config.json"))
