"""The measurement and the algorithm behind `npuspec tune` (npuspec/cli/tune.py holds the
command's flags and, in its docstring, the model written out): `run(args)` measures, tunes and
prints; the algorithm half is pure and unit-tested on synthetic inputs."""
from __future__ import annotations

import argparse
import bisect
import json
import statistics
import time
from typing import Mapping, Sequence

from npuspec.bench.common import make_llm, run_npuspec
from npuspec.bench.plots import plot_tune, require_matplotlib
from npuspec.bench.table import median_time, print_table
from npuspec.cli_util import common
from npuspec.cli_util.common import DEFAULT_SPEC
from npuspec.cli_util.errors import UsageError
from npuspec.cli_util.prompts import load_prompts
from npuspec.engine import SamplingParams
from npuspec.engine.scheduler import pad_rows

# ----------------------------------------------------------------------------------------------
# The algorithm (pure functions).


def conditional_acceptance(accepted_by_position: Sequence[float], steps: float) -> list[float]:
    """Conditional rates a_j from counts: accepted_by_position[j] = request-steps whose draft
    j+1 was accepted, out of `steps` request-steps that asked for drafts."""
    out, prev = [], float(steps)
    for acc in accepted_by_position:
        out.append(acc / prev if prev > 0 else 0.0)
        prev = acc
    return out


def conditional_from_unconditional(rates: Sequence[float]) -> list[float]:
    """a_j = r_j / r_{j-1} (r_0 = 1; 0 where r_{j-1} = 0), rates r_j = P(drafts 1..j accepted)."""
    return conditional_acceptance(list(rates), 1.0)


def expected_tokens(acceptance: Sequence[float], k: int) -> float:
    """E(K) = 1 + sum_{i<=K} prod_{j<=i} a_j; positions past the measured ones count as 0."""
    e, p = 1.0, 1.0
    for j in range(k):
        p *= acceptance[j] if j < len(acceptance) else 0.0
        e += p
    return e


def monotone(latency: Mapping[int, float]) -> dict[int, float]:
    """L(T) = min over T' >= T of the measured L(T'): a step over T tokens can always run padded
    to T' tokens, so a slower measurement at fewer tokens is noise (or a missing graph) and
    must not make speculation look cheaper than it is."""
    out, best = {}, float("inf")
    for t in sorted(latency, reverse=True):
        best = min(best, latency[t])
        out[t] = best
    return dict(sorted(out.items()))


def interpolate(points: Mapping[int, float], x: float) -> float:
    """Piecewise-linear latency at token count x; flat below the first point, the last slope
    (never negative) past the last one."""
    xs = sorted(points)
    assert xs, "no latency points"
    ys = [points[t] for t in xs]
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        if len(xs) == 1:
            return ys[0] * x / xs[0]  # one point: assume latency grows with tokens
        slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0)
        return ys[-1] + slope * (x - xs[-1])
    i = bisect.bisect_right(xs, x)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def step_tokens(batch: int, k: int, sizes: Mapping[int, Sequence[int]] | None = None) -> int:
    """Tokens a step really runs: B*(K+1), padded up to K's next capture size when there is a
    capture plan (a batch past the largest size runs unpadded, eagerly)."""
    t = batch * (k + 1)
    for s in (sizes or {}).get(k) or ():
        if s >= t:
            return s
    return t


def tokens_per_s(latency: Mapping[int, float], acceptance: Sequence[float], batch: int, k: int,
                 draft_s: float = 0.0, sizes: Mapping[int, Sequence[int]] | None = None,
                 host_s: float = 0.0) -> float:
    """Expected tokens/s of `batch` concurrent requests speculating `k` tokens each
    (draft_s: drafting per request-step, K > 0 only; host_s: the engine's other host work per
    request-step: input preparation, the device->host copy, bookkeeping)."""
    step = interpolate(latency, step_tokens(batch, k, sizes)) + batch * (host_s + (draft_s if k > 0 else 0.0))
    return batch * expected_tokens(acceptance, k) / step


def best_k(latency, acceptance, batch: int, k_max: int, tolerance: float = 0.01,
           draft_s: float = 0.0, sizes=None, host_s: float = 0.0) -> tuple[int, float, list[float]]:
    """(chosen K, its tokens/s, tokens/s for K = 0..k_max) for one batch size."""
    tps = [tokens_per_s(latency, acceptance, batch, k, draft_s, sizes, host_s) for k in range(k_max + 1)]
    top = max(tps)
    k = next(k for k, v in enumerate(tps) if v >= top * (1.0 - tolerance))
    return k, tps[k], tps


