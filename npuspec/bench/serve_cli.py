"""`npuspec bench serve`'s command line around the measurement (npuspec/bench/serve.py): the rows
of `--methods`, the checks of the other flags, and the printed report."""
from __future__ import annotations

import json
import math
from typing import Optional

from npuspec.bench.table import print_table
from npuspec.cli_util import common
from npuspec.cli_util.common import DEFAULT_SPEC, METHOD_SPECS
from npuspec.cli_util.errors import UsageError

CUSTOM = "custom"  # the row --speculative-config adds
LATENCIES = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "E2E"))


def method_names() -> list[str]:
    return ["none"] + sorted(METHOD_SPECS)


def method_spec(name: str) -> Optional[dict]:
    """The speculative config of a `--methods` name: none, or `npuspec demo --method NAME`'s
    default (ngram: prompt lookup 1..3 with K=4; the tiny-* heads ship for the embedded model)."""
    if name == "none":
        return None
    return dict(METHOD_SPECS[name] or DEFAULT_SPEC)


def parse_methods(value: str, custom: Optional[dict]) -> list[tuple[str, Optional[dict]]]:
    names = [m.strip() for m in value.split(",") if m.strip()]
    known = method_names()
    for m in names:
        if m not in known:
            raise UsageError(f"unknown method {m!r}; choose from {', '.join(known)} (comma-separated, "
                             f"e.g. none,ngram), or pass a config with --speculative-config JSON",
                             "--methods")
    if len(set(names)) != len(names):
        raise UsageError(f"{value!r} names a method twice; list each once", "--methods")
    rows = [(m, method_spec(m)) for m in names]
    if custom is not None:
        rows.append((CUSTOM, custom))
    if not rows:
        raise UsageError("names no method; e.g. --methods none,ngram", "--methods")
    return rows


def check_args(args) -> None:
    if not args.request_rate > 0:  # also nan
        raise UsageError(f"{args.request_rate} must be a rate > 0 requests/s, or inf to send every "
                         f"request at once", "--request-rate")
    if not (args.server_timeout > 0 and math.isfinite(args.server_timeout)):
        raise UsageError(f"{args.server_timeout} must be a finite number of seconds > 0, e.g. 900",
                         "--server-timeout")
    if args.compilation_config is not None:
        try:
            cc = json.loads(args.compilation_config)
        except json.JSONDecodeError as e:
            raise UsageError(f"not valid JSON ({e.msg} at column {e.colno}); e.g. "
                             f"'{{\"backend\": \"eager\"}}'", "--compilation-config") from None
        if not isinstance(cc, dict):
            raise UsageError(f"must be a JSON object, e.g. '{{\"backend\": \"eager\"}}', got {cc!r}",
                             "--compilation-config")
    common.out_file(args.json, "--json")
    common.out_file(args.plot, "--plot")


def _fmt_dist(row: dict) -> list[dict]:
    out = []
    for key, label in LATENCIES:
        d = row[key + "_ms"]
        out.append({"method": row["method"], "metric": label, "n": d["n"],
                    **{k: "-" if d[k] is None else d[k] for k in ("mean", "median", "p90", "p99")}})
    return out


def print_report(args, rows: list[dict], identity: dict, base_name: str, offline: list[dict],
                 mml) -> int:
    """The tables and findings on stdout; -> how many methods' greedy texts differ from the
    baseline's."""
    def na(v):
        return "-" if v is None else v
    rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}/s"
    print_table([{"method": r["method"], "completed": r["completed"], "failed": r["failed"],
                  "duration s": r["duration_s"], "req/s": r["request_throughput"],
                  "out tok/s": r["output_tokens_per_s"], f"x {base_name}": na(r["vs_baseline"]),
                  "acc len": na(r["spec"]["mean_acceptance_length"]),
                  "acc rate": na(r["spec"]["acceptance_rate"]),
                  "steps by K": " ".join(f"{k}:{int(n)}" for k, n in
                                         r["spec"].get("steps_by_k", {}).items()) or "-",
                  "server start s": r["server_startup_s"]} for r in rows],
                title=f"bench serve: {args.model}, {args.num_prompts} requests x {args.max_tokens} "
                      f"tokens, rate {rate}, max concurrency {args.max_concurrency}, max_num_seqs "
                      f"{args.max_num_seqs}, max_model_len {mml or 'default'}")
    print_table([d for r in rows for d in _fmt_dist(r)], title="latencies (ms)")
    print("output tok/s vs " + base_name + ": "
          + ", ".join(f"{r['method']} " + ("-" if r["vs_baseline"] is None else f"{r['vs_baseline']:.2f}x")
                     for r in rows))
    bad = 0
    for name, c in identity.items():
        if c["mismatches"]:
            bad += 1
            f = c["first_mismatch"]
            print(f"!! GREEDY TEXT MISMATCH: {name} differs from {base_name} on {c['mismatches']}/"
                  f"{c['compared']} requests (first: request {f['request']}, prompt {f['prompt_index']}, "
                  f"char {f['char']}: {f['ref']!r} vs {f['other']!r})")
        else:
            print(f"greedy texts: {name} identical to {base_name} on {c['identical']}/{c['compared']} requests")
    for r in rows:
        if r["prompts_with_varying_text"]:
            print(f"!! {r['method']}: {r['prompts_with_varying_text']} prompt(s) got different texts "
                  f"on their repeated requests within the run")
        if r["failed"]:
            print(f"!! {r['method']}: {r['failed']} request(s) failed: {'; '.join(r['errors'])}")
        if r["short_outputs"]:
            print(f"!! {r['method']}: {r['short_outputs']} request(s) did not get {args.max_tokens} tokens")
    if offline:
        print_table([{"method": o["method"], "requests": o["requests"],
                      "rounds": o["rounds"],
                      "server c=1 tok/s": o["server_tokens_per_s"], "offline tok/s": o["offline_tokens_per_s"],
                      "server / offline": o["server_over_offline"],
                      "engine process tok/s": o["engine_process_tokens_per_s"],
                      "engine process / offline": o["engine_process_over_offline"],
                      "server TTFT ms": na(o["server_ttft_ms"]["mean"]),
                      "server TPOT ms": na(o["server_tpot_ms"]["mean"]),
                      "same text": f"{o['same_text']}/{o['requests']}",
                      "engine process same text": f"{o['engine_process_same_text']}/{o['requests']}"}
                     for o in offline],
                    title="serving overhead, one request at a time: server (concurrency 1) vs "
                          "npuspec.LLM offline, same prompts, same config")
    return bad
