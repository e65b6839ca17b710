"""SpeculativeConfig: every rule of docs/engine.md ("speculative_config: keys and rules"), round
trips, and the vLLM Ascend guide's examples."""
import json

import pytest

from npuspec import SpeculativeConfig
from npuspec.config import merge_additional_config, resolve_synthetic_length

EAGLE = {"method": "eagle", "model": "d", "num_speculative_tokens": 3}
SYN = {**EAGLE, "rejection_sample_method": "synthetic"}
EHS_OK = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
          "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [2, 18, 34]}}}
TABLE = "num_speculative_tokens_per_batch_size"

# (config, substring the message must contain: the offending key) — one row per broken rule.
INVALID = [
    ({}, "method"),
    ({"num_speculative_tokens": 3}, "method"),
    ({"method": "ngramm", "num_speculative_tokens": 3}, "ngram"),  # nearest name suggested
    ({"method": "lookahead", "num_speculative_tokens": 3}, "method"),
    ({"method": 3, "num_speculative_tokens": 3}, "method"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "eagle", "model": "d"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": -2}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2.5}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": "3"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 3, "num_speculative_token": 3}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 3, "promt_lookup_max": 3}, "prompt_lookup_max"),
    ({"method": "eagle", "num_speculative_tokens": 3}, "model"),
    ({"method": "eagle3", "num_speculative_tokens": 3, "model": ""}, "model"),
    ({"method": "dflash", "num_speculative_tokens": 3}, "model"),
    ({"method": "dspark", "num_speculative_tokens": 3}, "model"),
    ({"method": "medusa", "num_speculative_tokens": 3}, "model"),
    ({"method": "draft_model", "num_speculative_tokens": 3}, "model"),
    ({**EAGLE, "draft_tensor_parallel_size": 2}, "draft_tensor_parallel_size"),
    ({**EAGLE, "draft_tensor_parallel_size": 0}, "draft_tensor_parallel_size"),
    ({"method": "ngram", "num_speculative_tokens": 3, "disable_padded_drafter_batch": True},
     "disable_padded_drafter_batch"),
    ({"method": "suffix", "disable_padded_drafter_batch": True}, "disable_padded_drafter_batch"),
    ({**EAGLE, "disable_padded_drafter_batch": "yes"}, "disable_padded_drafter_batch"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 0}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 5, "prompt_lookup_max": 3},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 0}, "prompt_lookup_max"),
    ({**EAGLE, "prompt_lookup_max": 3}, "prompt_lookup_max"),
    ({"method": "suffix", "suffix_decoding_max_tree_depth": 0}, "suffix_decoding_max_tree_depth"),
    ({"method": "suffix", "suffix_decoding_min_token_prob": 1.5}, "suffix_decoding_min_token_prob"),
    ({"method": "suffix", "suffix_decoding_min_token_prob": -0.1}, "suffix_decoding_min_token_prob"),
    ({"method": "suffix", "suffix_decoding_max_spec_factor": 0}, "suffix_decoding_max_spec_factor"),
    ({"method": "suffix", "suffix_decoding_max_cached_requests": -1},
     "suffix_decoding_max_cached_requests"),
    ({"method": "ngram", "num_speculative_tokens": 3, "suffix_decoding_max_tree_depth": 8},
     "suffix_decoding_max_tree_depth"),
    ({"method": "extract_hidden_states", "num_speculative_tokens": 2,
      "draft_model_config": EHS_OK["draft_model_config"]}, "num_speculative_tokens"),
    ({"method": "extract_hidden_states", "num_speculative_tokens": 1},
     "eagle_aux_hidden_state_layer_ids"),
    ({"method": "extract_hidden_states", "num_speculative_tokens": 1,
      "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": []}}},
     "eagle_aux_hidden_state_layer_ids"),
    ({**EAGLE, "draft_model_config": "x"}, "draft_model_config"),
    ({**EAGLE, TABLE: []}, TABLE),
    ({**EAGLE, TABLE: [[1, 4]]}, TABLE),
    ({**EAGLE, TABLE: [[0, 4, 2]]}, TABLE),
    ({**EAGLE, TABLE: [[5, 4, 2]]}, TABLE),
    ({**EAGLE, TABLE: [[1, 4, -1]]}, TABLE),
    ({**EAGLE, TABLE: [[2, 4, 2]]}, TABLE),  # first start must be 1
    ({**EAGLE, TABLE: [[1, 8, 2], [4, 16, 1]]}, TABLE),  # overlap
    ({**EAGLE, TABLE: [[1, 8, 2], [20, 30, 1], [9, 16, 1]]}, TABLE),  # unsorted
    ({**EAGLE, TABLE: [[1, 8.5, 2]]}, TABLE),
    ({"method": "suffix", TABLE: [[1, 8, 2]]}, TABLE),
    ({**EAGLE, "rejection_sample_method": "lossy"}, "rejection_sample_method"),
    (SYN, "rejection_sample_method"),  # synthetic needs rates or length
    ({**SYN, "synthetic_acceptance_rates": [0.9, 0.5, 0.2], "synthetic_acceptance_length": 2.0},
     "rejection_sample_method"),
    ({**SYN, "synthetic_acceptance_rates": [0.9, 0.5]}, "synthetic_acceptance_rates"),
    ({**SYN, "synthetic_acceptance_rates": [0.9, 1.2, 0.1]}, "synthetic_acceptance_rates"),
    ({**SYN, "synthetic_acceptance_rates": [0.5, 0.6, 0.1]}, "synthetic_acceptance_rates"),
    ({**SYN, "synthetic_acceptance_length": 0.5}, "synthetic_acceptance_length"),
    ({**SYN, "synthetic_acceptance_length": 4.5}, "synthetic_acceptance_length"),
    ({**EAGLE, "synthetic_acceptance_length": 2.0}, "synthetic_acceptance_length"),
    ({**SYN, "synthetic_acceptance_length": 2.0,
      "rejection_sampler_config": {"enable_block_verify": True}}, "enable_block_verify"),
    ({**EAGLE, "rejection_sampler_config": {"posterior_threshold": 0.0}}, "posterior_threshold"),
    ({**EAGLE, "rejection_sampler_config": {"posterior_threshold": 1.2}}, "posterior_threshold"),
    ({**EAGLE, "rejection_sampler_config": {"posterior_alpha": -1}}, "posterior_alpha"),
    ({**EAGLE, "rejection_sampler_config": {"enable_blok_verify": True}}, "enable_block_verify"),
    ({**EAGLE, "rejection_sampler_config": {"enable_entropy_verify": 1}}, "enable_entropy_verify"),
    ({**EAGLE, "enforce_eager": "true"}, "enforce_eager"),
    ({"method": "ngram", "num_speculative_tokens": 3, "enable_adaptive_verification": True},
     "enable_adaptive_verification"),
    ({**EAGLE, "dynamic_spec_config": {"method": "dspark"}}, "dynamic_spec_config.method"),
    ({"method": "ngram", "num_speculative_tokens": 3, "dynamic_spec_config": {"method": "ngram"}},
     "dynamic_spec_config.method"),
    ({**EAGLE, "dynamic_spec_config": {"method": "eagle", "method_params": {"budget_threshold": 0}}},
     "budget_threshold"),
    ({**EAGLE, "dynamic_spec_config": {"method": "eagle", "method_params": {"min_verify_tokens": 4}}},
     "min_verify_tokens"),
    ({**EAGLE, "dynamic_spec_config": {"method": "eagle",
                                        "method_params": {"budget_update_interval": 0}}},
     "budget_update_interval"),
    ({**EAGLE, "dynamic_spec_config": {"method": "eagle",
                                        "method_params": {"initial_budget": 2}}},
     "initial_verify_budget_per_req"),
]


