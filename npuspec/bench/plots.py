"""`--plot PATH.png` figures for `bench e2e`, `bench serve`, `bench methods` and `tune` (matplotlib, optional:
the [plot] extra, imported only inside these functions; `bench verify` draws its own
time-vs-batch figure in npuspec/bench/verify.py).

Every function takes plain numbers (what the bench already printed or computed) and a path,
and writes one PNG with the Agg backend, so it works headless.
"""
from __future__ import annotations

from typing import Mapping, Sequence

from npuspec.cli_util.errors import MissingExtra


def require_matplotlib(feature: str = "--plot"):
    """pyplot on the Agg backend, or a MissingExtra naming the flag and the install command."""
    try:
        import matplotlib
    except ImportError:
        raise MissingExtra("matplotlib", "plot", feature) from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    return plt


def _save(fig, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    require_matplotlib().close(fig)


def _acceptance_axis(ax, acceptance: Sequence[float], label: str = "") -> None:
    pos = list(range(1, len(acceptance) + 1))
    ax.bar(pos, acceptance, color="tab:green", alpha=0.8, label=label or None)
    ax.set_xticks(pos)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance")
    ax.set_title("acceptance by position")
    ax.grid(axis="y", alpha=0.3)


def plot_tune(path: str, batches: Sequence[int], fixed_k: Mapping[int, Sequence[float]],
              tuned: Sequence[float], acceptance: Sequence[float],
              measured: Mapping[str, Mapping[int, float]] | None = None) -> None:
    """Expected tokens/s against concurrency (`batches`) for each fixed K ({K: tokens/s per
    batch}) and for the tuned table (lines), measured tokens/s where `tune --validate` ran
    (markers), and the acceptance by position."""
    plt = require_matplotlib()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [2, 1]})
    for k, tps in fixed_k.items():
        ax.plot(batches, tps, lw=1.2, alpha=0.8, label=f"K={k}" + (" (no spec)" if k == 0 else ""))
    ax.plot(batches, tuned, "k--", lw=2.2, label="tuned table")
    markers = {"K=0": "o", "tuned table": "*"}
    for name, pts in (measured or {}).items():
        bs = sorted(pts)
        ax.plot(bs, [pts[b] for b in bs], markers.get(name, "s"), ms=9 if name == "tuned table" else 6,
                mfc="none" if name != "tuned table" else "k", color="k" if name == "tuned table" else None,
                label=f"{name} measured")
    ax.set_xlabel("concurrent requests (batch size)")
    ax.set_ylabel("expected tokens/s")
    ax.set_title("tokens/s by concurrency: fixed K vs tuned table (lines: model)")
    if max(batches) >= 8:
        ax.set_xscale("log", base=2)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _acceptance_axis(ax2, acceptance)
    _save(fig, path)


def k_over_time_axes(ax, timelines: Mapping[str, Sequence[Sequence[float]]],
                     window: int = 16) -> None:
    """K per verify step against time (steps), and tokens/s over the last `window` steps
    (dotted, right axis), one colour per row; rows of [t, batch, K, tokens]."""
    ax2 = ax.twinx()
    for i, (name, tl) in enumerate(timelines.items()):
        t = [x[0] for x in tl]
        ax.step(t, [x[2] for x in tl], where="post", color=f"C{i}", lw=1, label=f"{name}: K")
        rate = []
        for j in range(1, len(tl)):
            a = max(0, j - window)
            dt = t[j] - t[a]
            rate.append(sum(x[3] for x in tl[a + 1:j + 1]) / dt if dt > 0 else float("nan"))
        ax2.plot(t[1:], rate, ":", color=f"C{i}", lw=0.8)
    ax.set(xlabel="seconds (the timed pass)", ylabel="K verified")
    ax2.set_ylabel(f"tokens/s over {window} steps (dotted)")
    ax.set_title("K chosen and throughput over time")
    ax.legend(fontsize=7, loc="upper left")


