"""Triton row-statistics kernel for `npuspec::rejection_sample` (one source for CUDA and Ascend).

Written in the triton-ascend subset (docs/design.md, "Platforms"): float32 math, the random
draws come in by pointer (no in-kernel RNG, no fp64), the grid is capped by `grid_size`
(vector-core count on NPU, <= 65535) and each program walks rows with a grid-stride loop, and
the vocab is processed in BLOCK_V blocks so no [B, K+1, V] softmax is ever materialised.

Each program reads a logits row once (greedy, one-hot drafts) or twice back to back (draft
probs, whose residual needs the final normaliser; entropy verify), so the second read hits
cache. The first read is an online softmax: max, normaliser, e[x] and the races are kept
relative to the running max of the row and rescaled when it grows. The elementwise formulas
are those of `reference_row_stats` in verify_rows.py; what differs is the last ulp of exp, the
order of the sums and the rescaling (docs/verify.md gives the measured effect on tokens).
"""
from __future__ import annotations

import functools
from npuspec import envs
from typing import Optional

import torch
import triton
import triton.language as tl

from npuspec.kernels.verify_rows import FLT_MIN, RowStats

MAX_GRID = 65535


@functools.lru_cache(maxsize=None)
def _core_count(device_type: str, index: int) -> int:
    if device_type == "npu":
        try:  # triton-ascend exposes the vector-core count through its driver
            props = triton.runtime.driver.active.utils.get_device_properties(index)
            return int(props.get("num_vectorcore", 0)) or 48
        except Exception:
            return 48  # Atlas A2 (910B): 24 AI cores x 2 vector cores
    if device_type == "cuda":
        return torch.cuda.get_device_properties(index).multi_processor_count * 4
    return 16  # the interpreter runs programs one after another; fewer is cheaper


def grid_size(n_rows: int, device: torch.device) -> int:
    """Programs for n_rows rows: at most one per row, the core count, and 65535."""
    cores = _core_count(device.type, device.index or 0)
    return max(1, min(n_rows, cores, MAX_GRID))


def _block_v(V: int) -> int:
    interp = envs.triton_interpret()
    cap = 8192 if interp else 1024  # the interpreter pays per block, a GPU per register
    return max(16, min(cap, triton.next_power_of_2(V)))


