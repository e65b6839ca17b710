"""`npuspec bench methods`: every speculative method on one target, greedy, same prompts.

Rows: no speculation, then each method of `--methods` with its default speculative config on
the embedded model (`npuspec demo --method M`'s: ngram prompt lookup 1..3, the shipped
tiny-eagle3 / tiny-eagle / tiny-medusa / tiny-dflash / tiny-dspark heads, the tiny model's MTP
layer), K = `--k` (Medusa: its number of heads). `--spec NAME=JSON` adds or replaces a row, e.g.
a confidence budget (`"dynamic_spec_config": {...}` inside the JSON). Each row is an `npuspec.LLM` built and warmed up first (compilation and
graph capture), then the rows are timed round-robin `--repeats` times at each
`--max-num-seqs` value (1 = one request at a time; N = N requests at once) and each figure is
the median. Printed per row: tokens/s, mean acceptance length (tokens per verify step,
including the bonus), both as ratios to ngram's, the drafts verified and accepted per
request-step (a confidence budget's verify tokens saved against acceptance lost), and whether
the output equals the row without speculation token for token.

    npuspec bench methods
    npuspec bench methods --methods ngram,eagle3 --k 4 --max-num-seqs 1,4 --repeats 5
    npuspec bench methods --model DIR --spec eagle3='{"method": "eagle3", "model": "HEAD"}'
    npuspec bench methods --model SMOLLM2.gguf --methods ngram,suffix \
        --prompts code-edit,open-ended --plot methods.png --json methods.json

Several prompt sets (`--prompts a,b`) run in one run: each method's engine is built once and
answers every set, all rows are timed round-robin together, and each set's ratios are taken
against its own no-speculation row. `--plot` draws tokens/s per method and set, and the
acceptance by position.

The prompts default to the demo's built-in code prompts, which the tiny heads' training data
excludes (npuspec/train/data.py).
"""
from __future__ import annotations

import argparse
import json

from npuspec.bench.common import Runner, npuspec_runner, run_interleaved
from npuspec.bench.plots import plot_methods, require_matplotlib
from npuspec.bench.table import print_table
from npuspec.cli_util import common
from npuspec.cli_util.common import DEFAULT_SPEC, METHOD_SPECS, add_threads_flag, positive
from npuspec.cli_util.flags import add_quantization_flag, method_spec
from npuspec.cli_util.errors import UsageError
from npuspec.cli_util.prompts import load_prompts


def _spec(method: str, k: int, overrides: dict, mdir: str = "tiny") -> dict | None:
    if method == "none":
        return None
    if method in overrides:
        return overrides[method]
    if method not in METHOD_SPECS:
        raise SystemExit(f"npuspec bench methods: --methods has {method!r}; choose from "
                         f"{', '.join(sorted(METHOD_SPECS))} or pass --spec {method}=JSON")
    try:  # the target's shipped head (tiny's, SmolLM2's)
        s = method_spec(method, mdir) or dict(DEFAULT_SPEC)
    except ValueError as e:
        raise UsageError(f"{e}; or leave {method} out of --methods", "--methods") from None
    if method != "medusa":  # Medusa drafts exactly its number of heads
        s["num_speculative_tokens"] = k
    return s


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="npuspec bench methods", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--methods", default="ngram,suffix,eagle3,eagle,medusa,mtp,dflash,dspark")
    p.add_argument("--spec", action="append", default=[], metavar="NAME=JSON",
                   help="a row's speculative config (replaces the default of NAME)")
    p.add_argument("--k", type=positive, default=4)
    p.add_argument("--max-num-seqs", default="1", help="comma-separated, e.g. 1,4")
    p.add_argument("--max-tokens", type=positive, default=96)
    p.add_argument("--prompts", default=None,
                   help="as npuspec demo --prompts; several, comma-separated (e.g. "
                        "code-edit,open-ended), are compared in one run, each method's engine "
                        "built once for all of them")
    p.add_argument("--repeats", type=positive, default=3)
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="the target's and the heads' weights and activations (default float32)")
    add_quantization_flag(p)
    p.add_argument("--json", default=None, metavar="PATH")
    p.add_argument("--plot", default=None, metavar="PATH.png",
                   help="tokens/s per method and prompt set, and acceptance by position "
                        "(needs matplotlib)")
    add_threads_flag(p)
    return p


def _prompt_sets(value: str | None, mdir: str) -> dict[str, list]:
    """--prompts: {set name: prompts}; None -> the demo's prompts under the name "demo"."""
    if value is None:
        return {"demo": load_prompts(None, model=mdir)}
    names = [v for v in value.split(",") if v]
    if len(set(names)) != len(names):
        raise UsageError(f"{value!r} names a prompt set twice; list each once", "--prompts")
    return {n: load_prompts(n, model=mdir) for n in names}


