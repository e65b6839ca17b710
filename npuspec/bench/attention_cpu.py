"""Benchmark the C++ CPU kernel of `npuspec::paged_attention` in the decode/verify regime.

    python -m npuspec.bench.attention_cpu [--quick] [--threads 2] [--layers 1] [--cold]
                                          [--against /tmp/pa_orig.py]

Shapes are SmolLM2-135M's (H=9 query heads, Hkv=3 kv heads, D=64, fp32, block_size 16) over
B rows of T = K+1 new tokens (K in {0, 4}) and live length L, with the row's blocks scattered
over the pool by a random block table as wide as `--max-model-len / 16`. For each
(B, T, L) it prints the time per call of `cpu_paged_attention`, the K/V bytes it reads
(B * L * Hkv * D * 4 * 2) and the implied GB/s, and the time of `reference_paged_attention`.
`--against FILE` adds another version of the kernel module (e.g. a copy of the file before a
change), imported by path, so that before/after come from one run.

Timing: every call is timed on its own; the variants take turns, `--inner` calls each, for
`--repeats` rounds (interleaved, so a noisy neighbour on the machine slows all of them alike),
and the table shows the median call (robust to the calls that a preemption hits). By default the
K/V of one layer stays in the caches call after call; `--layers N` cycles through N layers of the
pool (N=30 is the model's depth: a larger working set), `--cold` writes over a 64 MiB buffer
before each call (not timed), as a decode step's weight reads do between two attention calls,
so K/V comes from memory.
"""
from __future__ import annotations

import argparse
import importlib.util
import itertools
import statistics
import time

import torch

from npuspec.bench.table import print_table
from npuspec.kernels import paged_attention as pa
from npuspec.kernels import paged_attention_cpu

H, HKV, D, BS = 9, 3, 64, 16


def load_module(path: str):
    """A kernel module (same API as paged_attention_cpu) imported from a file path."""
    spec = importlib.util.spec_from_file_location("npuspec_bench_pa_other", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def make_case(B, T, L, layers, max_model_len, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    MB = max_model_len // BS
    need = -(-L // BS)
    assert need <= MB, (L, max_model_len)
    nb = 1 + B * need  # block 0: scratch
    kc = torch.randn(layers, nb * BS, HKV, D, generator=g).to(dtype)
    vc = torch.randn(layers, nb * BS, HKV, D, generator=g).to(dtype)
    bt = torch.zeros(B, MB, dtype=torch.int32)
    bt[:, :need] = (torch.randperm(nb - 1, generator=g)[:B * need] + 1).view(B, need).int()
    q = torch.randn(B, T, H, D, generator=g).to(dtype)
    lens = torch.full((B,), L, dtype=torch.int32)
    return q, kc, vc, bt, lens


def sample(fn, layers, inner, start=0, flush=None):
    """Seconds of each of `inner` calls, cycling through the layers."""
    ts = []
    for i in range(start, start + inner):
        if flush is not None:
            flush.add_(1)
        t0 = time.perf_counter()
        fn(i % layers)
        ts.append(time.perf_counter() - t0)
    return ts


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--cold", action="store_true", help="evict the caches before each call")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--inner", type=int, default=20)
    ap.add_argument("--against", default=None, help="another kernel module file to time")
    ap.add_argument("--no-reference", action="store_true")
    ap.add_argument("--B", type=int, nargs="*", default=[1, 4, 16])
    ap.add_argument("--T", type=int, nargs="*", default=[1, 5])
    ap.add_argument("--L", type=int, nargs="*", default=[300, 2000])
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    repeats = args.repeats or (7 if args.quick else 21)
    flush = torch.zeros(16 << 20) if args.cold else None

    impls = {"new": paged_attention_cpu.cpu_paged_attention}
    if args.against:
        impls = {"old": load_module(args.against).cpu_paged_attention, **impls}
    if not args.no_reference:
        impls["ref"] = pa.reference_paged_attention

    rows = []
    for B, T, L in itertools.product(args.B, args.T, args.L):
        q, kc, vc, bt, lens = make_case(B, T, L, args.layers, max(args.max_model_len, L))
        scale = D ** -0.5
        fns = {name: (lambda f: lambda layer: f(q, kc, vc, layer, bt, lens, BS, scale))(f)
               for name, f in impls.items()}
        want = pa.reference_paged_attention(q, kc, vc, 0, bt, lens, BS, scale)
        for name, fn in fns.items():  # warm up (compiles) and check
            torch.testing.assert_close(fn(0), want, atol=1e-5, rtol=1e-5, msg=name)
        ts = {name: [] for name in fns}
        for rep in range(repeats):
            for name, fn in fns.items():
                inner = 1 if name == "ref" else args.inner
                ts[name] += sample(fn, args.layers, inner, rep * inner, flush)
        kv_bytes = B * L * HKV * D * kc.element_size() * 2
        row = {"B": B, "T": T, "L": L, "KV KB": kv_bytes / 1e3}
        for name in fns:
            us = statistics.median(ts[name]) * 1e6
            row[f"{name} us"] = us
            if name != "ref":
                row[f"{name} GB/s"] = kv_bytes / us / 1e3
        if "old" in fns:
            row["speedup"] = row["old us"] / row["new us"]
        rows.append(row)
    cache = "cold (K/V from memory)" if args.cold else f"{args.layers} layer(s) of K/V cycled"
    print_table(rows, title=f"paged_attention CPU, {args.threads} threads, {cache}, "
                            f"H={H} Hkv={HKV} D={D} bs={BS} fp32, medians of {repeats} x {args.inner} calls")


if __name__ == "__main__":
    main()