def plot_peers(path: str, rows: Sequence[Mapping]) -> None:
    """`bench peers`: tokens/s per row, grouped by precision (bars coloured by system), with
    each precision's weights-read bound as a short line over its group."""
    plt = require_matplotlib()
    fig, ax = plt.subplots(figsize=(max(6.0, 0.55 * len(rows) + 2), 4.5))
    precs = list(dict.fromkeys(r["system"].split()[-1] for r in rows))
    colors = {"llama.cpp": "tab:orange", "npuspec": "tab:blue", "hf": "tab:gray"}
    x, ticks, labels = 0.0, [], []
    for prec in precs:
        group = [r for r in rows if r["system"].split()[-1] == prec]
        start = x
        for r in group:
            ax.bar(x, r["tok/s"], color=colors.get(r["system"].split()[0], "tab:green"))
            ax.annotate(f"{r['tok/s']:.0f}", (x, r["tok/s"]), ha="center", va="bottom", fontsize=7)
            ticks.append(x)
            labels.append(f"{r['system'].split()[0]}\n{r['method']}")
            x += 1
        ax.hlines(group[0]["bound tok/s"], start - 0.4, x - 0.6, colors="k", linestyles="--", lw=0.8)
        ax.annotate(f"{prec} (-- bound)", ((start + x - 1) / 2, 0), xytext=(0, -34),
                    textcoords="offset points", ha="center", fontsize=8, annotation_clip=False)
        x += 0.8
    ax.set_xticks(ticks)
    ax.set_xticklabels(labels, fontsize=6)
    ax.set_ylabel("tokens/s (batch 1, prefill included)")
    ax.set_title("npuspec vs llama.cpp vs HF transformers, by precision")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    _save(fig, path)


