"""`npuspec bench hf --start`: the start-up cost of a compiled forward under HF generate.

The timed bench warms every row up in one process, one system after another, so the warm-up
figures there depend on which system ran first and on what Inductor's caches already held.
Here each (mode, system) runs in child processes of its own, on its own new, empty cache
directories (TORCHINDUCTOR_CACHE_DIR and NPUSPEC_CACHE_DIR):

    cold        first child: empty caches; its first run compiles everything
    warm start  second child on the caches the first one left: a restarted deployment
    steady      the second child's second run (nothing left to compile)
    new lengths the second child's third run, every prompt one token shorter: a warm process
                meeting new prompt and cache lengths (what each new shape costs to compile)
    backend s   of the warm start and of new lengths, the seconds Dynamo timed in the
                backend (`OutputGraph.call_user_compiler`): Inductor's compile_fx, or npuspec's
                backend with the same compile_fx inside it. Dynamo's tracing and guards, the
                same work for both systems, are ~90 % of a new length's time and move by
                ±25 % from one process to the next on a 2-core machine; these columns compare
                what the two systems do differently.
    own s       of the same runs, npuspec's own compile-time seconds: its backend outside the
                lowering it shares with Inductor, plus its passes
                (`npuspec.compilation.backend.own_seconds`).

A run is one generate() per prompt. Tokens are compared with the eager child of the mode.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from torch._dynamo.utils import compilation_time_metrics

CHILD_FLAG = "--start-child"
COMPILED = ("inductor", "npuspec")


def child(setup, setup_shorter, own) -> int:
    """In the child: `setup()` (load, compile the forward), the first run (every compile),
    a second run, then `setup_shorter()`'s run on the same compiled model with every prompt
    one token shorter; prints one JSON line. `own()`: npuspec's own compile seconds so far
    (`backend.own_seconds`), read around the first and the new-lengths runs (they stay put
    in an eager or Inductor child, whose compiles never reach npuspec)."""
    t0 = time.perf_counter()
    run = setup()
    t1 = time.perf_counter()
    o1, b1 = own(), _backend_s()
    first = run()
    t2 = time.perf_counter()
    o2, b2 = own(), _backend_s()
    run()
    t3 = time.perf_counter()
    o3, b3 = own(), _backend_s()
    shorter = setup_shorter()()
    t4 = time.perf_counter()
    print(json.dumps({"load_s": t1 - t0, "first_s": t2 - t1, "steady_s": t3 - t2,
                      "shorter_s": t4 - t3, "first_own_s": o2 - o1, "shorter_own_s": own() - o3,
                      "first_backend_s": b2 - b1, "shorter_backend_s": _backend_s() - b3,
                      "token_ids": first["token_ids"], "shorter_ids": shorter["token_ids"],
                      "tokens": first["tokens"]}))
    return 0


def _backend_s() -> float:
    """Seconds Dynamo has timed in backends so far in this process (0 where this torch keeps
    no such timer)."""
    return sum(compilation_time_metrics.get("OutputGraph.call_user_compiler", ()))


def _spawn(argv: list[str], system: str, mode: str, cache: str) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"),
               NPUSPEC_CACHE_DIR=os.path.join(cache, "npuspec"))
    cmd = [sys.executable, "-m", "npuspec.bench.hf", *argv, CHILD_FLAG, f"{system}:{mode}"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode or not lines:
        raise RuntimeError(f"bench hf --start: the {system} / {mode} child failed (exit "
                           f"{p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(lines[-1])


def run_start(argv: list[str], modes: list[str], progress) -> list[dict]:
    """Rows: per mode, eager once, then each compiled system cold and warm-started."""
    rows = []
    for mode in modes:
        with tempfile.TemporaryDirectory(prefix="npuspec-start-") as tmp:
            ref = _spawn(argv, "eager", mode, os.path.join(tmp, "eager"))
            progress.update()
            rows.append(_row(mode, "eager", ref, ref, ref))
            for system in COMPILED:
                cache = os.path.join(tmp, system)
                cold = _spawn(argv, system, mode, cache)
                progress.update()
                warm = _spawn(argv, system, mode, cache)
                progress.update()
                rows.append(_row(mode, system, cold, warm, ref))
    by = {(r["mode"], r["system"]): r for r in rows}
    for r in rows:  # start-up time relative to Inductor's (eager compiles nothing: "-")
        ind = by[(r["mode"], "inductor")]
        compiled = r["system"] != "eager"
        r["cold_vs_inductor"] = r["cold_first_s"] / ind["cold_first_s"] if compiled else "-"
        r["warm_vs_inductor"] = r["warm_first_s"] / ind["warm_first_s"] if compiled else "-"
        r["new_lengths_vs_inductor"] = (r["new_lengths_s"] / ind["new_lengths_s"] if compiled
                                        else "-")
        r["new_lengths_backend_vs_inductor"] = (
            r["new_lengths_backend_s"] / ind["new_lengths_backend_s"]
            if compiled and ind["new_lengths_backend_s"] > 0 else "-")
    return rows


def _row(mode: str, system: str, cold: dict, warm: dict, ref: dict) -> dict:
    same = sum(a == b for a, b in zip(cold["token_ids"], ref["token_ids"]))
    same_warm = sum(a == b for a, b in zip(warm["token_ids"], ref["token_ids"]))
    same_shorter = sum(a == b for a, b in zip(warm["shorter_ids"], ref["shorter_ids"]))
    return {"mode": mode, "system": system, "cold_first_s": cold["first_s"],
            "warm_first_s": warm["first_s"], "steady_s": warm["steady_s"],
            "new_lengths_s": warm["shorter_s"], "load_s": warm["load_s"],
            # seconds in the backend, and npuspec's own part of them (its keys, cache, passes)
            "warm_backend_s": warm.get("first_backend_s", 0.0),
            "new_lengths_backend_s": warm.get("shorter_backend_s", 0.0),
            "warm_own_s": warm.get("first_own_s", 0.0),
            "new_lengths_own_s": warm.get("shorter_own_s", 0.0),
            "tokens": cold["tokens"], "identical": min(same, same_warm, same_shorter),
            "prompts": len(ref["token_ids"])}