def merge_ranges(ks: Sequence[int]) -> list[list[int]]:
    """ks[b-1] = K for batch size b -> [[start, end, K], ...] with equal neighbours merged."""
    rows: list[list[int]] = []
    for b, k in enumerate(ks, start=1):
        if rows and rows[-1][2] == k:
            rows[-1][1] = b
        else:
            rows.append([b, b, k])
    return rows


def tune_table(latency: Mapping[int, float], acceptance: Sequence[float], max_num_seqs: int,
               k_max: int | None = None, tolerance: float = 0.01, draft_s: float = 0.0,
               sizes: Mapping[int, Sequence[int]] | None = None, host_s: float = 0.0) -> list[list[int]]:
    """The `num_speculative_tokens_per_batch_size` table maximising expected tokens/s
    (`sizes`: the capture plan per K, so each step is costed at its padded token count)."""
    assert max_num_seqs >= 1, max_num_seqs
    latency = monotone(latency)
    k_max = len(acceptance) if k_max is None else min(k_max, len(acceptance))
    ks = [best_k(latency, acceptance, b, k_max, tolerance, draft_s, sizes, host_s)[0]
          for b in range(1, max_num_seqs + 1)]
    return merge_ranges(ks)


def tuned_config(base: Mapping, table: Sequence[Sequence[int]]) -> dict:
    """`base` (a speculative_config dict) with the table; num_speculative_tokens = the largest K
    in the table (at least 1, which SpeculativeConfig requires even when the table says 0)."""
    out = {k: v for k, v in base.items() if k != "num_speculative_tokens_per_batch_size"}
    out["num_speculative_tokens"] = max(1, max(r[2] for r in table))
    out["num_speculative_tokens_per_batch_size"] = [list(r) for r in table]
    return out


def table_tokens_per_s(latency, acceptance, table, batch: int, draft_s: float = 0.0, sizes=None,
                       host_s: float = 0.0) -> float:
    k = table[0][2]
    for start, _end, kk in table:
        if start > batch:
            break
        k = kk
    return tokens_per_s(latency, acceptance, batch, k, draft_s, sizes, host_s)


# ----------------------------------------------------------------------------------------------
# Measurement (drives the engine).


def batch_ladder(max_num_seqs: int) -> list[int]:
    """1, 2, 4, ... up to max_num_seqs (always included)."""
    out, b = [], 1
    while b < max_num_seqs:
        out.append(b)
        b *= 2
    return out + [max_num_seqs]


def measure_acceptance(model: str, spec: dict, prompts: Sequence[str], max_tokens: int,
                       enforce_eager: bool = False) -> dict:
    """Run the prompts with K = spec's num_speculative_tokens; return conditional acceptance by
    position, the mean acceptance length, and the drafting and other host time per
    request-step (from the engine's wall-clock split, prefill excluded)."""
    res = run_npuspec(model, spec, prompts, max_tokens, max_num_seqs=1, repeats=1,
                      enforce_eager=enforce_eager)
    m = res["metrics"]
    k = spec["num_speculative_tokens"]
    steps = m["request_steps"]
    acc = list(m["accepted_by_position"])[:k] + [0] * max(0, k - len(m["accepted_by_position"]))
    return {"acceptance": conditional_acceptance(acc, steps),
            "mean_acceptance_length": m["mean_acceptance_length"],
            "draft_s_per_request_step": m["draft_s"] / steps if steps else 0.0,
            "host_s_per_request_step": m["bookkeeping_s"] / steps if steps else 0.0}


