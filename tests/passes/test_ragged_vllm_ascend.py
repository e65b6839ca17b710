"""The op's ragged mode (kernels/verify_ragged.py) gives exactly what our transcription of
vllm-ascend's PyTorch rejection sampler gives (field_vllm.py: the random path, its n-gram
variant and its block verify), on the same draws: the same tokens for every request, greedy
rows included, with placeholder drafts, and with vllm-ascend's own draws (float64 uniforms
per flat token, one Exp(1) vector per request) made in its order.
"""
from __future__ import annotations

import pytest
import torch
from field_vllm import (_make_ascend, _make_ascend_ngram, vllm_ascend_block_verify,
                        vllm_ascend_ngram, vllm_ascend_random)

from npuspec.kernels import rejection_sample

STEPS = {"random": (vllm_ascend_random, _make_ascend, "prefix"),
         "ngram": (vllm_ascend_ngram, _make_ascend_ngram, "prefix"),
         "block_verify": (vllm_ascend_block_verify, _make_ascend, "cumulative")}


def _variant(args, seed, ngram):
    """The entry's inputs, with some requests greedy and a placeholder draft in some seeds."""
    args = list(args)
    greedy_at, ids_at = (4, 1) if ngram else (5, 1)
    if seed % 3 == 1:
        g = torch.Generator().manual_seed(seed)
        args[greedy_at] = torch.rand(args[greedy_at].shape[0], generator=g) < 0.4
    if seed % 4 == 2:
        ids = args[ids_at].clone()
        ids[seed % ids.shape[0]] = -1
        args[ids_at] = ids
    return args


@pytest.mark.parametrize("name", list(STEPS))
def test_ragged_mode_is_vllm_ascend(name):
    step, make, rule = STEPS[name]
    ngram = name == "ngram"
    for seed in range(24):
        args = _variant(make(seed), seed, ngram)
        if ngram:
            cu, ids, logits, bonus, greedy, M = args
            q = None
        else:
            cu, ids, q, logits, bonus, greedy, M = args
        torch.manual_seed(seed)
        want = step(*args)
        torch.manual_seed(seed)
        p = logits.softmax(dim=-1, dtype=torch.float32)
        u = torch.rand((p.shape[0],), dtype=torch.float64)
        e = torch.empty((cu.shape[0], p.shape[1])).exponential_()
        got, num = rejection_sample(
            p, ids, q, target_is_probs=True, uniforms=u, exponentials=e, bonus_token_ids=bonus,
            cu_num_draft_tokens=cu, max_spec_len=M, is_greedy=greedy, accept_rule=rule,
            residual_guard="zero_inf", residual_fill=-1e10,
            residual_nonneg="none" if ngram else "clamp")
        assert torch.equal(got, want), (name, seed, got, want)
        if rule == "prefix":  # no placeholder is ever accepted: every written slot is a token
            assert torch.equal(num.long(), (want != -1).sum(1)), (num, want)
