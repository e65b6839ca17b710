"""HF transformers' generate() with its forward compiled: eager vs backend="inductor" vs
backend="npuspec", warm, in one run.

    npuspec bench hf [--model PATH] [--prompts code-edit|FILE] [--max-tokens 64] [--repeats 3]
    npuspec bench hf --start [...]        start-up instead: cold and warm-started child processes

    model.forward = torch.compile(model.forward, backend=B)    # B = inductor | npuspec
    model.generate(ids, do_sample=False, ...)                   # one prompt at a time

Rows per generate mode: greedy, prompt lookup (prompt_lookup_num_tokens=K), the static cache
(cache_implementation="static"), and assisted generation with --draft-model (default for the
embedded model: itself). Each system loads its own copy of the model; every row is warmed up
(compiled) once and then timed round-robin, so machine load hits every row alike, each round
starting one row later (no system always runs right after the same one: in a fixed order
npuspec read 0.88-0.97x Inductor for greedy on SmolLM2 and 0.999x with the order swapped);
tokens/s is the median. Outputs are compared token by token with the eager row of the same mode.

HF's forward is one code object for every model instance, so Dynamo's recompile limit is
raised to 256 for this run: generate's changing cache and candidate lengths recompile it.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import torch

from npuspec.bench import hf_start
from npuspec.bench.common import Runner, encode, run_interleaved
from npuspec.bench.hf_runners import hf_runner, load_hf, require_transformers
from npuspec.bench.table import print_table
from npuspec.cli_util import common
from npuspec.cli_util.errors import run_command
from npuspec.cli_util.prompts import BUILTIN_SETS, builtin_prompts, chat_tokenizer, load_prompts
from npuspec.compilation.backend import own_seconds
from npuspec.models.loading import TINY_MODEL_DIR, read_model_config

MODES = ("greedy", "prompt lookup", "static cache", "assisted")
SYSTEMS = ("eager", "inductor", "npuspec")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, metavar="PATH",
                   help="HF checkpoint directory or GGUF file (default: the embedded model)")
    p.add_argument("--draft-model", default=None, metavar="PATH",
                   help="assistant for the assisted row (default: the embedded model drafts "
                        "for itself; a --model with another vocabulary has no assisted row "
                        "without it)")
    p.add_argument("--prompts", default="code-edit",
                   help="'code-edit' or 'open-ended' (chat-templated when the checkpoint has a "
                        "template) or a file")
    p.add_argument("--num-prompts", type=int, default=4, help="first N prompts")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("-k", type=int, default=4, help="prompt_lookup_num_tokens / assistant tokens")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per row (median)")
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ", ".join(MODES))
    p.add_argument("--start", action="store_true",
                   help="time start-up instead: per mode and system, a cold child process on new, "
                        "empty caches, then a warm-started one on the caches it left")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the rows as JSON")
    p.add_argument(hf_start.CHILD_FLAG, default=None, help=argparse.SUPPRESS)
    p.add_argument("--debug", action="store_true", help="show the full traceback on errors")
    return p


def _modes(value: str) -> list[str]:
    modes = [m.strip() for m in value.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise SystemExit(f"--modes={value!r}: {bad or 'empty'} not among {', '.join(MODES)}")
    return modes


def compiled_model(load, backend: str):
    """A fresh model with its forward compiled by `backend` (eager: not compiled)."""
    m = load()
    if backend != "eager":
        m.forward = torch.compile(m.forward, backend=backend)
    return m


def run(args) -> int:
    require_transformers()
    modes = _modes(args.modes)
    mdir = common.model_dir(args.model)
    threads = common.set_threads(args.threads, mdir)
    torch._dynamo.config.recompile_limit = 256
    if args.prompts in BUILTIN_SETS:
        tok = chat_tokenizer(mdir)
        ids = encode(mdir, builtin_prompts(args.prompts, mdir, tok), tok)
    else:
        ids = encode(mdir, load_prompts(args.prompts))
    ids = ids[:args.num_prompts]
    eos = list(read_model_config(mdir).eos_token_ids)
    draft = args.draft_model or (TINY_MODEL_DIR if os.path.realpath(mdir) == os.path.realpath(
        TINY_MODEL_DIR) else None)
    if "assisted" in modes and draft is None:
        print("assisted: no --draft-model for this checkpoint; row skipped", file=sys.stderr)
        modes.remove("assisted")

    def assistant():
        m = load_hf(common.model_dir(draft, "--draft-model"))
        m.generation_config.num_assistant_tokens = args.k
        m.generation_config.num_assistant_tokens_schedule = "constant"
        return m

    extra = {"greedy": {}, "prompt lookup": {"prompt_lookup_num_tokens": args.k},
             "static cache": {"cache_implementation": "static"},
             "assisted": {"assistant_model": assistant}}
    if args.start_child is not None:  # one (system, mode) of --start, in its own process
        system, mode = args.start_child.split(":", 1)
        model = functools.lru_cache(None)(
            functools.partial(compiled_model, lambda: load_hf(mdir), system))
        shorter = [x[1:] for x in ids]  # new prompt and cache lengths for the warm model
        return hf_start.child(hf_runner(model, ids, args.max_tokens, eos, **extra[mode]),
                              hf_runner(model, shorter, args.max_tokens, eos, **extra[mode]),
                              own_seconds)
    if args.start:
        return _report_start(args, modes, mdir, threads)
    runners = []
    for system in SYSTEMS:
        model = functools.lru_cache(None)(functools.partial(compiled_model, lambda: load_hf(mdir), system))
        for mode in modes:
            runners.append(Runner(system, mode, args.k if mode in ("prompt lookup", "assisted") else 0,
                                  hf_runner(model, ids, args.max_tokens, eos, **extra[mode])))
    with common.Progress("bench hf", len(runners) * (1 + args.repeats)) as bar:
        run_interleaved(runners, args.repeats, bar, rotate=True)

    by = {(r.system, r.method): r for r in runners}
    rows = []
    for r in runners:
        tps = r.result["tokens"] / r.seconds
        ref = by[("eager", r.method)]
        ind = by[("inductor", r.method)]
        rows.append({"mode": r.method, "system": r.system, "tokens": r.result["tokens"],
                     "warmup_s": r.warmup_seconds, "seconds": r.seconds, "tokens_per_s": tps,
                     "vs_eager": tps / (ref.result["tokens"] / ref.seconds),
                     "vs_inductor": tps / (ind.result["tokens"] / ind.seconds),
                     "identical": sum(a == b for a, b in zip(r.result["token_ids"],
                                                             ref.result["token_ids"])),
                     "prompts": len(ids)})
    print_table(rows, title=f"HF generate, compiled forward ({os.path.basename(mdir.rstrip('/'))}, "
                            f"{threads} threads, {args.max_tokens} new tokens, median of {args.repeats})")
    return _finish(args, mdir, threads, rows)


def _finish(args, mdir: str, threads: int, rows: list[dict]) -> int:
    """--json, then exit status 1 (naming the rows) when an output differs from eager's."""
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": mdir, "threads": threads, "rows": rows}, f, indent=1)
    bad = [r for r in rows if r["identical"] != r["prompts"]]
    for r in bad:
        print(f"{r['system']} {r['mode']}: {r['prompts'] - r['identical']} of {r['prompts']} "
              f"outputs differ from eager", file=sys.stderr)
    return 1 if bad else 0


def _child_argv(args, modes: list[str]) -> list[str]:
    """The parent's settings as flags for its --start children (ids are rebuilt there alike)."""
    out = ["--prompts", args.prompts, "--num-prompts", str(args.num_prompts),
           "--max-tokens", str(args.max_tokens), "-k", str(args.k), "--modes", ",".join(modes)]
    for flag, v in (("--model", args.model), ("--draft-model", args.draft_model),
                    ("--threads", args.threads)):
        if v is not None:
            out += [flag, str(v)]
    return out


def _report_start(args, modes: list[str], mdir: str, threads: int) -> int:
    with common.Progress("bench hf --start", len(modes) * (1 + 2 * len(hf_start.COMPILED))) as bar:
        rows = hf_start.run_start(_child_argv(args, modes), modes, bar)
    print_table(rows, title=f"HF generate start-up, seconds of the first run "
                            f"({os.path.basename(mdir.rstrip('/'))}, {threads} threads, "
                            f"{args.num_prompts} prompts x {args.max_tokens} new tokens)")
    return _finish(args, mdir, threads, rows)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(lambda: run(args), "npuspec bench hf", args.debug)


if __name__ == "__main__":
    sys.exit(main())
