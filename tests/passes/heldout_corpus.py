"""The held-out corpus: 91 verify steps from 36 codebases, transcribed for issue 37 by helper
sessions that never read npuspec's passes or tests, each checked equal to eager before the
matcher met it. Wave 1 (55 steps, 20 codebases): heldout_a.py (vLLM v0/v1, vllm-ascend, SGLang,
TensorRT-LLM), heldout_b.py (HF transformers, gpt-fast, lucidrains, Medusa, EAGLE,
LookaheadDecoding), heldout_c.py (MLX-LM, mlx-examples, LMDeploy, romsto, feifeibear,
ArcticInference, exllamav2, TGI). Wave 2 (36 steps), written after the rules wave 1 asked for:
heldout_d.py (flashinfer's and vLLM's test references, SGLang, Apple's ReDrafter, Spec-Bench's
methods), heldout_e.py (LightLLM, ktransformers, SpecForge, optimum-habana, ipex-llm,
torchchat, REST, Hydra, NVIDIA Model-Optimizer). Each entry is a dict: name, source, kind, fn,
make(seed) -> args. Some draw from Python's `random`, which their make() seeds, so a run makes
its arguments afresh (`run`).

Measured blind, before any change made for them, all equal to eager: wave 1, 25 of 55 fused
(heldout_b + heldout_c 16 of 34, heldout_a 9 of 21); wave 2, 15 of 36 (heldout_d 8 of 19,
heldout_e 7 of 17), with wave 1's rules in place.
"""
from __future__ import annotations

import re

import torch
import torch.utils._pytree as pytree

import heldout_a
import heldout_b
import heldout_c
import heldout_d
import heldout_e
from npuspec import counters
from npuspec.passes import manager

ENTRIES = [*heldout_a.ENTRIES, *heldout_b.ENTRIES, *heldout_c.ENTRIES, *heldout_d.ENTRIES,
           *heldout_e.ENTRIES]
BY_NAME = {e["name"]: e for e in ENTRIES}
SEED, INPUT_SEED = 11, 3


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b


def compiled_leaves(entry, backend: str, options: dict, capture: bool = False) -> list:
    """The leaves of `entry` compiled afresh with `backend` (FX graph cache off); `capture`:
    through `npuspec.compile` (Dynamo's capture flags on for it) instead of torch.compile."""
    return compiled_calls(entry, backend, options, capture, 1)[0]


def compiled_calls(entry, backend: str, options: dict, capture: bool, calls: int) -> list:
    """Each call's leaves, `calls` calls of one fresh compile (as `compiled_leaves`), each from
    a fresh make() and the same RNG state."""
    from torch._inductor import config
    torch._dynamo.reset()
    if capture:
        import npuspec
        assert backend == "npuspec", backend
        cf = npuspec.compile(entry["fn"], options=options)
    else:
        cf = torch.compile(entry["fn"], backend=backend, options=options)
    out = []
    for _ in range(calls):
        args = entry["make"](INPUT_SEED)
        with config.patch(fx_graph_cache=False):
            torch.manual_seed(SEED)
            out.append(pytree.tree_leaves(cf(*args)))
    return out


def run(entry, lowering: str = "eager", capture: bool = False,
        calls: int = 1) -> tuple[bool, bool, set]:
    """(fused, equal to eager, npuspec ops after the passes): eager, then a fresh compile with
    backend="npuspec" (`capture`: through npuspec.compile), each from its own make() and the
    same torch RNG state. `calls` > 1: the compiled function called that many times; fused
    when any call fused, equal when every call was."""
    torch.manual_seed(SEED)
    w = pytree.tree_leaves(entry["fn"](*entry["make"](INPUT_SEED)))
    manager.HISTORY.clear()
    before = counters.snapshot()
    got = compiled_calls(entry, "npuspec", {"lowering": lowering, "capture": False}, capture,
                         calls)
    delta = counters.delta(before)
    equal = all(len(w) == len(g) and all(_equal(a, b) for a, b in zip(w, g)) for g in got)
    ops = set(re.findall(r"npuspec\.\w+", "\n".join(t for _, _, t in manager.HISTORY)))
    return delta.get("verify_patterns_matched", 0) > 0, equal, ops
