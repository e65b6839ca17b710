"""The held-out corpus (heldout_corpus.py) through backend="npuspec": every entry equals eager,
and the set the passes fuse is pinned (FUSED_NOW), so a pass that catches another entry, or
stops catching one, fails here until FUSED_NOW is updated on purpose.

    python tests/passes/heldout_report.py      # the table, "fused N of M"
"""
from __future__ import annotations

import pytest
import torch

from heldout_corpus import BY_NAME, ENTRIES, _equal, compiled_leaves, run
from npuspec import counters

KINDS = {"greedy", "ratio", "residual", "whole_step", "block", "typical"}

# wave 1: 25 of 55 when first measured (heldout_corpus.py); since then the nonneg trial rewrite
# (lucidrains' returned relu residual), the sum_keepdim rule (vLLM v0's recovered probs) and
# greedy_accept and k_one over mixed int32/int64 ids (TensorRT-LLM, vllm-ascend), the
# leading_dims rule (EAGLE's batched tree posterior), the scaled_pick rule (lucidrains' prophet)
FUSED_NOW = {
    "vllm_v0_rejection_sampler_forward",
    "vllm_v0_get_recovered_probs",
    "vllm_v1_forward_native_greedy_padded",
    "vllm_v1_forward_native_random_padded",
    "vllm_v1_mar2025_recovered_tokens",
    "vllm_ascend_greedy_spec_len_1",
    "vllm_ascend_rejection_sample_mixed",
    "vllm_ascend_entropy_verify",
    "vllm_ascend_block_verify",
    "sglang_verify_tree_greedy_native_k1_fastpath",
    "trtllm_mtp_sample_and_accept_greedy",
    "trtllm_accept_base_advanced_sampling",
    "trtllm_torch_sampler_rejection_two_model",
    "gptfast_speculative_decode_probs_rowloop",
    "gptfast_speculative_decode_topk_logits_k1",
    "hf_utils_speculative_sampling_2025_is_done",
    "hf_utils_assisted_greedy_2025_is_done",
    "eagle_modeling_eagle_batched_greedy",
    "hf_utils_assisted_greedy_5_24_ensemble_eos_crop",
    "lucidrains_speculative_decoding_step",
    "lucidrains_same_model_residual",
    "lucidrains_prophet_accept_ratio",
    "medusa_evaluate_posterior_typical_fast",
    "medusa_legacy_evaluate_posterior_greedy",
    "medusa_evaluate_posterior_typical_sampled_mask",
    "lmdeploy_reject_sampler_greedy_v0",
    "lmdeploy_torch_greedy_rejection_sample_k1",
    "romsto_speculative_generate_verify_nucleus",
    "feifeibear_v1_google_kvcache_prob_history",
    "feifeibear_v2_deepmind_top_p",
    "feifeibear_sfliu_batch_padding_variant",
    "feifeibear_max_fn_residual_sample",
    # wave 2 (heldout_d.py, heldout_e.py): 15 of 36 when first measured
    "vllm_v0_rejection_sampler_forward_d",
    "vllm_v0_typical_acceptance_sampler_forward",
    "sglang_verify_tree_greedy_native_k1_fastpath_d",
    "redrafter_greedy_accept_candidate_tokens",
    "specbench_sps_speculative_sampling",
    "specbench_medusa_evaluate_posterior_greedy",
    "specbench_medusa_evaluate_posterior_typical",
    "specbench_hydra_evaluate_posterior_typical",
    "ktransformers_verify_speculative_decoding_rowloop",
    "optimum_habana_assisted_greedy_n_matches",
    "optimum_habana_assisted_sampled_match",
    "rest_evaluate_posterior_greedy",
    "rest_evaluate_posterior_nucleus",
    "hydra_evaluate_posterior_greedy_max_accepts",
    "hydra_evaluate_posterior_typical",
}

# under the inductor lowering in the quick suite (the rest under -m slow)
INDUCTOR_QUICK = {
    "vllm_v0_get_recovered_probs", "vllm_v1_forward_native_random_padded",
    "trtllm_mtp_sample_and_accept_greedy", "lucidrains_same_model_residual",
    "vllm_ascend_block_verify", "eagle_modeling_eagle_batched_greedy",
}


def test_corpus_shape():
    assert len(ENTRIES) == len(BY_NAME) >= 91
    assert FUSED_NOW <= set(BY_NAME) and INDUCTOR_QUICK <= set(BY_NAME) >= set(INDUCTOR_OWN)
    for e in ENTRIES:
        assert e["kind"] in KINDS, e["name"]
        assert "/" in e["source"].split(",")[0], e["source"]  # names the repository


