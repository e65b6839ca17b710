"""`npuspec plan`'s run: the capture plan per K and its warnings (its flags and documentation:
npuspec/cli/plan.py)."""
from __future__ import annotations

import json
import sys
import warnings

from npuspec.bench.table import print_table
from npuspec.cli_util import common
from npuspec.cli_util.errors import UsageError, with_field
from npuspec.config import SpeculativeConfig
from npuspec.graphs import plan_capture_sizes
from npuspec.platform import NPU_MAX_TOKENS_PER_REQUEST, Platform, current_platform


def _platform(device: str | None):
    if device is None:
        return current_platform()
    limit = NPU_MAX_TOKENS_PER_REQUEST if device == "npu" else float("inf")
    runner = {"npu": "acl", "cuda": "cuda", "cpu": "cpu"}[device]
    return Platform(device, runner, device != "cpu", limit, f"{device} (planned)")


def build_plan(cfg, max_num_seqs: int, sizes=None, platform=None) -> dict:
    """{K: {"sizes", "batches" (using this K), "uncaptured" (batches over the largest size),
    "padding" (mean fraction of padded tokens)}} plus totals."""
    per_k = {}
    for k in cfg.k_values():
        m = k + 1
        caps = plan_capture_sizes(k, max_num_seqs, sizes=sizes, platform=platform)
        batches = [b for b in range(1, max_num_seqs + 1) if cfg.k_for_batch_size(b) == k]
        uncaptured = [b for b in batches if b * m > caps[-1]]
        pads, used = [], set()
        for b in batches:
            if b * m <= caps[-1]:
                padded = next(s for s in caps if s >= b * m)
                pads.append((padded - b * m) / padded)
                used.add(padded)
        unused = [s for s in caps if s not in used]  # sizes no batch using this K pads to
        per_k[k] = {"sizes": caps, "batches": _ranges(batches), "uncaptured": _ranges(uncaptured),
                    "padding": sum(pads) / len(pads) if pads else 0.0,
                    "largest_batch": caps[-1] // m, "unused": unused}
    return {"k": per_k, "graphs": sum(len(v["sizes"]) for v in per_k.values()),
            "max_num_seqs": max_num_seqs}


def _ranges(xs: list[int]) -> list[list[int]]:
    out: list[list[int]] = []
    for x in xs:
        if out and out[-1][1] == x - 1:
            out[-1][1] = x
        else:
            out.append([x, x])
    return out


def _fmt_ranges(rs) -> str:
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in rs) or "none"


def run(args) -> int:
    d = common.spec_dict(args.speculative_config)
    if d is None:
        raise UsageError("planning needs a speculative config, e.g. "
                         "'{\"method\": \"ngram\", \"num_speculative_tokens\": 3}'", "--speculative-config")
    platform = _platform(args.device)
    try:
        cfg = SpeculativeConfig.from_dict(d, device=platform.device)
    except ValueError as e:
        raise with_field(e, "--speculative-config") from None
    try:
        with warnings.catch_warnings():  # the planner logs the same message (shown once)
            warnings.simplefilter("ignore")
            plan = build_plan(cfg, args.max_num_seqs, args.capture_sizes, platform)
    except ValueError as e:  # NPUSPEC_CAPTURE_SIZES garbage, NPU limits: the planner names them
        raise with_field(e, "--capture-sizes" if args.capture_sizes else "capture plan") from None
    if args.json:
        print(json.dumps({"speculative_config": cfg.to_dict(), "device": platform.device,
                          "max_num_seqs": plan["max_num_seqs"], "graphs": plan["graphs"],
                          "k": {str(k): v for k, v in plan["k"].items()}}, indent=1))
    else:
        rows = [{"K": k, "K+1": k + 1, "graphs": len(v["sizes"]), "batch sizes": _fmt_ranges(v["batches"]),
                 "largest captured batch": v["largest_batch"], "never replayed": len(v["unused"]),
                 "mean padding": f"{100 * v['padding']:.1f}%",
                 "capture sizes (tokens)": ",".join(map(str, v["sizes"]))}
                for k, v in plan["k"].items()]
        print_table(rows, title=f"capture plan ({platform.device}, max_num_seqs={args.max_num_seqs})")
        print(f"total graphs: {plan['graphs']}")
    for k, v in plan["k"].items():
        if v["uncaptured"]:
            print(f"warning: K={k}: batch sizes {_fmt_ranges(v['uncaptured'])} need more than "
                  f"{v['sizes'][-1]} tokens (the largest capture size) and run eagerly; add capture "
                  f"sizes up to {v['uncaptured'][-1][1] * (k + 1)} (multiples of {k + 1}) or lower "
                  f"--max-num-seqs", file=sys.stderr)
        if not v["batches"]:
            print(f"note: K={k} is used by no batch size <= {args.max_num_seqs}; its graphs are never replayed",
                  file=sys.stderr)
        elif v["unused"]:
            print(f"note: K={k} serves batch sizes {_fmt_ranges(v['batches'])}, so {len(v['unused'])} of its "
                  f"{len(v['sizes'])} graphs (sizes {','.join(map(str, v['unused']))}) are never replayed",
                  file=sys.stderr)
    return 0
