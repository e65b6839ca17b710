"""Cold vs warm start of a compiled speculative step with the graph cache.

    python -m npuspec.bench.cache [--repeats 3] [--batch 4] [--k 3] [--lowering inductor]

Each repetition starts two fresh Python processes on one new cache directory: the first finds
it empty (cold: Dynamo trace, passes, Inductor codegen and C++/Triton build, entry published),
the second finds the entry (warm: Dynamo trace, passes, entry verified and loaded). Each process
times the first call of the compiled step (a 2-layer Llama-shaped decoder's forward over
B*(K+1) tokens with a static KV cache, then the greedy verify idiom), checks the result against eager,
and reports the cache counters. Printed: per-repetition times, the medians and warm/cold.
Target on CPU: warm <= 25% of cold. Interpreter start-up and `import torch` are not included.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from npuspec import counters
from npuspec.bench.table import print_table
from npuspec.models import DecoderLM, ModelConfig


def child(out: str, cache_dir: str, lowering: str, batch: int, k: int) -> None:
    torch.manual_seed(0)
    # A small Llama-shaped decoder with random weights (the compile work depends on the graph,
    # not on the weights): 2 layers, GQA 4/2 heads, hidden 128, vocab 512.
    cfg = ModelConfig(vocab_size=512, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=32, intermediate_size=256)
    model = DecoderLM(cfg).eval()
    cache = model.allocate_cache(num_slots=batch, max_len=64)
    T = k + 1

    def spec_step(tokens, positions, slots, drafts):
        logits = model(tokens, positions, slots, cache)            # [B, K+1, V]
        target = logits.argmax(-1)                                 # [B, K+1]
        accepted = (target[:, :-1] == drafts).int().cumprod(-1).sum(-1)  # [B]
        return target, accepted

    tokens = torch.randint(0, cfg.vocab_size, (batch, T))
    positions = torch.arange(T).expand(batch, T) + 8
    slots = torch.arange(batch)
    drafts = tokens[:, 1:].clone()
    with torch.no_grad():
        want = spec_step(tokens, positions, slots, drafts)
        f = torch.compile(spec_step, backend="npuspec", dynamic=False,
                          options={"cache_dir": cache_dir, "lowering": lowering, "capture": False})
        t0 = time.perf_counter()
        got = f(tokens, positions, slots, drafts)
        first = time.perf_counter() - t0
    equal = all(torch.equal(a, b) for a, b in zip(got, want))
    snap = {k_: v for k_, v in counters.snapshot().items() if k_.startswith("cache_")}
    with open(out, "w") as fh:
        json.dump({"first_call_s": first, "equal": equal, "counters": snap}, fh)


def run_child(cache_dir: str, lowering: str, batch: int, k: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tf:
        out = tf.name
    try:
        cmd = [sys.executable, "-m", "npuspec.bench.cache", "--child", out, "--cache-dir", cache_dir,
               "--lowering", lowering, "--batch", str(batch), "--k", str(k)]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"benchmark child failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
        with open(out) as fh:
            return json.load(fh)
    finally:
        os.unlink(out)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="npuspec bench cache", description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="cold+warm process pairs")
    ap.add_argument("--batch", type=int, default=4, help="requests per step (B)")
    ap.add_argument("--k", type=int, default=3, help="speculative tokens per request (K)")
    ap.add_argument("--lowering", default="inductor", choices=("inductor", "eager"))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--cache-dir", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        child(a.child, a.cache_dir, a.lowering, a.batch, a.k)
        return {}
    if a.repeats < 1:
        raise ValueError(f"--repeats {a.repeats}: must be >= 1")

    rows, cold, warm = [], [], []
    for rep in range(a.repeats):
        d = tempfile.mkdtemp(prefix="npuspec-bench-cache-")
        try:
            c = run_child(os.path.join(d, "cache"), a.lowering, a.batch, a.k)
            w = run_child(os.path.join(d, "cache"), a.lowering, a.batch, a.k)
        finally:
            shutil.rmtree(d, ignore_errors=True)
        for name, r in (("cold", c), ("warm", w)):
            if not r["equal"]:
                raise RuntimeError(f"{name} run {rep}: compiled result differs from eager")
        if w["counters"].get("cache_hits", 0) < 1 or w["counters"].get("cache_misses", 0):
            raise RuntimeError(f"warm run {rep} did not hit the cache: {w['counters']}")
        cold.append(c["first_call_s"])
        warm.append(w["first_call_s"])
        rows.append({"rep": rep, "cold_s": c["first_call_s"], "warm_s": w["first_call_s"],
                     "warm/cold": w["first_call_s"] / c["first_call_s"],
                     "warm_counters": " ".join(f"{k}={v}" for k, v in sorted(w["counters"].items()))})
    print_table(rows, ["rep", "cold_s", "warm_s", "warm/cold", "warm_counters"],
                title=f"graph cache: first call of a compiled speculative step "
                      f"(2-layer decoder, B={a.batch}, K={a.k}, lowering={a.lowering})")
    mc, mw = statistics.median(cold), statistics.median(warm)
    summary = {"cold_median_s": mc, "warm_median_s": mw, "warm/cold": mw / mc,
               "target": "<= 0.25", "met": mw / mc <= 0.25}
    print_table([summary], list(summary), title="medians")
    return summary


if __name__ == "__main__":
    main()
