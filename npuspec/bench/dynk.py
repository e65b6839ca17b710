"""`npuspec bench dynk`: the online K controller against no speculation and every fixed K, at
each batch size, in one run (docs/engine.md, "The online K controller").

For each method (ngram, suffix, ...) it builds one engine per setting (no speculation; fixed
K = each captured value of the online set; `k_controller: online` up to --k) with
max_num_seqs = the largest batch, and times greedy `generate` calls of exactly B requests
(prompts cycled so every B sees the same mix) for each B. Rows are timed round-robin --repeats
times; each figure is the median. Every output is compared with no speculation's.

It then replays a load that changes mid-run (1 request, then --burst more, then 1 again) on the
online engine through the step API and prints K per step beside the batch size, and the steps
the controller took to settle after each change. Its host time per step is measured twice:
inside the engine, over one generate call at the largest batch (the controller's work before
and after each verify step, drafting excluded, with the caches as the model step left them;
`OnlineK.host_s`, timed by OnlineK itself; median and mean, as the mean carries the work
done every few steps), and its calls alone at batch 64 on synthetic state (median of 2,000 steps).

    npuspec bench dynk --model tiny --methods ngram,suffix --batches 1,4,16,64
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import time

import numpy as np

from npuspec.bench.plots import require_matplotlib
from npuspec.bench.table import print_table
from npuspec.cli_util import common
from npuspec.cli_util.common import positive
from npuspec.cli_util.prompts import load_prompts
from npuspec.engine import LLM, SamplingParams
from npuspec.spec_decode.k_controller import KController, candidate_ks


def _ints(v: str) -> list[int]:
    try:
        out = [int(x) for x in v.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{v!r}: give comma-separated integers, e.g. 1,4,16")
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"{v!r}: every value must be >= 1")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="npuspec bench dynk", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="'tiny', an HF directory or a .gguf file")
    p.add_argument("--methods", default="ngram,suffix", help="comma-separated methods")
    p.add_argument("--k", type=positive, default=4, help="K_max (the guide's 4)")
    p.add_argument("--batches", type=_ints, default=[1, 4, 16, 64], help="batch sizes")
    p.add_argument("--prompts", default="code-edit", help="a built-in set or a file")
    p.add_argument("--max-tokens", type=positive, default=64, help="new tokens per request")
    p.add_argument("--repeats", type=positive, default=1, help="timed passes per row (median)")
    p.add_argument("--burst", type=int, default=31,
                   help="requests added mid-run in the load-change trace (0: skip it)")
    p.add_argument("--json", default=None, metavar="PATH", help="write results as JSON")
    p.add_argument("--plot", default=None, metavar="PATH.png",
                   help="tokens/s by batch and K over the load-change trace (needs matplotlib)")
    return p


def _engine(model, spec, max_num_seqs, max_model_len):
    return LLM(model, speculative_config=spec, max_num_seqs=max_num_seqs,
               max_model_len=max_model_len)


def _timed(llm, prompts, b, sp):
    """(tokens/s, outputs) of generate calls of b requests covering every prompt once."""
    rounds = -(-len(prompts) // b)
    tokens, secs, outs = 0, 0.0, []
    for r in range(rounds):
        ps = [prompts[(r * b + i) % len(prompts)] for i in range(b)]
        if llm.proposer is not None:
            llm.proposer.forget_responses()
        t0 = time.perf_counter()
        res = llm.generate(ps, sp)
        secs += time.perf_counter() - t0
        tokens += sum(len(x.outputs[0].token_ids) for x in res)
        outs += [list(x.outputs[0].token_ids) for x in res]
    return tokens / secs, outs, llm.metrics


def sweep(model, method, k_max, batches, prompts, max_tokens, repeats, max_model_len):
    """Rows of tokens/s per (setting, batch) and the online engine (for the trace)."""
    ks = candidate_ks(k_max)
    settings = {"none": None}
    for k in ks[1:]:
        settings[f"K={k}"] = {"method": method, "num_speculative_tokens": k,
                              "k_controller": "fixed"}
    settings["online"] = {"method": method, "num_speculative_tokens": k_max,
                          "k_controller": "online"}
    engines = {name: _engine(model, spec, max(batches), max_model_len)
               for name, spec in settings.items()}
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    tps = {(n, b): [] for n in settings for b in batches}
    ref, same, ksteps = {}, {}, {}
    for b in batches:
        for _ in range(repeats):
            for name, llm in engines.items():
                t, outs, m = _timed(llm, prompts, b, sp)
                tps[(name, b)].append(t)
                if name == "none":
                    ref[b] = outs
                else:
                    same[(name, b)] = sum(o == r for o, r in zip(outs, ref[b]))
                if name == "online":
                    ksteps[b] = dict(sorted(m.steps_by_k.items()))
    rows = []
    for b in batches:
        med = {n: statistics.median(tps[(n, b)]) for n in settings}
        fixed = {n: v for n, v in med.items() if n.startswith("K=")}
        best = max(fixed, key=fixed.get)
        rows.append({"method": method, "batch": b, "none tok/s": med["none"],
                     **{f"{n} ×none": med[n] / med["none"] for n in fixed},
                     "online ×none": med["online"] / med["none"],
                     "online ×best fixed": med["online"] / fixed[best], "best fixed": best,
                     "online steps by K": json.dumps(ksteps[b]),
                     "identical": f"{same[('online', b)]}/{len(ref[b])}"})
    online = engines.pop("online")
    engines.clear()
    gc.collect()  # the next method's engines need the KV pools these hold
    return rows, online


def load_change(llm, prompts, burst, max_tokens):
    """1 request, then `burst` more, then 1: [(batch, K)] per step, the step indices of the
    changes, the steps K took to settle after each (`settle`, `follow`), and the same for the
    controller's decisions (`follow_decisions`)."""
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens * 6, ignore_eos=True)
    short = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    if llm.proposer is not None:
        llm.proposer.forget_responses()
    trace, caps, change = [], [], []
    llm.add_request(llm.new_request(prompts[0], sp, "long"))
    phase = 0
    while llm.has_unfinished_requests():
        before = len(llm.totals.k_trace)
        llm.step()
        if len(llm.totals.k_trace) > before:
            trace.append(llm.totals.k_trace[-1])
            caps.append(llm.online.ctl.last_cap)
        if phase == 0 and len(trace) == 30:
            for i in range(burst):
                llm.add_request(llm.new_request(prompts[(i + 1) % len(prompts)], short, f"b{i}"))
            change.append(len(trace))
            phase = 1
        elif phase == 1 and llm.num_requests()[0] == 1:
            change.append(len(trace))
            phase = 2
        if phase == 2 and len(trace) > change[-1] + 40:
            llm.abort_request("long")
    return (trace, change, settle(trace, change), follow(trace, change),
            follow(trace, change, decisions(trace, caps)))


