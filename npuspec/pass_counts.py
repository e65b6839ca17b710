"""Pass counters that tell the truth on warm starts (issue 13, point 5).

On an Inductor FX-graph cache hit the custom passes do not run, so `verify_patterns_matched`
and `small_m_linears` would stay 0 for a graph that was rewritten. Each cold compile therefore
writes what its passes counted to a small JSON file beside Inductor's cache entries (in the
directory Inductor uses for this compile: npuspec's graph cache entry when one is configured,
else Inductor's own cache directory), keyed by a hash of the Dynamo graph, its inputs and the
lowering settings; a compile whose passes did not run replays the counts from it.

Only plain JSON of counter names to ints is read back, never code or pickles.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Any

import torch

from npuspec import counters

log = logging.getLogger("npuspec.backend")

PASS_COUNTERS = ("verify_patterns_matched", "verify_patterns_unmatched", "small_m_linears")
DIRNAME = "npuspec-pass-counts"


def graph_key(gm: torch.fx.GraphModule, example_inputs: list, opts: Any) -> str:
    from npuspec.lowering import lowering_key
    from npuspec.passes import PassManager

    parts = [gm.code, torch.__version__, PassManager().uuid(), repr(lowering_key(opts)),
             repr(getattr(opts, "mode", None))]
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for n, x in zip(phs, example_inputs):
        # the shapes Dynamo traced (symbols for dynamic dims), as Inductor's key has them:
        # a graph compiled first at B=3 is a cache hit for one first called at B=5
        v = n.meta.get("example_value", x)
        if isinstance(v, torch.Tensor):
            parts.append(f"{v.dtype}{tuple(v.shape)}{tuple(v.stride())}{v.device.type}")
        else:
            parts.append(repr(type(x)))
    return hashlib.sha256("\n".join(map(str, parts)).encode()).hexdigest()[:32]


def record_uuid() -> str:
    """Hash of how records are keyed and read, for Inductor's cache key
    (InductorVerifyPass.uuid): entries compiled before a change to it are compiled again,
    and record their counts under the new key."""
    from npuspec.passes.patterns import _source_hash
    return _source_hash(graph_key, _path, carry)


def _path(key: str) -> str:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return os.path.join(cache_dir(), DIRNAME, key + ".json")


def carry(gm, example_inputs, opts, before: dict, ran: bool) -> None:
    """After a compile: record the passes' counts (they ran) or replay them (a cache hit)."""
    path = _path(graph_key(gm, example_inputs, opts))
    if ran:
        delta = {k: v for k, v in counters.delta(before).items()
                 if k.split(".")[0] in PASS_COUNTERS}
        try:
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(delta, f)
            os.replace(tmp, path)
        except OSError as e:  # a read-only cache: the counts of a later hit will be missing
            log.info("npuspec: could not record pass counts at %s: %s", path, e)
        return
    try:
        with open(path) as f:
            saved = json.load(f)
    except FileNotFoundError:
        log.info("npuspec: Inductor cache hit without recorded pass counts (%s)", path)
        return
    except (OSError, ValueError) as e:
        log.warning("npuspec: unreadable pass counts %s (%s); counters not replayed", path, e)
        return
    if not isinstance(saved, dict):
        return
    for k, v in saved.items():
        if (isinstance(k, str) and k.split(".")[0] in PASS_COUNTERS and isinstance(v, int)
                and not isinstance(v, bool) and v > 0):
            counters.bump(k, v)
