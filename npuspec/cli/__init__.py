"""The `npuspec` command.

    npuspec demo                       # speculative vs plain decoding on the embedded model
    npuspec generate --prompt "def f(" [--model PATH] [--speculative-config JSON]
    npuspec serve MODEL [--speculative-config JSON] [--port P]   # OpenAI-compatible server
    npuspec bench e2e|verify|propose|graphs|cache|passes|linear|hf|methods|serve|tp|dynk|peers|heads [...]
    npuspec plan --speculative-config JSON --max-num-seqs N
    npuspec tune [--max-num-seqs N]
    npuspec cache ls|verify|prune|clear
    npuspec train-draft --target tiny --method eagle3 --out DIR   # train a drafter

Every subcommand has --help. User errors print one line and exit 2; --debug (anywhere on the
line) shows the traceback instead. Only the subcommand on the command line has its module
imported, for its docstring, flags and `run`; so `npuspec --help` does not import torch. Those
modules do not import it either (their `run` imports the part that does, npuspec/cli/*_run.py),
so `npuspec CMD --help` and flag errors stay fast (tune's `run` is npuspec.bench.tune.run).
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

from npuspec import __version__
from npuspec.cli_util import errors
from npuspec.cli_util.errors import EXIT_USAGE, run_command

# `npuspec bench NAME ARGS...` runs npuspec.bench.NAME.main(ARGS) with its own argparse.
BENCHES = {
    "e2e": "npuspec vs HF transformers end to end: greedy, prompt lookup, assisted generation",
    "verify": "the fused rejection-sampling op against its reference and the bandwidth bound",
    "propose": "ngram / suffix proposers replayed on traces (tokens per step, us per propose)",
    "graphs": "graph-capture dispatch overhead per step (pad, copy, replay, slice)",
    "cache": "cold vs warm start of a compiled speculative step with the graph cache",
    "passes": "pattern-matching passes: compile time and matched verify patterns",
    "linear": "one step's projections per weight layout (mm, few-row kernel, packed fp32/bf16/fp16, q8/q4)",
    "quant": "weight-only quantization (GGUF as stored, int8, int4) against fp32: top-1 agreement, perplexity, greedy",
    "hf": "HF generate with a compiled forward: eager vs backend=inductor vs backend=npuspec",
    "methods": "every speculative method on one target: tokens/s and acceptance vs ngram",
    "serve": "npuspec serve under N streaming clients: TTFT/TPOT/ITL percentiles, tok/s with and without speculation",
    "dynk": "the online K controller vs no speculation and every fixed K, by batch size",
    "tp": "tensor parallelism on one host: tok/s at TP=1 vs N, collectives per step vs the step's time",
    "peers": "npuspec vs llama.cpp and HF transformers on a GGUF file at each precision, batch 1",
    "heads": "a chain head's teacher-forced agreement on the target's own answers to a prompt set (data vs serving gap)",
}

COMMANDS = {
    "demo": ("npuspec.cli.demo", "speculative vs plain decoding on the embedded model: text, identity, speedup"),
    "generate": ("npuspec.cli.generate", "generate text from prompts with an HF checkpoint"),
    "serve": ("npuspec.cli.serve", "an OpenAI-compatible server with continuous batching and speculative decoding"),
    "plan": ("npuspec.cli.plan", "print the graph capture plan per K and warn about uncaptured batches"),
    "tune": ("npuspec.cli.tune", "measure latency and acceptance, write the K-per-batch-size table"),
    "train-draft": ("npuspec.cli.train_draft", "train an EAGLE-3 / EAGLE / Medusa / MTP drafter for a target"),
}
# listed after `bench` in the help, as it always was
CACHE = ("npuspec.cli.cache", "graph cache directory: ls, verify, prune, clear")


def _add_debug(p: argparse.ArgumentParser) -> None:
    p.add_argument("--debug", action="store_true", help="show the full traceback on errors")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; only `command`'s module is imported, for its flags (the others are
    listed by name and help)."""
    p = argparse.ArgumentParser(prog="npuspec", description=__doc__.split("\n\n")[0] + " Speculative "
                                "decoding for Ascend NPUs, CUDA GPUs and CPUs.", epilog="Start with: npuspec demo")
    p.add_argument("--version", action="version", version=f"npuspec {__version__}")
    _add_debug(p)
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in COMMANDS.items():
        _add_command(sub, name, module, help_, name == command)
    bench = sub.add_parser("bench", help="benchmarks, one table format: " + ", ".join(BENCHES),
                           description="Run one benchmark; `npuspec bench NAME --help` shows its options.\n\n"
                           + "\n".join(f"  {k:8s} {v}" for k, v in BENCHES.items()),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_argument("name", choices=list(BENCHES), metavar="NAME", help="one of " + ", ".join(BENCHES))
    bench.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own options")
    _add_command(sub, "cache", *CACHE, command == "cache")
    return p


def _add_command(sub, name: str, module: str, help_: str, chosen: bool) -> None:
    """A subcommand's parser; the chosen one gets its module's docstring, flags and `run`."""
    sp = sub.add_parser(name, help=help_, description=help_,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_debug(sp)
    if chosen:
        mod = importlib.import_module(module)
        sp.description = (mod.__doc__ or help_).strip()
        mod.add_arguments(sp)
        sp.set_defaults(run=mod.run)


def _command(argv: list[str]) -> str | None:
    """The subcommand named on the line: the first word that is not an option (the top-level
    options take no values)."""
    return next((a for a in argv if not a.startswith("-")), None)


def _unavailable(what: str, e: Exception) -> int:
    print(f"{what}: error: not available in this installation ({e}); reinstall npuspec", file=sys.stderr)
    return EXIT_USAGE


def run_bench(name: str, argv: list[str], debug: bool = False) -> int:
    """`npuspec bench NAME ARGS` -> npuspec.bench.NAME.main(ARGS), errors mapped like the rest."""
    prog = f"npuspec bench {name}"
    try:
        mod = importlib.import_module(f"npuspec.bench.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"npuspec.bench.{name}":
            raise
        return _unavailable(prog, e)
    old, old_debug = sys.argv, errors.DEBUG
    sys.argv = [prog] + argv  # so the bench's argparse prints `npuspec bench NAME` in its usage
    errors.DEBUG = debug
    try:
        return run_command(lambda: mod.main(argv), prog, debug)
    finally:
        sys.argv, errors.DEBUG = old, old_debug


def _setup_logging(debug: bool) -> None:
    """Library warnings as `WARNING npuspec.x: ...` lines on stderr (a no-op when the host
    program, or pytest, already configured logging)."""
    logging.basicConfig(level=logging.DEBUG if debug else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    _setup_logging(debug)
    argv = [a for a in argv if a != "--debug"]  # accepted anywhere, also inside `cache ls`
    if len(argv) >= 2 and argv[0] == "bench" and argv[1] in BENCHES:
        return run_bench(argv[1], argv[2:], debug)
    try:
        args = build_parser(_command(argv)).parse_args(argv)
    except SystemExit as e:  # --help, --version, or argparse's own usage error (exit 2)
        return e.code if isinstance(e.code, int) else 0
    if args.command is None:
        build_parser().print_help()
        return EXIT_USAGE
    if args.command == "bench":  # only reached with an unknown name or none; argparse handled it
        return EXIT_USAGE
    return run_command(lambda: args.run(args), f"npuspec {args.command}", debug)


if __name__ == "__main__":
    sys.exit(main())