def run(args) -> int:
    mdir = common.model_dir(args.model)
    if args.plot:
        require_matplotlib("--plot")  # before any engine is built
    sets = _prompt_sets(args.prompts, mdir)
    threads = common.set_threads(args.threads, mdir)
    overrides = {}
    for item in args.spec:
        name, _, js = item.partition("=")
        overrides[name] = common.spec_dict(js, "--spec")
    methods = ["none"] + [m for m in args.methods.split(",") if m]
    everything = [p for ps in sets.values() for p in ps]
    mml = common.fit_max_model_len(mdir, everything, args.max_tokens)  # one engine, all sets
    rows, out = [], []
    for n in [int(x) for x in args.max_num_seqs.split(",")]:
        engines: dict = {}
        runners = {(name, m): Runner(m, m, args.k, npuspec_runner(
            mdir, _spec(m, args.k, overrides, mdir), ps, args.max_tokens, n, max_model_len=mml,
            dtype=args.dtype, engines=engines, quantization=args.quantization))
            for name, ps in sets.items() for m in methods}
        with common.Progress(f"npuspec bench methods (max_num_seqs={n})",
                             len(runners) * (args.repeats + 1)) as bar:
            run_interleaved(list(runners.values()), args.repeats, bar)
        for name, ps in sets.items():
            group = [runners[name, m] for m in methods]
            rows_n, out_n = _rows(group, n, name, len(ps), args.k, overrides, mdir)
            rows += rows_n
            out += out_n
        engines.clear()
    print_table(rows, title=f"npuspec bench methods: {mdir}, prompt sets "
                            f"{', '.join(f'{k} ({len(v)})' for k, v in sets.items())} x "
                            f"{args.max_tokens} tokens, greedy, K={args.k}, {args.dtype}"
                            f"{', quantization ' + args.quantization if args.quantization else ''}, {threads} threads, "
                            f"median of {args.repeats}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"model": mdir, "prompts": sets, "rows": out}, f, indent=1)
    if args.plot:
        plot_methods(args.plot, out)
        print(f"wrote {args.plot}")
    bad = [r for r in rows if r["same as none"] != r["prompts"]]
    return 1 if bad else 0


def _rows(runners, n: int, set_name: str, n_prompts: int, k: int, overrides: dict,
          mdir: str = "tiny"):
    """The table rows (and JSON rows) of one prompt set: ratios against its own none/ngram."""
    base = runners[0].result["token_ids"]
    tps = {r.system: r.result["tokens"] / r.seconds for r in runners}
    al = {r.system: r.result["metrics"]["mean_acceptance_length"] for r in runners}
    rows, out = [], []
    ng = "ngram" in tps
    for r in runners:
        mt = r.result["metrics"]
        per = (lambda x: x / mt["request_steps"]) if mt["request_steps"] else (lambda x: "-")
        row = {"max_num_seqs": n, "prompt set": set_name, "method": r.system,
               "tok/s": tps[r.system], "× none": tps[r.system] / tps["none"],
               "× ngram tok/s": tps[r.system] / tps["ngram"] if ng else "-",
               "mean acc len": al[r.system] if r.system != "none" else "-",
               "× ngram AL": (al[r.system] / al["ngram"]) if ng and r.system != "none" else "-",
               "verified/step": per(mt["drafted"]), "accepted/step": per(mt["accepted"]),
               **_draft_share(mt, r.system),
               "same as none": sum(a == b for a, b in zip(r.result["token_ids"], base)),
               "eager fallbacks": r.result.get("eager_fallbacks", 0),  # in the last timed pass
               # the hybrid's request-steps per drafter (suffix/model/none), last timed pass
               "picks": "/".join(str(v) for v in r.result["picks"].values())
               if r.result.get("picks") else "-",
               "prompts": n_prompts, "warm-up s": r.warmup_seconds}
        rows.append(row)
        out.append(dict(row, acceptance_by_position=mt.get("acceptance_by_position"),
                        spec=_spec(r.system, k, overrides, mdir)))
    return rows, out


def _draft_share(mt: dict, method: str) -> dict:
    """The drafter's cost in a decode round (its loop and, for hidden-state drafters, its
    first pass): as a share of the round and against the verify step it feeds."""
    d, v, b = mt["draft_s"], mt["step_s"], mt["bookkeeping_s"]
    if method == "none" or not d:
        return {"draft % round": "-", "draft ÷ verify": "-"}
    return {"draft % round": 100 * d / (d + v + b), "draft ÷ verify": d / v if v else "-"}


def main(argv=None) -> int:
    return run(build_parser().parse_args(argv))