def measure_throughput(model: str, spec: dict | None, prompts: Sequence[str], batches: Sequence[int],
                       max_tokens: int, max_model_len: int, enforce_eager: bool = False,
                       repeats: int = 3) -> dict[int, float]:
    """Measured tokens/s of `generate` with B concurrent requests, for each B: every prompt
    runs at least once, in generate() calls of exactly B requests (prompts cycled), so each B
    sees the same prompt mix; median over `repeats` passes. One engine (compiled and captured
    once) serves every B."""
    llm = make_llm(model, spec, max(batches), max_model_len, enforce_eager)
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(list(prompts[:1]), SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    out = {}
    for b in batches:
        rounds = -(-len(prompts) // b)
        runs = []
        for _ in range(repeats):
            tokens, secs = 0, 0.0
            for r in range(rounds):
                ps = [prompts[(r * b + i) % len(prompts)] for i in range(b)]
                t0 = time.perf_counter()
                res = llm.generate(ps, sp)
                secs += time.perf_counter() - t0
                tokens += sum(len(x.outputs[0].token_ids) for x in res)
            runs.append(tokens / secs)
        out[b] = statistics.median(runs)
    return out


def measure_latency(model: str, batches: Sequence[int], k_max: int, max_model_len: int, repeats: int,
                    enforce_eager: bool = False) -> tuple[dict[int, float], list[dict], dict]:
    """Median seconds of the engine's own decode step (target forward + fused verify, compiled
    and replayed from captured graphs, padded to the capture plan exactly as in serving) for B
    requests at K = 0..k_max. Returns ({token count B*(K+1): seconds}, one row per (B, K)).

    One engine holds a graph set per K (a batch-size table that lists every K declares them);
    each timing runs the step on padding rows, which cost what real rows cost (the attention
    mask spans the whole static cache row, whatever the positions). Also returns the capture
    plan per K (None without capture), so the tuner costs each batch at its padded size."""
    table = [[k + 1, k + 1, k] for k in range(k_max + 1)]  # declares K = 0..k_max
    spec = {"method": "ngram", "num_speculative_tokens": max(k_max, 1), "k_controller": "fixed",
            "num_speculative_tokens_per_batch_size": table}
    llm = make_llm(model, spec if k_max else None, max(batches), max_model_len, enforce_eager)
    by_tokens: dict[int, list[float]] = {}
    rows = []
    for k in range(k_max + 1):
        sizes = llm.runner.plans.get(k)
        for b in batches:
            n = pad_rows(b, sizes, k)
            inp = llm.runner.step_inputs(k, [], n, None, None)
            secs = median_time(lambda: llm.runner.run_step(inp), repeats=repeats, warmup=1)
            by_tokens.setdefault(n * (k + 1), []).append(secs)  # the tokens the step really ran
            rows.append({"batch": b, "K": k, "padded rows": n, "tokens": n * (k + 1), "step ms": secs * 1e3})
    plans = {k: llm.runner.plans.get(k) for k in range(k_max + 1)}
    return {t: statistics.median(v) for t, v in by_tokens.items()}, rows, plans


# ----------------------------------------------------------------------------------------------
def _read_latency(path: str) -> dict[int, float]:
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
        lat = {int(k): float(v) for k, v in raw.items()}
    except FileNotFoundError:
        raise UsageError(f"{path!r} does not exist", "--latency-json") from None
    except (ValueError, AttributeError, TypeError) as e:
        raise UsageError(f"{path!r} must be a JSON object {{\"token_count\": seconds, ...}} ({e})",
                         "--latency-json") from None
    if not lat or min(lat) < 1 or min(lat.values()) <= 0:
        raise UsageError(f"{path!r} needs token counts >= 1 with positive seconds", "--latency-json")
    return lat


def run(args: argparse.Namespace) -> int:
    base = common.spec_dict(args.speculative_config) or dict(DEFAULT_SPEC)
    cfg = common.spec_config(base)  # validates, names the key on error
    if cfg.method not in ("ngram", "suffix", "draft_model"):
        raise UsageError(f"method {cfg.method!r} cannot be measured by the engine yet; use ngram, "
                         f"suffix or draft_model", "--speculative-config method")
    if not 0.0 <= args.tolerance < 1.0:
        raise UsageError(f"{args.tolerance} must be in [0, 1)", "--tolerance")
    k_max = cfg.num_speculative_tokens
    if args.acceptance is None or args.latency_json is None:
        common.set_threads(args.threads, common.model_dir(args.model))
    if args.plot:
        require_matplotlib("--plot")
    t0 = time.perf_counter()

    if args.acceptance is not None:
        acc = args.acceptance
        if not acc or any(not 0.0 <= a <= 1.0 for a in acc):
            raise UsageError(f"{acc} must be numbers in [0, 1]", "--acceptance")
        k_max = min(k_max, len(acc)) if args.speculative_config else len(acc)
        measured = {"acceptance": list(acc), "mean_acceptance_length": None, "draft_s_per_request_step": 0.0,
                    "host_s_per_request_step": 0.0}
    else:
        mdir = common.model_dir(args.model)
        common.check_draft(mdir, cfg)
        spec = dict(base, num_speculative_tokens=k_max, k_controller="fixed")
        spec.pop("num_speculative_tokens_per_batch_size", None)
        measured = measure_acceptance(mdir, spec, load_prompts(args.prompts), args.max_tokens,
                                      args.enforce_eager)
    acc = measured["acceptance"][:k_max]

    ladder = batch_ladder(args.max_num_seqs)
    sizes = None  # given latencies are taken as unpadded B*(K+1) token counts
    if args.latency_json:
        lat = _read_latency(args.latency_json)
    else:
        mdir = common.model_dir(args.model)
        max_len = args.max_model_len or common.fit_max_model_len(mdir, load_prompts(args.prompts),
                                                                 args.max_tokens)
        lat, lat_rows, sizes = measure_latency(mdir, ladder, k_max, max_len, args.repeats, args.enforce_eager)
        print_table(lat_rows, title="decode step latency (median)")

    lat = monotone(lat)
    draft, host = measured["draft_s_per_request_step"], measured["host_s_per_request_step"]
    table = tune_table(lat, acc, args.max_num_seqs, k_max, args.tolerance, draft, sizes, host)
    rows = []
    for b in ladder:
        k, tps, all_tps = best_k(lat, acc, b, k_max, args.tolerance, draft, sizes, host)
        row = {"batch": b, "K": k, "tuned tok/s": tps}
        row.update({f"K={kk} tok/s": v for kk, v in enumerate(all_tps)})
        rows.append(row)
    print_table([{"position": i + 1, "acceptance": a, "E(K)": expected_tokens(acc, i + 1)}
                 for i, a in enumerate(acc)], title="acceptance (conditional) and expected tokens per step")
    print_table([{"tokens": t, "step ms": s * 1e3} for t, s in sorted(lat.items())],
                title="step latency by token count")
    print_table(rows, title="expected tokens/s by concurrency")
    cfg_out = tuned_config(base, table)
    common.spec_config(cfg_out, "tuned table")  # the table must be one SpeculativeConfig accepts
    print(f"tuned in {time.perf_counter() - t0:.1f}s; paste into --speculative-config (with the "
          f"online K controller, the default, the table is its prior for the first steps; add "
          f"\"k_controller\": \"fixed\" to follow the table throughout):")
    print(json.dumps(cfg_out))
    measured_tps = {}
    if args.validate:
        mdir = common.model_dir(args.model)
        prompts = load_prompts(args.prompts)
        max_len = args.max_model_len or common.fit_max_model_len(mdir, prompts, args.max_tokens)
        spec_k = dict(base, num_speculative_tokens=k_max, k_controller="fixed")
        spec_k.pop("num_speculative_tokens_per_batch_size", None)
        table_fixed = dict(cfg_out, k_controller="fixed")  # the table itself, not as a prior
        for name, spec_v in (("K=0", None), (f"K={k_max}", spec_k), ("tuned table", table_fixed)):
            if name == "tuned table" and len(table) == 1 and f"K={table[0][2]}" in measured_tps:
                measured_tps[name] = measured_tps[f"K={table[0][2]}"]  # one K throughout: measured
                continue
            measured_tps[name] = measure_throughput(mdir, spec_v, prompts, ladder, args.max_tokens, max_len,
                                                    args.enforce_eager, min(args.repeats, 3))
        vrows = [{"batch": b, **{f"{n} tok/s": v[b] for n, v in measured_tps.items()},
                  "tuned predicted tok/s": table_tokens_per_s(lat, acc, table, b, draft, sizes, host)} for b in ladder]
        print_table(vrows, title="measured tokens/s by concurrency (generate, ignore_eos)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"speculative_config": cfg_out, "measured_tokens_per_s": {
                           n: {str(b): v for b, v in d.items()} for n, d in measured_tps.items()}, "acceptance": acc,
                       "mean_acceptance_length": measured["mean_acceptance_length"],
                       "draft_s_per_request_step": draft, "host_s_per_request_step": host,
                       "latency_s": {str(k): v for k, v in sorted(lat.items())},
                       "max_num_seqs": args.max_num_seqs, "rows": rows}, f, indent=1)
    if args.plot:
        batches = list(range(1, args.max_num_seqs + 1))
        fixed = {k: [tokens_per_s(lat, acc, b, k, draft, sizes, host) for b in batches]
                 for k in range(k_max + 1)}
        tuned = [table_tokens_per_s(lat, acc, table, b, draft, sizes, host) for b in batches]
        plot_tune(args.plot, batches, fixed, tuned, acc, measured_tps)
        print(f"wrote {args.plot}")
    return 0
