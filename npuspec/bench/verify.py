"""Benchmark the fused verify op against an unfused eager pipeline, side by side in one run.

    python -m npuspec.bench.verify [--quick] [--draft-probs] [--plot verify.png]

For each configuration (B, K, V, logits dtype) on the current device it times:
- `op`: `npuspec.kernels.rejection_sample` (standard verify, temperature 1 for every request, so
  the full sampling path runs; the uniforms and exponentials are drawn beforehand and passed in
  so that both sides time the verify work only);
- `unfused`: the textbook eager pipeline: materialised softmax [B, K+1, V], gather, compare,
  cumprod, residual (a copy with the draft masked out, or p - q clamped), exponential race;
- `bound`: the logits-read bound of issue 3: the bytes of logits (and draft probs) divided by
  the memory read bandwidth, measured on this device by a `sum` over a buffer of
  `--mem-buffer-mb` (default 1024 MiB: larger than the last-level cache, so it reads memory);
- `cache bound`: a stricter bound, the same bytes divided by the bandwidth of a `sum` over a
  buffer of exactly those bytes, which the last-level cache may hold as it holds the op's
  logits when they are re-read call after call (on this project's CPU, a 300 MiB L3 holds
  41 MB of logits and reads about twice as fast as memory).
It prints the time per call, the speedup over the unfused pipeline, the op's time over both
bounds, and the GB/s. Medians of `--repeats` calls. The CPU targets (issue 3) are at B=64,
K=4, V=32000, fp32: >= 5x the unfused pipeline and <= 2x the (memory) bound.
"""
from __future__ import annotations

import argparse
import itertools
import sys

import torch

from npuspec.bench.table import median_time, print_table
from npuspec.kernels import rejection_sample
from npuspec.platform import current_platform

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def unfused_verify(logits, draft, q, t, u, E):
    """Standard verify, one op at a time, as a straightforward eager implementation does it."""
    B, K1, V = logits.shape
    K = K1 - 1
    p = torch.softmax(logits.float() / t[:, None, None], dim=-1)        # [B, K+1, V]
    px = p[:, :K].gather(-1, draft[..., None]).squeeze(-1)              # [B, K]
    if q is None:
        ratio = px
        resid = p[:, :K].clone()
        resid.scatter_(-1, draft[..., None], 0.0)                       # [B, K, V]
    else:
        ratio = px / q.gather(-1, draft[..., None]).squeeze(-1)
        resid = (p[:, :K] - q).clamp_min(0.0)
    accepted = torch.cumprod((ratio >= u).to(torch.int64), dim=1)     # [B, K]
    n_acc = accepted.sum(1)
    recovered = (resid / E[:, None, :]).argmax(-1)                     # [B, K]
    bonus = (p[:, K] / E).argmax(-1)                                   # [B]
    tok = torch.cat([recovered, bonus[:, None]], 1).gather(1, n_acc[:, None])
    pos = torch.arange(K1, device=logits.device)
    out = torch.where(pos < n_acc[:, None], torch.cat([draft, draft[:, :1]], 1), -1)
    out = torch.where(pos == n_acc[:, None], tok, out)
    return out, n_acc + 1


# Each row has one likely token (the "model's" choice, p ~ 0.65 at V=32000, boost 13); the
# drafter proposes it 80% of the time, so about half the drafts are accepted per position.
# --acceptance all makes every draft certain (p ~ 1): every row is needed, the worst case for
# the CPU lowering, which skips the exp pass on rows after a request's first rejection.
BOOST = {"realistic": 13.0, "all": 40.0}
PROPOSE_TOP = {"realistic": 0.8, "all": 1.0}