def decisions(trace, caps) -> list:
    """What the controller decided at each step, apart from what the drafter found: "skip"
    (drafting skipped), "all" (verified every useful draft position: K = the cap its drafts
    set), K (cut below that cap), None (drafted, found nothing: K = 0 whatever the load)."""
    out = []
    for (_, k), cap in zip(trace, caps):
        out.append("skip" if cap < 0 else None if cap == 0 else "all" if k == cap else k)
    return out


def _settled_after(ks: list) -> int:
    """Steps until K equals the most common K of `ks` and stays there for the rest at least
    80% of the time (len(ks) if never)."""
    if not ks:
        return 0
    mode = max(set(ks), key=ks.count)
    return next((i for i in range(len(ks))
                 if ks[i] == mode and ks[i:].count(mode) >= 0.8 * len(ks[i:])), len(ks))


def settle(trace, change) -> list[int]:
    """Per phase after a change: steps until K settles (`_settled_after`) over the phase."""
    bounds = change + [len(trace)]
    return [_settled_after([k for _, k in trace[a:b]]) for a, b in zip(bounds, bounds[1:])]


def follow(trace, change, values=None) -> list[int]:
    """Per phase: steps until K settles once the load has arrived: counted from the first
    step whose batch is at least 90% of the phase's largest, over the steps that stay there
    (a burst is admitted over many steps, a prompt budget at a time, and then drains; K
    chosen for the batch in hand follows that ramp, which `settle` counts as not settled).
    `values` (one per step, None = no evidence) replaces K: `decisions`; then the count
    starts at the first step with evidence (a phase with none at all gives None)."""
    if values is None:
        values = [k for _, k in trace]
    out = []
    bounds = change + [len(trace)]
    for a, b in zip(bounds, bounds[1:]):
        phase = trace[a:b]
        if not phase:
            out.append(0)
            continue
        top = 0.9 * max(n for n, _ in phase)
        start = next(i for i, (n, _) in enumerate(phase) if n >= top)
        end = next((i for i in range(start, len(phase)) if phase[i][0] < top), len(phase))
        seen = [(i, v) for i, v in enumerate(values[a + start:a + end]) if v is not None]
        if not seen:
            out.append(None)
            continue
        i = _settled_after([v for _, v in seen])
        settled = seen[i][0] if i < len(seen) else end - start   # in steps of the phase
        out.append(settled - seen[0][0])
    return out