def plot_e2e(path: str, rows: Sequence[Mapping], acceptance: Mapping[str, Sequence[float]] | None = None) -> None:
    """Tokens/s per system and method (bars, identical outputs marked), and acceptance by position
    for the speculative rows."""
    plt = require_matplotlib()
    acceptance = {k: v for k, v in (acceptance or {}).items() if v}
    timelines = {f"{r['system']} {r['method']}": r["k_over_time"] for r in rows
                 if r.get("k_over_time") and any(k for _, _, k, _ in r["k_over_time"])}
    ncols = 1 + bool(acceptance) + bool(timelines)
    fig, axes = plt.subplots(1, ncols, figsize=(5.5 * ncols + 1, 4.2), squeeze=False)
    if timelines:
        k_over_time_axes(axes[0][ncols - 1], timelines)
    ax = axes[0][0]
    labels = [f"{r['system']}\n{r['method']}" for r in rows]
    colors = ["tab:blue" if r["system"] == "npuspec" else "tab:gray" for r in rows]
    bars = ax.bar(range(len(rows)), [r["tokens_per_s"] for r in rows], color=colors)
    for bar, r in zip(bars, rows):
        mark = "" if r.get("identical") is None else ("=" if r["identical"] else "!=")
        ax.annotate(f"{r['tokens_per_s']:.0f} {mark}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("tokens/s")
    ax.set_title("npuspec vs HF transformers (= : tokens identical to HF greedy)")
    ax.grid(axis="y", alpha=0.3)
    if acceptance:
        ax2 = axes[0][1]
        width = 0.8 / len(acceptance)
        for i, (name, acc) in enumerate(acceptance.items()):
            pos = [p + 1 + (i - (len(acceptance) - 1) / 2) * width for p in range(len(acc))]
            ax2.bar(pos, acc, width=width, label=name)
        _acceptance_axis(ax2, [])
        ax2.set_xticks(range(1, max(len(a) for a in acceptance.values()) + 1))
        ax2.legend(fontsize=8)
    _save(fig, path)


def plot_serve(path: str, rows: Sequence[Mapping], offline: Sequence[Mapping] | None = None) -> None:
    """`bench serve`: TTFT and TPOT (mean, median, p90, p99 in ms; grouped bars per method) and
    output tokens/s per method; with `offline` rows also server (concurrency 1) vs offline tok/s;
    for speculative rows, mean K and tokens/s per /metrics interval over the run."""
    plt = require_matplotlib()
    timed = [r for r in rows if any(p["mean_k"] for p in r.get("timeline") or ())]
    ncols = 3 + bool(offline) + bool(timed)
    fig, axes = plt.subplots(1, ncols, figsize=(4.4 * ncols, 4.2), squeeze=False)
    if timed:
        ax = axes[0][ncols - 1]
        ax2 = ax.twinx()
        for i, r in enumerate(timed):
            tl = r["timeline"]
            ax.plot([p["t"] for p in tl], [p["mean_k"] for p in tl], "-", color=f"C{i}",
                    label=f"{r['method']}: mean K")
            ax2.plot([p["t"] for p in tl], [p["tokens_per_s"] for p in tl], ":", color=f"C{i}")
        ax.set(xlabel="seconds", ylabel="mean K verified per interval")
        ax2.set_ylabel("output tokens/s (dotted)")
        ax.set_title("K and throughput over time")
        ax.legend(fontsize=8)
    methods = [r["method"] for r in rows]
    stats = ("mean", "median", "p90", "p99")
    width = 0.8 / len(stats)
    for ax, key, title in ((axes[0][0], "ttft_ms", "TTFT (ms)"), (axes[0][1], "tpot_ms", "TPOT (ms)")):
        for i, s in enumerate(stats):
            vals = [r[key][s] if r[key][s] is not None else 0.0 for r in rows]
            pos = [m + (i - (len(stats) - 1) / 2) * width for m in range(len(rows))]
            ax.bar(pos, vals, width=width, label=s)
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels(methods, fontsize=8)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    ax = axes[0][2]
    bars = ax.bar(range(len(rows)), [r["output_tokens_per_s"] for r in rows], color="tab:blue")
    for bar, r in zip(bars, rows):
        ax.annotate(f"{r['output_tokens_per_s']:.0f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(methods, fontsize=8)
    ax.set_ylabel("output tokens/s")
    ax.set_title("throughput under load")
    ax.grid(axis="y", alpha=0.3)
    if offline:
        ax = axes[0][3]
        pos = range(len(offline))
        ax.bar([p - 0.2 for p in pos], [o["server_tokens_per_s"] for o in offline], width=0.4,
               label="server, concurrency 1")
        ax.bar([p + 0.2 for p in pos], [o["offline_tokens_per_s"] for o in offline], width=0.4,
               label="offline LLM")
        ax.set_xticks(list(pos))
        ax.set_xticklabels([o["method"] for o in offline], fontsize=8)
        ax.set_ylabel("output tokens/s")
        ax.set_title("serving overhead, one request at a time")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    _save(fig, path)


def plot_methods(path: str, rows: Sequence[Mapping]) -> None:
    """`bench methods`: tokens/s per method, one bar per prompt set (the first max_num_seqs
    value; identical outputs to no speculation marked "="), and acceptance by position per
    (prompt set, method)."""
    plt = require_matplotlib()
    n0 = rows[0]["max_num_seqs"]
    rows = [r for r in rows if r["max_num_seqs"] == n0]
    sets = list(dict.fromkeys(r["prompt set"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.4), gridspec_kw={"width_ratios": [3, 2]})
    width = 0.8 / len(sets)
    for i, name in enumerate(sets):
        by = {r["method"]: r for r in rows if r["prompt set"] == name}
        xs = [j + (i - (len(sets) - 1) / 2) * width for j in range(len(methods))]
        ys = [by[m]["tok/s"] if m in by else 0 for m in methods]
        bars = ax.bar(xs, ys, width=width, label=name)
        for bar, m in zip(bars, methods):
            r = by.get(m)
            if r is not None:
                same = "=" if r["same as none"] == r["prompts"] else "!="
                ax.annotate(f"{r['× none']:.2f}x {same}", (bar.get_x() + bar.get_width() / 2,
                                                           bar.get_height()),
                            ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(methods)))
    ax.set_xticklabels(methods, fontsize=8)
    ax.set_ylabel("tokens/s")
    ax.set_title(f"tokens/s by method (max_num_seqs={n0}; label: x none, = same tokens)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    for r in rows:
        acc = r.get("acceptance_by_position")
        if acc and r["method"] != "none":
            ax2.plot(range(1, len(acc) + 1), acc, marker="o", lw=1.2,
                     label=f"{r['method']} ({r['prompt set']})")
    from matplotlib.ticker import MaxNLocator  # matplotlib: optional, as require_matplotlib
    ax2.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax2.set_ylim(0, 1.05)
    ax2.set_xlabel("draft position")
    ax2.set_ylabel("acceptance")
    ax2.set_title("acceptance by position")
    ax2.grid(alpha=0.3)
    if ax2.lines:
        ax2.legend(fontsize=7)
    _save(fig, path)