def _inputs(B, K, V, dtype, device, draft_probs, acceptance="realistic", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    logits = torch.randn(B, K + 1, V, generator=g) * 2
    top = torch.randint(0, V, (B, K + 1), generator=g)
    logits.scatter_add_(-1, top[..., None], torch.full((B, K + 1, 1), BOOST[acceptance]))
    logits = logits.to(dtype).to(device)
    rnd = torch.randint(0, V, (B, K), generator=g)
    pick = torch.rand(B, K, generator=g) < PROPOSE_TOP[acceptance]
    draft = torch.where(pick, top[:, :K], rnd).to(device)
    q = torch.softmax(torch.randn(B, K, V, generator=g), -1).to(device) if draft_probs else None
    t = torch.ones(B, device=device)
    u = torch.rand(B, K, dtype=torch.float64, generator=g).float().to(device)
    E = torch.empty(B, V).exponential_(generator=g).to(device)
    return logits, draft, q, t, u, E


def _read_time(nbytes, device, repeats, sync):
    """Seconds to read nbytes once (torch.sum over an fp32 buffer of that size)."""
    buf = torch.rand(max(1, nbytes // 4), device=device)
    return median_time(lambda: buf.sum(), repeats, 2, sync)


def memory_read_bandwidth(device, mb, repeats, sync):
    """Bytes/s of a torch.sum over an fp32 buffer of mb MiB (larger than the caches)."""
    nbytes = mb << 20
    return nbytes / _read_time(nbytes, device, max(3, repeats // 3), sync)


def _sync_fn(device):
    if device.startswith("cuda"):
        return torch.cuda.synchronize
    if device.startswith("npu"):
        return torch.npu.synchronize  # type: ignore[attr-defined]
    return None


def run_config(B, K, V, dname, device, draft_probs, repeats, acceptance="realistic",
               mem_bw=None):
    logits, draft, q, t, u, E = _inputs(B, K, V, DTYPES[dname], device, draft_probs, acceptance)
    sync = _sync_fn(device)
    op = lambda: rejection_sample(logits, draft, q, temperature=t, uniforms=u,  # noqa: E731
                                  exponentials=E)
    un = lambda: unfused_verify(logits, draft, q, t, u, E)  # noqa: E731
    a, b = op(), un()  # warm up (and compile the CPU kernel once)
    assert torch.equal(a[1].long(), b[1].long()), "unfused and fused disagree on accepted lengths"
    t_op = median_time(op, repeats, 1, sync)
    t_un = median_time(un, max(1, repeats // 2), 1, sync)
    nbytes = logits.numel() * logits.element_size() + (q.numel() * q.element_size() if q is not None else 0)
    t_cache = _read_time(nbytes, device, repeats, sync)
    if mem_bw is None:
        mem_bw = memory_read_bandwidth(device, 1024, repeats, sync)
    t_bound = nbytes / mem_bw
    return {"B": B, "K": K, "V": V, "dtype": dname, "emitted": a[1].float().mean().item(),
            "op_ms": t_op * 1e3, "unfused_ms": t_un * 1e3, "speedup": t_un / t_op,
            "bound_ms": t_bound * 1e3, "op/bound": t_op / t_bound,
            "cache_bound_ms": t_cache * 1e3, "op/cache_bound": t_op / t_cache,
            "op_GB/s": nbytes / t_op / 1e9, "mem_GB/s": mem_bw / 1e9,
            "cache_GB/s": nbytes / t_cache / 1e9}


def plot(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib: pip install matplotlib (or npuspec[plot])", file=sys.stderr)
        return False
    fig, ax = plt.subplots(figsize=(9, 5))
    # one dtype and one K keep the plot readable: fp32 if present, the median K
    dt = "fp32" if any(r["dtype"] == "fp32" for r in rows) else rows[0]["dtype"]
    ks = sorted({r["K"] for r in rows})
    kk = ks[len(ks) // 2]
    groups = sorted({(r["K"], r["V"], r["dtype"]) for r in rows if r["dtype"] == dt and r["K"] == kk})
    for K, V, d in groups:
        rs = sorted((r for r in rows if (r["K"], r["V"], r["dtype"]) == (K, V, d)),
                    key=lambda r: r["B"])
        if len(rs) < 2:
            continue
        bs = [r["B"] for r in rs]
        line, = ax.plot(bs, [r["op_ms"] for r in rs], "o-", label=f"op K={K} V={V} {d}")
        ax.plot(bs, [r["bound_ms"] for r in rs], "--", color=line.get_color(),
                label=f"read bound K={K} V={V} {d}")
        ax.plot(bs, [r["unfused_ms"] for r in rs], ":", color=line.get_color(), alpha=0.6,
                label=f"unfused K={K} V={V} {d}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size B")
    ax.set_ylabel("ms per verify call")
    ax.set_title("npuspec verify: time vs batch (dashed: logits-read bound)")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")
    return True


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="a small subset: B in {1, 64}, K=4, V=32000, fp32 and bf16")
    ap.add_argument("--draft-probs", action="store_true",
                    help="verify with draft probabilities [B, K, V] instead of one-hot drafts")
    ap.add_argument("--batch", type=int, nargs="*", help="override the batch sizes")
    ap.add_argument("--k", type=int, nargs="*", help="override K")
    ap.add_argument("--vocab", type=int, nargs="*", help="override V")
    ap.add_argument("--dtype", choices=sorted(DTYPES), nargs="*", help="override dtypes")
    ap.add_argument("--acceptance", choices=sorted(BOOST), default="realistic",
                    help="realistic: ~half the drafts accepted per position; all: every draft "
                         "accepted (every logits row is needed)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch/OpenMP threads for the CPU (default: torch's default)")
    ap.add_argument("--device", default=None, help="default: the current npuspec platform")
    ap.add_argument("--mem-buffer-mb", type=int, default=1024,
                    help="MiB read to measure the memory bandwidth of the bound; make it larger "
                         "than the last-level cache (default 1024)")
    ap.add_argument("--plot", metavar="PATH.png", help="plot time vs batch with the read bound")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device is None:
        args.device = current_platform().device
    if args.quick:
        Bs, Ks, Vs, Ds = [1, 64], [4], [32000], ["fp32", "bf16"]
    else:
        Bs, Ks, Vs, Ds = [1, 8, 64, 256], [1, 3, 7], [32000, 151936], ["fp32", "bf16"]
    Bs, Ks, Vs, Ds = args.batch or Bs, args.k or Ks, args.vocab or Vs, args.dtype or Ds
    configs = list(itertools.product(Bs, Ks, Vs, Ds))
    if not args.quick and not (args.batch or args.k or args.vocab or args.dtype):
        configs.insert(0, (64, 4, 32000, "fp32"))  # the CPU target configuration
    sync = _sync_fn(args.device)
    mem_bw = memory_read_bandwidth(args.device, args.mem_buffer_mb, args.repeats, sync)
    rows = []
    for B, K, V, d in configs:
        reps = args.repeats if B * (K + 1) * V < 2e7 else max(3, args.repeats // 3)
        rows.append(run_config(B, K, V, d, args.device, args.draft_probs, reps, args.acceptance,
                               mem_bw))
        print(f"  done B={B} K={K} V={V} {d}", file=sys.stderr, flush=True)
    title = (f"verify on {args.device} ({torch.get_num_threads()} threads), "
             f"{'draft probs' if args.draft_probs else 'one-hot drafts'}, temperature 1, "
             f"acceptance {args.acceptance}")
    title += f", memory read {mem_bw / 1e9:.1f} GB/s ({args.mem_buffer_mb} MiB sum)"
    print_table(rows, ["B", "K", "V", "dtype", "emitted", "op_ms", "unfused_ms", "speedup",
                       "bound_ms", "op/bound", "cache_bound_ms", "op/cache_bound", "op_GB/s",
                       "cache_GB/s"], title)
    if args.plot:
        plot(rows, args.plot)
    return rows


if __name__ == "__main__":
    main()
