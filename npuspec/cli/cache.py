"""`npuspec cache ls | verify | prune --older-than DAYS | clear` (docs/cache.md).

    ls       each entry: key, size, age, platform, lowering, hit count
    verify   re-check every entry's manifest: sha256 and size of every file, format and
             version, and the trust rules for the executable parts; exit 1 if any fails
             (--quarantine moves failing entries to quarantine/)
    prune    delete entries not created or hit in the last DAYS days, and old quarantine/tmp
    clear    delete every entry, the hit counts, quarantine/ and tmp/

The directory is --dir, else NPUSPEC_CACHE_DIR. Also runs as `python -m npuspec.cli.cache`.
"""
from __future__ import annotations

import argparse
import math
import sys

from npuspec.cli_util.errors import EXIT_USAGE


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="cache_command", metavar="ACTION")
    for name, help_ in (("ls", "list entries with size, age, platform and hit count"),
                        ("verify", "re-check every manifest (sha256, size, version, trust)"),
                        ("prune", "delete entries older than --older-than DAYS"),
                        ("clear", "delete every entry")):
        sp = sub.add_parser(name, help=help_, description=help_)
        sp.add_argument("--dir", default=None,
                        help="cache directory (default: NPUSPEC_CACHE_DIR)")
        if name == "verify":
            sp.add_argument("--quarantine", action="store_true",
                            help="move entries that fail to quarantine/")
        if name == "prune":
            sp.add_argument("--older-than", type=days, required=True, metavar="DAYS",
                            help="delete entries neither created nor hit within DAYS days")


def days(s: str) -> float:
    """argparse type of --older-than: a finite number >= 0 (float() also takes nan, whose
    comparisons are all false, so `prune --older-than nan` pruned nothing and succeeded)."""
    try:
        v = float(s)
    except ValueError:
        v = math.nan
    if not math.isfinite(v) or v < 0:
        raise argparse.ArgumentTypeError(f"{s!r} must be a finite number of days >= 0, e.g. 7 "
                                          f"(0 prunes every entry)")
    return v


def run(args) -> int:
    if getattr(args, "cache_command", None) is None:
        print("npuspec cache: choose an action: ls, verify, prune --older-than DAYS, clear",
              file=sys.stderr)
        return EXIT_USAGE
    from npuspec.cli import cache_run  # heavy: keeps `--help` and flag errors off torch's import
    return cache_run.run(args)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="npuspec cache", description=__doc__.strip(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return run(args)
    except (ValueError, FileNotFoundError, PermissionError) as e:
        print(f"npuspec cache: error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
