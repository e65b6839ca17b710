"""`DraftConfig`: everything a drafter module (EAGLE, EAGLE-3, Medusa, MTP, DFlash, DSpark) is
built from, the checkpoint formats each method reads and writes, and the default aux layers.

The modules (npuspec/models/eagle.py, medusa.py, mtp.py, dflash.py), the checkpoint readers and
writers (draft_loading.py and the files it dispatches to) and training (npuspec/train) all
build from it.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from npuspec.models.config import ModelConfig

FORMATS = {
    "eagle": ("eagle", "speculators"),
    "eagle3": ("specforge", "yuhuili", "speculators"),
    "medusa": ("vllm", "fasterdecoding"),
    "mtp": ("deepseek",),
    "dflash": ("zlab", "speculators"),
    "dspark": ("deepspec",),
}


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
        if method not in FORMATS:
            raise ValueError(f"method={method!r}: choose one of {', '.join(FORMATS)}")
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