def test_at_least_forty_invalid_configs():
    assert len(INVALID) >= 40, len(INVALID)


@pytest.mark.parametrize("cfg,key", INVALID, ids=[f"{i}-{k}" for i, (_, k) in enumerate(INVALID)])
def test_invalid_config_names_the_key(cfg, key):
    with pytest.raises(ValueError) as e:
        SpeculativeConfig.from_dict(cfg, device="cpu")
    assert key in str(e.value), str(e.value)


def test_npu_limit_is_k_plus_one_at_most_16():
    SpeculativeConfig.from_dict({**EAGLE, "num_speculative_tokens": 15}, device="npu")
    with pytest.raises(ValueError, match="num_speculative_tokens=16.*16 query tokens"):
        SpeculativeConfig.from_dict({**EAGLE, "num_speculative_tokens": 16}, device="npu")
    # suffix's default K (24) is too deep for the NPU operator; the error says so.
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig.from_dict({"method": "suffix"}, device="npu")
    SpeculativeConfig.from_dict({**EAGLE, "num_speculative_tokens": 40}, device="cuda")


def test_draft_tp_may_equal_target_tp():
    c = SpeculativeConfig.from_dict({**EAGLE, "draft_tensor_parallel_size": 4},
                                    tensor_parallel_size=4, device="cpu")
    assert c.draft_tensor_parallel_size == 4


