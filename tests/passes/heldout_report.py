"""Print the held-out corpus table (heldout_corpus.py): which entries the passes fuse.

    python tests/passes/heldout_report.py [--lowering eager|inductor] [--npuspec-compile]
                                          [--calls N]

Ends with "fused N of M" and any difference from test_heldout_corpus.FUSED_NOW.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from heldout_corpus import ENTRIES, run  # noqa: E402
from test_heldout_corpus import FUSED_NOW  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lowering", default="eager", choices=("eager", "inductor"))
    ap.add_argument("--npuspec-compile", action="store_true",
                    help="compile each entry with npuspec.compile (Dynamo's capture flags on) "
                         "instead of torch.compile(backend='npuspec')")
    ap.add_argument("--calls", type=int, default=1,
                    help="call each compiled entry N times (fused: by any call; equal: every "
                         "call); npuspec.compile compiles a frame Dynamo skipped with its flags "
                         "on from the second call")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    for name in ("torch._dynamo", "npuspec"):
        logging.getLogger(name).setLevel(logging.ERROR)
    rows = []
    for e in ENTRIES:
        fused, equal, ops = run(e, args.lowering, args.npuspec_compile, args.calls)
        rows.append((e["name"], e["kind"], "yes" if fused else "no",
                     ",".join(sorted(o.split(".", 1)[1] for o in ops)) or "-",
                     "yes" if equal else "NO"))
    head = ("name", "kind", "fused", "ops", "equal")
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    line = lambda vals: "  ".join(v.ljust(w) for v, w in zip(vals, widths))  # noqa: E731
    via = "npuspec.compile" if args.npuspec_compile else "torch.compile"
    print(f"held-out corpus, lowering={args.lowering}, through {via}, {args.calls} call(s)")
    print(line(head))
    print(line(["-" * w for w in widths]))
    for r in rows:
        print(line(r))
    now = {r[0] for r in rows if r[2] == "yes"}
    print(f"\nfused {len(now)} of {len(rows)}; equal to eager {sum(r[4] == 'yes' for r in rows)}")
    if now != FUSED_NOW and not args.npuspec_compile and args.calls == 1:
        print(f"differs from FUSED_NOW: newly fused {sorted(now - FUSED_NOW)}, "
              f"no longer fused {sorted(FUSED_NOW - now)}")


if __name__ == "__main__":
    main()