def host_time_us(batch: int = 64, steps: int = 2000) -> float:
    """Median µs of one step's controller calls as the engine makes them (slots,
    choose_before, choose_after_drafts, after_step with the step's times) at `batch`, on
    synthetic drafts and results, every captured pair measured; warm, unlike
    `engine_host_us`."""
    ks = candidate_ks(4)
    ctl = KController(ks, lambda b, k: b)
    for k in ks:
        ctl.record_verify(batch, k, 0.01 * (1 + k))
    ids = [f"r{i}" for i in range(batch)]
    rng = np.random.default_rng(0)
    ts = []
    for _ in range(steps):
        L = rng.integers(0, 5, batch)
        drafts = np.where(np.arange(4) < L[:, None], 7, -1)                     # [B, 4]
        t0 = time.perf_counter()
        s = ctl.slots(ids)
        ch = ctl.choose_before(s)
        k, lengths = ctl.choose_after_drafts(ch, s, drafts[:, :ch.k_draft])
        t1 = time.perf_counter()
        res = np.zeros((batch, k + 2), dtype=np.int32)
        res[:, k + 1] = np.minimum(lengths, k) // 2 + 1                       # num_emitted
        t2 = time.perf_counter()
        ctl.after_step(s, ch.k_draft, lengths, k, res, True, batch, 1e-4, 0.01 * (1 + k),
                       1e-4, math.nan)
        ts.append(time.perf_counter() - t2 + t1 - t0)
    return statistics.median(ts) * 1e6


def engine_host_us(llm, prompts, batch: int, max_tokens: int) -> tuple[float, float, int]:
    """(median, mean) µs per step of the online engine's controller work inside the engine
    (`OnlineK.host_s`: its calls before and after the verify step, the drafting itself
    excluded, timed by OnlineK itself), over the steps of one generate call that ran with at
    least 90% of `batch` requests; and how many there were. The mean carries the work done
    every few steps (a probe resolved, a batch's rows bound anew) that the median hides.
    Unlike `host_time_us` it runs where the engine does, after each model step has filled the
    caches with its own data."""
    on = llm.online
    verified, per_step = on.verified, []

    def read_after(rows, k, res, *a):
        verified(rows, k, res, *a)
        if len(on._slots) >= 0.9 * batch:
            per_step.append(on.host_s)
    on.verified = read_after
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        llm.generate([prompts[i % len(prompts)] for i in range(batch)], sp)
    finally:
        del on.verified  # back to the class's method
    if not per_step:
        return math.nan, math.nan, 0
    return statistics.median(per_step) * 1e6, statistics.fmean(per_step) * 1e6, len(per_step)


