"""DFlash (block diffusion, method "dflash") and DSpark (method "dspark") block drafters.

Formats and algorithm: docs/drafters.md, "DFlash and DSpark". Both draft a whole block in one forward over the
target's context features (no chain of [B, 1] steps):

    c = hidden_norm(fc(cat[aux_1..aux_n]))        # [R, T, H] from the target's aux states
    draft.write_context(c, positions, meta, cache) # context K/V of every layer at the context
                                                   # tokens' own slots (no input_layernorm on
                                                   # c; k_norm, RoPE on K only)
    h = draft(block_ids, positions, meta, cache)  # [B, S, H] post-norm; the block is
                                                   # [anchor, MASK x (S-1)] at positions
                                                   # anchor..anchor+S-1, attending to the
                                                   # context and (non-causally) to itself
    logits = draft.logits(h)                      # fp32 [B, S, V] (target vocabulary)

DFlash: the anchor is the bonus token; slot j >= 1 predicts the token at anchor+j, so S = K+1.
DSpark (sample_from_anchor): slot j predicts the token at anchor+j+1, so S = K; a Markov head
adds W2 W1[prev] to slot j's draft-vocabulary logits, prev being the token drafted before it
(the anchor for slot 0), and a confidence head gives sigmoid(proj([h_j; W1[prev_j]])) in fp32.

The draft's K/V pool has the target pool's geometry (`PagedDraft.allocate_paged_cache`): the
context of position p lives at p's slot, and the block's own K/V is written at the slots the next
verify step will use, where the next round's context overwrites it.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
from torch import nn

from npuspec.kernels.paged_attention import paged_attention
from npuspec.models.decoder import AttnMetadata, PagedKVCache, RMSNorm, _linear
from npuspec.models.eagle import DraftLayer, PagedDraft, to_target_vocab, vocab_index

if TYPE_CHECKING:
    from npuspec.models.draft_config import DraftConfig


class DFlashDraft(PagedDraft):
    method = "dflash"
    final_feature = False

    def __init__(self, cfg: "DraftConfig"):
        super().__init__(cfg)
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.aux_layer_ids = tuple(cfg.aux_layer_ids)  # vLLM ids: target_layer_ids + 1
        self.fc = nn.Linear(len(cfg.aux_layer_ids) * cfg.target_hidden_size, H, bias=False)
        self.hidden_norm = RMSNorm(H, eps)
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(H, eps)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H) if cfg.own_embed else None
        self.mask_embedding = nn.Parameter(torch.zeros(H)) if cfg.own_mask_embedding else None
        Vd = cfg.draft_vocab_size or cfg.vocab_size
        self.lm_head = nn.Linear(H, Vd, bias=False) if cfg.own_lm_head else None
        self.register_buffer("d2t", torch.zeros(Vd, dtype=torch.long) if cfg.own_lm_head else None)
        self.register_buffer("vocab_index", None, persistent=False)
        self.init_buffers()

    def init_buffers(self, device=None) -> None:
        super().init_buffers(device)
        if self.d2t is not None:
            self.vocab_index = vocab_index(self.d2t, self.config.vocab_size)

    @property
    def drafts_per_block(self) -> int:
        """The most drafts one block gives: block_size - 1 (DFlash), block_size (DSpark)."""
        return self.config.block_size - (0 if self.config.sample_from_anchor else 1)

    def block_len(self, k: int) -> int:
        """Query slots for K drafts: K+1 (anchor + K masks), or K when sampling from the anchor."""
        return k + (0 if self.config.sample_from_anchor else 1)

    # -- context ---------------------------------------------------------------------------------
    def context(self, feats):
        # feats [R, T, n_aux*Ht] -> c [R, T, H]
        return self.hidden_norm(_linear(feats, self.fc))

    def context_kv(self, i: int, c, cos, sin):
        """Layer i's context K/V [R, T, Hkv, D] from c (the q it computes is dropped)."""
        _, k, v = self.layers[i].self_attn.project(c, cos, sin)
        return k, v

    def write_context(self, c, positions, meta: AttnMetadata, cache: PagedKVCache) -> None:
        """Every layer's context K/V at meta.slot_mapping (c [R, T, H], positions [R, T])."""
        cos, sin = self._rope(positions, c.dtype)
        for i in range(len(self.layers)):
            self._write_kv(meta.slot_mapping, cache, i, *self.context_kv(i, c, cos, sin))

    # -- the block -------------------------------------------------------------------------------
    def embed_block(self, input_ids, dtype):
        e = self._embed(input_ids, dtype, self.embed_tokens)  # [B, S, H]
        if self.mask_embedding is None:
            return e
        is_mask = (input_ids == self.config.mask_token_id)[..., None]
        return torch.where(is_mask, self.mask_embedding.to(e.dtype), e)

    def forward(self, input_ids, positions, meta: AttnMetadata, cache: PagedKVCache):
        # input_ids/positions [B, S] -> [B, S, H] post final norm
        dt = self.norm.weight.dtype
        h = self.embed_block(input_ids, dt)
        cos, sin = self._rope(positions, dt)
        for i, layer in enumerate(self.layers):
            h = layer(layer.input_layernorm(h), h, cos, sin,
                      functools.partial(self._attend_block, meta, cache, i))
        return self.norm(h)

    def _attend_block(self, meta: AttnMetadata, cache: PagedKVCache, i: int, q, k, v):
        # q [B, S, Hq, D], k/v [B, S, Hkv, D] -> [B, S, Hq*D]
        if self.config.draft_causal:
            return self._attend(meta, cache, i, q, k, v)
        B, S, Hq, D = q.shape
        self._write_kv(meta.slot_mapping, cache, i, k, v)
        # non-causal: every slot sees the whole sequence up to the block's end. As B*S rows of
        # one query at that end, the causal paged op computes exactly that, with every
        # implementation (CPU, Triton, NPU) and no separate kernel.
        # (expand + reshape rather than repeat_interleave: the graphs layer proves those keep
        # rows independent, so a block graph may be padded to a captured batch size)
        MB = meta.block_table.shape[1]
        table = meta.block_table[:, None].expand(B, S, MB)
        lens = meta.seq_lens[:, None].expand(B, S)
        o = paged_attention(q.reshape(B * S, 1, Hq, D), cache.k, cache.v, i,
                            table.reshape(B * S, MB), lens.reshape(B * S), cache.block_size)
        return o.reshape(B, S, Hq * D)

    def draft_logits(self, h):
        """fp32 logits over the draft vocabulary [.., Vd] (the target's head when none)."""
        if self.lm_head is None:
            return self._target_head(h)
        return _linear(h, self.lm_head).float()

    def to_target(self, ld):
        return to_target_vocab(ld, self.vocab_index, self.config.vocab_size)

    def logits(self, h):
        return self.to_target(self.draft_logits(h))  # fp32 [.., V]


