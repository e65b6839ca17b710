"""`npuspec bench serve`: `npuspec serve` under streaming clients, with and without speculation
(in the manner of vLLM's benchmarks/benchmark_serving.py).

For each method of `--methods` (default none,ngram; `--speculative-config JSON` adds one more
row, "custom") it starts `npuspec serve MODEL --port 0` on 127.0.0.1 as a subprocess, waits for
GET /health (model load and compile warm-up: up to --server-timeout seconds), sends untimed
warm-up requests (each distinct prompt once, at most --max-concurrency, all at once), then
`--num-prompts` streaming /v1/completions requests (greedy, `ignore_eos`, exactly `--max-tokens`
new tokens each, prompts cycled from `--prompts` in order) from asyncio + httpx clients in this
process. Arrivals follow a Poisson process of `--request-rate` requests/s (seeded by --seed;
`inf`: all at once), with at most `--max-concurrency` requests in flight (the others wait on
the client side, and their latencies start when they are sent). Then it reads /metrics and
stops the server with SIGTERM (SIGKILL after a grace period; always, also on Ctrl-C, SIGTERM
to the bench or an error).

Per request: TTFT (sent -> first non-empty text chunk), ITL (gaps between successive non-empty
chunks; a speculative step can deliver several tokens in one chunk, so ITL is per chunk, not per
token), TPOT ((E2E - TTFT) / (completion tokens - 1), the tokens from the final usage chunk) and
E2E latency. Per method: completed / failed requests, duration (first send to last finish),
requests/s, output tokens/s, mean / median / p90 / p99 of each latency in ms, and from the
server's Prometheus counters over the timed requests only (differences of /metrics read before
and after them, so the warm-up does not count) the mean acceptance length (vLLM's: 1 +
accepted / request-steps that verified drafts) and the acceptance rate (accepted / drafted).
Then output tokens/s of each method over `none`'s. Greedy decoding with speculation is lossless,
so the bench compares every request's text with `none`'s for the same request (same prompt);
a mismatch is printed as a finding and makes the exit status 1, as does a failed request.

`--offline` (off by default: it loads and compiles the model once more, in this process) adds
the serving-overhead regime, one request at a time: with the server still up after its load
run, `npuspec.LLM` in this process (same model, speculative config, max_model_len,
max_num_seqs, compilation config and threads) and the server at concurrency 1 run the first
`--offline-prompts` prompts one after another, alternating for `--rounds` rounds after one
untimed pass each (so a noisy machine's slow spells hit both sides). A third side runs in the
same rounds: the server's engine process alone (started as `npuspec serve` starts it), fed over
its pipe from this process with no HTTP, which tells the engine process's cost from the HTTP
side's. It prints the medians of each side's tok/s and of the per-round ratios to offline (1.0
= no overhead), and whether the texts match.

The clients share the machine with the server: on a small CPU box their JSON parsing and
event loop take cycles the server would otherwise use, as with any load generator on the host.

    npuspec bench serve
    npuspec bench serve --num-prompts 64 --max-concurrency 32 --max-tokens 128 --json serve.json
    npuspec bench serve --request-rate 4 --offline --plot serve.png
    npuspec bench serve --methods none --speculative-config '{"method": "suffix", "num_speculative_tokens": 8}'
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import signal
import statistics
import sys
import threading
import time
from typing import Optional, Sequence

from npuspec import __version__
from npuspec.bench.common import spec_from_flag
from npuspec.bench.plots import plot_serve, require_matplotlib
from npuspec.bench.serve_cli import CUSTOM, check_args, parse_methods, print_report
from npuspec.bench.serve_client import HOST, ServerProcess, http_client, run_sequential, send_request
from npuspec.bench.serve_offline import Offline, PipeOnly
from npuspec.cli_util import common
from npuspec.cli_util.common import add_threads_flag, positive
from npuspec.cli_util.errors import MissingExtra, UsageError, run_command
from npuspec.cli_util.prompts import load_prompts

SCHEMA = "npuspec.bench.serve/1"


def server_argv(mdir: str, spec: Optional[dict], args, max_model_len: Optional[int]) -> list[str]:
    argv = [sys.executable, "-m", "npuspec.cli", "serve", mdir, "--host", HOST, "--port", "0",
            "--served-model-name", args.model, "--max-num-seqs", str(args.max_num_seqs)]
    if spec is not None:
        argv += ["--speculative-config", json.dumps(spec)]
    if max_model_len is not None:
        argv += ["--max-model-len", str(max_model_len)]
    if args.compilation_config is not None:
        argv += ["--compilation-config", args.compilation_config]
    if getattr(args, "enforce_eager", False):
        argv += ["--enforce-eager"]
    if args.threads is not None:
        argv += ["--threads", str(args.threads)]
    if getattr(args, "stream_interval", 1) != 1:
        argv += ["--stream-interval", str(args.stream_interval)]
    return argv


# ----------------------------------------------------------------------------------------------
# The load.

def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Send times (s from the start) of a Poisson process of `rate` requests/s: the first at 0,
    then exponential gaps of mean 1/rate (all 0 for rate = inf)."""
    rng = random.Random(seed)
    out, t = [], 0.0
    for _ in range(n):
        out.append(t)
        if math.isfinite(rate):
            t += rng.expovariate(rate)
    return out