def test_defaults():
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4}, device="cpu")
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4,
                                     "prompt_lookup_max": 3}, device="cpu")
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (3, 3)
    s = SpeculativeConfig.from_dict({"method": "suffix"}, device="cpu")
    assert s.num_speculative_tokens == 24 and s.suffix_decoding_max_tree_depth == 24
    assert s.suffix_decoding_max_cached_requests == 10000
    s = SpeculativeConfig.from_dict({"method": "suffix", "suffix_decoding_max_tree_depth": 8},
                                    device="cpu")
    assert s.num_speculative_tokens == 8
    m = SpeculativeConfig.from_dict({"method": "mtp"}, device="cpu")
    assert m.num_speculative_tokens == 1
    m = SpeculativeConfig.from_dict({"method": "mtp", "draft_model_config":
                                     {"hf_config": {"num_nextn_predict_layers": 3}}}, device="cpu")
    assert m.num_speculative_tokens == 3
    # model is resolved automatically for mtp/ngram/suffix: a given one is ignored.
    m = SpeculativeConfig.from_dict({"method": "mtp", "model": "x", "num_speculative_tokens": 2},
                                    device="cpu")
    assert m.model is None
    r = c.rejection_sampler_config
    assert (r.enable_block_verify, r.enable_entropy_verify, r.posterior_threshold,
            r.posterior_alpha) == (False, False, 0.95, 0.4)
    assert r.entropy_verify is None
    assert c.rejection_sample_method == "standard" and c.synthetic_rates() is None


GUIDE_JSON = [
    '{"method": "eagle3", "model": "path/to/draft/model", "num_speculative_tokens": 3}',
    '{"method": "eagle", "model": "yuhuili/EAGLE-LLaMA3.1-Instruct-8B", '
    '"draft_tensor_parallel_size": 1, "num_speculative_tokens": 2}',
    '{"num_speculative_tokens": 2, "method":"mtp", "disable_padded_drafter_batch": false}',
    '{"method": "dflash", "model": "z-lab/Qwen3-8B-DFlash-b16", "num_speculative_tokens": 7}',
    '{"method": "dspark", "model": "deepseek-ai/dspark_qwen3_8b_block7", '
    '"num_speculative_tokens": 7, "enforce_eager": true}',
    '{\n    "method": "dspark",\n    "model": "deepseek-ai/dspark_qwen3_8b_block7",\n'
    '    "num_speculative_tokens": 7,\n    "enable_adaptive_verification": true\n  }',
    '{"method": "suffix", "num_speculative_tokens": 15}',
    '{"method": "extract_hidden_states", "num_speculative_tokens": 1, "draft_model_config": '
    '{"hf_config": {"eagle_aux_hidden_state_layer_ids": [2, 18, 34]}}}',
    '{\n    "method": "eagle",\n    "model": "yuhuili/EAGLE-LLaMA3.1-Instruct-8B",\n'
    '    "num_speculative_tokens": 3,\n    "num_speculative_tokens_per_batch_size": [\n'
    '      [1, 64, 3],\n      [65, 128, 1],\n      [129, 512, 0]\n    ]\n  }',
    '{"method":"mtp","num_speculative_tokens":3,"num_speculative_tokens_per_batch_size":'
    '[[1,8,3],[9,32,0]]}',
    '{\n    "method": "eagle3",\n    "model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B",\n'
    '    "num_speculative_tokens": 3,\n    "num_speculative_tokens_per_batch_size": [\n'
    '      [1, 16, 5],\n      [17, 32, 4],\n      [33, 64, 3],\n      [65, 128, 1],\n'
    '      [129, 512, 0]\n    ]\n  }',
    '{"method": "eagle3", "model": "path/to/draft/model", \\\n    "num_speculative_tokens": 3, '
    '"rejection_sample_method": "synthetic", \\\n    "synthetic_acceptance_rates": [0.9, 0.6, 0.3]}'
    .replace("\\\n", "\n"),  # the shell line continuations of the guide, as the shell passes them
    '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}',
]


@pytest.mark.parametrize("s", GUIDE_JSON)
def test_guide_examples_parse_and_round_trip(s):
    c = SpeculativeConfig.from_json(s, device="cpu")
    assert SpeculativeConfig.from_dict(c.to_dict(), device="cpu") == c
    assert SpeculativeConfig.from_json(c.to_json(), device="cpu") == c
    assert json.loads(c.to_json()) == c.to_dict()


