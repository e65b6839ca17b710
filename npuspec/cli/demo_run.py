"""`npuspec demo`'s run: both generations, the identity check and the table (its flags and
documentation: npuspec/cli/demo.py)."""
from __future__ import annotations

import json
import sys
import time

from npuspec.bench.common import aggregate_metrics, make_llm
from npuspec.bench.table import print_table
from npuspec.cli_util import common
from npuspec.cli_util.errors import UsageError
from npuspec.cli_util.flags import DEFAULT_SPEC, method_spec
from npuspec.cli_util.prompts import load_prompts
from npuspec.engine import SamplingParams


def _generate(llm, prompts, max_tokens: int):
    t0 = time.perf_counter()
    res = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return res, time.perf_counter() - t0


def _first_diff(a, b) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def _method_spec(method, mdir: str) -> dict:
    """--method on this target: its shipped head (tiny's, SmolLM2's), or ngram without it."""
    if method is None:
        return dict(DEFAULT_SPEC)
    try:
        return method_spec(method, mdir) or dict(DEFAULT_SPEC)
    except ValueError as e:
        raise UsageError(str(e), "--method") from None


def run(args) -> int:
    t_start = time.perf_counter()
    mdir = common.model_dir(args.model)
    spec = common.spec_dict(args.speculative_config) or _method_spec(args.method, mdir)
    cfg = common.spec_config(spec)
    common.check_draft(mdir, cfg)
    prompts = load_prompts(args.prompts, model=mdir)
    threads = common.set_threads(args.threads, mdir)
    max_len = common.fit_max_model_len(mdir, prompts, args.max_tokens)
    label = (f"{cfg.method} K<={cfg.num_speculative_tokens} (online K)" if cfg.online_k
             else f"{cfg.method} K={cfg.num_speculative_tokens}")

    runs = {}
    with common.Progress("npuspec demo", 4) as bar:
        for name, s in (("no speculation", None), (label, spec)):
            t0 = time.perf_counter()
            llm = make_llm(mdir, s, args.max_num_seqs, max_len, args.enforce_eager)
            _generate(llm, prompts[:1], 8)  # warm-up: compiles and captures outside the timing
            warm = time.perf_counter() - t0
            bar.update()
            res, secs = _generate(llm, prompts, args.max_tokens)
            bar.update()
            runs[name] = (res, secs, warm)
            metrics = llm.metrics

    (base, base_s, base_w), (spec_res, spec_s, spec_w) = runs["no speculation"], runs[label]
    if not args.no_text:
        for i, (p, r) in enumerate(zip(prompts, spec_res)):
            print(f"--- prompt {i + 1} ---")
            print(f"{p}\033[1m{r.outputs[0].text}\033[0m" if _tty() else p + r.outputs[0].text)
        print("---")
    same = [list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids) for a, b in zip(base, spec_res)]
    m = aggregate_metrics(spec_res, metrics)
    toks = [sum(len(r.outputs[0].token_ids) for r in rs) for rs in (base, spec_res)]
    rows = [{"mode": "no speculation", "tokens": toks[0], "seconds": base_s, "tok/s": toks[0] / base_s,
             "warm-up s": base_w, "mean acc len": "-"},
            {"mode": label, "tokens": toks[1], "seconds": spec_s, "tok/s": toks[1] / spec_s,
             "warm-up s": spec_w, "mean acc len": m["mean_acceptance_length"]}]
    print_table(rows, title=f"npuspec demo: {len(prompts)} prompts x {args.max_tokens} tokens, greedy, "
                            f"max_num_seqs={args.max_num_seqs}, {threads} threads")
    speedup = rows[1]["tok/s"] / rows[0]["tok/s"]
    acc = m["acceptance_by_position"]
    print(f"speedup: {speedup:.2f}x   outputs identical: {'yes' if all(same) else 'NO'} "
          f"({sum(same)}/{len(same)} prompts)")
    print("acceptance by position: " + "  ".join(f"{i + 1}: {a:.2f}" for i, a in enumerate(acc)))
    print(f"total time: {time.perf_counter() - t_start:.1f}s (including model load and compilation)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"model": mdir, "speculative_config": spec, "prompts": prompts,
                       "max_tokens": args.max_tokens, "identical": all(same), "speedup": speedup,
                       "rows": rows, "acceptance_by_position": acc, "metrics": m,
                       "texts": [r.outputs[0].text for r in spec_res],
                       "token_ids": [list(r.outputs[0].token_ids) for r in spec_res]}, f, indent=1)
    if not all(same):
        for i, (a, b) in enumerate(zip(base, spec_res)):
            if not same[i]:
                j = _first_diff(list(a.outputs[0].token_ids), list(b.outputs[0].token_ids))
                print(f"prompt {i + 1}: outputs differ from token {j} on; this is a bug in npuspec, "
                      f"please report it with this command line")
        return 1
    return 0


def _tty() -> bool:
    return sys.stdout.isatty()