POLL_S = 0.5  # /metrics reads during the timed requests: one small GET each, off the hot path


async def run_load(base: str, model: str, prompts: Sequence[str], num_requests: int, max_tokens: int,
                   rate: float, max_concurrency: int, seed: int, progress=None,
                   poll_s: float = POLL_S) -> dict:
    """Warm-up (the first distinct prompts at once, up to max_concurrency: compiles anything
    the server compiles lazily), /metrics, the timed requests, /metrics again; during them,
    /metrics every `poll_s` seconds (K and throughput over time)."""
    offsets = arrival_offsets(num_requests, rate, seed)
    sem = asyncio.Semaphore(max_concurrency)
    async with http_client(max_concurrency) as client:
        n_warm = min(len(prompts), max_concurrency, num_requests)
        for warm in await asyncio.gather(*(send_request(client, base, model, prompts[i], max_tokens)
                                           for i in range(n_warm))):
            if not warm["ok"]:
                raise RuntimeError(f"a warm-up request to {base} failed: {warm['error']}")
        before = await read_metrics(client, base)
        start = time.perf_counter()
        samples: list = [(0.0, before)]
        stop = asyncio.Event()
        poller = asyncio.create_task(poll_metrics(client, base, start, poll_s, samples, stop))

        async def one(i: int) -> dict:
            delay = start + offsets[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            async with sem:
                rec = await send_request(client, base, model, prompts[i % len(prompts)], max_tokens,
                                         i, i % len(prompts), start)
            if progress is not None:
                progress.update()
            return rec

        records = await asyncio.gather(*(one(i) for i in range(num_requests)))
        duration = time.perf_counter() - start
        stop.set()
        await poller
        after = await read_metrics(client, base)
        samples.append((duration, after))
    return {"records": list(records), "duration_s": duration, "metrics_before": before,
            "metrics_after": after, "samples": samples}



async def poll_metrics(client, base: str, start: float, every: float, out: list,
                       stop: asyncio.Event) -> None:
    """Append (seconds since start, /metrics) every `every` seconds until `stop` is set."""
    while True:
        try:
            await asyncio.wait_for(stop.wait(), every)
            return
        except asyncio.TimeoutError:
            pass
        out.append((time.perf_counter() - start, await read_metrics(client, base)))


def timeline(samples: Sequence[tuple[float, dict]]) -> list[dict]:
    """Per interval between two /metrics reads: its midpoint (s), output tokens/s, and the
    mean K of the verify steps run in it (None when none ran)."""
    steps = "npuspec:spec_decode_num_steps_by_k_total{k="
    out = []
    for (t0, a), (t1, b) in zip(samples, samples[1:]):
        if t1 <= t0:
            continue
        gen = b.get("npuspec:generation_tokens_total", 0.0) - a.get("npuspec:generation_tokens_total", 0.0)
        by_k = {int(key[len(steps):-1]): b[key] - a.get(key, 0.0) for key in b if key.startswith(steps)}
        n = sum(by_k.values())
        out.append({"t": (t0 + t1) / 2, "tokens_per_s": gen / (t1 - t0),
                    "mean_k": sum(k * v for k, v in by_k.items()) / n if n else None})
    return out


# ----------------------------------------------------------------------------------------------
# /metrics.

async def read_metrics(client, base: str) -> dict:
    r = await client.get(base + "/metrics")
    r.raise_for_status()
    return parse_metrics(r.text)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {sample name (with a `{position=i}` or `{k=K}` suffix for the
    per-position and per-K counters): value}, summed over other labels (model_name,
    finished_reason)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if not s.name.startswith("npuspec:") or s.name.endswith(("_bucket", "_created")):
                continue
            key = s.name
            for lab in ("position", "k"):
                if lab in s.labels:
                    key += f"{{{lab}={s.labels[lab]}}}"
            out[key] = out.get(key, 0.0) + s.value
    return out


def spec_metrics(before: dict, after: dict) -> dict:
    """Speculative-decoding figures over the window between two /metrics reads."""
    def d(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    drafts = d("npuspec:spec_decode_num_drafts_total")
    drafted = d("npuspec:spec_decode_num_draft_tokens_total")
    accepted = d("npuspec:spec_decode_num_accepted_tokens_total")
    positions = sorted((int(k.split("=")[1].rstrip("}")), k) for k in after
                       if k.startswith("npuspec:spec_decode_num_accepted_tokens_per_pos_total{"))
    return {"num_drafts": drafts, "num_draft_tokens": drafted, "num_accepted_tokens": accepted,
            "generation_tokens": d("npuspec:generation_tokens_total"),
            "prompt_tokens": d("npuspec:prompt_tokens_total"),
            "num_preemptions": d("npuspec:num_preemptions_total"),
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
            "acceptance_rate": accepted / drafted if drafted else None,
            "acceptance_by_position": [d(k) / drafts for _, k in positions] if drafts else [],
            "steps_by_k": {int(k.split("=")[1].rstrip("}")): d(k) for k in sorted(after)
                           if k.startswith("npuspec:spec_decode_num_steps_by_k_total{")
                           and d(k)},
            "gauge_mean_acceptance_length_since_start":
                after.get("npuspec:spec_decode_mean_acceptance_length")}


# ----------------------------------------------------------------------------------------------
# Statistics.

def percentile(xs: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    s = sorted(xs)
    if not s:
        raise ValueError("percentile of no values")
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def dist_ms(xs: Sequence[float]) -> dict:
    xs = [x * 1000 for x in xs if x is not None]
    if not xs:
        return {"n": 0, "mean": None, "median": None, "p90": None, "p99": None}
    return {"n": len(xs), "mean": sum(xs) / len(xs), "median": percentile(xs, 50),
            "p90": percentile(xs, 90), "p99": percentile(xs, 99)}


def summarize(method: str, spec: Optional[dict], load: dict, max_tokens: int) -> dict:
    recs = load["records"]
    ok = [r for r in recs if r["ok"]]
    dur = load["duration_s"]
    out_tok = sum(r["output_tokens"] for r in ok)
    in_tok = sum(r["prompt_tokens"] or 0 for r in ok)
    row = {"method": method, "speculative_config": spec, "completed": len(ok),
           "failed": len(recs) - len(ok), "duration_s": dur,
           "request_throughput": len(ok) / dur if dur > 0 else 0.0,
           "output_tokens": out_tok, "prompt_tokens": in_tok,
           "output_tokens_per_s": out_tok / dur if dur > 0 else 0.0,
           "total_tokens_per_s": (out_tok + in_tok) / dur if dur > 0 else 0.0,
           "short_outputs": sum(1 for r in ok if r["output_tokens"] != max_tokens),
           "errors": sorted({r["error"] for r in recs if r["error"]})[:5]}
    row["ttft_ms"] = dist_ms([r["ttft"] for r in ok])
    row["tpot_ms"] = dist_ms([r["tpot"] for r in ok])
    row["itl_ms"] = dist_ms([x for r in ok for x in r["itl"]])
    row["e2e_ms"] = dist_ms([r["e2e"] for r in ok])
    row["spec"] = spec_metrics(load["metrics_before"], load["metrics_after"])
    row["timeline"] = timeline(load.get("samples", ()))
    return row


def compare_texts(ref: Sequence[dict], other: Sequence[dict]) -> dict:
    """Request-by-request text identity (same request index = same prompt), both completed."""
    same = diff = 0
    first = None
    for a, b in zip(ref, other):
        if not (a["ok"] and b["ok"]):
            continue
        if a["text"] == b["text"]:
            same += 1
            continue
        diff += 1
        if first is None:
            at = next((i for i, (x, y) in enumerate(zip(a["text"], b["text"])) if x != y),
                      min(len(a["text"]), len(b["text"])))
            first = {"request": a["index"], "prompt_index": a["prompt_index"], "char": at,
                     "ref": a["text"][max(0, at - 20):at + 40], "other": b["text"][max(0, at - 20):at + 40]}
    return {"compared": same + diff, "identical": same, "mismatches": diff, "first_mismatch": first}


def self_consistency(records: Sequence[dict]) -> int:
    """Prompts whose repeated requests within one run got different texts (batching effects)."""
    texts: dict[int, set] = {}
    for r in records:
        if r["ok"]:
            texts.setdefault(r["prompt_index"], set()).add(r["text"])
    return sum(1 for v in texts.values() if len(v) > 1)


# ----------------------------------------------------------------------------------------------
# Offline: the serving overhead, one request at a time.

def run_overhead(srv, off: Offline, pipe: PipeOnly, prompts: Sequence[str], max_tokens: int,
                 rounds: int) -> dict:
    """Server (concurrency 1), offline and engine-process-only passes over the same prompts,
    alternated for `rounds` rounds after one untimed pass of each (every prompt length seen
    once), so a noisy machine's slow spells hit all three; medians of the per-round tok/s and
    of the ratios to offline."""
    warm = asyncio.run(run_sequential(srv.url, srv.name, prompts, max_tokens))
    if not all(r["ok"] for r in warm["records"]):
        raise RuntimeError(f"a warm-up request to {srv.url} failed: "
                           f"{next(r['error'] for r in warm['records'] if not r['ok'])}")
    off.run(prompts)
    pipe.run(prompts)
    server, offline, piped = [], [], []
    for _ in range(rounds):
        seq = asyncio.run(run_sequential(srv.url, srv.name, prompts, max_tokens))
        o = off.run(prompts)
        q = pipe.run(prompts)
        piped.append({"tokens_per_s": q["tokens"] / q["seconds"], "texts": q["texts"]})
        recs = seq["records"]
        toks = sum(r["output_tokens"] for r in recs if r["ok"])
        server.append({"tokens_per_s": toks / seq["seconds"], "records": recs,
                       "failed": sum(not r["ok"] for r in recs)})
        offline.append({"tokens_per_s": o["tokens"] / o["seconds"], "texts": o["texts"]})
    s_tps = [r["tokens_per_s"] for r in server]
    o_tps = [r["tokens_per_s"] for r in offline]
    p_tps = [r["tokens_per_s"] for r in piped]
    last = server[-1]["records"]
    return {"requests": len(prompts), "rounds": rounds, "failed": sum(r["failed"] for r in server),
            "server_tokens_per_s": statistics.median(s_tps), "server_rounds": s_tps,
            "offline_tokens_per_s": statistics.median(o_tps), "offline_rounds": o_tps,
            "server_over_offline": statistics.median(s / o for s, o in zip(s_tps, o_tps)),
            "engine_process_tokens_per_s": statistics.median(p_tps), "engine_process_rounds": p_tps,
            "engine_process_over_offline": statistics.median(q / o for q, o in zip(p_tps, o_tps)),
            "engine_process_same_text": sum(a == b for a, b in zip(piped[-1]["texts"],
                                                                   offline[-1]["texts"])),
            "server_ttft_ms": dist_ms([r["ttft"] for r in last if r["ok"]]),
            "server_tpot_ms": dist_ms([r["tpot"] for r in last if r["ok"]]),
            "same_text": sum(r["ok"] and r["text"] == t for r, t in zip(last, offline[-1]["texts"])),
            "server_texts": [r["text"] for r in last], "offline_texts": offline[-1]["texts"]}


# ----------------------------------------------------------------------------------------------
# The benchmark.

def _rate(s: str) -> float:
    try:
        return float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a number (requests/s, or inf)") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="npuspec bench serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny",
                   help="what `npuspec serve` loads: HF checkpoint directory, .gguf file or 'tiny' (default)")
    p.add_argument("--methods", default="none,ngram",
                   help="comma-separated rows, one server each: none (no speculation), ngram (prompt "
                        "lookup 1..3, K=4), or another `npuspec demo --method` name (its shipped tiny-* "
                        "heads fit the embedded model). Default: none,ngram")
    p.add_argument("--speculative-config", default=None, metavar="JSON|PATH",
                   help=f"one more row, '{CUSTOM}', with this config (vllm serve schema)")
    p.add_argument("--num-prompts", type=positive, default=64, help="timed requests per method (default 64)")
    p.add_argument("--prompts", default="code-edit",
                   help="prompt file (.txt/.json/.jsonl) or a built-in set; default 'code-edit' (6 "
                        "code-editing requests, chat-templated when the model has a template; "
                        "'open-ended': 24 chat requests with little to copy), "
                        "cycled in order to --num-prompts requests")
    p.add_argument("--max-tokens", type=positive, default=128,
                   help="new tokens per request (ignore_eos: exactly this many; default 128)")
    p.add_argument("--request-rate", type=_rate, default=float("inf"), metavar="REQ/S",
                   help="Poisson arrival rate in requests/s; inf (default): all at once")
    p.add_argument("--max-concurrency", type=positive, default=32,
                   help="most requests in flight at once (client side; default 32)")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrival times (default 0)")
    p.add_argument("--max-num-seqs", type=positive, default=32,
                   help="the server's --max-num-seqs (default 32)")
    p.add_argument("--max-model-len", type=positive, default=None,
                   help="the server's --max-model-len (default: fitted to the longest prompt plus "
                        "--max-tokens)")
    p.add_argument("--compilation-config", default=None, metavar="JSON",
                   help="the server's --compilation-config, e.g. '{\"backend\": \"eager\"}' (default: "
                        "the engine's, Inductor lowering)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="the servers' (and --offline's engine's) --enforce-eager: no torch.compile "
                        "or graph capture")
    add_threads_flag(p)
    p.add_argument("--stream-interval", type=positive, default=1, metavar="N",
                   help="the servers' --stream-interval (default 1: a message every step)")
    p.add_argument("--server-timeout", type=float, default=900.0, metavar="S",
                   help="seconds to wait for each server's /health (load + compile; default 900)")
    p.add_argument("--offline", action="store_true",
                   help="also the serving-overhead regime: server at concurrency 1 vs npuspec.LLM "
                        "in this process, one request at a time on the same prompts")
    p.add_argument("--offline-prompts", type=positive, default=None, metavar="N",
                   help="requests of the --offline regime (default: each distinct prompt once, at "
                        "most --num-prompts)")
    p.add_argument("--rounds", type=positive, default=5,
                   help="alternating server / offline rounds of the --offline regime; medians are "
                        "reported (default 5)")
    p.add_argument("--json", default=None, metavar="PATH", help="write every number (and every text) as JSON")
    p.add_argument("--plot", default=None, metavar="PATH.png",
                   help="TTFT / TPOT percentiles and throughput per method (needs matplotlib)")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


def run(args) -> int:
    for mod in ("httpx", "prometheus_client"):  # the clients' own needs; the server checks its own
        try:
            __import__(mod)
        except ImportError:
            raise MissingExtra(mod, "serve", "npuspec bench serve") from None
    check_args(args)
    if args.plot:
        require_matplotlib("--plot")
    mdir = common.model_dir(args.model)
    custom = None
    if args.speculative_config is not None:
        custom = spec_from_flag(args.speculative_config)
        if custom is None:
            raise UsageError("says no speculation; that row is --methods none", "--speculative-config")
    rows_spec = parse_methods(args.methods, custom)
    for name, spec in rows_spec:  # every config checked before any server starts
        common.spec_config(spec, "--speculative-config" if name == CUSTOM else "--methods")
    prompts = load_prompts(args.prompts, model=mdir)
    mml = args.max_model_len or common.fit_max_model_len(mdir, prompts, args.max_tokens)
    cc = json.loads(args.compilation_config) if args.compilation_config else None

    results, offline = _measure(args, rows_spec, mdir, prompts, mml, cc)
    rows = [r for r, _ in results]
    recs = {r["method"]: rr for r, rr in results}
    base_name = "none" if "none" in recs else rows[0]["method"]
    identity = _compare(rows, recs, base_name)
    bad = print_report(args, rows, identity, base_name, offline, mml)
    if args.json:
        doc = {"schema": SCHEMA, "command": args.command_line, "npuspec": __version__, "model": mdir,
               "methods": [n for n, _ in rows_spec], "num_prompts": args.num_prompts,
               "max_tokens": args.max_tokens, "request_rate": None if math.isinf(args.request_rate)
               else args.request_rate, "max_concurrency": args.max_concurrency, "seed": args.seed,
               "max_num_seqs": args.max_num_seqs, "max_model_len": mml,
               "compilation_config": cc,
               "enforce_eager": args.enforce_eager, "threads": args.threads, "prompts": args.prompts,
               "num_distinct_prompts": len(prompts), "baseline": base_name, "rows": rows,
               "identity": identity, "offline": offline,
               "requests": {name: rr for name, rr in recs.items()}}
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        plot_serve(args.plot, rows, offline)
        print(f"wrote {args.plot}")
    failed = any(r["failed"] for r in rows) or any(o["failed"] for o in offline)
    return 1 if bad or failed else 0


def _measure(args, rows_spec, mdir: str, prompts: Sequence[str], mml: Optional[int],
             cc: Optional[dict]) -> tuple[list, list]:
    """One server per method: its load run, then (--offline) the serving-overhead rounds.
    -> ([(row, records)], [offline row])."""
    n_off = args.offline_prompts or min(len(prompts), args.num_prompts)
    off_prompts = [prompts[i % len(prompts)] for i in range(n_off)]
    results, offline = [], []
    old_term = None
    if threading.current_thread() is threading.main_thread():
        def on_term(signum, frame):  # SIGTERM to the bench: unwind, so the servers are stopped
            raise KeyboardInterrupt
        old_term = signal.signal(signal.SIGTERM, on_term)
    try:
        for name, spec in rows_spec:
            argv = server_argv(mdir, spec, args, mml)
            srv = ServerProcess(argv, name, args.server_timeout)
            with srv:
                print(f"[{name}] server up at {srv.url} after {srv.startup_s:.1f} s "
                      f"(speculative: {srv.spec})", file=sys.stderr, flush=True)
                with common.Progress(f"bench serve [{name}]", args.num_prompts) as bar:
                    load = asyncio.run(run_load(srv.url, srv.name, prompts, args.num_prompts,
                                                args.max_tokens, args.request_rate,
                                                args.max_concurrency, args.seed, bar))
                if args.offline:  # both sides live, alternated (see run_overhead)
                    off = Offline(mdir, spec, args.max_tokens, args.max_num_seqs, mml, cc,
                                  args.threads, args.enforce_eager)
                    pipe = PipeOnly(argv[4:], args.max_tokens)  # the flags after `serve`
                    try:
                        o = run_overhead(srv, off, pipe, off_prompts, args.max_tokens, args.rounds)
                    finally:
                        pipe.close()
                    offline.append({"method": name, **o})
                    del off
            row = summarize(name, spec, load, args.max_tokens)
            row["server_startup_s"] = srv.startup_s
            row["server_exit_status"] = srv.returncode
            results.append((row, load["records"]))
    finally:
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
    return results, offline


def _compare(rows: list[dict], recs: dict, base_name: str) -> dict:
    """Sets each row's throughput over the baseline's and its texts' consistency;
    -> {method: compare_texts against the baseline}."""
    base_tps = next(r["output_tokens_per_s"] for r in rows if r["method"] == base_name)
    identity = {}
    for r in rows:
        r["vs_baseline"] = r["output_tokens_per_s"] / base_tps if base_tps else None
        r["prompts_with_varying_text"] = self_consistency(recs[r["method"]])
        if r["method"] != base_name:
            identity[r["method"]] = compare_texts(recs[base_name], recs[r["method"]])
    return identity


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.command_line = "npuspec bench serve " + " ".join(argv)
    return run_command(lambda: run(args), "npuspec bench serve", args.debug)


if __name__ == "__main__":
    sys.exit(main())
