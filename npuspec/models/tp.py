"""Megatron-style tensor parallelism for `DecoderLM`: one rank's shard of a whole model.

    shard = shard_model(model, rank, world)   # model: the whole DecoderLM, unpacked

Per layer (Shoeybi et al., Megatron-LM; the split vLLM's parallel linears make):
- q|k|v (`wqkv`) and gate|up (`w13`) are column-parallel: rank r keeps its H/N query heads,
  Hkv/N kv heads and I/N MLP columns, so attention runs on local heads with no communication;
- `wo` and `w2` are row-parallel: each rank's output is a partial sum, all-reduced
  (`npuspec::tp_all_reduce`), and their biases are kept on rank 0 only, so they count once;
- norms, RoPE and the residual stream are replicated.
The embedding and the LM head are vocabulary-parallel: rank r holds rows
[r * ceil(V/N), (r+1) * ceil(V/N)) (zero rows pad the last rank); the embedding's partial
lookups are all-reduced, the head's logits all-gathered and cut back to V. Every rank so ends
a step with the same full logits and the same residual stream (hidden-state drafters read it).

The shard's config holds the local head and MLP sizes (so attention, the KV pool and its
memory check see this rank's share) and the full vocabulary size.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from npuspec.models.decoder import DecoderLM, TPShard
from npuspec.models.eagle import MLP, Attention


def check_shardable(cfg, world: int, key: str = "LLM: tensor_parallel_size") -> None:
    """ValueError naming the model field that `world` does not divide."""
    for field, n in (("num_attention_heads", cfg.num_heads),
                     ("num_key_value_heads", cfg.num_kv_heads),
                     ("intermediate_size", cfg.intermediate_size)):
        if n % world:
            ok = [d for d in range(1, n + 1) if cfg.num_heads % d == 0 and
                  cfg.num_kv_heads % d == 0 and cfg.intermediate_size % d == 0]
            raise ValueError(f"{key}={world}: the model's {field}={n} is not divisible "
                             f"by it (each rank holds whole heads and an equal MLP slice); use "
                             f"one of {ok}")


def local_config(cfg, world: int):
    """The config of one rank's shard: its heads and MLP columns, the whole vocabulary."""
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // world,
                               num_kv_heads=cfg.num_kv_heads // world,
                               intermediate_size=cfg.intermediate_size // world)


def _rows(w: torch.Tensor, start: int, n: int) -> torch.Tensor:
    return w[start:start + n]


def _vocab_rows(w: torch.Tensor, start: int, n: int) -> torch.Tensor:
    out = w.new_zeros((n, *w.shape[1:]))
    part = w[start:start + n]
    out[:len(part)] = part
    return out


def _qkv_rows(w: torch.Tensor, cfg, rank: int, world: int) -> torch.Tensor:
    H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    h, hkv = H // world, Hkv // world
    q = _rows(w, rank * h * D, h * D)
    k = _rows(w, H * D + rank * hkv * D, hkv * D)
    v = _rows(w, (H + Hkv) * D + rank * hkv * D, hkv * D)
    return torch.cat([q, k, v])


def _gate_up_rows(w: torch.Tensor, inter: int, rank: int, world: int) -> torch.Tensor:
    n = inter // world
    return torch.cat([_rows(w, rank * n, n), _rows(w, inter + rank * n, n)])


def _set(layer: nn.Linear, weight: torch.Tensor, bias) -> None:
    # clone: a row slice is a view, and would keep the whole model alive
    layer.weight = nn.Parameter(weight.detach().clone(memory_format=torch.contiguous_format),
                                requires_grad=False)
    if layer.bias is not None:
        layer.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)


