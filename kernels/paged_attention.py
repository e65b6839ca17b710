"""`npuspec::paged_attention`: attention over a paged KV pool, bounded by each row's live length.

    out = paged_attention(q,            # [B, T, H, D]
                          k_cache,      # [L, num_blocks * block_size, Hkv, D] (this step's K/V written)
                          v_cache,      # same
                          layer,        # int: which layer of the pool
                          block_table,  # int32 [B, MB]: logical block j of row b -> physical block
                          seq_lens,     # int32 [B]: row b's KV length after this step's writes
                          block_size, scale)  # -> [B, T, H, D], q's dtype

Query t of row b sits at position `seq_lens[b] - T + t` (a row's new tokens are the last T of its
sequence; a chunked-prefill row with fewer tokens is left-padded) and attends to the positions
0..that position of its own sequence, read through the block table: token p of row b lives at
pool row `block_table[b, p // block_size] * block_size + p % block_size`. A query whose position
is negative (left padding; padding rows have `seq_lens == 0`) sees nothing and returns zeros.

The work of a row follows `seq_lens[b]`, never the pool size or `max_model_len`, and the op has
static output shapes and reads its lengths from device memory, so it can sit inside a captured
graph whose `seq_lens`/`block_table` buffers are refilled before each replay (docs/engine.md,
"Paged KV and attention").
K/V past a row's length (rejected drafts) is never read: rollback is moving `seq_lens`.

Implementations: `reference_paged_attention` (plain PyTorch, the oracle), the C++ CPU kernel
(`paged_attention_cpu.py`), the Triton kernel (`paged_attention_triton.py`, CUDA) and
`torch_npu.npu_fused_infer_attention_score` (`paged_attention_npu.py`); fp32 softmax and
accumulation in all of them.

Why a custom op and not `flex_attention`: Inductor's CPU flex template (torch 2.13) fails to
compile once the batch dim is dynamic (C++ codegen error), and the engine serves every batch
size from one dynamic graph; a static graph per batch size costs a whole-model compile each.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import Tensor

from npuspec.kernels import paged_attention_cpu, paged_attention_npu
from npuspec.platform import triton_available

IMPLS = ("reference", "cpu", "triton", "npu")
_FORCED: list[Optional[str]] = [None]
# Called with True while `use_impl` forces an implementation, False after: the native CPU op
# (kernels/native_cpu.py) then passes every call to `_paged_attention_op`, which honours it.
FORCE_HOOKS: list = []


@contextlib.contextmanager
def use_impl(name: Optional[str]):
    """Force the implementation ('reference', 'cpu', 'triton') inside a block (tests, benches)."""
    if name is not None and name not in IMPLS:
        raise ValueError(f"paged_attention.use_impl({name!r}): choose one of {', '.join(IMPLS)} "
                         f"or None")
    old, _FORCED[0] = _FORCED[0], name
    for hook in FORCE_HOOKS:
        hook(name is not None)
    try:
        yield
    finally:
        _FORCED[0] = old
        for hook in FORCE_HOOKS:
            hook(old is not None)


def _pick_impl(device: torch.device) -> str:
    if _FORCED[0] is not None:
        return _FORCED[0]
    if device.type == "cpu":
        return "cpu" if paged_attention_cpu.available() else "reference"
    if device.type == "npu":
        return "npu"
    return "triton" if triton_available(device.type) else "reference"


def reference_paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, layer: int,
                              block_table: Tensor, seq_lens: Tensor, block_size: int,
                              scale: float) -> Tensor:
    """Plain PyTorch: per row, gather the live blocks, causal softmax in fp32."""
    B, T, H, D = q.shape
    Hkv = k_cache.shape[2]
    G = H // Hkv
    out = torch.zeros(B, T, H, D, dtype=torch.float32, device=q.device)
    lens = seq_lens.tolist()
    for b in range(B):
        n = int(lens[b])
        if n <= 0:
            continue
        nb = -(-n // block_size)
        blocks = block_table[b, :nb].long()
        rows = (blocks[:, None] * block_size + torch.arange(block_size, device=q.device)).reshape(-1)[:n]
        k = k_cache[layer, rows].float()                       # [n, Hkv, D]
        v = v_cache[layer, rows].float()
        qb = q[b].float().view(T, Hkv, G, D)                   # [T, Hkv, G, D]
        s = torch.einsum("tkgd,nkd->kgtn", qb, k) * scale      # [Hkv, G, T, n]
        qpos = n - T + torch.arange(T, device=q.device)        # [T]
        visible = torch.arange(n, device=q.device)[None, :] <= qpos[:, None]  # [T, n]
        s = s.masked_fill(~visible, float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)           # rows with nothing visible -> 0
        o = torch.einsum("kgtn,nkd->tkgd", p, v)               # [T, Hkv, G, D]
        out[b] = o.reshape(T, H, D)
    return out.to(q.dtype)


def _check(q, k_cache, v_cache, layer, block_table, seq_lens, block_size):
    """Metadata-only checks (no host sync)."""
    assert q.dim() == 4 and k_cache.dim() == 4, (q.shape, k_cache.shape)
    assert k_cache.shape == v_cache.shape, (k_cache.shape, v_cache.shape)
    assert q.shape[3] == k_cache.shape[3] and q.shape[2] % k_cache.shape[2] == 0, (q.shape, k_cache.shape)
    assert 0 <= layer < k_cache.shape[0], (layer, k_cache.shape)
    assert k_cache.shape[1] % block_size == 0, (k_cache.shape, block_size)
    assert block_table.dim() == 2 and block_table.shape[0] == q.shape[0], (block_table.shape, q.shape)
    assert seq_lens.shape == (q.shape[0],), (seq_lens.shape, q.shape)
    assert block_table.dtype == torch.int32 and seq_lens.dtype == torch.int32, (
        block_table.dtype, seq_lens.dtype)


def _paged_attention_op(q: Tensor, k_cache: Tensor, v_cache: Tensor, layer: int,
                        block_table: Tensor, seq_lens: Tensor, block_size: int,
                        scale: float) -> Tensor:
    _check(q, k_cache, v_cache, layer, block_table, seq_lens, block_size)
    impl = _pick_impl(q.device)
    if impl == "cpu":
        return paged_attention_cpu.cpu_paged_attention(q, k_cache, v_cache, layer, block_table,
                                                       seq_lens, block_size, scale)
    if impl == "triton":
        # optional: Triton (CUDA, or triton-ascend) is imported only where a kernel runs on it
        from npuspec.kernels.paged_attention_triton import triton_paged_attention
        return triton_paged_attention(q, k_cache, v_cache, layer, block_table, seq_lens,
                                      block_size, scale)
    if impl == "npu":
        return paged_attention_npu.npu_paged_attention(q, k_cache, v_cache, layer, block_table,
                                                       seq_lens, block_size, scale)
    return reference_paged_attention(q, k_cache, v_cache, layer, block_table, seq_lens,
                                     block_size, scale)


# Registered through torch.library.Library, not @custom_op: custom_op's Python autograd and
# dynamo-disable layers cost ~40 us per call here (the CPU kernel itself takes ~20-60 us at
# batch 1, and a step calls it once per layer). The op is inference-only (no autograd formula).
_lib = torch.library.Library("npuspec", "FRAGMENT")
_lib.define("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, int layer, "
            "Tensor block_table, Tensor seq_lens, int block_size, float scale) -> Tensor")
_lib.impl("paged_attention", _paged_attention_op, "CompositeExplicitAutograd")


@torch.library.register_fake("npuspec::paged_attention")
def _(q, k_cache, v_cache, layer, block_table, seq_lens, block_size, scale):
    return torch.empty_like(q)


def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, layer: int,
                    block_table: Tensor, seq_lens: Tensor, block_size: int,
                    scale: Optional[float] = None) -> Tensor:
    """See the module docstring. `scale` defaults to 1/sqrt(D)."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return torch.ops.npuspec.paged_attention(q, k_cache, v_cache, layer, block_table, seq_lens,
                                             block_size, float(scale))
