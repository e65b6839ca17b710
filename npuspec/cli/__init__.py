"""The `npuspec` command.

    npuspec demo                       # speculative vs plain decoding on the embedded model
    npuspec generate --prompt "def f(" [--model PATH] [--speculative-config JSON]
    npuspec serve MODEL [--speculative-config JSON] [--port P]   # OpenAI-compatible server
    npuspec bench e2e|verify|propose|graphs|cache|passes|linear|hf|methods|serve [...]
    npuspec plan --speculative-config JSON --max-num-seqs N
    npuspec tune [--max-num-seqs N]
    npuspec cache ls|verify|prune|clear
    npuspec train-draft --target tiny --method eagle3 --out DIR   # train a drafter

Every subcommand has --help. User errors print one line and exit 2; --debug (anywhere on the
line) shows the traceback instead. Subcommand modules are imported only when they run, so
`npuspec --help` does not import torch.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from npuspec.cli import errors
from npuspec.cli.errors import EXIT_USAGE, run_command

# `npuspec bench NAME ARGS...` runs npuspec.bench.NAME.main(ARGS) with its own argparse.
BENCHES = {
    "e2e": "npuspec vs HF transformers end to end: greedy, prompt lookup, assisted generation",
    "verify": "the fused rejection-sampling op against its reference and the bandwidth bound",
    "propose": "ngram / suffix proposers replayed on traces (tokens per step, us per propose)",
    "graphs": "graph-capture dispatch overhead per step (pad, copy, replay, slice)",
    "cache": "cold vs warm start of a compiled speculative step with the graph cache",
    "passes": "pattern-matching passes: compile time and matched verify patterns",
    "linear": "one step's projections per weight layout (mm, few-row kernel, packed fp32/bf16/fp16)",
    "hf": "HF generate with a compiled forward: eager vs backend=inductor vs backend=npuspec",
    "methods": "every speculative method on one target: tokens/s and acceptance vs ngram",
    "serve": "npuspec serve under N streaming clients: TTFT/TPOT/ITL percentiles, tok/s with and without speculation",
    "tp": "tensor parallelism on one host: tok/s at TP=1 vs N, collectives per step vs the step's time",
}

COMMANDS = {
    "demo": ("npuspec.cli.demo", "speculative vs plain decoding on the embedded model: text, identity, speedup"),
    "generate": ("npuspec.cli.generate", "generate text from prompts with an HF checkpoint"),
    "serve": ("npuspec.cli.serve", "an OpenAI-compatible server with continuous batching and speculative decoding"),
    "plan": ("npuspec.cli.plan", "print the graph capture plan per K and warn about uncaptured batches"),
    "tune": ("npuspec.bench.tune", "measure latency and acceptance, write the K-per-batch-size table"),
    "train-draft": ("npuspec.cli.train_draft", "train an EAGLE-3 / EAGLE / Medusa / MTP drafter for a target"),
}


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    pass


def _add_debug(p: argparse.ArgumentParser) -> None:
    p.add_argument("--debug", action="store_true", help="show the full traceback on errors")


def build_parser() -> argparse.ArgumentParser:
    from npuspec import __version__

    p = argparse.ArgumentParser(prog="npuspec", description=__doc__.split("\n\n")[0] + " Speculative "
                                "decoding for Ascend NPUs, CUDA GPUs and CPUs.", epilog="Start with: npuspec demo")
    p.add_argument("--version", action="version", version=f"npuspec {__version__}")
    _add_debug(p)
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in COMMANDS.items():
        mod = importlib.import_module(module)
        sp = sub.add_parser(name, help=help_, description=(mod.__doc__ or help_).strip(),
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(sp)
        _add_debug(sp)
        sp.set_defaults(run=mod.run)
    bench = sub.add_parser("bench", help="benchmarks, one table format: " + ", ".join(BENCHES),
                           description="Run one benchmark; `npuspec bench NAME --help` shows its options.\n\n"
                           + "\n".join(f"  {k:8s} {v}" for k, v in BENCHES.items()),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_argument("name", choices=list(BENCHES), metavar="NAME", help="one of " + ", ".join(BENCHES))
    bench.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own options")
    _mount_cache(sub)
    return p


def _mount_cache(sub) -> None:
    """`npuspec cache ...` is the cache helper's parser (npuspec/cli/cache.py)."""
    try:
        from npuspec.cli import cache as cache_cli
    except ImportError as e:
        sp = sub.add_parser("cache", help="graph cache directory tools (not available in this build)")
        sp.set_defaults(run=lambda args, e=e: _unavailable("npuspec cache", e))
        return
    before = set(sub.choices)
    cache_cli.add_parser(sub)
    for name in set(sub.choices) - before:
        sp = sub.choices[name]
        if not any("--debug" in a.option_strings for a in sp._actions):
            _add_debug(sp)
        sp.set_defaults(run=cache_cli.run)


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
    import logging
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
        args = build_parser().parse_args(argv)
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
