"""Print the field corpus table: which entries the verify passes fuse.

    python tests/passes/field_report.py [--lowering eager|inductor]

Columns: name, source, kind, breaks (the original holds an op Dynamo breaks on, as recorded in
field_corpus.py), fused (counters["verify_patterns_matched"] moved), the npuspec ops in the
graphs after the passes, the graphs and graph breaks torch._dynamo.explain reports, the frames
Dynamo gave up on and ran eagerly (a break inside a loop), and whether the compiled result
equals eager. Ends with "fused N of M".
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from field_corpus import ENTRIES  # noqa: E402
from test_field_corpus import FUSED_NOW, fused  # noqa: E402

SEED = 11


def graph_breaks(entry) -> tuple[int, int, int]:
    """(graphs, graph breaks) from torch._dynamo.explain, and the frames Dynamo gave up on and
    ran eagerly (a break inside a loop skips the whole frame, which explain does not count as a
    break)."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(SEED)
    ex = torch._dynamo.explain(entry.fn)(*entry.make(3))
    skipped = counters["frames"]["total"] - counters["frames"]["ok"]
    return ex.graph_count, ex.graph_break_count, skipped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lowering", default="eager", choices=("eager", "inductor"))
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    import logging
    logging.getLogger("torch._dynamo").setLevel(logging.ERROR)
    logging.getLogger("npuspec").setLevel(logging.ERROR)

    rows = []
    for e in ENTRIES:
        try:
            is_fused, ops = fused(e, lowering=args.lowering)
            equal = "yes"
        except AssertionError:
            is_fused, ops, equal = False, set(), "NO"
        graphs, breaks, skipped = graph_breaks(e)
        rows.append((e.name, e.source, e.kind, "yes" if e.breaks else "no",
                     "yes" if is_fused else "no", ",".join(sorted(o.split(".", 1)[1] for o in ops))
                     or "-", str(graphs), str(breaks), str(skipped), equal))

    head = ("name", "kind", "breaks", "fused", "ops", "graphs", "graph breaks", "eager frames",
            "equal")
    cols = [0, 2, 3, 4, 5, 6, 7, 8, 9]
    widths = [max(len(head[i]), *(len(r[c]) for r in rows)) for i, c in enumerate(cols)]
    line = lambda vals: "  ".join(v.ljust(w) for v, w in zip(vals, widths))  # noqa: E731
    print(f"field corpus, lowering={args.lowering}")
    print(line(head))
    print(line(["-" * w for w in widths]))
    for r in rows:
        print(line([r[c] for c in cols]))
    print()
    print("sources:")
    for r in rows:
        print(f"  {r[0]}: {r[1]}")
    n = sum(r[4] == "yes" for r in rows)
    print()
    print(f"fused {n} of {len(rows)}")
    now = {r[0] for r in rows if r[4] == "yes"}
    if now != FUSED_NOW:
        print(f"differs from FUSED_NOW: newly fused {sorted(now - FUSED_NOW)}, "
              f"no longer fused {sorted(FUSED_NOW - now)}")


if __name__ == "__main__":
    main()
