"""A compact decoder-only LM (Llama / Qwen2 / Qwen3) over a paged KV pool.

One forward serves prefill and (speculative) decode:

    logits = model(input_ids, positions, meta, cache)
    # input_ids [B, T] int64, positions [B, T] int64 -> logits [B, T, V] fp32

The paged pool (`PagedKVCache`, `allocate_paged_cache`) is what the engine's target runs
(engine/model_runner.py builds the metadata, engine/step.py calls this). K and V are one
[L, num_blocks * block_size, Hkv, D] tensor each; block 0 is scratch. `meta` is an
`AttnMetadata`: slot_mapping [B, T] (the pool row each new token's K/V is written to),
block_table [B, MB] and seq_lens [B] (the KV length after this step's writes). Row b's T tokens
are the last T of its sequence, and `npuspec::paged_attention` reads each row's first
seq_lens[b] positions through its block table, never `max_model_len`. Padding rows write the
scratch block (slot_mapping 0) and have seq_lens 0, so they attend to nothing. Rollback of
rejected drafts is the next step's smaller seq_lens: stale entries are never read, and are
overwritten. `forward_features` also returns the hidden states a drafter reads, `hidden` the
final residual (the prefill step's output).

The slot cache (`KVCache`, `allocate_cache`) is the same pool laid out as fixed request slots,
for callers that keep one sequence per slot (the `draft_model` drafter, helpers, benchmarks):
`meta` is then slots [B] int64, and `KVCache.metadata` derives the paged metadata from the
slots and positions (a row's positions are consecutive; -1 marks left padding).

Shapes depend only on (B, T) and the cache size, with no data-dependent Python
branches and no host syncs, so the forward can be torch.compile'd and captured in graphs.
`forward_causal` is a cache-free causal forward, for training.

Weights are stored fused (q|k|v and gate|up) to halve the number of matmuls per layer;
`npuspec.models.loading` maps HF names in and out.
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F
from torch import nn

from npuspec.kernels.collectives import tp_all_gather, tp_all_reduce
from npuspec.kernels.linear_cpu import linear
from npuspec.kernels.linear_packed_cpu import linear_packed, packed_rows
from npuspec.kernels.paged_attention import paged_attention
from npuspec.kernels.rms_norm_cpu import add_rms_norm
from npuspec.models.config import ModelConfig


@dataclasses.dataclass
class PagedKVCache:
    """A pool of fixed-size blocks per layer (docs/engine.md, "Paged KV and attention"). Pool
    row r = block r // block_size, offset r % block_size. Block 0 is scratch: padding tokens
    write there, no request owns it."""
    k: torch.Tensor  # [L, num_blocks * block_size, Hkv, D]
    v: torch.Tensor
    block_size: int

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1] // self.block_size


@dataclasses.dataclass(frozen=True)
class TPShard:
    """Which slice of a tensor-parallel model this rank holds (npuspec.models.tp)."""
    rank: int
    world: int
    vocab_start: int   # first vocabulary row of this rank's embedding / LM head
    vocab_rows: int    # rows per rank: ceil(V / world); the last rank's tail is zero padding


@dataclasses.dataclass
class AttnMetadata:
    """What attention needs to know about one step (nano-vllm's context object). Row b's T new
    tokens are the last T of its sequence: token t sits at position seq_lens[b] - T + t (a row
    with fewer real tokens is left-padded; its padding tokens point at the scratch block)."""
    slot_mapping: torch.Tensor  # int64 [B, T]: pool row each new token's K/V is written to
    block_table: torch.Tensor   # int32 [B, MB]: row b's logical block j -> physical block
    seq_lens: torch.Tensor      # int32 [B]: KV length after this step's writes (0 = padding row)


def slot_blocks(max_len: int, block_size: int) -> int:
    """Blocks each slot of a slot cache owns: enough for max_len positions."""
    return -(-max_len // block_size)


def slot_cache_rows(num_slots: int, max_len: int, block_size: int) -> int:
    """Pool rows of a slot cache (`allocate_cache`): the scratch block and every slot's run."""
    return block_size * (1 + num_slots * slot_blocks(max_len, block_size))


@dataclasses.dataclass
class KVCache:
    """The slot cache (`allocate_cache`): a paged pool laid out as fixed request slots, for
    callers that hold one sequence per slot (the `draft_model` drafter, helpers, benchmarks):
    slot s owns the `nb` consecutive blocks 1 + s*nb .., so its block-table row never changes.
    `k`/`v` are views of the pool in the per-slot layout [L, S, Hkv, max_len, D]."""
    pool: PagedKVCache
    num_slots: int
    max_len: int

    @property
    def blocks_per_slot(self) -> int:
        return slot_blocks(self.max_len, self.pool.block_size)

    def _slots_view(self, t: torch.Tensor) -> torch.Tensor:
        L, _, Hkv, D = t.shape
        rows = self.blocks_per_slot * self.pool.block_size
        per_slot = t[:, self.pool.block_size:].view(L, self.num_slots, rows, Hkv, D)
        return per_slot[:, :, :self.max_len].transpose(2, 3)  # [L, S, Hkv, max_len, D]

    @property
    def k(self) -> torch.Tensor:
        return self._slots_view(self.pool.k)

    @property
    def v(self) -> torch.Tensor:
        return self._slots_view(self.pool.v)

    def metadata(self, slots: torch.Tensor, positions: torch.Tensor) -> AttnMetadata:
        """slots int64 [B]; positions int64 [B, T], consecutive in a row, -1 = left padding
        (written to the scratch block). -> the paged step's metadata, without a host sync."""
        bs, nb = self.pool.block_size, self.blocks_per_slot
        first = (1 + slots * nb)[:, None]  # [B, 1]: the slot's first block
        rows = first * bs + positions      # [B, T]: blocks are consecutive, so rows are too
        slot_mapping = torch.where(positions >= 0, rows, torch.zeros_like(rows))
        block_table = (first + torch.arange(nb, device=slots.device)).to(torch.int32)  # [B, nb]
        seq_lens = (positions[:, -1] + 1).to(torch.int32)  # [B]
        return AttnMetadata(slot_mapping, block_table, seq_lens)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        # fp32 statistics, like HF, so logits match at fp32 tolerance in any dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    D = cfg.head_dim
    return 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D))  # [D/2]


