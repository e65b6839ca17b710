"""Tensor parallelism on one host: tokens/s at tensor_parallel_size=1 and N, and what the N
ranks exchange per engine step (count, bytes and time of rank 0's collectives) against the
step's own time. Greedy; the two engines alternate for --rounds and medians are reported;
tokens must be identical (a mismatch exits 1).

    npuspec bench tp                                  # embedded model, N=2, none and ngram
    npuspec bench tp --model SmolLM2-135M-Instruct.Q4_1.gguf --tp 3 --max-num-seqs 1,4
    npuspec bench tp --cpu-comm gloo                  # torch.distributed's TCP transport

On a CPU the N ranks split the cores (each gets cores/N threads; the N=1 engine runs on all
of them), so this measures the communication's cost more than it shows a speedup: the ranks
compete for the same memory bandwidth that one engine already saturates.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from npuspec import envs
from npuspec.bench.table import print_table
from npuspec.cli_util import common
from npuspec.cli_util.common import positive
from npuspec.cli_util.prompts import load_prompts
from npuspec.engine import LLM, SamplingParams
from npuspec.kernels import collectives


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="npuspec bench tp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--tp", type=positive, default=2, help="tensor_parallel_size to compare "
                                                          "with 1 (default 2)")
    p.add_argument("--methods", default="none,ngram", help="comma-separated: none, ngram, "
                                                           "suffix, draft_model=PATH ...")
    p.add_argument("--k", type=positive, default=4)
    p.add_argument("--max-num-seqs", default="1,4", help="comma-separated batch sizes")
    p.add_argument("--max-tokens", type=positive, default=64)
    p.add_argument("--max-model-len", type=positive, default=1024)
    p.add_argument("--prompts", default=None, help="as npuspec demo --prompts")
    p.add_argument("--rounds", type=positive, default=3)
    p.add_argument("--cpu-comm", choices=("shm", "gloo"), default="shm",
                   help="how CPU ranks exchange activations (NPUSPEC_TP_CPU_COMM; default shm)")
    p.add_argument("--json", default=None, metavar="PATH")
    return p


def _spec(method: str, k: int):
    if method == "none":
        return None
    name, _, model = method.partition("=")
    d = {"method": name, "num_speculative_tokens": k}
    if model:
        d["model"] = model
    return d


def _timed(llm, prompts, params, threads: int):
    torch.set_num_threads(threads)
    collectives.reset_comm()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    m = llm.metrics
    return {"s": dt, "tokens": sum(len(o.outputs[0].token_ids) for o in outs),
            "ids": [o.outputs[0].token_ids for o in outs], "comm": dict(collectives.COMM),
            "steps": m.num_engine_steps + m.num_prefill_steps,
            "busy_s": m.step_s + m.prefill_s}


def _row(n: int, method: str, tp: int, one: list, many: list) -> dict:
    med = statistics.median
    tps1 = med(r["tokens"] / r["s"] for r in one)
    tpsn = med(r["tokens"] / r["s"] for r in many)
    steps = many[0]["steps"]
    c = many[0]["comm"]
    coll_ms = med(r["comm"]["seconds"] for r in many) / steps * 1e3
    step_ms = med(r["busy_s"] for r in many) / steps * 1e3
    step1_ms = med(r["busy_s"] / r["steps"] for r in one) * 1e3
    return {"max_num_seqs": n, "method": method, "tok/s TP=1": tps1, f"tok/s TP={tp}": tpsn,
            "× TP=1": tpsn / tps1, "steps": steps,
            "all-reduce/step": c["all_reduce"] / steps, "all-gather/step": c["all_gather"] / steps,
            "KiB/step": c["bytes"] / steps / 1024, "coll ms/step": coll_ms,
            "step ms TP=1": step1_ms, f"step ms TP={tp}": step_ms,
            "coll share": coll_ms / step_ms if step_ms else float("nan"),
            "same tokens": all(r["ids"] == one[0]["ids"] for r in one + many)}


def run(args) -> int:
    envs.set_tp_cpu_comm(args.cpu_comm)  # the spawned ranks inherit it
    mdir = common.model_dir(args.model)
    prompts = load_prompts(args.prompts, model=mdir)
    cores = os.cpu_count() or 1
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    rows = []
    for n in [int(x) for x in args.max_num_seqs.split(",")]:
        for method in [m for m in args.methods.split(",") if m]:
            kw = dict(speculative_config=_spec(method, args.k), max_num_seqs=n,
                      max_model_len=args.max_model_len)
            one = LLM(mdir, **kw)
            with LLM(mdir, tensor_parallel_size=args.tp, **kw) as many:
                # warm both (compiles, first captures) before anything is timed
                _timed(one, prompts, params, cores)
                _timed(many, prompts, params, max(1, cores // args.tp))
                r1, rn = [], []
                for _ in range(args.rounds):
                    r1.append(_timed(one, prompts, params, cores))
                    rn.append(_timed(many, prompts, params, max(1, cores // args.tp)))
            rows.append(_row(n, method, args.tp, r1, rn))
            del one
    print_table(rows, title=f"npuspec bench tp: {mdir}, {len(prompts)} prompts x "
                            f"{args.max_tokens} tokens, greedy, K={args.k}, TP=1 on {cores} "
                            f"threads vs TP={args.tp} ranks on {max(1, cores // args.tp)} "
                            f"each ({args.cpu_comm} collectives), median of {args.rounds} "
                            f"alternated rounds; per-step figures "
                            f"are rank 0's, per engine iteration (prefill and verify)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"model": mdir, "tp": args.tp, "rows": rows}, f, indent=1)
    return 0 if all(r["same tokens"] for r in rows) else 1


def main(argv=None) -> int:
    return run(build_parser().parse_args(argv))
