"""A field corpus of speculative-decoding verify steps, independent of our own corpora.

Each entry is our own PyTorch transcription of one verify step as a public codebase writes it:
the same ops in the same order and spelling (the point is to test whether the passes recognise
the field's spellings), with our own names and layout, and no text copied. An entry is batched
over B requests where the original is batched; where the original handles one request (B = 1
loops, `.item()`, host-side control flow), the transcription keeps that. MLX and Triton code is
rendered as the torch ops that compute the same values (a per-request kernel loop over draft
positions becomes a loop over positions on [B] tensors).

Randomness inside `fn` comes only from torch's global RNG (torch.rand / rand_like / uniform_ /
exponential_ / multinomial), so eager and compiled runs from one `torch.manual_seed` draw the
same numbers. `make(seed)` builds the inputs from a private torch.Generator.

Fields:
    name     entry id
    source   repository, file and function transcribed
    fn       the transcription
    make     seed -> tuple of positional args for fn
    kind     "greedy" | "ratio" | "residual" | "whole_step" | "block" | "typical"
    breaks   the original holds an op Dynamo breaks the graph on (`.item()`, `.nonzero()`,
             `if tensor:`, boolean-mask indexing, a data-dependent repeat or slice)

Shapes: B = 4 requests, K = 5 drafts, V = 29 tokens unless the layout needs otherwise (ragged
vLLM layouts draft [5, 3, 5, 2] tokens per request).
"""
from __future__ import annotations

from field_inputs import Entry
from field_others import (_make_dflash, _make_eagle_row, _make_gpt_fast, _make_hf,
    _make_hf_greedy, _make_lucidrains, _make_rows, _make_rows_tp, _make_sglang_block, _make_tree,
    _make_tree_chain, _make_typical, eagle_greedy_posterior, eagle_residual_row,
    gpt_fast_residual, gpt_fast_speculative_decode, hf_assisted_greedy_ensemble,
    hf_speculative_sampling, lucidrains_whole_step, medusa_greedy_posterior,
    medusa_typical_posterior, sglang_block_verify_reference, sglang_dflash_greedy,
    sglang_tree_greedy_chain)
from field_rest import (_make_feifeibear, _make_ff_rows, _make_lmdeploy_greedy,
    _make_lmdeploy_random, _make_lmdeploy_recovered, _make_mlx_examples, _make_mlx_lm,
    _make_romsto, feifeibear_max_fn_sample, feifeibear_speculative_sampling_v2,
    lmdeploy_recovered_tokens, lmdeploy_rejection_sample, lmdeploy_torch_greedy,
    mlx_examples_num_accept, mlx_lm_speculative_greedy, romsto_max_fn_residual,
    romsto_speculative_generate)
from field_vllm import (_make_ascend, _make_ascend_greedy, _make_ascend_len1, _make_ascend_ngram,
    _make_v0, _make_v0_typical, _make_v1_greedy, _make_v1_ngram, _make_v1_random,
    vllm_ascend_block_verify, vllm_ascend_greedy, vllm_ascend_greedy_spec_len_1,
    vllm_ascend_ngram, vllm_ascend_random, vllm_v0_rejection_sampler, vllm_v0_typical_acceptance,
    vllm_v1_native_greedy, vllm_v1_native_ngram, vllm_v1_native_random)


# ============================================================================================
# the corpus
# ============================================================================================
_V0 = "vllm-project/vllm (v0), vllm/model_executor/layers/"
_V1 = "vllm-project/vllm (v1, early 2025), vllm/v1/sample/rejection_sampler.py, "
_ASC = "vllm-project/vllm-ascend, vllm_ascend/sample/rejection_sampler.py, "
_LMD = "InternLM/lmdeploy, lmdeploy/pytorch/spec_decode/reject_sampler.py, "