@triton.jit
def _row_stats_kernel(logits_ptr, x_ptr, q_ptr, t_ptr, thr_ptr, e_ptr, w_ptr,
                      gidx_ptr, rawmax_ptr, px_ptr, qx_ptr, racep_ptr, racer_ptr, rho_ptr,
                      ent_ptr, n_rows, K1, V,
                      RANDOM: tl.constexpr, FILTER: tl.constexpr, HAS_Q: tl.constexpr,
                      RESIDUAL: tl.constexpr, ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs = tl.arange(0, BLOCK_V)
    NEG_INF: tl.constexpr = float("-inf")
    for r in range(pid, n_rows, nprog):
        b = r // K1
        j = r - b * K1
        row = logits_ptr + tl.cast(r, tl.int64) * V
        x = tl.load(x_ptr + r).to(tl.int32)                     # -1: no draft in this row
        t = 1.0
        thr = NEG_INF
        if RANDOM:
            t = tl.load(t_ptr + b)
            if FILTER:
                thr = tl.load(thr_ptr + r)
        # pass 1, one read: raw max + greedy argmax (first index) + NaN flag, and, online
        # (rescaled whenever the running max of z grows, as in an online softmax): S = sum e,
        # e[x], the race over p, the one-hot residual race, and the entropy's normaliser
        gmax = NEG_INF
        gidx = 0
        nan_any = 0
        zmax = NEG_INF
        eb = e_ptr + tl.cast(b, tl.int64) * V
        S = 0.0
        ex = 0.0
        st = 0.0            # entropy: sum of exp(l - running raw max)
        bp = -1.0
        ip = 0
        br = 0.0
        ir = -1
        for v0 in range(0, V, BLOCK_V):
            idx = v0 + offs
            m = idx < V
            lg = tl.load(row + idx, mask=m, other=NEG_INF).to(tl.float32)
            nan_any = tl.maximum(nan_any, tl.max(tl.where(lg != lg, 1, 0), axis=0))
            bmax = tl.max(lg, axis=0)
            bidx = tl.min(tl.where(lg == bmax, idx, V), axis=0)
            gidx = tl.where(bmax > gmax, bidx, gidx)
            gnew = tl.maximum(gmax, bmax)
            if ENTROPY:
                gsc = tl.where(gmax == NEG_INF, 0.0, tl.exp(gmax - gnew))
                eg = tl.where(gnew == NEG_INF, 0.0, tl.exp(lg - gnew))
                st = st * gsc + tl.sum(eg, axis=0)
            gmax = gnew
            if RANDOM:
                z = lg / t
                if FILTER:
                    z = tl.where(z >= thr, z, NEG_INF)
                znew = tl.maximum(zmax, tl.max(z, axis=0))
                sc = tl.where(zmax == NEG_INF, 0.0, tl.exp(zmax - znew))  # 1 when unchanged
                e = tl.where(znew == NEG_INF, 0.0, tl.exp(z - znew))
                zmax = znew
                S = S * sc + tl.sum(e, axis=0)
                ex = ex * sc + tl.sum(tl.where(idx == x, e, 0.0), axis=0)
                R = 1.0 / tl.maximum(tl.load(eb + idx, mask=m, other=1.0), FLT_MIN)
                s = tl.where(m, e * R, -1.0)
                bp = tl.where(bp > 0.0, bp * sc, bp)
                bm = tl.max(s, axis=0)
                bi = tl.min(tl.where(s == bm, idx, V), axis=0)
                ip = tl.where(bm > bp, bi, ip)
                bp = tl.maximum(bp, bm)
                if not HAS_Q:
                    br = br * sc
                    s1 = tl.where(idx == x, 0.0, s)
                    bm1 = tl.max(s1, axis=0)
                    bi1 = tl.min(tl.where(s1 == bm1, idx, V), axis=0)
                    ir = tl.where(bm1 > br, bi1, ir)
                    br = tl.maximum(br, bm1)
        tl.store(gidx_ptr + r, gidx.to(tl.int64))
        tl.store(rawmax_ptr + r, tl.where(nan_any > 0, float("nan"), gmax))
        if RANDOM:
            has = x >= 0
            tl.store(px_ptr + r, tl.where(has, ex / S, 0.0))
            tl.store(racep_ptr + r, ip.to(tl.int64))
            qrow = q_ptr + tl.cast(b * (K1 - 1) + j, tl.int64) * V
            vq = V * (j < K1 - 1)                               # q row length (0: bonus row)
            if HAS_Q:
                qx = tl.load(qrow + tl.maximum(x, 0), mask=has & (x < vq), other=0.0).to(tl.float32)
                tl.store(qx_ptr + r, tl.where(has, qx, 0.0))
            else:
                tl.store(qx_ptr + r, tl.where(has, 1.0, 0.0))
                tl.store(racer_ptr + r, ir.to(tl.int64))
            # pass 2 (second read, while the row is cached): the draft-probs residual
            # max(w p - q, 0) (race + mass) and/or the entropy, with the final max and sums
            if (HAS_Q and RESIDUAL) or ENTROPY:
                w = 1.0
                if HAS_Q and RESIDUAL:
                    w = tl.load(w_ptr + r)
                rho = 0.0
                br = 0.0
                ir = -1
                H = 0.0
                for v0 in range(0, V, BLOCK_V):
                    idx = v0 + offs
                    m = idx < V
                    lg = tl.load(row + idx, mask=m, other=NEG_INF).to(tl.float32)
                    if HAS_Q and RESIDUAL:
                        z = lg / t
                        if FILTER:
                            z = tl.where(z >= thr, z, NEG_INF)
                        p = tl.exp(z - zmax) / S
                        q = tl.load(qrow + idx, mask=idx < vq, other=0.0).to(tl.float32)
                        res = tl.maximum(w * p - q, 0.0)
                        rho += tl.sum(res, axis=0)
                        R = 1.0 / tl.maximum(tl.load(eb + idx, mask=m, other=1.0), FLT_MIN)
                        s = tl.where(m, res * R, -1.0)
                        bm = tl.max(s, axis=0)
                        bi = tl.min(tl.where(s == bm, idx, V), axis=0)
                        ir = tl.where(bm > br, bi, ir)
                        br = tl.maximum(br, bm)
                    if ENTROPY:
                        pt = tl.exp(lg - gmax) / st
                        H += tl.sum(tl.where(m, pt * tl.log(pt + 1e-10), 0.0), axis=0)
                if HAS_Q and RESIDUAL:
                    tl.store(rho_ptr + r, rho)
                    tl.store(racer_ptr + r, ir.to(tl.int64))
                if ENTROPY:
                    tl.store(ent_ptr + r, -H)


def triton_row_stats(logits: torch.Tensor, xpad: torch.Tensor, draft_probs: Optional[torch.Tensor],
                     t: torch.Tensor, thr: Optional[torch.Tensor],
                     exponentials: Optional[torch.Tensor], weights: Optional[torch.Tensor], *,
                     random: bool, entropy: bool, residual: bool = True,
                     early_exit=None) -> RowStats:
    """Same contract as `reference_row_stats`, computed by `_row_stats_kernel` (every row, in
    parallel: `early_exit` is accepted and ignored)."""
    B, K1, V = logits.shape
    dev = logits.device
    n = B * K1
    lg = logits.contiguous()
    f32 = dict(dtype=torch.float32, device=dev)
    i64 = dict(dtype=torch.int64, device=dev)
    gidx, race_p, race_r = (torch.zeros(B, K1, **i64) for _ in range(3))
    rawmax, px, qx, rho, ent = (torch.zeros(B, K1, **f32) for _ in range(5))
    has_q = draft_probs is not None
    q = draft_probs.contiguous() if has_q else lg            # dummy pointer when absent
    E = exponentials.float().contiguous() if random else lg
    thr_ = thr.float().contiguous() if thr is not None else rawmax
    w = rawmax
    if has_q and residual and random:
        w = torch.ones(B, K1, **f32)
        if weights is not None:
            w[:, :K1 - 1] = weights.float()
    _row_stats_kernel[(grid_size(n, dev),)](
        lg, xpad.contiguous(), q, t.float().contiguous(), thr_, E, w,
        gidx, rawmax, px, qx, race_p, race_r, rho, ent, n, K1, V,
        RANDOM=random, FILTER=thr is not None, HAS_Q=has_q, RESIDUAL=residual,
        ENTROPY=entropy, BLOCK_V=_block_v(V))
    return RowStats(gidx, rawmax, px, qx, race_p, race_r, rho, ent)
