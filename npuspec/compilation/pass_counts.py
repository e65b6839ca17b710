"""Pass counters that tell the truth on warm starts (issue 13, point 5).

On an Inductor FX-graph cache hit the custom passes do not run, so `verify_patterns_matched`
and `small_m_linears` would stay 0 for a graph that was rewritten. Each cold compile therefore
writes what its passes counted to a small JSON file beside Inductor's cache entries (in the
directory Inductor uses for this compile: npuspec's graph cache entry when one is configured,
else Inductor's own cache directory), keyed by a hash of the Dynamo graph, its inputs and the
lowering's Inductor settings (`key_settings`: the custom passes' uuids and the mode's options);
a compile whose passes did not run replays the counts from it.

Only plain JSON of counter names to ints is read back, never code or pickles.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os

import torch
from torch._inductor.runtime.cache_dir_utils import cache_dir

from npuspec import counters
from npuspec.compilation.graph_text import graph_text
from npuspec.passes.hashing import source_hash

log = logging.getLogger("npuspec.backend")  # the backend's logger, as before the move

PASS_COUNTERS = ("verify_patterns_matched", "verify_patterns_unmatched", "small_m_linears")
DIRNAME = "npuspec-pass-counts"


def key_settings(patches: dict) -> list[str]:
    """The Inductor config patches of a compile as key parts: a custom pass by its uuid (the
    verify passes, the small-M linear pass), a plain setting (the mode's) by its value."""
    return [f"{k}={v.uuid() if hasattr(v, 'uuid') else repr(v)}"
            for k, v in sorted(patches.items())]


def graph_key(gm: torch.fx.GraphModule, example_inputs: list, patches: dict) -> str:
    """The record's key: taken before compile_fx, from the Dynamo graph as the backend got it
    (Inductor's pre-grad passes rewrite it in place, and its cache key marks its code stale)."""
    parts = [graph_text(gm), torch.__version__, *key_settings(patches)]
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
    """Hash of how records are keyed and read, for Inductor's cache key (the lowering gives it
    to InductorVerifyPass, whose uuid() holds it): entries compiled before a change to it are
    compiled again, and record their counts under the new key."""
    return source_hash(key_settings, graph_key, graph_text, _path, carry)


def _path(key: str) -> str:
    return os.path.join(cache_dir(), DIRNAME, key + ".json")


def carry(key: str, before: dict, ran: bool) -> None:
    """After a compile whose graph_key is `key`: record the passes' counts (they ran) or
    replay them (a cache hit)."""
    path = _path(key)
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
