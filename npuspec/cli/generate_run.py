"""`npuspec generate`'s run: the checks, the engine, the outputs (its flags and documentation:
npuspec/cli/generate.py)."""
from __future__ import annotations

import json
import sys
import time

from npuspec.bench.common import aggregate_metrics
from npuspec.cli_util import common
from npuspec.cli_util.errors import UsageError
from npuspec.cli_util.prompts import load_prompts
from npuspec.engine import LLM, SamplingParams


def run(args) -> int:
    cfg = common.spec_config(args.speculative_config)
    mdir = common.model_dir(args.model)
    common.check_draft(mdir, cfg)
    prompts = list(args.prompt) + (load_prompts(args.prompts, model=mdir) if args.prompts else [])
    if not prompts:
        raise UsageError("give at least one prompt, e.g. --prompt 'def fib(n):'", "--prompt")
    if any(not p for p in prompts):
        raise UsageError("a prompt is empty; pass some text", "--prompt")
    if args.temperature < 0:
        raise UsageError(f"{args.temperature} must be >= 0 (0 = greedy)", "--temperature")
    sp_kw = dict(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    for key in ("top_p", "top_k", "seed"):
        if getattr(args, key) is not None:
            sp_kw[key] = getattr(args, key)
    try:  # before the model loads: a bad --seed / --top-p fails at once, naming its flag
        sp = SamplingParams(**sp_kw)
    except ValueError as e:
        flag = next((f"--{k.replace('_', '-')}" for k in sp_kw if f": {k}=" in str(e)), "sampling")
        raise common.with_field(e, flag) from None
    common.out_file(args.json, "--json")
    max_len = args.max_model_len or common.fit_max_model_len(mdir, prompts, args.max_tokens)
    llm = LLM(model=mdir, speculative_config=cfg.to_dict() if cfg else None,
              max_num_seqs=args.max_num_seqs, max_model_len=max_len, enforce_eager=args.enforce_eager,
              quantization=args.quantization)
    t0 = time.perf_counter()
    res = llm.generate(prompts, sp)
    secs = time.perf_counter() - t0
    for i, r in enumerate(res):
        if len(res) > 1:
            print(f"--- {i + 1} ---")
        print(r.outputs[0].text if args.only_new else r.prompt + r.outputs[0].text)
    sys.stdout.flush()
    m = aggregate_metrics(res, llm.metrics)
    n = sum(len(r.outputs[0].token_ids) for r in res)
    mal = m["mean_acceptance_length"]
    print(f"{n} tokens in {secs:.2f}s ({n / secs:.1f} tok/s)"
          + (f", mean acceptance length {mal:.2f}" if cfg and mal else ""), file=sys.stderr)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"model": mdir, "speculative_config": cfg.to_dict() if cfg else None,
                       "outputs": [{"prompt": r.prompt, "text": r.outputs[0].text,
                                    "token_ids": list(r.outputs[0].token_ids)} for r in res],
                       "seconds": secs, "metrics": m}, f, indent=1)
    return 0
