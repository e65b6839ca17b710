"""One table format for every `npuspec bench ...` script."""
from __future__ import annotations

import statistics
import time
from typing import Callable, Iterable, Sequence


def fmt(v) -> str:
    if isinstance(v, float):
        if v != v:
            return "nan"
        a = abs(v)
        if a == 0:
            return "0"
        if a >= 1000:
            return f"{v:,.0f}"
        if a >= 10:
            return f"{v:.1f}"
        if a >= 0.01:
            return f"{v:.3f}"
        return f"{v:.2e}"
    return str(v)


def print_table(rows: Sequence[dict], columns: Sequence[str] | None = None, title: str = "") -> str:
    """Print rows (dicts) as an aligned plain-text table; returns the text."""
    cols = list(columns or (rows[0].keys() if rows else []))
    cells = [[fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(cols)]
    lines = []
    if title:
        lines.append(f"== {title} ==")
    lines.append("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def median_time(fn: Callable[[], object], repeats: int = 20, warmup: int = 3,
                sync: Callable[[], None] | None = None) -> float:
    """Median wall seconds of fn() over `repeats` runs after `warmup` runs."""
    for _ in range(warmup):
        fn()
    if sync:
        sync()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def median(xs: Iterable[float]) -> float:
    return statistics.median(list(xs))
