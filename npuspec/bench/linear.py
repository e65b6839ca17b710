"""`npuspec bench linear`: the projections of one decode/verify step, per weight layout.

For a model's shapes (every layer's q|k|v, o, gate|up, down and the LM head; random weights
of the model's size, so no checkpoint is read), times one step's worth of matmuls at M rows
(M = B*(K+1): 1 = plain decode at batch 1, 5 = K=4) for:
- `mm`: torch.mm on the row-major fp32 weight (MKL; what F.linear does);
- `rows`: npuspec::linear_rows, the unpacked few-row kernel (kernels/linear_cpu.py);
- `packed <dtype>`: npuspec::linear_packed over weights packed at load (kernels/linear_packed_cpu.py);
- `packed bf16, bf16 x`: the same with bf16 activations, as a bf16 model calls it (on a CPU with
  AVX512_BF16, the dot-product instruction's path);
- `q8`, `q4`: npuspec::linear_quant over 8-bit / 4-bit codes in groups of 32 (kernels/linear_quant_cpu.py),
  quantized like GGUF's Q8_0 / Q4_1 (their bytes per weight, scales included, in the GB/s).
Variants run interleaved, call by call, so machine noise hits each alike; medians. Columns:
ms per step, the weight bytes read over that time (GB/s), and the time over the same
variant's M=1 time. `sum GB/s` is a plain read of a 1 GiB buffer, the bandwidth yardstick.

    python -m npuspec.bench.linear --model PATH_OR_GGUF [--rows 1,2,5,8,10,16] [--threads 2]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from npuspec.bench.table import print_table
from npuspec.cli_util.common import int_list, positive
from npuspec.kernels import linear_cpu, linear_packed_cpu as lp, linear_quant_cpu as lq
from npuspec.models import quant, read_model_config


def step_shapes(cfg) -> list[tuple[int, int, int]]:
    """(N, K, count) of every matmul one step runs."""
    h, D = cfg.hidden_size, cfg.head_dim
    L = cfg.num_layers
    return [((cfg.num_heads + 2 * cfg.num_kv_heads) * D, h, L), (h, cfg.num_heads * D, L),
            (2 * cfg.intermediate_size, h, L), (h, cfg.intermediate_size, L), (cfg.vocab_size, h, 1)]


def _variants(shapes):
    dense = [torch.randn(N, K) * K ** -0.5 for N, K, c in shapes for _ in range(c)]
    # name -> (fn(x, w), weights, bytes per weight, x dtype)
    f32 = torch.float32
    out = {"mm": (lambda x, w: torch.mm(x, w.t()), dense, 4, f32),
           "rows": (lambda x, w: linear_cpu.linear_rows_impl(x, w), dense, 4, f32)}
    if lp.available():
        for dt, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16"), (torch.float16, "fp16")):
            packed = [(lp.pack_weight(w.to(dt)), w.shape[0]) for w in dense]
            fn = lambda x, wn: lp.linear_packed_impl(x, wn[0], None, wn[1])  # noqa: E731
            out[f"packed {name}"] = (fn, packed, dt.itemsize, f32)
            if dt == torch.bfloat16:  # x cast inside the timed call would time the cast too
                out["packed bf16, bf16 x"] = (fn, packed, 2, torch.bfloat16)
    if lq.available():  # weight-only quantized, as GGUF stores them: bytes per weight incl. scales
        for scheme, name, esize in (("int8", "q8 (Q8_0)", 34 / 32), ("int4", "q4 (Q4_1)", 20 / 32)):
            qs = []
            for w in dense:
                q = quant.quantize(w, scheme)
                qs.append((*lq.pack_quant(q.codes, q.scale, q.minv, q.bits), q.bits, q.zero, w.shape[0]))
            out[name] = (lambda x, t: lq.linear_quant_impl(x, *t), qs, esize, f32)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="npuspec bench linear", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--rows", type=int_list, default=[1, 2, 5, 8, 10, 16])
    p.add_argument("--repeats", type=positive, default=15)
    p.add_argument("--threads", type=positive, default=None)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    cfg = read_model_config(a.model)
    shapes = step_shapes(cfg)
    variants = _variants(shapes)
    x32 = {m: {K: torch.randn(m, K) for _, K, _ in shapes} for m in a.rows}
    xs = {torch.float32: x32,
          torch.bfloat16: {m: {K: x.bfloat16() for K, x in d.items()} for m, d in x32.items()}}
    times = {(v, m): [] for v in variants for m in a.rows}
    buf = torch.ones(256 * 1024 * 1024)
    sums = []
    for _ in range(a.repeats + 1):  # the first pass warms up and is dropped
        for (v, m) in times:
            fn, ws, _, xdt = variants[v]
            x = xs[xdt][m]
            t0 = time.perf_counter()
            for w in ws:  # dense [N, K] or (packed [NB, K, BW], N): K is dim 1 either way
                fn(x[(w[0] if isinstance(w, tuple) else w).shape[1]], w)
            times[(v, m)].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        buf.sum()
        sums.append(time.perf_counter() - t0)
    bw = buf.numel() * 4 / statistics.median(sums[1:])
    rows = []
    for v, (_, ws, esize, _) in variants.items():
        nbytes = sum(N * K * c for N, K, c in shapes) * esize
        base = statistics.median(times[(v, a.rows[0])][1:])
        for m in a.rows:
            t = statistics.median(times[(v, m)][1:])
            rows.append({"variant": v, "M": m, "ms/step": t * 1e3, "GB/s": nbytes / t / 1e9,
                         f"x M={a.rows[0]}": t / base})
    print_table(rows, title=f"one step's projections ({a.model}, {torch.get_num_threads()} threads; "
                            f"sum GB/s {bw / 1e9:.1f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
