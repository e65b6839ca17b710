"""DeepSeek-style multi-token-prediction (MTP, "next-n") layers on a Llama / Qwen2 / Qwen3 target
(method "mtp"; drafters.md §5.2).

The weights live in the target checkpoint as extra layers `model.layers.{L+i}.*` (L = the
target's num_hidden_layers, i < num_nextn_predict_layers): enorm, hnorm, eh_proj, one decoder
layer of the target's family (its biases, Qwen3's q/k norms), shared_head.norm and optionally
their own embed_tokens / shared_head.head (else the target's are shared). One step:

    e = embed(x), zeroed where position == 0 (nothing precedes the first token)
    h = layer(eh_proj(cat[enorm(e), hnorm(hidden)]))    # embedding first; h = residual + out
    logit_h = next_h = shared_head.norm(h)              # the recycled hidden is post-norm (§1.6)

The first pass reads the target's final post-norm hidden. With K > n_predict the engine
reuses the layers: `spec_step` picks layer `spec_step % n` (one layer per step).
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
from torch import nn

from npuspec.models.decoder import AttnMetadata, PagedKVCache, RMSNorm, _linear
from npuspec.models.eagle import DraftLayer, PagedDraft

if TYPE_CHECKING:
    from npuspec.models.draft_config import DraftConfig


class SharedHead(nn.Module):
    def __init__(self, cfg: "DraftConfig"):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # the checkpoint's own head, when it differs from the target's LM head
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if cfg.own_lm_head else None


class MTPLayer(DraftLayer):
    """A target-family decoder layer plus the next-n parts (HF names under model.layers.{L+i})."""

    def __init__(self, cfg: "DraftConfig"):
        super().__init__(cfg)
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H) if cfg.own_embed else None
        self.enorm = RMSNorm(H, eps)
        self.hnorm = RMSNorm(H, eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.shared_head = SharedHead(cfg)


class MTPDraft(PagedDraft):
    method = "mtp"
    aux_layer_ids = ()
    final_feature = True

    def __init__(self, cfg: "DraftConfig"):
        super().__init__(cfg)
        self.layers = nn.ModuleList(MTPLayer(cfg) for _ in range(cfg.num_layers))
        self.init_buffers()

    def first_hidden(self, feats):
        return feats  # the target's final post-norm hidden, [B, T, H]

    def forward(self, input_ids, hidden, positions, meta: AttnMetadata, cache: PagedKVCache,
                spec_step: int = 0):
        i = spec_step % len(self.layers)
        m = self.layers[i]
        e = self._embed(input_ids, hidden.dtype, m.embed_tokens)  # [B, T, H]
        e = e.masked_fill((positions == 0)[..., None], 0.0)  # no branch: a where on device
        h0 = _linear(torch.cat([m.enorm(e), m.hnorm(hidden)], dim=-1), m.eh_proj)  # [B, T, H]
        cos, sin = self._rope(positions, h0.dtype)
        h = m(m.input_layernorm(h0), h0, cos, sin, functools.partial(self._attend, meta, cache, i))
        out = m.shared_head.norm(h)
        return out, out

    def logits(self, logit_h, spec_step: int = 0):
        head = self.layers[spec_step % len(self.layers)].shared_head.head
        if head is None:
            return self._target_head(logit_h)
        return _linear(logit_h, head).float()  # [.., V]