def test_guide_additional_config_examples():
    rs = json.loads('{"rejection_sampler_config": {"enable_block_verify": true, '
                    '"enable_entropy_verify": true, "posterior_threshold": 0.95, '
                    '"posterior_alpha": 0.4}}')
    c = SpeculativeConfig.from_dict(merge_additional_config(EAGLE, rs), device="cpu")
    assert c.rejection_sampler_config.enable_block_verify
    assert c.rejection_sampler_config.entropy_verify == (0.95, 0.4)
    dyn = {"dynamic_spec_config": {"method": "dspark", "method_params": {
        "initial_verify_budget_per_req": 5, "budget_update_interval": 50, "budget_threshold": 0.7}}}
    spec = {"method": "dspark", "model": "deepseek-ai/dspark_qwen3_8b_block7",
            "num_speculative_tokens": 7}
    c = SpeculativeConfig.from_dict(merge_additional_config(spec, dyn), device="cpu")
    d = c.dynamic_spec_config
    assert (d.initial_verify_budget_per_req, d.budget_update_interval, d.budget_threshold,
            d.min_verify_tokens) == (5, 50, 0.7, 1)
    assert SpeculativeConfig.from_dict(c.to_dict(), device="cpu") == c
    with pytest.raises(ValueError, match="rejection_sampler_confg"):
        merge_additional_config(EAGLE, {"rejection_sampler_confg": {}})


def test_round_trip_of_every_field():
    full = {**EAGLE, "draft_tensor_parallel_size": 1, "disable_padded_drafter_batch": True,
            TABLE: [[1, 4, 3], [9, 16, 1]], "enforce_eager": False,
            "draft_model_config": {"hf_config": {"x": [1, 2]}},
            "rejection_sampler_config": {"enable_block_verify": True, "posterior_alpha": 0.0},
            "dynamic_spec_config": {"method": "eagle", "method_params": {"min_verify_tokens": 2}}}
    c = SpeculativeConfig.from_dict(full, device="cpu")
    d = c.to_dict()
    assert SpeculativeConfig.from_dict(d, device="cpu") == c
    assert SpeculativeConfig.from_dict(d, device="cpu").to_dict() == d
    d["draft_model_config"]["hf_config"]["x"].append(3)  # to_dict hands out copies
    assert c.draft_model_config == {"hf_config": {"x": [1, 2]}}


def test_batch_size_table_semantics():
    c = SpeculativeConfig.from_dict({**EAGLE, TABLE: [[1, 4, 3], [9, 16, 1], [17, 32, 5]]},
                                    device="cpu")
    assert c.k_for_batch_size(0) == 0  # nothing to decode
    assert [c.k_for_batch_size(n) for n in (1, 4)] == [3, 3]
    assert [c.k_for_batch_size(n) for n in (5, 8)] == [3, 3]  # gap inherits the previous range
    assert [c.k_for_batch_size(n) for n in (9, 16)] == [1, 1]
    assert c.k_for_batch_size(17) == 3  # K 5 capped at num_speculative_tokens 3
    assert c.k_for_batch_size(10_000) == 3  # tail inherits the last range
    assert c.k_values() == (1, 3)
    with pytest.raises(ValueError, match="-1"):
        c.k_for_batch_size(-1)
    plain = SpeculativeConfig.from_dict(EAGLE, device="cpu")
    assert [plain.k_for_batch_size(n) for n in (0, 1, 999)] == [0, 3, 3]
    zero = SpeculativeConfig.from_dict({**EAGLE, TABLE: [[1, 8, 3], [9, 32, 0]]}, device="cpu")
    assert zero.k_for_batch_size(100) == 0 and zero.k_values() == (0, 3)


def test_synthetic_length_resolution():
    assert resolve_synthetic_length(3.4, 5) == pytest.approx((1, 1, 0.4, 0, 0))
    assert resolve_synthetic_length(1.0, 3) == (0.0, 0.0, 0.0)
    assert resolve_synthetic_length(4.0, 3) == (1.0, 1.0, 1.0)
    c = SpeculativeConfig.from_dict({**SYN, "num_speculative_tokens": 5,
                                     "synthetic_acceptance_length": 3.4}, device="cpu")
    assert c.synthetic_rates() == pytest.approx((1, 1, 0.4, 0, 0))
    c = SpeculativeConfig.from_dict({**SYN, "synthetic_acceptance_rates": [0.9, 0.6, 0.3]},
                                    device="cpu")
    assert c.synthetic_rates() == (0.9, 0.6, 0.3)


def test_bad_json_says_where():
    with pytest.raises(ValueError, match="not valid JSON.*line 1"):
        SpeculativeConfig.from_json('{"method": "ngram",}')
    with pytest.raises(ValueError, match="must be an object"):
        SpeculativeConfig.from_json('[1, 2]')


def test_config_is_frozen():
    c = SpeculativeConfig.from_dict(EAGLE, device="cpu")
    with pytest.raises(Exception):
        c.num_speculative_tokens = 5
