"""Triton kernel for `npuspec::paged_attention` (CUDA; written in the triton-ascend subset).

Contract: the module docstring of `paged_attention.py` (`reference_paged_attention` is the
oracle). This file adds only how the work is laid out:

* **Work item = (row b, kv head g, query block mb).** The G = H / Hkv query heads that share kv
  head g, times the T query tokens of row b, are packed into one tile of G*T query rows, row
  m = t*G + h (token t, head g*G + h); the tile is padded to BLOCK_M >= 16 rows (a power of two,
  the smallest `tl.dot` takes), so every K/V tile read from memory serves all G heads and all T
  tokens at once. When G*T is larger than the register budget (BLOCK_M capped at 64 on a GPU)
  the rows split into cdiv(G*T, BLOCK_M) query blocks, each its own work item. With the usual
  shapes (G*T <= 64) that is exactly one work item per (b, g).
* **Grid fixed by shapes.** B * Hkv * NM work items (NM query blocks), one program each, walked
  with a grid-stride loop so that the grid never exceeds 65535 (the triton-ascend cap; on CUDA
  it only matters past 65535 items). Nothing about the grid depends on the data, so a launch
  can be captured in a CUDA graph and replayed after `seq_lens`/`block_table` are refilled.
* **Work follows the live length.** Each program loads `seq_lens[b]` from device memory and
  loops over cdiv(kv_end, TILE) K/V tiles, kv_end = the last position its query block may see
  plus one (= seq_len for the block holding the row's last token; 0 for a padding row, whose
  loop runs zero times and writes zeros). Positions past kv_end are never read, whatever the
  pool holds there (rejected drafts, another row's data, NaN).
* **Paged addressing per element.** Position p of the tile maps to pool row
  `block_table[b, p // block_size] * block_size + p % block_size`, looked up for every lane of
  the tile, so TILE (a power of two, 16..128) need not divide `block_size` nor be a multiple of
  it; `block_size` can be any positive integer. Pool offsets are formed in int64.
* **Online softmax in fp32.** Per query row: running max m, normaliser l, accumulator acc
  [BLOCK_M, D]; each tile computes s = (q k^T) * scale in fp32, masks kv_pos > q_pos to -inf
  (causal: q_pos = seq_len - T + t, so left-padded tokens of a chunk, q_pos < 0, see nothing),
  rescales l and acc by exp(m_old - m_new) and adds exp(s - m_new) and its product with V.
  A row that has seen nothing keeps m = -inf; its exponent base is taken as 0 so that no
  inf - inf appears, and the final acc / l uses l = 1 there, giving the contract's zeros.
* **Precision.** Both dots accumulate in fp32. With fp32 caches the dots are fp32 x fp32 with
  `input_precision="ieee"` (no TF32). With bf16/fp16 caches q is cast to the cache dtype for
  q k^T and the probabilities are cast to it for p V (the usual flash-attention trade); scale,
  max, exp and sums stay fp32. No fp64, no RNG. (Triton 3.9's interpreter multiplies bf16 dot
  operands as their raw uint16 bits, so under TRITON_INTERPRET=1 the bf16 operands, rounded
  exactly as on the GPU, are widened to fp32 just before each dot: `DOT_F32`.)

D (head size) can be anything in 1..256: the tile width is the next power of two >= 16 and the
extra lanes are masked. Status: tested under TRITON_INTERPRET=1 on CPU only; unverified on GPU
hardware (the `@pytest.mark.cuda` test, graph replay included, has not run yet; docs/attention.md).

The kernel is JIT-wrapped on first use, separately for interpreter and compiled mode (Triton
decides which when `triton.jit` runs), so a test can turn TRITON_INTERPRET=1 on at any time
before its first call.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from npuspec import envs

MAX_GRID = 65535
MAX_HEAD_DIM = 256


def _paged_attention_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, out_ptr, scale,
                            n_items, Hkv, NM, T, G, D, block_size,
                            sq_b, sq_t, sq_h, sq_d,
                            sk_r, sk_h, sk_d, sv_r, sv_h, sv_d, sbt_b,
                            BLOCK_M: tl.constexpr, HEAD_D: tl.constexpr, TILE: tl.constexpr,
                            DOT_F32: tl.constexpr, IEEE: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    NEG_INF: tl.constexpr = float("-inf")
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_D)
    offs_n = tl.arange(0, TILE)
    d_ok = offs_d < D
    GT = G * T
    for w in range(pid, n_items, nprog):
        mb = w % NM
        bg = w // NM
        g = bg % Hkv
        b = bg // Hkv
        seq_len = tl.load(lens_ptr + b)
        # query rows of this block: m = t * G + h
        m = mb * BLOCK_M + offs_m
        row_ok = m < GT
        t = m // G
        h = m - t * G
        head = g * G + h
        q_pos = seq_len - T + t                                   # [BLOCK_M]
        q_off = (tl.cast(b, tl.int64) * sq_b + t.to(tl.int64) * sq_t + head.to(tl.int64) * sq_h)
        qmask = row_ok[:, None] & d_ok[None, :]
        q = tl.load(q_ptr + q_off[:, None] + offs_d[None, :] * sq_d, mask=qmask, other=0.0)
        q = q.to(k_ptr.dtype.element_ty)
        if DOT_F32:  # interpreter + bf16: same rounding, the matmul done on fp32 copies
            q = q.to(tl.float32)
        # the last token in this block bounds what any of its rows may see
        t_last = tl.minimum((mb * BLOCK_M + BLOCK_M - 1) // G, T - 1)
        kv_end = tl.maximum(seq_len - (T - 1 - t_last), 0)
        n_tiles = (kv_end + TILE - 1) // TILE  # not tl.cdiv: a jit helper the interpreter rejects once triton was imported without TRITON_INTERPRET
        m_i = tl.full([BLOCK_M], NEG_INF, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_D], tl.float32)
        bt_row = bt_ptr + tl.cast(b, tl.int64) * sbt_b
        for j in range(0, n_tiles):
            kv = j * TILE + offs_n                                # [TILE] logical positions
            kv_ok = kv < kv_end
            blk = tl.load(bt_row + kv // block_size, mask=kv_ok, other=0)
            slot = blk.to(tl.int64) * block_size + (kv % block_size)
            kvmask = kv_ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + slot[:, None] * sk_r + g * sk_h + offs_d[None, :] * sk_d,
                        mask=kvmask, other=0.0)                   # [TILE, HEAD_D]
            if DOT_F32:
                k = k.to(tl.float32)
            if IEEE:  # fp32 operands: true fp32 products, no TF32
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * scale                                         # [BLOCK_M, TILE] fp32
            visible = (kv[None, :] <= q_pos[:, None]) & row_ok[:, None] & kv_ok[None, :]
            s = tl.where(visible, s, NEG_INF)
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            base = tl.where(m_new == NEG_INF, 0.0, m_new)         # nothing seen yet: no inf-inf
            p = tl.exp(s - base[:, None])                         # masked -> 0
            alpha = tl.exp(m_i - base)                            # m_i = -inf -> 0
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + slot[:, None] * sv_r + g * sv_h + offs_d[None, :] * sv_d,
                        mask=kvmask, other=0.0)
            pv = p.to(v_ptr.dtype.element_ty)
            if DOT_F32:
                pv = pv.to(tl.float32)
                v = v.to(tl.float32)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(pv, v)
            m_i = m_new
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]      # rows that saw nothing -> 0
        o_off = ((tl.cast(b, tl.int64) * T + t.to(tl.int64)) * (G * Hkv) + head.to(tl.int64)) * D
        tl.store(out_ptr + o_off[:, None] + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=qmask)


@functools.lru_cache(maxsize=None)
def _jitted(interpret: bool):
    """`triton.jit` reads TRITON_INTERPRET when it wraps the function: one wrapper per mode."""
    return triton.jit(_paged_attention_kernel)


def _block_m(rows: int, head_d: int, interpret: bool) -> int:
    cap = 256 if interpret else (64 if head_d <= 128 else 32)  # GPU: acc stays in registers
    return max(16, min(cap, triton.next_power_of_2(rows)))


def _tile(block_size: int, head_d: int, interpret: bool) -> int:
    if interpret:
        return 128  # the interpreter pays per tile, not per register
    cap = 64 if head_d <= 128 else 32
    # the largest power of two dividing block_size (a tile stays inside one block), in 16..cap
    return max(16, min(cap, block_size & -block_size))


def triton_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           layer: int, block_table: torch.Tensor, seq_lens: torch.Tensor,
                           block_size: int, scale: float, *, tile: Optional[int] = None,
                           block_m: Optional[int] = None) -> torch.Tensor:
    """Same contract as `reference_paged_attention`. `tile` (kv positions per inner step) and
    `block_m` (query rows per program) override the defaults; both powers of two >= 16."""
    B, T, H, D = q.shape
    Hkv = k_cache.shape[2]
    assert k_cache.dtype in (torch.float32, torch.bfloat16, torch.float16), (
        f"triton paged_attention: KV cache dtype {k_cache.dtype} unsupported; use float32, "
        f"bfloat16 or float16")
    assert v_cache.dtype == k_cache.dtype, (k_cache.dtype, v_cache.dtype)
    assert q.dtype in (torch.float32, torch.bfloat16, torch.float16), (
        f"triton paged_attention: query dtype {q.dtype} unsupported")
    assert 1 <= D <= MAX_HEAD_DIM, (
        f"triton paged_attention: head_dim {D} unsupported; this kernel takes 1..{MAX_HEAD_DIM}")
    assert H % Hkv == 0, f"triton paged_attention: {H} query heads not a multiple of {Hkv} kv heads"
    assert block_size >= 1, block_size
    assert block_table.dtype == torch.int32 and seq_lens.dtype == torch.int32, (
        block_table.dtype, seq_lens.dtype)
    assert q.device == k_cache.device == v_cache.device == block_table.device == seq_lens.device, (
        "triton paged_attention: all inputs must be on one device")
    G = H // Hkv
    out = torch.empty(B, T, H, D, dtype=q.dtype, device=q.device)
    if B == 0 or T == 0:
        return out
    interpret = envs.triton_interpret()
    head_d = max(16, triton.next_power_of_2(D))
    BM = block_m or _block_m(G * T, head_d, interpret)
    TILE = tile or _tile(block_size, head_d, interpret)
    for name, x in (("tile", TILE), ("block_m", BM)):
        assert x >= 16 and x & (x - 1) == 0, (
            f"triton paged_attention: {name}={x} must be a power of two >= 16")
    NM = triton.cdiv(G * T, BM)
    n_items = B * Hkv * NM
    k, v = k_cache[layer], v_cache[layer]            # views: [num_blocks * block_size, Hkv, D]
    bt = block_table if block_table.stride(1) == 1 else block_table.contiguous()
    lens = seq_lens.contiguous()
    grid = (max(1, min(n_items, MAX_GRID)),)
    _jitted(interpret)[grid](
        q, k, v, bt, lens, out, float(scale), n_items, Hkv, NM, T, G, D, block_size,
        *q.stride(), *k.stride(), *v.stride(), bt.stride(0),
        BLOCK_M=BM, HEAD_D=head_d, TILE=TILE,
        DOT_F32=interpret and k_cache.dtype == torch.bfloat16,
        IEEE=k_cache.dtype == torch.float32,
        num_warps=8 if BM * head_d >= 8192 else 4)
    return out