def shard_model(model: DecoderLM, rank: int, world: int) -> DecoderLM:
    """Rank `rank`'s shard of `model` (a new module on the same device and dtype)."""
    cfg = model.config
    assert 0 <= rank < world and world > 1, (rank, world)
    assert model.head_packed is None, "shard before npuspec.models.packing.pack_model"
    check_shardable(cfg, world)
    H, D, inter = cfg.num_heads, cfg.head_dim, cfg.intermediate_size
    local = local_config(cfg, world)
    w0 = model.norm.weight
    with torch.device("meta"):
        shard = DecoderLM(local)
    shard.to_empty(device=w0.device)
    shard.to(w0.dtype)
    shard.init_buffers(w0.device)
    for src, dst in zip(model.layers, shard.layers):
        for name in ("attn_norm", "mlp_norm", "q_norm", "k_norm"):
            if hasattr(src, name):
                getattr(dst, name).load_state_dict(getattr(src, name).state_dict())
        qkv_b = None if src.wqkv.bias is None else _qkv_rows(src.wqkv.bias, cfg, rank, world)
        _set(dst.wqkv, _qkv_rows(src.wqkv.weight, cfg, rank, world), qkv_b)
        hd = H // world * D
        _set(dst.wo, src.wo.weight[:, rank * hd:(rank + 1) * hd],
             None if src.wo.bias is None else src.wo.bias * (rank == 0))
        w13_b = None if src.w13.bias is None else _gate_up_rows(src.w13.bias, inter, rank, world)
        _set(dst.w13, _gate_up_rows(src.w13.weight, inter, rank, world), w13_b)
        n = inter // world
        _set(dst.w2, src.w2.weight[:, rank * n:(rank + 1) * n],
             None if src.w2.bias is None else src.w2.bias * (rank == 0))
        dst.tp_world = world
    shard.norm.load_state_dict(model.norm.state_dict())
    rows = -(-cfg.vocab_size // world)
    start = rank * rows
    shard.embed = nn.Embedding.from_pretrained(_vocab_rows(model.embed.weight.detach(), start,
                                                           rows), freeze=True)
    if model.lm_head is not None:
        shard.lm_head = nn.Linear(cfg.hidden_size, rows, bias=False, device=w0.device,
                                  dtype=w0.dtype)
        _set(shard.lm_head, _vocab_rows(model.lm_head.weight.detach(), start, rows), None)
    shard.tp = TPShard(rank, world, start, rows)
    return shard.eval().requires_grad_(False)


def shard_draft(module: nn.Module, rank: int, world: int) -> nn.Module:
    """Shard a KV-carrying drafter's decoder layers in place (npuspec.models.eagle's
    Attention and MLP: EAGLE, EAGLE-3, MTP, DFlash, DSpark) the way shard_model shards the
    target's. Everything else the drafter owns (fc, norms, its own embedding or LM head,
    Medusa's residual blocks) stays whole on every rank; what it shares with the target is
    the target's shard, so each rank must run the drafter (draft_tensor_parallel_size = N).
    Call before npuspec.models.packing.pack_draft."""
    cfg = module.config
    if any(isinstance(m, (Attention, MLP)) for m in module.modules()):
        check_shardable(cfg, world, "speculative_config.draft_tensor_parallel_size")
    for m in module.modules():
        if isinstance(m, Attention):
            Hq, Hkv, D = m.shape
            hq, hkv = Hq // world, Hkv // world
            for name, n in (("q_proj", hq), ("k_proj", hkv), ("v_proj", hkv)):
                lin = getattr(m, name)
                b = None if lin.bias is None else _rows(lin.bias, rank * n * D, n * D)
                _set(lin, _rows(lin.weight, rank * n * D, n * D), b)
                lin.out_features = n * D
            _row_parallel(m.o_proj, rank, hq * D)
            m.shape = (hq, hkv, D)
            m.tp_world = world
        elif isinstance(m, MLP):
            n = m.down_proj.in_features // world
            for lin in (m.gate_proj, m.up_proj):
                b = None if lin.bias is None else _rows(lin.bias, rank * n, n)
                _set(lin, _rows(lin.weight, rank * n, n), b)
                lin.out_features = n
            _row_parallel(m.down_proj, rank, n)
            m.tp_world = world
    object.__setattr__(module, "config", local_config(cfg, world))  # its KV pool's heads
    return module


def _row_parallel(lin: nn.Linear, rank: int, n: int) -> None:
    """Keep input columns [rank * n, (rank+1) * n); the bias counts once (rank 0)."""
    _set(lin, lin.weight[:, rank * n:(rank + 1) * n],
         None if lin.bias is None else lin.bias * (rank == 0))
    lin.in_features = n
