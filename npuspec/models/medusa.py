"""Medusa heads (method "medusa"; drafters.md §6): no KV, no attention, no recurrence.

Head k (0-based) maps the target's final post-norm hidden h_t, the state that produced the
bonus token x_{t+1}, to logits for x_{t+k+2}: a stack of residual blocks x + SiLU(W x + b),
then its own LM head (FasterDecoding, vLLM `lm_heads.{k}`), one LM head shared by all heads
(vLLM `original_lm_head`), or the target's head when the checkpoint ships none. With a
truncated vocabulary (vLLM `truncated_vocab_size` < V, `token_map` [Vt]) head logits land at
target ids token_map[j] and every other id gets -inf. K must equal the number of heads.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from npuspec.models.decoder import _linear

if TYPE_CHECKING:
    from npuspec.models.decoder import DecoderLM
    from npuspec.models.draft_config import DraftConfig


class ResBlocks(nn.Module):
    def __init__(self, hidden: int, num_layers: int, bias: bool):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden, bias=bias) for _ in range(num_layers))

    def forward(self, x):
        for layer in self.layers:
            x = x + F.silu(_linear(x, layer))
        return x


class MedusaHeads(nn.Module):
    method = "medusa"
    aux_layer_ids: tuple = ()
    final_feature = True

    def __init__(self, cfg: "DraftConfig"):
        super().__init__()
        self.config = cfg
        H, Vt, n = cfg.hidden_size, cfg.draft_vocab_size, cfg.medusa_num_heads
        self.num_heads = n
        self.blocks = nn.ModuleList(ResBlocks(H, cfg.num_layers, cfg.fc_bias) for _ in range(n))
        self.lm_head = self.lm_heads = None
        if cfg.own_lm_head and cfg.original_lm_head:
            self.lm_head = nn.Linear(H, Vt, bias=False)
        elif cfg.own_lm_head:
            self.lm_heads = nn.ModuleList(nn.Linear(H, Vt, bias=False) for _ in range(n))
        if Vt < cfg.vocab_size:
            self.register_buffer("token_map", torch.zeros(Vt, dtype=torch.long))
        else:
            self.token_map = None
        # the target head's logits outside the token map: -inf (additive, no sync)
        self.register_buffer("vocab_mask", None, persistent=False)
        object.__setattr__(self, "_target", None)
        self.init_buffers()

    @property
    def target_features(self) -> tuple:
        return self.aux_layer_ids, self.final_feature

    def bind_target(self, target: "DecoderLM") -> None:
        object.__setattr__(self, "_target", target)  # not a submodule

    def init_buffers(self, device=None) -> None:
        if self.token_map is None or self.token_map.is_meta or self.lm_head is not None \
                or self.lm_heads is not None:
            return
        mask = torch.full((self.config.vocab_size,), float("-inf"), device=self.token_map.device)
        self.vocab_mask = mask.index_fill(0, self.token_map, 0.0)

    def check_k(self, k: int) -> None:
        if k != self.num_heads:
            raise ValueError(
                f"speculative_config.num_speculative_tokens={k}: a Medusa checkpoint with "
                f"{self.num_heads} heads drafts exactly {self.num_heads} tokens; set "
                f"num_speculative_tokens={self.num_heads}")

    def _head(self, k: int, x):
        if self.lm_heads is None and self.lm_head is None:  # the target's head
            out = self._target.head(x.to(self._target.norm.weight.dtype))  # fp32 [B, V]
            return out if self.vocab_mask is None else out + self.vocab_mask
        head = self.lm_head if self.lm_heads is None else self.lm_heads[k]
        out = _linear(x, head).float()  # [B, Vt]
        if self.token_map is None:
            return out
        full = out.new_full((out.shape[0], self.config.vocab_size), float("-inf"))
        return full.index_copy(-1, self.token_map, out)  # [B, V]

    def forward(self, h):
        # h [B, H]: the target's final post-norm hidden -> fp32 [B, num_heads, V];
        # head k's row predicts the token k+2 positions after the one h was computed at
        return torch.stack([self._head(k, block(h)) for k, block in enumerate(self.blocks)], dim=1)
