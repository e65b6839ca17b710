"""EAGLE-1 / HASS (method "eagle") and EAGLE-3 (method "eagle3") drafters over a paged KV pool.

Each is one (or a few) Llama-style decoder layers fed a token embedding and a target feature
(formats: docs/drafters.md, "Checkpoint formats"). The engine drives every KV-carrying drafter
(these two and `mtp.MTPDraft`) the same way:

    h = draft.first_hidden(feats)             # [B, T, F] target features -> [B, T, H]
    logit_h, next_h = draft(input_ids, h, positions, meta, cache)      # [B, T, H] each
    logits = draft.logits(logit_h)            # fp32 [B, T, V], always the target vocabulary
    # the chain's next step feeds next_h back as `hidden` (no first_hidden then)

`feats` is what `DecoderLM.forward_features(..., aux_ids=draft.aux_layer_ids,
final=draft.final_feature)` returns. The draft's K/V lives in its own pool with the target
pool's geometry (`allocate_paged_cache`), addressed by the target's block tables and slot
mappings. Parameter names are the HF checkpoint names (`self_attn.q_proj`, `mlp.gate_proj`,
...), so the checkpoint readers (draft_formats.py) only rename prefixes.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from npuspec.kernels.collectives import tp_all_reduce
from npuspec.kernels.paged_attention import paged_attention
from npuspec.kernels.linear_packed_cpu import linear_packed
from npuspec.models.decoder import (AttnMetadata, PagedKVCache, RMSNorm, _linear, _rotate_half,
                                    rope_inv_freq)

if TYPE_CHECKING:
    from npuspec.models.decoder import DecoderLM
    from npuspec.models.draft_config import DraftConfig


class Attention(nn.Module):
    """Llama/Qwen self-attention whose projections read `in_dim` features (2H in EAGLE-3's
    first layer). `attend(q, k, v)` writes K/V and attends; it is the owner's."""

    def __init__(self, cfg: "DraftConfig", in_dim: int):
        super().__init__()
        Hq, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.shape = (Hq, Hkv, D)
        self.q_proj = nn.Linear(in_dim, Hq * D, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(in_dim, Hkv * D, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(in_dim, Hkv * D, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(Hq * D, cfg.hidden_size, bias=cfg.o_bias)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:  # qwen3: RMSNorm over head_dim before RoPE
            self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.tp_world = 1  # > 1: sharded by heads (npuspec.models.tp.shard_draft)

    def forward(self, x, cos, sin, attend):
        q, k, v = self.project(x, cos, sin)
        o = _linear(attend(q, k, v), self.o_proj)  # [B, T, H]
        return tp_all_reduce(o) if self.tp_world > 1 else o

    def project(self, x, cos, sin):
        """x [B, T, in_dim] -> q [B, T, Hq, D], k/v [B, T, Hkv, D], normed and rotated."""
        B, T, _ = x.shape
        Hq, Hkv, D = self.shape
        if getattr(self, "qkv_packed", None) is not None:  # npuspec.models.packing.pack_draft
            qkv = linear_packed(x, self.qkv_packed, self.qkv_bias, (Hq + 2 * Hkv) * D)
            q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
            q, k, v = q.view(B, T, Hq, D), k.view(B, T, Hkv, D), v.view(B, T, Hkv, D)
        else:
            q = _linear(x, self.q_proj).view(B, T, Hq, D)
            k = _linear(x, self.k_proj).view(B, T, Hkv, D)
            v = _linear(x, self.v_proj).view(B, T, Hkv, D)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        return q, k, v


class MLP(nn.Module):
    def __init__(self, cfg: "DraftConfig"):
        super().__init__()
        H, I = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(H, I, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(H, I, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(I, H, bias=cfg.mlp_bias)
        self.tp_world = 1  # > 1: sharded by columns (npuspec.models.tp.shard_draft)

    def forward(self, x):
        if getattr(self, "gate_up_packed", None) is not None:  # packing.pack_draft
            gate, up = linear_packed(x, self.gate_up_packed, self.gate_up_bias,
                                     2 * self.down_proj.in_features).chunk(2, dim=-1)
        else:
            gate, up = _linear(x, self.gate_proj), _linear(x, self.up_proj)
        o = _linear(F.silu(gate) * up, self.down_proj)
        return tp_all_reduce(o) if self.tp_world > 1 else o


class DraftLayer(nn.Module):
    """One HF Llama/Qwen decoder layer. The caller applies the input norm(s) (which differ per
    method) and passes the attention input and the residual stream; the layer does the rest:
    h = residual + attn(x); out = h + mlp(post_attention_layernorm(h))."""

    def __init__(self, cfg: "DraftConfig", in_dim: int | None = None, input_norm: bool = True,
                 hidden_norm: bool = False):
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        # EAGLE-1's first layer has no input_layernorm (the fc output goes in as is)
        self.input_layernorm = RMSNorm(H, eps) if input_norm else None
        self.hidden_norm = RMSNorm(H, eps) if hidden_norm else None  # EAGLE-3 layer 0
        self.self_attn = Attention(cfg, in_dim or H)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.mlp = MLP(cfg)
        # the layer's index into the [L, ...] pool as a tensor (see DecoderLM.init_buffers)
        self.register_buffer("index", None, persistent=False)

    def forward(self, x, residual, cos, sin, attend):
        h = residual + self.self_attn(x, cos, sin, attend)  # [B, T, H]
        return h + self.mlp(self.post_attention_layernorm(h))


class PagedDraft(nn.Module):
    """What every KV-carrying drafter shares: the target binding, RoPE, the draft KV pool and
    the paged write+attend. Subclasses define `layers` (DraftLayers), `forward`, `logits`."""

    method = ""
    aux_layer_ids: tuple = ()   # DecoderLM.forward_features(aux_ids=...) for the first pass
    final_feature = True        # ... and final=: the target's post-norm hidden (EAGLE-1, MTP)
    layers: nn.ModuleList

    def __init__(self, cfg: "DraftConfig"):
        super().__init__()
        self.config = cfg
        self.register_buffer("inv_freq", None, persistent=False)
        object.__setattr__(self, "_target", None)

    @property
    def target_features(self) -> tuple:
        return self.aux_layer_ids, self.final_feature

    def bind_target(self, target: "DecoderLM") -> None:
        """Share the target's embedding / LM head. Not a submodule: `state_dict()` and `.to()`
        see the draft's own tensors only."""
        object.__setattr__(self, "_target", target)

    def init_buffers(self, device=None) -> None:
        """(Re)make the computed, non-persistent buffers (after a load on the meta device)."""
        self.inv_freq = rope_inv_freq(self.config).to(device)
        for i, layer in enumerate(self.layers):
            layer.index = torch.full((1, 1), i, dtype=torch.long, device=device)

    def _apply(self, fn, recurse=True):
        # keep the RoPE frequencies in fp32 whatever dtype the weights are moved to
        super()._apply(fn, recurse)
        if self.inv_freq is not None:
            self.inv_freq = rope_inv_freq(self.config).to(self.inv_freq.device)
        return self

    def allocate_paged_cache(self, num_blocks: int, block_size: int, dtype=None,
                             device=None) -> PagedKVCache:
        """k/v [num_draft_layers, num_blocks * block_size, Hkv, D], the target pool's geometry
        (num_blocks includes the scratch block 0)."""
        assert num_blocks >= 2 and block_size >= 1, (num_blocks, block_size)
        cfg = self.config
        w = self.layers[0].post_attention_layernorm.weight
        shape = (len(self.layers), num_blocks * block_size, cfg.num_kv_heads, cfg.head_dim)
        k = torch.zeros(shape, dtype=dtype or w.dtype, device=device or w.device)
        return PagedKVCache(k, torch.zeros_like(k), block_size)

    def _embed(self, input_ids, dtype, own: nn.Module | None = None):
        if own is not None:  # the checkpoint's own embedding (it differs from the target's)
            return own(input_ids)
        return self._target.embed_tokens(input_ids).to(dtype)  # [B, T, H]

    def _target_head(self, x):
        # the target's LM head (maybe packed) in the target's dtype -> fp32 [.., V]
        return self._target.head(x.to(self._target.norm.weight.dtype))

    # The draft loop samples in the draft's own vocabulary and maps to target ids only for what
    # leaves it (the next input's embedding, the drafts, q): identity unless the head has a
    # draft vocabulary of its own (EAGLE-3's d2t).
    @property
    def draft_vocab_size(self) -> int:
        return self.config.vocab_size

    def draft_logits(self, logit_h):
        return self.logits(logit_h)  # fp32 [.., draft_vocab_size]

    def draft_to_target_ids(self, ids):
        return ids

    def draft_to_target_probs(self, q):
        return q

    def _rope(self, positions, dtype):
        freqs = positions[..., None].float() * self.inv_freq  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]  # [B, T, 1, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def _write_kv(self, slot_mapping, cache: PagedKVCache, i: int, k, v) -> None:
        """Layer i's K/V [B, T, Hkv, D] into the pool at slot_mapping [B, T]. The write goes
        through the base pool with a tensor layer index, so Inductor updates the graph input
        in place (a write into the view cache.k[i] would be copied in and out of every step)."""
        B, T, Hkv, D = k.shape
        rows = slot_mapping.reshape(1, -1)  # not B * T: see DecoderLM._hidden_pair
        li = self.layers[i].index  # [1, 1]
        cache.k[li, rows] = k.reshape(1, B * T, Hkv, D)
        cache.v[li, rows] = v.reshape(1, B * T, Hkv, D)

    def _attend(self, meta: AttnMetadata, cache: PagedKVCache, i: int, q, k, v):
        # q [B, T, Hq, D], k/v [B, T, Hkv, D] -> [B, T, Hq*D]
        B, T, Hq, D = q.shape
        self._write_kv(meta.slot_mapping, cache, i, k, v)
        o = paged_attention(q, cache.k, cache.v, i, meta.block_table, meta.seq_lens,
                            cache.block_size)  # [B, T, Hq, D]
        return o.reshape(B, T, Hq * D)


class EagleDraft(PagedDraft):
    """EAGLE-1 / HASS (drafters.md §2.2): h0 = fc(cat[embed(x), hidden]) (embedding first),
    then the decoder layer(s), the first without input_layernorm; no final norm. The hidden it
    returns is both the LM-head input (the target's head) and the next step's feature."""

    method = "eagle"
    aux_layer_ids = ()
    final_feature = True

    def __init__(self, cfg: "DraftConfig"):
        super().__init__(cfg)
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H) if cfg.own_embed else None
        if cfg.para_norm:  # HASS `add_para_norm`: norms on both fc inputs
            self.embedding_layernorm = RMSNorm(H, eps)
            self.hidden_states_layernorm = RMSNorm(H, eps)
        self.fc = nn.Linear(2 * H, H, bias=cfg.fc_bias)
        self.layers = nn.ModuleList(DraftLayer(cfg, input_norm=i > 0) for i in range(cfg.num_layers))
        self.init_buffers()

    def first_hidden(self, feats):
        return feats  # the target's final post-norm hidden, [B, T, H]

    def forward(self, input_ids, hidden, positions, meta: AttnMetadata, cache: PagedKVCache):
        e = self._embed(input_ids, hidden.dtype, self.embed_tokens)  # [B, T, H]
        if self.config.para_norm:
            e, hidden = self.embedding_layernorm(e), self.hidden_states_layernorm(hidden)
        h = _linear(torch.cat([e, hidden], dim=-1), self.fc)  # [B, 2H] -> [B, T, H]
        cos, sin = self._rope(positions, h.dtype)
        for i, layer in enumerate(self.layers):
            x = h if layer.input_layernorm is None else layer.input_layernorm(h)
            h = layer(x, h, cos, sin, functools.partial(self._attend, meta, cache, i))
        return h, h

    def logits(self, logit_h):
        return self._target_head(logit_h)  # fp32 [.., V]


class Eagle3Draft(PagedDraft):
    """EAGLE-3 (drafters.md §3.2). First pass: g = fc(cat[aux_1..aux_n]) (`first_hidden`).
    Layer 0 attends over cat[input_layernorm(embed(x)), hidden_norm(g)] (2H) with residual g
    (hidden_norm(g) with norm_before_residual); extra layers are plain Llama layers. Returns
    (norm(h) for the LM head, prenorm h for the next step). The LM head covers a draft vocab of
    Vd ids; draft id d is target id d + d2t[d], every other target id gets -inf."""

    method = "eagle3"
    final_feature = False

    def __init__(self, cfg: "DraftConfig"):
        super().__init__(cfg)
        H, eps, Vd = cfg.hidden_size, cfg.rms_norm_eps, cfg.draft_vocab_size
        self.aux_layer_ids = tuple(cfg.aux_layer_ids)
        F_in = len(cfg.aux_layer_ids) * cfg.target_hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H) if cfg.own_embed else None
        # speculators `norm_before_fc` (gpt-oss drafts): RMSNorm over the concatenated features
        self.input_norm = RMSNorm(F_in, eps) if cfg.norm_before_fc else None
        self.fc = nn.Linear(F_in, H, bias=cfg.fc_bias)
        self.layers = nn.ModuleList(
            [DraftLayer(cfg, in_dim=2 * H, hidden_norm=True)]
            + [DraftLayer(cfg) for _ in range(cfg.num_layers - 1)])
        self.norm = RMSNorm(H, eps)
        self.lm_head = nn.Linear(H, Vd, bias=False)
        self.register_buffer("d2t", torch.zeros(Vd, dtype=torch.long))  # target id - draft id
        self.register_buffer("vocab_index", None, persistent=False)
        self.init_buffers()

    def init_buffers(self, device=None) -> None:
        super().init_buffers(device)
        # precomputed once, so logits() scatters with no host sync; None = identity map
        self.vocab_index = vocab_index(self.d2t, self.config.vocab_size)

    def first_hidden(self, feats):
        # feats [B, T, n_aux*Ht] -> [B, T, H]
        if self.input_norm is not None:
            feats = self.input_norm(feats)
        return _linear(feats, self.fc)

    def forward(self, input_ids, hidden, positions, meta: AttnMetadata, cache: PagedKVCache):
        e = self._embed(input_ids, hidden.dtype, self.embed_tokens)  # [B, T, H]
        l0 = self.layers[0]
        hn = l0.hidden_norm(hidden)
        residual = hn if self.config.norm_before_residual else hidden
        x = torch.cat([l0.input_layernorm(e), hn], dim=-1)  # [B, T, 2H], embedding first
        cos, sin = self._rope(positions, hidden.dtype)
        h = l0(x, residual, cos, sin, functools.partial(self._attend, meta, cache, 0))
        for i in range(1, len(self.layers)):
            layer = self.layers[i]
            h = layer(layer.input_layernorm(h), h, cos, sin,
                      functools.partial(self._attend, meta, cache, i))
        return self.norm(h), h

    def _head(self, logit_h):
        return _linear(logit_h, self.lm_head).float()  # [.., Vd]

    def logits(self, logit_h):
        return to_target_vocab(self._head(logit_h), self.vocab_index, self.config.vocab_size)

    @property
    def draft_vocab_size(self) -> int:
        return self.config.vocab_size if self.vocab_index is None else self.d2t.numel()

    def draft_logits(self, logit_h):
        return self._head(logit_h)

    def draft_to_target_ids(self, ids):
        return ids if self.vocab_index is None else self.vocab_index[ids]

    def draft_to_target_probs(self, q):
        # q [.., Vd] -> [.., V], 0 off the draft vocabulary
        return to_target_vocab(q, self.vocab_index, self.config.vocab_size, fill=0.0)


def vocab_index(d2t: torch.Tensor, V: int):
    """Draft id d -> target id d + d2t[d] as a [Vd] tensor; None for the identity map."""
    if d2t.is_meta or (d2t.numel() == V and not bool(d2t.any())):
        return None
    return torch.arange(d2t.numel(), device=d2t.device) + d2t


def to_target_vocab(ld: torch.Tensor, index, V: int, fill: float = float("-inf")) -> torch.Tensor:
    """Draft-vocabulary logits [.., Vd] -> target-vocabulary logits [.., V]: each draft id's
    logit lands on its target id, every other target id gets `fill` (-inf: q is 0 there; 0 for
    probabilities)."""
    if index is None:
        return ld
    out = ld.new_full((*ld.shape[:-1], V), fill)
    return out.index_copy(-1, index, ld)  # [.., V]