class MarkovHead(nn.Module):
    """DSpark's first-order Markov logit bias: W2 W1[prev] over the draft vocabulary."""

    def __init__(self, V: int, Vd: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(V, rank)
        self.markov_w2 = nn.Linear(rank, Vd, bias=False)

    def forward(self, prev):
        return _linear(self.markov_w1(prev), self.markov_w2).float()  # [.., Vd]


class _Proj(nn.Module):
    """proj.weight [1, in], proj.bias [1]: a plain module, not nn.Linear, so weight packing
    (models/packing.py) leaves this fp32 head alone."""

    def __init__(self, in_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, in_dim))
        self.bias = nn.Parameter(torch.zeros(1))


class ConfidenceHead(nn.Module):
    def __init__(self, in_dim: int):
        super().__init__()
        self.proj = _Proj(in_dim)
        nn.init.normal_(self.proj.weight, std=in_dim ** -0.5)

    def forward(self, x):
        # fp32 whatever the draft's dtype (vLLM keeps this head fp32)
        w, b = self.proj.weight.float(), self.proj.bias.float()
        return torch.sigmoid(torch.nn.functional.linear(x.float(), w, b))[..., 0]


class DSparkDraft(DFlashDraft):
    method = "dspark"

    def __init__(self, cfg: "DraftConfig"):
        super().__init__(cfg)
        V, Vd, r = cfg.vocab_size, cfg.draft_vocab_size or cfg.vocab_size, cfg.markov_rank
        self.markov_head = MarkovHead(V, Vd, r) if r > 0 else None
        conf_in = cfg.hidden_size + (r if cfg.confidence_with_markov and r > 0 else 0)
        self.confidence_head = ConfidenceHead(conf_in)

    def _apply(self, fn, recurse=True):
        # `.to(bfloat16)` must not round the confidence head: vLLM keeps it fp32, and the
        # budget compares its survival products against thresholds
        super()._apply(fn, recurse)
        p = self.confidence_head.proj
        p.weight.data, p.bias.data = p.weight.data.float(), p.bias.data.float()
        return self

    def slot_logits(self, h, prev):
        """fp32 target-vocabulary logits of slots h [.., H] whose previous tokens are prev [..]."""
        return self.biased_logits(self.draft_logits(h), prev)

    def biased_logits(self, ld, prev):
        """Draft-vocabulary logits ld [.., Vd] plus the Markov bias of prev [..] -> fp32 [.., V].
        (The walk computes ld for every slot in one head call, then biases slot by slot.)"""
        if self.markov_head is not None:
            ld = ld + self.markov_head(prev)
        return self.to_target(ld)

    def confidence(self, h, prev):
        """P(slot accepted | its prefix accepted), fp32 [..]."""
        x = h
        if self.markov_head is not None and self.config.confidence_with_markov:
            x = torch.cat([h.float(), self.markov_head.markov_w1(prev).float()], dim=-1)
        return self.confidence_head(x)
