"""The field corpus (field_corpus.py): verify steps transcribed from public codebases, compiled
with backend="npuspec" and compared with eager, and an honest count of how many the passes fuse.

- Every entry, compiled with the eager lowering, returns exactly what eager returns from the
  same RNG state (`three_way` with matched=None, inside `fused`: test_fused_now checks it).
- The same under the inductor lowering, for a subset that keeps this file quick on 2 cores:
  every fused entry plus one or more unfused entries of each kind (INDUCTOR_QUICK). The rest run
  under `-m slow` (all 31 passed under the inductor lowering when this file was written).
- `fused(entry)` says whether the passes fused the entry: counters["verify_patterns_matched"]
  moved, with the npuspec ops found in the graphs after the passes. FUSED_NOW records the
  current state, and `test_fused_now` pins it per entry, so a pass that catches another entry
  (or stops catching one) fails here until FUSED_NOW is updated on purpose. A whole step
  counted as fused may be fused only in part (the accept test as ratio_accept, say); the ops
  in field_report.py's table show which part.

    python tests/passes/field_report.py      # the table, "fused N of M"
"""
from __future__ import annotations

import re

import pytest
import torch

from field_corpus import BY_NAME, ENTRIES
from passes_helpers import three_way

SEED, INPUT_SEED = 11, 3
KINDS = {"greedy", "ratio", "residual", "whole_step", "block", "typical"}

# what the passes fuse today (eager and inductor lowerings agree)
FUSED_NOW = {
    "vllm_v0_rejection_sampler",      # ratio_accept only (not the residual or the emission)
    "vllm_v0_typical_acceptance",     # ratio_accept, one-hot "gt" mode against the threshold
    "sglang_dflash_greedy",           # greedy_accept
    "hf_speculative_sampling",        # ratio_accept, in the graph before `if n_matches < gamma`
    "hf_assisted_greedy_ensemble",    # greedy_accept
    "lucidrains_whole_step",          # ratio_accept only
    "medusa_greedy_posterior",        # greedy_accept, in the graph before `if accept_length == 0`
    "eagle_greedy_posterior",         # greedy_accept, likewise
    # issue 37's rewrites and rounds:
    "vllm_v1_native_random",          # ratio_accept (gather_rows, the pad fill moved to q) and
                                      # residual_sample (its clamp(min=1e-5) as the op's floor),
                                      # then with the emission one rejection_sample (composed)
    "vllm_v1_native_ngram",           # likewise
    "vllm_ascend_greedy_spec_len_1",  # greedy_accept (k_one)
    "sglang_tree_greedy_chain",       # greedy_accept (k_one)
    "gpt_fast_speculative_decode",    # residual_sample (nonneg where mode), one graph of three
    "gpt_fast_residual",              # residual_sample (nonneg where mode, keepdim race)
    "romsto_max_fn_residual",         # residual_probs (nonneg where mode)
    "medusa_typical_posterior",       # ratio_accept (shared intermediates round)
    "lmdeploy_torch_greedy",          # greedy_accept (shared intermediates round)
    "vllm_v1_native_greedy",          # greedy_accept (bare-mask round), the graph before the break
    "mlx_lm_speculative_greedy",      # greedy_accept (columns rule: the unrolled loop's compares)
    "lmdeploy_recovered_tokens",      # residual_sample, race_mul sampler (* E.reciprocal())
    "lmdeploy_rejection_sample",      # residual_sample (race_mul), the graph after `.item()`
    "feifeibear_max_fn_sample",       # residual_probs (probs spelling), the graph before `.item()`
    "vllm_ascend_random",             # residual_sample: its guarded race found by the check set
    "vllm_ascend_block_verify",       # likewise (passes/residual_proof.py)
    "vllm_ascend_ngram",              # likewise, its one-hot residual (the draft zeroed) raced
                                      # with q = 0.0, in the graph after the mask-indexing break
    "eagle_residual_row",             # residual_probs (given_residual: the row with xi zeroed)
    "romsto_speculative_generate",    # residual_probs (given_residual): max_fn's own frame; the
    "feifeibear_speculative_sampling_v2",  # step runs eagerly (its `if` in a loop), likewise
}

# run under the inductor lowering in the quick suite; the rest are marked slow
INDUCTOR_QUICK = FUSED_NOW | {
    "vllm_v1_native_random", "vllm_ascend_block_verify", "sglang_tree_greedy_chain",
    "gpt_fast_residual", "mlx_lm_speculative_greedy", "mlx_examples_num_accept",
    "lmdeploy_torch_greedy", "lmdeploy_recovered_tokens", "eagle_residual_row",
    "medusa_typical_posterior",
}


def fused(entry, lowering: str = "eager") -> tuple[bool, set]:
    """(whether the passes fused `entry`, the npuspec ops in the graphs after the passes).

    Compiles afresh (Dynamo reset; the FX graph cache off for the inductor lowering, where a
    hit would skip the passes), and checks on the way that the result equals eager."""
    from torch._inductor import config
    torch._dynamo.reset()
    with config.patch(fx_graph_cache=False):
        _, graphs = three_way(entry.fn, entry.make(INPUT_SEED), lowering=lowering, matched=None,
                              seed=SEED)
    ops = set(re.findall(r"npuspec\.\w+", graphs))
    return three_way.last_delta.get("verify_patterns_matched", 0) > 0, ops


def _ids(entries):
    return [e.name for e in entries]


def test_corpus_shape():
    assert len(ENTRIES) >= 27
    assert FUSED_NOW <= set(BY_NAME) and INDUCTOR_QUICK <= set(BY_NAME)
    for e in ENTRIES:
        assert e.kind in KINDS, e
        assert "/" in e.source.split(",")[0], e.source   # names the repository
        assert isinstance(e.breaks, bool)


_INDUCTOR = [pytest.param(e, id=e.name, marks=() if e.name in INDUCTOR_QUICK else pytest.mark.slow)
             for e in ENTRIES]


@pytest.mark.parametrize("entry", _INDUCTOR)
def test_inductor_lowering_equals_eager(entry, no_fx_cache):
    three_way(entry.fn, entry.make(INPUT_SEED), lowering="inductor", matched=None, seed=SEED)


@pytest.mark.parametrize("entry", ENTRIES, ids=_ids(ENTRIES))
def test_fused_now(entry):
    """Fused exactly as FUSED_NOW says, and equal to eager under the eager lowering."""
    is_fused, ops = fused(entry)
    assert is_fused == (entry.name in FUSED_NOW), (
        f"{entry.name}: fused={is_fused} (ops {sorted(ops)}); update FUSED_NOW if intended")
    assert bool(ops) == is_fused, ops