ENTRIES = [
    Entry("vllm_v0_rejection_sampler",
          _V0 + "rejection_sampler.py RejectionSampler._batch_modified_rejection_sampling "
          "(_get_accepted, _get_recovered_probs, _multinomial) + spec_decode_base_sampler.py "
          "_create_output", vllm_v0_rejection_sampler, _make_v0, "whole_step", False),
    Entry("vllm_v0_typical_acceptance",
          _V0 + "typical_acceptance_sampler.py TypicalAcceptanceSampler.forward "
          "(_evaluate_accepted_tokens, _get_recovered_token_ids) + _create_output",
          vllm_v0_typical_acceptance, _make_v0_typical, "typical", False),
    Entry("vllm_v1_native_greedy", _V1 + "RejectionSampler.forward_native (all_greedy)",
          vllm_v1_native_greedy, _make_v1_greedy, "greedy", True),
    Entry("vllm_v1_native_random", _V1 + "RejectionSampler.forward_native (random) + "
          "ops/topk_topp_sampler.py random_sample", vllm_v1_native_random, _make_v1_random,
          "whole_step", False),
    Entry("vllm_v1_native_ngram", _V1 + "RejectionSampler.forward + _create_greedy_token_probs "
          "+ forward_native (n-gram drafts, random)", vllm_v1_native_ngram, _make_v1_ngram,
          "whole_step", False),
    Entry("vllm_ascend_random", _ASC + "rejection_sample (fallback) + sample_recovered_tokens"
          "_pytorch + rejection_random_sample_pytorch", vllm_ascend_random, _make_ascend,
          "whole_step", False),
    Entry("vllm_ascend_ngram", _ASC + "rejection_sample + sample_recovered_tokens_pytorch + "
          "rejection_random_sample_pytorch (IS_NGRAM)", vllm_ascend_ngram, _make_ascend_ngram,
          "whole_step", True),
    Entry("vllm_ascend_block_verify", _ASC + "rejection_sample + sample_recovered_tokens_pytorch"
          " + rejection_random_sample_block_verify_pytorch", vllm_ascend_block_verify,
          _make_ascend, "block", False),
    Entry("vllm_ascend_greedy_spec_len_1", _ASC + "rejection_sample + rejection_greedy_sample"
          "_spec_len_1_pytorch", vllm_ascend_greedy_spec_len_1, _make_ascend_len1, "greedy",
          False),
    Entry("vllm_ascend_greedy", _ASC + "rejection_sample + rejection_greedy_sample_pytorch",
          vllm_ascend_greedy, _make_ascend_greedy, "greedy", True),
    Entry("sglang_dflash_greedy", "sgl-project/sglang, python/sglang/srt/speculative/"
          "dflash_utils.py compute_dflash_accept_len_and_bonus (+ the verify's argmax)",
          sglang_dflash_greedy, _make_dflash, "greedy", False),
    Entry("sglang_tree_greedy_chain", "sgl-project/sglang, python/sglang/srt/speculative/"
          "eagle_utils.py verify_tree_greedy_native (2-token, topk=1 fast path)",
          sglang_tree_greedy_chain, _make_tree_chain, "greedy", False),
    Entry("sglang_block_verify_reference", "sgl-project/sglang, unit test of "
          "chain_block_speculative_sampling_triton, block_verify_reference",
          sglang_block_verify_reference, _make_sglang_block, "block", False),
    Entry("gpt_fast_speculative_decode", "pytorch-labs/gpt-fast, generate.py speculative_decode "
          "(+ logits_to_probs, multinomial_sample_one_no_sync)", gpt_fast_speculative_decode,
          _make_gpt_fast, "whole_step", True),
    Entry("gpt_fast_residual", "pytorch-labs/gpt-fast, generate.py speculative_decode (rejection "
          "branch) + multinomial_sample_one_no_sync", gpt_fast_residual, _make_rows, "residual",
          False),
    Entry("hf_speculative_sampling", "huggingface/transformers, src/transformers/generation/"
          "utils.py _speculative_sampling", hf_speculative_sampling, _make_hf, "whole_step", True),
    Entry("hf_assisted_greedy_ensemble", "huggingface/transformers, src/transformers/generation/"
          "utils.py GenerationMixin._assisted_decoding (greedy, assistant_ensemble_weight)",
          hf_assisted_greedy_ensemble, _make_hf_greedy, "greedy", False),
    Entry("lucidrains_whole_step", "lucidrains/speculative-decoding, speculative_decoding/"
          "speculative_decoding.py speculative_decoding (+ find_first_true_index)",
          lucidrains_whole_step, _make_lucidrains, "whole_step", False),
    Entry("medusa_greedy_posterior", "FasterDecoding/Medusa, medusa/model/utils.py "
          "evaluate_posterior (temperature 0)", medusa_greedy_posterior, _make_tree, "greedy",
          True),
    Entry("medusa_typical_posterior", "FasterDecoding/Medusa, medusa/model/utils.py "
          "evaluate_posterior (typical, fast)", medusa_typical_posterior, _make_typical,
          "typical", True),
    Entry("eagle_greedy_posterior", "SafeAILab/EAGLE, eagle/model/utils.py evaluate_posterior "
          "(logits_processor None)", eagle_greedy_posterior, _make_tree, "greedy", True),
    Entry("eagle_residual_row", "SafeAILab/EAGLE, eagle/model/utils.py evaluate_posterior "
          "(sampled: gtp[xi] = 0, renormalise) + update_inference_inputs (multinomial)",
          eagle_residual_row, _make_eagle_row, "residual", False),
    Entry("mlx_lm_speculative_greedy", "ml-explore/mlx-lm, mlx_lm/generate.py "
          "speculative_generate_step (_process_and_sample, accept loop)",
          mlx_lm_speculative_greedy, _make_mlx_lm, "greedy", False),
    Entry("mlx_examples_num_accept", "ml-explore/mlx-examples, llms/speculative_decoding/"
          "decoder.py SpeculativeDecoder._get_num_accept + speculative_decode",
          mlx_examples_num_accept, _make_mlx_examples, "ratio", False),
    Entry("lmdeploy_torch_greedy", _LMD + "torch_greedy_rejection_sample", lmdeploy_torch_greedy,
          _make_lmdeploy_greedy, "greedy", False),
    Entry("lmdeploy_recovered_tokens", _LMD + "rejection_sample (Exp(1), reciprocal) + "
          "sample_recovered_tokens_kernel", lmdeploy_recovered_tokens, _make_lmdeploy_recovered,
          "residual", False),
    Entry("lmdeploy_rejection_sample", _LMD + "rejection_sample (+ rejection_greedy_sample_kernel,"
          " rejection_random_sample_kernel, sample_recovered_tokens_kernel, _extract_outputs)",
          lmdeploy_rejection_sample, _make_lmdeploy_random, "whole_step", True),
    Entry("romsto_speculative_generate", "romsto/Speculative-Decoding, sampling/"
          "speculative_decoding.py speculative_generate (one step) + max_fn",
          romsto_speculative_generate, _make_romsto, "whole_step", True),
    Entry("romsto_max_fn_residual", "romsto/Speculative-Decoding, sampling/speculative_decoding.py"
          " max_fn + utils/logits_processor.py MultinomialProcessor.sample",
          romsto_max_fn_residual, _make_rows_tp, "residual", False),
    Entry("feifeibear_speculative_sampling_v2", "feifeibear/LLMSpeculativeSampling, sampling/"
          "speculative_sampling.py speculative_sampling_v2 (one step)",
          feifeibear_speculative_sampling_v2, _make_feifeibear, "whole_step", True),
    Entry("feifeibear_max_fn_sample", "feifeibear/LLMSpeculativeSampling, sampling/utils.py "
          "max_fn + sample", feifeibear_max_fn_sample, _make_ff_rows, "residual", True),
]

BY_NAME = {e.name: e for e in ENTRIES}
assert len(BY_NAME) == len(ENTRIES)