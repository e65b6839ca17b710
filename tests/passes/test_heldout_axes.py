"""The held-out corpus along axes its transcriptions do not vary: its float32 inputs cast to
float16 or bfloat16, every input's batch dim marked dynamic (what Dynamo's recompile does when
a server's batch changes), and every input of rank >= 2 a non-contiguous view (a slice of a
padded buffer). Each keeps the entries fused at the transcribed settings fused (FUSED_NOW),
fuses nothing else, and equals eager, under both lowerings, except where Inductor itself
differs from eager (INDUCTOR_OWN's "differs"; its float rounding, the tokens eager's).

These found the `upcast` rule (fp16 residuals under Inductor), and that `sum_keepdim`, the
picks and `leading_dims` needed static sizes (5 fusions lost at a dynamic batch). The whole
corpus per axis runs under -m slow; the quick suite runs the entries those fixes were for."""
from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as pytree

from heldout_corpus import ENTRIES, INPUT_SEED, SEED, _equal
from npuspec import counters
from test_heldout_corpus import FUSED_NOW, INDUCTOR_OWN

QUICK = {"ktransformers_verify_speculative_decoding_rowloop", "vllm_v0_get_recovered_probs",
         "vllm_v1_mar2025_recovered_tokens", "vllm_v0_rejection_sampler_forward",
         "lucidrains_prophet_accept_ratio", "redrafter_greedy_accept_candidate_tokens"}
AXES = ("float16", "bfloat16", "dynamic_batch", "strided")


def _cast(dtype):
    return lambda a: a.to(dtype) if isinstance(a, torch.Tensor) and a.dtype == torch.float32 else a


def _strided(a):
    if not isinstance(a, torch.Tensor) or a.dim() < 2 or a.numel() == 0:
        return a
    big = torch.zeros(*a.shape[:-1], a.shape[-1] + 3, dtype=a.dtype)
    return big[..., :a.shape[-1]].copy_(a)


def _args(entry, axis: str):
    args = entry["make"](INPUT_SEED)
    if axis in ("float16", "bfloat16"):
        return pytree.tree_map(_cast(getattr(torch, axis)), args)
    if axis == "strided":
        return pytree.tree_map(_strided, args)
    for a in pytree.tree_leaves(args):
        if isinstance(a, torch.Tensor) and a.dim() >= 1 and a.shape[0] > 1:
            torch._dynamo.maybe_mark_dynamic(a, 0)
    return args


def _run(entry, axis: str, lowering: str):
    """(fused, equal to eager): eager, then a fresh backend="npuspec" compile, each from the
    same arguments' values and the same RNG state."""
    from torch._inductor import config
    torch.manual_seed(SEED)
    want = pytree.tree_leaves(entry["fn"](*_args(entry, axis)))
    torch._dynamo.reset()
    cf = torch.compile(entry["fn"], backend="npuspec",
                       options={"lowering": lowering, "capture": False})
    before = counters.snapshot()
    with config.patch(fx_graph_cache=False):
        torch.manual_seed(SEED)
        got = pytree.tree_leaves(cf(*_args(entry, axis)))
    fused = counters.delta(before).get("verify_patterns_matched", 0) > 0
    return fused, len(want) == len(got) and all(_equal(a, b) for a, b in zip(want, got))


def _eager_runs(entry, axis: str) -> bool:
    try:
        torch.manual_seed(SEED)
        entry["fn"](*_args(entry, axis))
    except Exception:  # the transcription itself refuses it (lmdeploy asserts contiguity)
        return False
    return True


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
@pytest.mark.parametrize("axis", AXES)
@pytest.mark.parametrize("entry", [
    pytest.param(e, id=e["name"], marks=() if e["name"] in QUICK else pytest.mark.slow)
    for e in ENTRIES])
def test_fusion_holds_along_the_axis(entry, axis, lowering, no_fx_cache):
    if not _eager_runs(entry, axis):
        pytest.skip(f"{entry['name']} does not run eagerly with {axis} inputs")
    fused, equal = _run(entry, axis, lowering)
    assert fused == (entry["name"] in FUSED_NOW), (entry["name"], axis, lowering, fused)
    if lowering == "inductor" and INDUCTOR_OWN.get(entry["name"]) == "differs":
        return  # Inductor's own float rounding (tests/passes/test_heldout_corpus.py)
    assert equal, f"{entry['name']} with {axis} inputs: the compiled result differs from eager"