def _linear(x, layer: nn.Linear):
    # a packed layer (npuspec.models.packing) reads its weight once per step at streaming
    # speed; otherwise few-row fp32 CPU calls take npuspec::linear_rows, the rest F.linear
    wp = getattr(layer, "packed", None)
    if wp is not None:
        return linear_packed(x, wp, layer.bias, layer.out_features)
    q = getattr(layer, "quant", None)  # weight-only quantized (npuspec.models.quant)
    if q is not None:
        y = q.linear(x)
        return y if layer.bias is None else y + layer.bias.to(y.dtype)
    return linear(x, layer.weight, layer.bias)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.cfg = cfg
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.wqkv = nn.Linear(cfg.hidden_size, (H + 2 * Hkv) * D, bias=cfg.attention_bias)
        self.wo = nn.Linear(H * D, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.w13 = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.w2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        # > 1 once npuspec.models.tp sharded this layer: wo and w2 are row-parallel, so their
        # outputs are partial sums the ranks add up
        self.tp_world = 1

    def _reduce(self, x):
        return tp_all_reduce(x) if self.tp_world > 1 else x

    def forward(self, x, residual, cos, sin, attend, fused: bool):
        # x [B, T, hidden]: the previous layer's MLP output (the embedding, with residual
        # None, for layer 0); residual: the stream before it. -> (MLP output, residual), so
        # each residual add is fused into the norm that follows it (npuspec::add_rms_norm
        # when `fused`). cos/sin [B, T, 1, D]; attend(q, k, v) -> [B, T, H*D]
        cfg = self.cfg
        B, T, _ = x.shape
        H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        eps = cfg.rms_norm_eps
        if residual is None:
            h, residual = self.attn_norm(x), x
        else:
            h, residual = add_rms_norm(x, residual, self.attn_norm.weight, eps, fused)
        qkv = _linear(h, self.wqkv)
        qk = qkv[..., :(H + Hkv) * D].view(B, T, H + Hkv, D)
        v = qkv[..., (H + Hkv) * D:].view(B, T, Hkv, D)
        if cfg.qk_norm:
            qk = torch.cat([self.q_norm(qk[:, :, :H]), self.k_norm(qk[:, :, H:])], dim=2)
        qk = qk * cos + _rotate_half(qk) * sin  # RoPE on q and k heads at once
        q, k = qk.split([H, Hkv], dim=2)
        h, residual = add_rms_norm(self._reduce(_linear(attend(q, k, v), self.wo)), residual,
                                   self.mlp_norm.weight, eps, fused)
        gate, up = _linear(h, self.w13).chunk(2, dim=-1)
        return self._reduce(_linear(F.silu(gate) * up, self.w2)), residual


class DecoderLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        for layer in self.layers:
            layer.register_buffer("index", None, persistent=False)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", None, persistent=False)
        self.init_buffers()
        # set by npuspec.models.packing.pack_model: the LM head packed for linear_packed
        # (then `lm_head` is None and, for a tied model, so is `embed`), and whether the
        # norms run as npuspec::add_rms_norm
        self.register_buffer("head_packed", None, persistent=False)
        self.fused_norm = False
        # set by npuspec.models.quant: the LM head weight-only quantized (a QuantParams), which
        # a tied model's embedding lookup reads too
        self.head_quant = None
        # set by npuspec.models.tp.shard_model: this rank's slice of the vocabulary-parallel
        # embedding and LM head (rows vocab_start .. vocab_start + embed rows; None: whole)
        self.tp: "TPShard | None" = None

    def init_buffers(self, device=None) -> None:
        """(Re)make the computed, non-persistent buffers (after a load on the meta device)."""
        self.inv_freq = rope_inv_freq(self.config).to(device)
        for i, layer in enumerate(self.layers):
            # the layer's index into the [L, ...] KV pool as a tensor input, not a constant:
            # Inductor then emits one KV-write kernel for all layers (a constant index bakes
            # the layer's offset into the code: one kernel, and one g++ run, per layer)
            layer.index = torch.full((1, 1), i, dtype=torch.long, device=device)

    def _apply(self, fn, recurse=True):
        # keep the RoPE frequencies in fp32 whatever dtype the weights are moved to
        super()._apply(fn, recurse)
        self.inv_freq = rope_inv_freq(self.config).to(self.norm.weight.device)
        return self

    # ---- cache -------------------------------------------------------------------------
    def allocate_cache(self, num_slots: int, max_len: int, dtype=None, device=None,
                       block_size: int = 16) -> KVCache:
        """A slot cache: `num_slots` sequences of up to `max_len` positions each."""
        rows = slot_cache_rows(num_slots, max_len, block_size)
        pool = self.allocate_paged_cache(rows // block_size, block_size, dtype, device)
        return KVCache(pool, num_slots, max_len)

    def allocate_paged_cache(self, num_blocks: int, block_size: int, dtype=None,
                             device=None) -> PagedKVCache:
        """num_blocks includes the scratch block 0."""
        assert num_blocks >= 2 and block_size >= 1, (num_blocks, block_size)
        cfg = self.config
        dtype = dtype or self.norm.weight.dtype
        device = device or self.norm.weight.device
        shape = (cfg.num_layers, num_blocks * block_size, cfg.num_kv_heads, cfg.head_dim)
        return PagedKVCache(torch.zeros(shape, dtype=dtype, device=device),
                            torch.zeros(shape, dtype=dtype, device=device), block_size)

    def kv_bytes_per_token(self, dtype=None) -> int:
        cfg = self.config
        esize = torch.empty((), dtype=dtype or self.norm.weight.dtype).element_size()
        return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * esize

    # ---- forward -----------------------------------------------------------------------
    def _rope(self, positions, dtype):
        freqs = positions[..., None].float() * self.inv_freq  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]  # [B, T, 1, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def _embed(self, input_ids):
        if self.tp is None:
            return self._lookup(input_ids)
        # vocabulary-parallel: each rank looks up the ids in its rows, zeros elsewhere, and
        # the all-reduce assembles every row (Megatron's VocabParallelEmbedding)
        local = input_ids - self.tp.vocab_start
        inside = (local >= 0) & (local < self.tp.vocab_rows)
        x = self._lookup(local.clamp(0, self.tp.vocab_rows - 1))
        return tp_all_reduce(x * inside[..., None].to(x.dtype))  # [B, T, hidden]

    def _lookup(self, input_ids):
        if self.embed is None and self.head_quant is not None:  # tied and quantized
            return self.head_quant.rows(input_ids).to(self.norm.weight.dtype)
        if self.embed is None:  # tied and packed
            return packed_rows(self.head_packed, input_ids).to(self.norm.weight.dtype)
        return self.embed(input_ids)  # [B, T, hidden]

    def _layers(self, x, cos, sin, attend, aux=None):
        """Run every layer; attend(i, q, k, v). -> (last MLP output, residual before it).
        `aux`: a dict {layer id: None} to fill with the residual stream entering each of those
        layers (vLLM's semantics: id i = the input of layer i, id L = the final residual
        before the norm), each [B, T, hidden]."""
        residual = None
        for i, layer in enumerate(self.layers):
            if aux is not None and i in aux:
                aux[i] = x if residual is None else x + residual
            x, residual = layer(x, residual, cos, sin, functools.partial(attend, i),
                                self.fused_norm)
        if aux is not None and len(self.layers) in aux:
            aux[len(self.layers)] = x + residual
        return x, residual

    # ---- pieces a drafter shares with its target ------------------------------------------
    def embed_tokens(self, input_ids):
        """Token embeddings [B, T, hidden] (read from the packed LM head when tied+packed)."""
        return self._embed(input_ids)

    def final_norm(self, h):
        """The final RMSNorm of a residual stream h [.., hidden]."""
        return self.norm(h)

    def head(self, x):
        """The LM head alone on normed hidden states x [.., hidden] -> fp32 logits [.., V]."""
        out = self._head_rows(x)
        if self.tp is None:
            return out
        # each rank's vocabulary rows, gathered in rank order; the last rank's padding rows
        # (the vocabulary rounded up to a multiple of the ranks) are cut off
        return tp_all_gather(out, self.tp.world)[..., :self.config.vocab_size]

    def _head_rows(self, x):
        if self.head_quant is not None:
            return self.head_quant.linear(x).float()
        if self.head_packed is not None:
            n = self.config.vocab_size if self.tp is None else self.tp.vocab_rows
            return linear_packed(x, self.head_packed, None, n).float()
        w = self.embed.weight if self.lm_head is None else self.lm_head.weight
        return linear(x, w).float()

    def _logits(self, x, residual):
        """The final norm of (x + residual), fused like the layers' norms, then the LM head."""
        x = add_rms_norm(x, residual, self.norm.weight, self.config.rms_norm_eps,
                         self.fused_norm)[0]
        return self.head(x)  # [B, T, V]

    def forward(self, input_ids, positions, meta, cache):
        """meta: an `AttnMetadata` with a `PagedKVCache`, or slots [B] int64 with a slot
        `KVCache` (from `allocate_cache`). -> logits [B, T, V] fp32."""
        if isinstance(cache, KVCache):
            meta, cache = cache.metadata(meta, positions), cache.pool
        return self._logits(*self._hidden_pair(input_ids, positions, meta, cache))

    def forward_features(self, input_ids, positions, meta: AttnMetadata, cache: PagedKVCache,
                         aux_ids: tuple = (), final: bool = False, logits: bool = True):
        """The paged forward, also returning what a drafter reads from the target:
        -> (logits [B, T, V] fp32 or None, features [B, T, F]), where features concatenates
        the residual streams entering layers `aux_ids` (in that order; id L = the final
        residual before the norm) and then, with `final`, the final post-norm hidden state
        (what the LM head reads). F = (len(aux_ids) + final) * hidden."""
        assert aux_ids or final, "forward_features without features: use forward()"
        aux = dict.fromkeys(aux_ids)
        x, residual = self._hidden_pair(input_ids, positions, meta, cache, aux)
        feats = [aux[i] for i in aux_ids]
        out = None
        if final or logits:
            normed = add_rms_norm(x, residual, self.norm.weight, self.config.rms_norm_eps,
                                  self.fused_norm)[0]
            if final:
                feats.append(normed)
            if logits:
                out = self.head(normed)
        return out, feats[0] if len(feats) == 1 else torch.cat(feats, dim=-1)

    def hidden(self, input_ids, positions, meta: AttnMetadata, cache: PagedKVCache):
        """The paged forward up to the final residual (before the norm): [B, T, hidden]."""
        x, residual = self._hidden_pair(input_ids, positions, meta, cache)
        return x + residual

    def _hidden_pair(self, input_ids, positions, meta: AttnMetadata, cache: PagedKVCache,
                     aux=None):
        cfg = self.config
        B, T = input_ids.shape
        H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        x = self._embed(input_ids)  # [B, T, hidden]
        cos, sin = self._rope(positions, x.dtype)
        # -1, not B * T: with T = 1 the size is the batch symbol itself, and the graphs
        # layer cannot tell a size used as a shape from one used as index data
        rows = meta.slot_mapping.reshape(1, -1)

        def attend(i, q, k, v):
            # the write goes through the base pool with a tensor layer index, so Inductor
            # updates the graph input in place (a write into the view cache.k[i] is copied)
            li = self.layers[i].index  # [1, 1]
            cache.k[li, rows] = k.reshape(1, B * T, Hkv, D)
            cache.v[li, rows] = v.reshape(1, B * T, Hkv, D)
            o = paged_attention(q, cache.k, cache.v, i, meta.block_table, meta.seq_lens,
                                cache.block_size)  # [B, T, H, D]
            return o.reshape(B, T, H * D)

        return self._layers(x, cos, sin, attend, aux)

    def forward_causal(self, input_ids, aux_ids: tuple = (), final: bool = False):
        """Cache-free causal forward over [B, T] tokens at positions 0..T-1 (for training).
        -> logits [B, T, V]; with aux_ids or final, (logits, features) as forward_features."""
        B, T = input_ids.shape
        cfg = self.config
        H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        positions = torch.arange(T, device=input_ids.device).expand(B, T)
        x = self._embed(input_ids)
        cos, sin = self._rope(positions, x.dtype)

        def attend(i, q, k, v):
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, T, D]
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=H != Hkv)
            return o.transpose(1, 2).reshape(B, T, H * D)

        if not (aux_ids or final):
            return self._logits(*self._layers(x, cos, sin, attend))
        aux = dict.fromkeys(aux_ids)
        x, residual = self._layers(x, cos, sin, attend, aux)
        normed = add_rms_norm(x, residual, self.norm.weight, cfg.rms_norm_eps, self.fused_norm)[0]
        feats = [aux[i] for i in aux_ids] + ([normed] if final else [])
        return self.head(normed), feats[0] if len(feats) == 1 else torch.cat(feats, dim=-1)