def _plot(path, rows, traces):
    plt = require_matplotlib()
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for m in sorted({r["method"] for r in rows}):
        rs = [r for r in rows if r["method"] == m]
        a.plot([r["batch"] for r in rs], [r["online ×none"] for r in rs], "o-", label=f"{m} online")
        for col in [c for c in rs[0] if c.startswith("K=")]:
            a.plot([r["batch"] for r in rs], [r[col] for r in rs], ":", label=f"{m} {col[:-6]}")
    a.axhline(1.0, color="k", lw=0.5)
    a.set(xscale="log", xlabel="batch size", ylabel="tok/s vs no speculation")
    a.legend(fontsize=7)
    b2 = b.twinx()
    for i, (m, (trace, change, *_)) in enumerate(traces.items()):
        color = f"C{i}"
        b.plot([k for _, k in trace], color=color, label=f"{m}: K")
        b2.plot([n for n, _ in trace], ":", color=color, lw=0.8)
        for c in change:
            b.axvline(c, color=color, lw=0.5, alpha=0.5)
    b2.set_ylabel("batch size (dotted)")
    b.set(xlabel="verify step", ylabel="K chosen")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.plot:
        require_matplotlib()
    prompts = load_prompts(args.prompts, model=None if args.model == "tiny" else args.model)
    # the prompts plus --max-tokens (the burst's long request: 6x): one engine per setting
    # is alive at once, each with a KV pool for max_num_seqs requests of this length
    max_model_len = common.fit_max_model_len(args.model, prompts, args.max_tokens * 6)
    rows, traces, host = [], {}, {}
    for method in [m for m in args.methods.split(",") if m]:
        r, online = sweep(args.model, method, args.k, args.batches, prompts, args.max_tokens,
                          args.repeats, max_model_len)
        rows += r
        print_table(r, title=f"{method}: tok/s vs no speculation, by batch size (median of "
                             f"{args.repeats})")
        # long enough that the batch fills up (the prefill budget admits a few prompts a step)
        eng_us, mean_us, n = engine_host_us(online, prompts, max(args.batches),
                                            args.max_tokens * 5)
        host[method] = {"median_us": eng_us, "mean_us": mean_us, "steps": n}
        print(f"{method}: the controller's host time per step inside the engine at batch "
              f"{max(args.batches)}: {eng_us:.1f} µs median, {mean_us:.1f} µs mean ({n} steps)")
        if args.burst > 0 and max(args.batches) >= args.burst + 1:
            traces[method] = load_change(online, prompts, args.burst, args.max_tokens)
            trace, change, steps, after_peak, decided = traces[method]
            runs = []
            for bk in trace:
                if runs and runs[-1][0] == bk:
                    runs[-1][1] += 1
                else:
                    runs.append([bk, 1])
            print(f"{method}: load change (1 -> {1 + args.burst} -> 1 requests) at steps "
                  f"{change}; steps to settle after each phase start: {steps}; after the load "
                  f"arrived (batch within 90% of the phase's largest): {after_peak}; its "
                  f"decisions (skip / verify all drafts / cut to K; steps without drafts "
                  f"left out): {decided}")
            print("  (batch, K) x steps: " + ", ".join(f"{tuple(bk)}x{n}" for bk, n in runs))
        del online
        gc.collect()
    us = host_time_us()
    print(f"controller host time per step at batch 64, its calls alone on synthetic state: "
          f"{us:.1f} µs (median of 2000)")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"rows": rows, "host_us_batch64": us, "engine_host_us": host,
                       "traces": {m: {"trace": t, "changes": c, "settle": s, "follow": f,
                                      "follow_decisions": d}
                                  for m, (t, c, s, f, d) in traces.items()}}, out, indent=1)
    if args.plot:
        _plot(args.plot, rows, traces)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