@pytest.mark.parametrize("entry", ENTRIES, ids=[e["name"] for e in ENTRIES])
def test_fused_now_and_equal_to_eager(entry):
    fused, equal, ops = run(entry)
    assert equal, f"{entry['name']}: the compiled result differs from eager"
    assert fused == (entry["name"] in FUSED_NOW), (
        f"{entry['name']}: fused={fused} (ops {sorted(ops)}); update FUSED_NOW if intended")
    assert bool(ops) == fused, ops


# Inductor itself, as `backend="inductor"` with fallback_random, differs from eager on these
# (its logsumexp / softmax code) or fails to compile them (KeyError 'buf5' in its scheduler):
# npuspec's inductor lowering must give Inductor's own result where it differs, and where it
# fails, lower those graphs eagerly instead (counted) and equal eager
INDUCTOR_OWN = {
    "mlx_lm_generate_speculative_generate_step_logits_processors": "differs",
    "lucidrains_speculative_decoding_step": "differs",
    "vllm_v1_rejection_sample_mixed_ragged": "raises",
    "vllm_v1_rejection_sample_ngram_ragged": "raises",
}


@pytest.mark.parametrize("entry", [
    pytest.param(e, id=e["name"], marks=() if e["name"] in INDUCTOR_QUICK else pytest.mark.slow)
    for e in ENTRIES])
def test_inductor_lowering_equals_eager(entry, no_fx_cache):
    own = INDUCTOR_OWN.get(entry["name"])
    if own is None:
        assert run(entry, "inductor")[1], f"{entry['name']}: the compiled result differs from eager"
        return
    plain = {"fallback_random": True}
    ours = {"lowering": "inductor", "capture": False}
    if own == "raises":
        with pytest.raises(torch._inductor.exc.InductorError, match="KeyError"):
            compiled_leaves(entry, "inductor", plain)
        before = counters.snapshot()
        assert run(entry, "inductor")[1], f"{entry['name']}: the compiled result differs from eager"
        assert counters.delta(before).get("inductor_fallbacks", 0) >= 1
        return
    want = run(entry, "eager")  # eager-lowered npuspec equals eager (test above)
    assert want[1]
    inductor = compiled_leaves(entry, "inductor", plain)
    got = compiled_leaves(entry, "npuspec", ours)
    assert all(_equal(a, b) for a, b in zip(got, inductor)), entry["name"]
    assert not run(entry, "inductor")[1], f"{entry['name']}: now equals eager; drop it from INDUCTOR_OWN"


# npuspec.compile turns Dynamo's capture flags on; PyTorch 2.13 cannot compile these frames
# with them (IndexError on an .item() index while Dynamo traces; GuardOnDataDependentSymNode
# in AOT autograd, for HF's in a frame resumed after its random draws): each such frame runs
# eagerly, counted, and the result is eager's (the draws before it are not made twice)
EAGER_FRAMES_UNDER_FLAGS = {
    "flashinfer_chain_speculative_sampling_reference": True,
    "hf_utils_speculative_sampling_5_24_ensemble_weight": True,
    "specbench_pld_greedy_verify": False,
    "hf_utils_assisted_greedy_5_24_ensemble_eos_crop": False,
    "optimum_habana_assisted_greedy_n_matches": False,
    "optimum_habana_assisted_sampled_match": False,
}


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=() if quick else pytest.mark.slow)
    for n, quick in EAGER_FRAMES_UNDER_FLAGS.items()])
def test_npuspec_compile_runs_eagerly_what_the_capture_flags_cannot_compile(name, no_fx_cache):
    import torch.utils._pytree as pytree

    import npuspec
    from heldout_corpus import INPUT_SEED, SEED
    from npuspec import counters
    entry = BY_NAME[name]
    torch.manual_seed(SEED)
    want = pytree.tree_leaves(entry["fn"](*entry["make"](INPUT_SEED)))
    torch._dynamo.reset()
    f = npuspec.compile(entry["fn"], options={"lowering": "eager", "capture": False})
    args = entry["make"](INPUT_SEED)
    before = counters.snapshot()
    torch.manual_seed(SEED)
    got = pytree.tree_leaves(f(*args))
    assert counters.delta(before).get("npuspec_compile.eager_frames", 0) >= 1
    assert len(got) == len(want) and all(_equal(a, b) for a, b in zip(want, got)), name
