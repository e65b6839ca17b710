"""`python -m npuspec.bench.kvlen`: does a step's cost follow the live length or max_model_len?

One engine per max_model_len (max_num_seqs=1, so the pool is one request's worth of blocks);
each times the verify step of one request whose context holds `--live` tokens (its K/V pool
rows are whatever the pool holds: attention cost does not depend on the values), at K=0 and
K=--k. Engines are timed round-robin in one process, so machine noise hits every row alike;
each figure is a median. The last column is the step time over the smallest max_model_len's.

    python -m npuspec.bench.kvlen --model tiny --live 300 --max-model-len 512,2048,8192
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from npuspec.bench.table import print_table
from npuspec.cli_util.common import int_list, positive
from npuspec.engine import LLM
from npuspec.engine.request import Request
from npuspec.engine.sampling import SamplingParams


def _request(llm, live: int):
    """A running request with `live` context tokens and the blocks for them plus K drafts."""
    toks = list(np.random.default_rng(0).integers(0, llm.model_config.vocab_size, live))
    r = Request(0, "bench", None, [int(t) for t in toks], SamplingParams(temperature=0.0),
                frozenset(), llm.max_model_len)
    assert llm.runner.blocks.grow(r.blocks, live + llm.k_max), "pool too small"
    r.num_cached = live - 1
    return r


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="npuspec bench kvlen", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--live", type=positive, default=300, help="context tokens of the request")
    p.add_argument("--max-model-len", type=int_list, default=[512, 2048, 8192])
    p.add_argument("--k", type=positive, default=4)
    p.add_argument("--repeats", type=positive, default=15)
    p.add_argument("--threads", type=positive, default=None)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--dtype", default="auto", help="LLM(dtype=...): float32, bfloat16, float16")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    spec = {"method": "ngram", "num_speculative_tokens": a.k, "k_controller": "fixed",
            "num_speculative_tokens_per_batch_size": [[1, 1, a.k]]}
    engines = {}
    for m in a.max_model_len:
        llm = LLM(a.model, max_model_len=m, max_num_seqs=1, speculative_config=spec,
                  enforce_eager=a.enforce_eager, dtype=a.dtype)
        req = _request(llm, a.live)
        for k in (0, a.k):
            drafts = np.zeros((1, k), dtype=np.int64)
            inp = llm.runner.step_inputs(k, [req], llm.runner.rows_for(1, k), drafts, None)
            engines[(m, k)] = (llm, inp)
    times: dict = {key: [] for key in engines}
    for _ in range(a.repeats):  # round-robin
        for key, (llm, inp) in engines.items():
            t0 = time.perf_counter()
            llm.runner.run_step(inp)
            times[key].append(time.perf_counter() - t0)
    rows = []
    for k in (0, a.k):
        base = statistics.median(times[(a.max_model_len[0], k)][1:])
        for m in a.max_model_len:
            ms = statistics.median(times[(m, k)][1:])
            rows.append({"K": k, "max_model_len": m, "live": a.live, "step ms": ms * 1e3,
                         "x smallest": ms / base})
    print_table(rows, title=f"step time vs max_model_len ({a.model}, {a.dtype}, "
                            f"{'eager' if a.enforce_eager else 'compiled'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
