"""Held-out corpus B: speculative-decoding verify steps transcribed from public codebases.

Each entry keeps the spelling of its original (ops, order, .item()/.tolist() calls, Python
loops, in-place ops, dtype casts) and only adapts what is needed to turn it into a pure,
batched tensor function: model calls, KV-cache and class state are dropped; code written for
batch 1 is batched the way its authors batched their own code (a Python loop over requests,
as EAGLE's modeling_eagle.py and Medusa's callers do), keeping each row's spelling untouched.

Sources (snapshots read with the search/fetch tools):
  pytorch-labs/gpt-fast            32971d3129541c5bfb4f715abc33d1c5f408d204 (2024-09-15)
  lucidrains/speculative-decoding  72171ac91cd040ad6b67c186ac985e4f50a0c269 (2024-12-22)
  FasterDecoding/Medusa            e2a5d20c048a9b0a4092e6933c34313687422518 (2024-04-18)
  SafeAILab/EAGLE                  cb7e0841fe0c206c6ed74a197ad5e2a1f13f5a2b (2026-02-19)
  hao-ai-lab/LookaheadDecoding     eed010da9c7b1867912675d480feec5629e0c2d0 (2025-03-05)
  huggingface/transformers         generation/utils.py @ 000034a44ef887621d9b36001a5eb7c46e64cb3f (2025,
                                   has _prefill / prefill_chunk_size), and the transformers 5.24.0
                                   wheel installed in the venv (2026, assistant_ensemble_weight / DIVERSE).
"""
import math
import random

import torch
import torch.nn.functional as F
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)

B, K, V = 3, 4, 32


# ----------------------------------------------------------------------------------------------
# input builders
# ----------------------------------------------------------------------------------------------

def _gen(seed):
    g = torch.Generator().manual_seed(seed)
    return g


def _pair_logits(g, b=B, k=K, v=V, scale=2.0, mix=0.7, noise=0.8):
    """target logits [b, k+1, v] and correlated draft logits [b, k, v]."""
    tgt = torch.randn(b, k + 1, v, generator=g) * scale
    drf = mix * tgt[:, :k] + noise * torch.randn(b, k, v, generator=g)
    return tgt, drf


def _sample_rows(g, probs):
    """sample one id per row of probs[..., v] with the generator -> [...]."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=g).view(probs.shape[:-1])


def _greedy_drafts(tgt_logits, k, cuts):
    """drafts = target argmax for positions < cut, then a wrong token at the cut."""
    am = tgt_logits[:, :k].argmax(dim=-1)
    drafts = am.clone()
    for row, cut in enumerate(cuts):
        if cut < k:
            drafts[row, cut] = (am[row, cut] + 1 + row) % tgt_logits.shape[-1]
            drafts[row, cut + 1:] = (am[row, cut + 1:] + 3) % tgt_logits.shape[-1]
    return drafts


# ==============================================================================================
# 1-2. gpt-fast  generate.py  speculative_decode (verify tail), batch-1 code looped over requests
# ==============================================================================================

def _gptfast_multinomial_sample_one_no_sync(probs_sort):
    q = torch.empty_like(probs_sort).exponential_(1)
    return torch.argmax(probs_sort / q, dim=-1, keepdim=True).to(dtype=torch.int)


def _gptfast_logits_to_probs(logits, temperature=1.0, top_k=None):
    logits = logits / max(temperature, 1e-5)
    if top_k is not None:
        v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
        pivot = v.select(-1, -1).unsqueeze(-1)
        logits = torch.where(logits < pivot, -float("Inf"), logits)
    probs = torch.nn.functional.softmax(logits, dim=-1)
    return probs


def _gptfast_verify_one(draft_tokens, draft_probs, target_probs, speculate_k):
    # draft_tokens [k] int32, draft_probs [k, V], target_probs [k+1, V]
    device = draft_tokens.device
    p = draft_probs[torch.arange(0, speculate_k, device=device), draft_tokens]
    q = target_probs[torch.arange(0, speculate_k, device=device), draft_tokens]
    accept_draft_prob = torch.minimum(torch.ones(()), q[:speculate_k] / p)
    rejected_locations = (torch.rand_like(accept_draft_prob) > accept_draft_prob).nonzero()

    if rejected_locations.shape[0] == 0:  # every draft accepted
        last_token = _gptfast_multinomial_sample_one_no_sync(target_probs[-1])
        return torch.cat([draft_tokens, last_token])
    else:
        accept_length = rejected_locations[0].item()
        p = draft_probs[accept_length]
        q = target_probs[accept_length]
        new = q - p
        new = torch.where(new > 0, new, 0.0)
        new = new / new.sum()
        next_token = _gptfast_multinomial_sample_one_no_sync(new)
        return torch.cat([draft_tokens[:accept_length], next_token])


def gptfast_speculative_decode_probs(draft_tokens, draft_probs, target_probs):
    speculate_k = draft_tokens.shape[1]
    outs = []
    for b in range(draft_tokens.shape[0]):
        outs.append(_gptfast_verify_one(draft_tokens[b], draft_probs[b], target_probs[b], speculate_k))
    return outs


def _make_gptfast_probs(seed):
    g = _gen(seed)
    tgt, drf = _pair_logits(g)
    draft_probs = torch.softmax(drf, dim=-1)
    target_probs = torch.softmax(tgt, dim=-1)
    draft_tokens = _sample_rows(g, draft_probs).to(torch.int)
    # row 0: first draft token has ~no target mass (rejected at 0); last row: target == draft
    target_probs[0, 0, draft_tokens[0, 0]] = 1e-6
    target_probs[-1, :K] = draft_probs[-1]
    return draft_tokens, draft_probs, target_probs


def gptfast_speculative_decode_topk_k1(draft_tokens, draft_logits, target_logits):
    # draft probs come from sample() -> logits_to_probs(logits[:, -1]) per draft step, target probs
    # from logits_to_probs(target_logits[0]) with the same sampling kwargs (temperature, top_k).
    temperature, top_k = 0.8, 8
    speculate_k = draft_tokens.shape[1]
    outs = []
    for b in range(draft_tokens.shape[0]):
        draft_probs = [_gptfast_logits_to_probs(draft_logits[b:b + 1, i], temperature, top_k)
                       for i in range(speculate_k)]
        draft_probs = torch.stack(draft_probs)[:, 0]
        target_probs = _gptfast_logits_to_probs(target_logits[b], temperature, top_k)
        outs.append(_gptfast_verify_one(draft_tokens[b], draft_probs, target_probs, speculate_k))
    return outs


def _make_gptfast_topk_k1(seed):
    g = _gen(seed)
    b, k = 4, 1
    tgt, drf = _pair_logits(g, b=b, k=k, v=29, scale=1.5, mix=0.9, noise=0.4)
    dp = _gptfast_logits_to_probs(drf, 0.8, 8)
    draft_tokens = _sample_rows(g, dp).to(torch.int)
    return draft_tokens, drf, tgt


# ==============================================================================================
# 3-5. HF transformers generation/utils.py (assisted decoding), batch-1 code looped over requests
# ==============================================================================================

def _hf_speculative_sampling_2025(candidate_input_ids, candidate_logits, candidate_length, new_logits,
                                  is_done_candidate):
    new_candidate_input_ids = candidate_input_ids[:, -candidate_length:]
    q = candidate_logits.softmax(dim=-1)
    q_i = q[:, torch.arange(candidate_length), new_candidate_input_ids].squeeze(0, 1)
    p = new_logits.softmax(dim=-1)
    p_i = p[:, torch.arange(candidate_length), new_candidate_input_ids].squeeze(0, 1)
    probability_ratio = p_i / q_i

    r_i = torch.rand_like(probability_ratio)
    is_accepted = r_i <= probability_ratio
    n_matches = ((~is_accepted).cumsum(dim=-1) < 1).sum()

    if is_done_candidate and n_matches == candidate_length:
        n_matches -= 1
        valid_tokens = new_candidate_input_ids[:, : n_matches + 1]
    else:
        gamma = candidate_logits.shape[1]
        p_n_plus_1 = p[:, n_matches, :]
        if n_matches < gamma:
            q_n_plus_1 = q[:, n_matches, :]
            p_prime = torch.clamp((p_n_plus_1 - q_n_plus_1), min=0)
            p_prime.div_(p_prime.sum())
        else:
            p_prime = p_n_plus_1
        t = torch.multinomial(p_prime, num_samples=1).squeeze(1)[None, :]
        if n_matches > 0:
            valid_tokens = torch.cat((new_candidate_input_ids[:, :n_matches], t), dim=-1)
        else:
            valid_tokens = t
    return valid_tokens, n_matches


def hf_speculative_sampling_2025(candidate_input_ids, candidate_logits, new_logits, is_done_candidate):
    candidate_length = candidate_logits.shape[1]
    outs = []
    for b in range(candidate_input_ids.shape[0]):
        outs.append(_hf_speculative_sampling_2025(
            candidate_input_ids[b:b + 1], candidate_logits[b:b + 1], candidate_length, new_logits[b:b + 1],
            is_done_candidate[b:b + 1]))
    return outs


def _make_hf_sampling(seed):
    g = _gen(seed)
    b = 4
    tgt, drf = _pair_logits(g, b=b, scale=1.5, mix=0.9, noise=0.3)
    tgt[2:, :K] = drf[2:]                 # rows 2, 3: target == draft, every draft accepted
    prompt = torch.randint(0, V, (b, 5), generator=g)
    drafts = _sample_rows(g, torch.softmax(drf, -1))
    candidate_input_ids = torch.cat([prompt, drafts], dim=-1)
    is_done = torch.tensor([False, True, False, True])
    return candidate_input_ids, drf, tgt, is_done


def _hf_assisted_greedy_2025(candidate_input_ids, cur_len, new_logits, is_done_candidate, candidate_length):
    selected_tokens = new_logits.argmax(dim=-1)
    candidate_new_tokens = candidate_input_ids[:, cur_len:]
    n_matches = ((~(candidate_new_tokens == selected_tokens[:, :-1])).cumsum(dim=-1) < 1).sum()
    if is_done_candidate and n_matches == candidate_length:
        n_matches -= 1
    valid_tokens = selected_tokens[:, : n_matches + 1]
    return valid_tokens, n_matches


def hf_assisted_greedy_2025(candidate_input_ids, new_logits, is_done_candidate):
    candidate_length = new_logits.shape[1] - 1
    cur_len = candidate_input_ids.shape[1] - candidate_length
    outs = []
    for b in range(candidate_input_ids.shape[0]):
        outs.append(_hf_assisted_greedy_2025(candidate_input_ids[b:b + 1], cur_len, new_logits[b:b + 1],
                                             is_done_candidate[b:b + 1], candidate_length))
    return outs


def _make_hf_greedy(seed):
    g = _gen(seed)
    b = 4
    tgt, _ = _pair_logits(g, b=b)
    prompt = torch.randint(0, V, (b, 6), generator=g)
    drafts = _greedy_drafts(tgt, K, cuts=[0, 2, K, K])
    candidate_input_ids = torch.cat([prompt, drafts], dim=-1)
    is_done = torch.tensor([False, False, False, True])
    return candidate_input_ids, tgt, is_done


# transformers 5.24.0 (installed wheel): _speculative_sampling with assistant_ensemble_weight (DIVERSE)
def _hf_speculative_sampling_5_24(candidate_input_ids, candidate_logits, candidate_length, new_logits,
                                  assistant_ensemble_weight=None):
    new_candidate_input_ids = candidate_input_ids[:, -candidate_length:]
    q = candidate_logits.softmax(dim=-1)
    q_i = q[:, torch.arange(candidate_length), new_candidate_input_ids].squeeze(0, 1)
    p = new_logits.softmax(dim=-1)
    p_i = p[:, torch.arange(candidate_length), new_candidate_input_ids].squeeze(0, 1)

    if assistant_ensemble_weight is not None:
        probability_ratio = 1.0 - assistant_ensemble_weight + assistant_ensemble_weight * (p_i / q_i)
    else:
        probability_ratio = p_i / q_i

    r_i = torch.rand_like(probability_ratio)
    is_accepted = r_i <= probability_ratio
    n_matches = ((~is_accepted).cumsum(dim=-1) < 1).sum()

    gamma = candidate_logits.shape[1]
    p_n_plus_1 = p[:, n_matches, :]
    if n_matches < gamma:
        q_n_plus_1 = q[:, n_matches, :]
        p_prime = torch.clamp((p_n_plus_1 - q_n_plus_1), min=0)
        p_prime_sum = p_prime.sum()
        if assistant_ensemble_weight is not None and p_prime_sum <= torch.finfo(p_prime.dtype).tiny:
            p_prime = p_n_plus_1
        else:
            p_prime.div_(p_prime_sum)
    else:
        p_prime = p_n_plus_1
    t = torch.multinomial(p_prime, num_samples=1).squeeze(1)[None, :]

    if n_matches > 0:
        valid_tokens = torch.cat((new_candidate_input_ids[:, :n_matches], t), dim=-1)
    else:
        valid_tokens = t
    return valid_tokens, n_matches


def hf_speculative_sampling_5_24_ensemble(candidate_input_ids, candidate_logits, new_logits):
    candidate_length = candidate_logits.shape[1]
    outs = []
    for b in range(candidate_input_ids.shape[0]):
        outs.append(_hf_speculative_sampling_5_24(
            candidate_input_ids[b:b + 1], candidate_logits[b:b + 1], candidate_length, new_logits[b:b + 1],
            assistant_ensemble_weight=0.6))
    return outs


def _make_hf_sampling_524(seed):
    g = _gen(seed)
    tgt, drf = _pair_logits(g, v=29, scale=2.5, mix=0.8, noise=0.9)
    tgt[2, :K] = drf[2]
    prompt = torch.randint(0, 29, (B, 4), generator=g)
    drafts = _sample_rows(g, torch.softmax(drf, -1))
    return torch.cat([prompt, drafts], dim=-1), drf, tgt


# transformers 5.24.0: greedy branch with ensemble argmax + token-budget / EOS crop
def _hf_assisted_greedy_5_24(candidate_input_ids, candidate_logits, new_logits, cur_len, candidate_length,
                             assistant_ensemble_weight, max_length, eos_token_id):
    if assistant_ensemble_weight is not None and candidate_logits is not None:
        p_probs = new_logits[:, :candidate_length, :].softmax(dim=-1)
        q_probs = candidate_logits.softmax(dim=-1)
        nu_probs = assistant_ensemble_weight * p_probs + (1.0 - assistant_ensemble_weight) * q_probs
        bonus_logits = new_logits[:, candidate_length:, :]
        selected_tokens = torch.cat([nu_probs.argmax(dim=-1), bonus_logits.argmax(dim=-1)], dim=-1)
    else:
        selected_tokens = new_logits.argmax(dim=-1)

    candidate_new_tokens = candidate_input_ids[:, cur_len:]
    n_matches = ((~(candidate_new_tokens == selected_tokens[:, :-1])).cumsum(dim=-1) < 1).sum()
    valid_tokens = selected_tokens[:, : n_matches + 1]

    tokens_budget = max_length - cur_len
    if valid_tokens.shape[1] > tokens_budget:
        valid_tokens = valid_tokens[:, :tokens_budget]
    if eos_token_id is not None:
        eos_positions = torch.isin(valid_tokens.squeeze(0), eos_token_id.to(valid_tokens.device)).nonzero()
        if eos_positions.numel() > 0:
            num_drafted = eos_positions[0].item() + 1
            valid_tokens = valid_tokens[:, :num_drafted]
    n_matches = valid_tokens.shape[1] - 1
    return valid_tokens, n_matches


def hf_assisted_greedy_5_24_ensemble_eos(candidate_input_ids, candidate_logits, new_logits, eos_token_id):
    candidate_length = candidate_logits.shape[1]
    cur_len = candidate_input_ids.shape[1] - candidate_length
    outs = []
    for b in range(candidate_input_ids.shape[0]):
        outs.append(_hf_assisted_greedy_5_24(candidate_input_ids[b:b + 1], candidate_logits[b:b + 1],
                                             new_logits[b:b + 1], cur_len, candidate_length, 0.8,
                                             cur_len + candidate_length + 1, eos_token_id))
    return outs


def _make_hf_greedy_524(seed):
    g = _gen(seed)
    b = 4
    tgt, drf = _pair_logits(g, b=b, scale=2.0, mix=1.0, noise=0.2)
    prompt = torch.randint(0, V, (b, 3), generator=g)
    drafts = _greedy_drafts(tgt, K, cuts=[0, 3, K, K])
    eos = tgt[3, 1].argmax().reshape(1)  # row 3 hits EOS at position 1
    return torch.cat([prompt, drafts], dim=-1), drf, tgt, eos


# ==============================================================================================
# 6-8. lucidrains/speculative-decoding  speculative_decoding.py (batched natively)
# ==============================================================================================

def _lr_log(t, eps=1e-20):
    return torch.log(t.clamp(min=eps))


def _lr_top_k(logits, thres=0.9):
    k = math.ceil((1 - thres) * logits.shape[-1])
    val, ind = torch.topk(logits, k)
    probs = torch.full_like(logits, float('-inf'))
    probs.scatter_(-1, ind, val)
    return probs


def _lr_safe_div(num, den, eps=1e-10):
    return num / max(den, eps)


def _lr_find_first_true_index(bool_tensor, dim=-1):
    return (bool_tensor.cumsum(dim=dim) == 0).sum(dim=dim)


def lucidrains_speculative_decoding_step(logits, small_logits, q_sampled_out):
    # speculative_decoding(): verify with larger network ... sample the additional token.
    # einops.rearrange calls are spelled with the equivalent view ops (einops is not installed).
    temperature, filter_thres, lenience = 1., 0.8, 1.
    batch, device = logits.shape[0], logits.device
    gamma = small_logits.shape[-2]
    batch_range = torch.arange(batch, device=device, dtype=torch.long)[..., None]

    logits = logits[..., -(gamma + 1):, :]
    logits = _lr_top_k(logits, thres=filter_thres)

    prob = _lr_safe_div(logits, temperature).softmax(dim=-1)
    small_prob = _lr_safe_div(small_logits, temperature).softmax(dim=-1)

    p, prob_next = prob[:, :-1], prob[:, -1]

    p = p.gather(-1, q_sampled_out)
    q = small_prob.gather(-1, q_sampled_out) * lenience

    p, q = [t.reshape(t.shape[0], t.shape[1]) for t in (p, q)]  # 'b n 1 -> b n'

    r = random_uniform = torch.zeros_like(q).float().uniform_(0, 1)

    accepted = _lr_find_first_true_index(r > (p / q))

    num_rejected = gamma - accepted
    has_rejected = num_rejected > 0

    accepted = accepted.reshape(-1, 1)  # 'b -> b 1'
    accepted.clamp_(max=gamma - 1)
    adjusted_prob = F.relu(prob[batch_range, accepted] - small_prob[batch_range, accepted])
    adjusted_prob = adjusted_prob / adjusted_prob.sum(dim=-1, keepdim=True)
    adjusted_prob = adjusted_prob.reshape(adjusted_prob.shape[0], -1)  # 'b 1 d -> b d'

    prob_next = torch.where(
        has_rejected[..., None],
        adjusted_prob,
        prob_next
    )

    next_token = torch.multinomial(prob_next, 1)
    return num_rejected, accepted, prob_next, next_token


def _make_lucidrains(seed, thres=0.8, b=B, k=K, v=V, prefix=0):
    g = _gen(seed)
    tgt, drf = _pair_logits(g, b=b, k=k, v=v, scale=2.5, mix=1.0, noise=0.5)
    if prefix:
        tgt = torch.cat([torch.randn(b, prefix, v, generator=g), tgt], dim=1)
    # small logits were top-k filtered per draft step before being stacked
    small_logits = torch.stack([_lr_top_k(drf[:, i], thres=thres) for i in range(k)], dim=-2)
    q_sampled_out = _sample_rows(g, small_logits.softmax(-1))[..., None]
    return tgt, small_logits, q_sampled_out


# speculative_decoding_with_prophet.py: acceptance only (p/q ratio test with lenience, temperature)
def lucidrains_prophet_accept(logits, small_logits, q_sampled_out):
    temperature, filter_thres, lenience = 0.7, 0.8, 1.3
    gamma = small_logits.shape[-2]
    logits = logits[..., -(gamma + 1):, :]
    logits = _lr_top_k(logits, thres=filter_thres)

    prob = _lr_safe_div(logits, temperature).softmax(dim=-1)
    small_prob = _lr_safe_div(small_logits, temperature).softmax(dim=-1)

    p, prob_next = prob[:, :-1], prob[:, -1]

    p = p.gather(-1, q_sampled_out)
    q = small_prob.gather(-1, q_sampled_out) * lenience

    p, q = [t.reshape(t.shape[0], t.shape[1]) for t in (p, q)]

    r = random_uniform = torch.zeros_like(q).float().uniform_(0, 1)

    accepted = _lr_find_first_true_index(r > (p / q))

    total_accepted = accepted.float().mean()
    num_rejected = gamma - accepted
    has_rejected = num_rejected > 0
    return accepted, total_accepted, num_rejected, has_rejected


# speculative_decoding_with_same_model(): the adjusted (residual) distribution + bonus token,
# given the accepted counts (taken as input).
def lucidrains_same_model_residual(prob, small_prob, accepted):
    batch, device = prob.shape[0], prob.device
    gamma = small_prob.shape[-2]
    batch_range = torch.arange(batch, device=device, dtype=torch.long)[..., None]
    prob_next = prob[:, -1]

    num_rejected = gamma - accepted
    has_rejected = num_rejected > 0

    accepted = accepted.reshape(-1, 1)
    accepted.clamp_(max=gamma - 1)

    adjusted_prob = F.relu(prob[batch_range, accepted] - small_prob[batch_range, accepted])
    adjusted_prob = adjusted_prob / adjusted_prob.sum(dim=-1, keepdim=True)
    adjusted_prob = adjusted_prob.reshape(adjusted_prob.shape[0], -1)

    prob_next = torch.where(
        has_rejected[..., None],
        adjusted_prob,
        prob_next
    )
    next_token = torch.multinomial(prob_next, 1)
    return prob_next, next_token


def _make_lucidrains_residual(seed):
    g = _gen(seed)
    b = 4
    tgt, drf = _pair_logits(g, b=b, k=K)
    prob = _lr_top_k(tgt, thres=0.75).softmax(dim=-1)
    small_prob = _lr_top_k(drf, thres=0.75).softmax(dim=-1)
    accepted = torch.tensor([0, 2, K, 1])
    return prob, small_prob, accepted


# ==============================================================================================
# 9-11. FasterDecoding/Medusa  medusa/model/utils.py + utils_legacy.py  evaluate_posterior
#   logits [C, K+1, V] / candidates [C, K+1] per request (C = tree paths); looped over B requests.
# ==============================================================================================

def _medusa_evaluate_posterior_typical_fast(logits, candidates, temperature, posterior_threshold=0.3,
                                            posterior_alpha=0.09):
    posterior_prob = torch.softmax(logits[:, :-1] / temperature, dim=-1)
    candidates_prob = torch.gather(
        posterior_prob, dim=-1, index=candidates[:, 1:].unsqueeze(-1)
    ).squeeze(-1)
    posterior_entropy = -torch.sum(
        posterior_prob * torch.log(posterior_prob + 1e-5), dim=-1
    )
    threshold = torch.minimum(
        torch.ones_like(posterior_entropy) * posterior_threshold,
        torch.exp(-posterior_entropy) * posterior_alpha,
    )
    posterior_mask = candidates_prob > threshold
    candidates_accept_length = (torch.cumprod(posterior_mask, dim=1)).sum(dim=1)

    accept_length = candidates_accept_length.max()
    if accept_length == 0:
        best_candidate = torch.tensor(0, dtype=torch.long, device=candidates.device)
    else:
        best_candidates = torch.where(candidates_accept_length == accept_length)[0]
        likelihood = torch.sum(
            torch.log(candidates_prob[best_candidates, :accept_length]), dim=-1
        )
        best_candidate = best_candidates[torch.argmax(likelihood)]
    return best_candidate, accept_length


def medusa_evaluate_posterior_typical_fast(logits, candidates):
    outs = []
    for b in range(logits.shape[0]):
        outs.append(_medusa_evaluate_posterior_typical_fast(logits[b], candidates[b], 0.7, 0.3, 0.3))
    return outs


def _make_medusa(seed, b=B, c=5, k=K, v=V, scale=3.0):
    g = _gen(seed)
    logits = torch.randn(b, c, k + 1, v, generator=g) * scale
    top2 = logits.topk(2, dim=-1).indices            # [b, c, k+1, 2]
    rnd = torch.randint(0, v, (b, c, k + 1), generator=g)
    pick = torch.randint(0, 3, (b, c, k + 1), generator=g)
    cand = torch.where(pick == 0, top2[..., 0], torch.where(pick == 1, top2[..., 1], rnd))
    # candidates[:, 1:] are compared with logits[:, :-1]: shift by one
    candidates = torch.cat([rnd[..., :1], cand[..., :-1]], dim=-1)
    candidates[..., 0] = candidates[:, :1, 0]      # same root token on every path
    # make path 0 of request 0 fully greedy, path 1 of request 1 greedy up to 2
    am = logits.argmax(-1)
    candidates[0, 0, 1:] = am[0, 0, :-1]
    candidates[1, 1, 1:3] = am[1, 1, :2]
    return logits, candidates


def _medusa_legacy_evaluate_posterior_greedy(logits, candidates):
    posterior_mask = (
        candidates[:, 1:] == torch.argmax(logits[:, :-1], dim=-1)
    ).int()
    candidates_accept_length = (torch.cumprod(posterior_mask, dim=1)).sum(dim=1)
    accept_length = candidates_accept_length.max()
    if accept_length == 0:
        best_candidate = torch.tensor(0, dtype=torch.long, device=candidates.device)
    else:
        best_candidate = torch.argmax(candidates_accept_length).to(torch.long)
    return best_candidate, accept_length


def medusa_legacy_evaluate_posterior_greedy(logits, candidates):
    outs = []
    for b in range(logits.shape[0]):
        outs.append(_medusa_legacy_evaluate_posterior_greedy(logits[b], candidates[b]))
    return outs


def _make_medusa_greedy(seed):
    logits, candidates = _make_medusa(seed, b=4, c=4)
    am = logits.argmax(-1)
    candidates[2, :, 1] = (am[2, :, 0] + 1) % V     # request 2: nothing accepted
    return logits, candidates


def _medusa_get_typical_posterior_mask(logits, candidates, temperature, posterior_threshold, posterior_alpha):
    logits = logits[:, :-1] / temperature
    n_samples, n_tokens = logits.shape[0], logits.shape[1]
    logits = logits.view(n_samples * n_tokens, -1)
    probs = F.softmax(logits, dim=-1)
    entropy = -torch.sum(
        probs * torch.log(probs + 1e-5), dim=-1
    )
    threshold = torch.minimum(
        torch.ones_like(entropy) * posterior_threshold,
        torch.exp(-entropy) * posterior_alpha,
    )
    indices_to_remove = probs < threshold.unsqueeze(-1)
    logits[indices_to_remove] = float('-inf')
    sampled_tokens = torch.multinomial(F.softmax(logits, dim=-1), 1)
    sampled_tokens = sampled_tokens.view(n_samples, n_tokens)
    posterior_mask = (candidates[:, 1:] == sampled_tokens).int()
    return posterior_mask


def _medusa_evaluate_posterior_typical_sampled(logits, candidates, temperature, posterior_threshold,
                                               posterior_alpha):
    # evaluate_posterior(sampling='typical', fast=False); the original passes an extra `fast`
    # argument to get_typical_posterior_mask, which takes five -- called here with the five it takes.
    posterior_mask = _medusa_get_typical_posterior_mask(logits, candidates, temperature, posterior_threshold,
                                                        posterior_alpha)
    candidates_accept_length = (torch.cumprod(posterior_mask, dim=1)).sum(dim=1)
    accept_length = candidates_accept_length.max()
    if accept_length == 0:
        best_candidate = torch.tensor(0, dtype=torch.long, device=candidates.device)
    else:
        best_candidate = torch.argmax(candidates_accept_length).to(torch.long)
    return best_candidate, accept_length


def medusa_evaluate_posterior_typical_sampled(logits, candidates):
    outs = []
    for b in range(logits.shape[0]):
        outs.append(_medusa_evaluate_posterior_typical_sampled(logits[b], candidates[b], 0.5, 0.3, 0.5))
    return outs


# ==============================================================================================
# 12-14. SafeAILab/EAGLE
# ==============================================================================================
# A small static tree shared by the EAGLE entries:
#   node 0 root; layer 1: nodes 1,2,3 (children of 0); layer 2: nodes 4,5 (children of 1), node 6
#   (child of 2); layer 3: node 7 (child of 4).  retrieve paths: [0,1,4,7] [0,1,5,-] [0,2,6,-] [0,3,-,-]
_EAGLE_PARENT = [-1, 0, 0, 0, 1, 1, 2, 4]
_EAGLE_RETRIEVE = [[0, 1, 4, 7], [0, 1, 5, -1], [0, 2, 6, -1], [0, 3, -1, -1]]
_EAGLE_LAYER_PARENTS = [[0], [1, 2], [4]]          # nodes that have children, per layer (op rows)


def _make_eagle_tree(seed, b=B, v=V, scale=2.5, greedy_row0=False):
    g = _gen(seed)
    n = len(_EAGLE_PARENT)
    node_logits = torch.randn(b, n, v, generator=g) * scale          # target logits at each node
    draft_logits = 0.8 * node_logits + 0.6 * torch.randn(b, n, v, generator=g)
    draft_probs = torch.softmax(draft_logits, dim=-1)
    tokens = torch.zeros(b, n, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, v, (b,), generator=g)
    cprob = torch.ones(b, n)                                          # draft prob (w/o replacement)
    for parent in range(n):
        kids = [c for c in range(n) if _EAGLE_PARENT[c] == parent]
        if not kids:
            continue
        for row in range(b):
            q = draft_probs[row, parent].clone()
            picks = torch.multinomial(q, len(kids), replacement=False, generator=g)
            for kid, tok in zip(kids, picks.tolist()):
                qn = q / q.sum()
                cprob[row, kid] = qn[tok]
                tokens[row, kid] = tok
                q[tok] = 0
    ri = torch.tensor(_EAGLE_RETRIEVE)
    tree_candidates = tokens
    tree_candidates_ext = torch.cat([tree_candidates, torch.zeros((b, 1), dtype=torch.long) - 1], dim=-1)
    cart_candidates = tree_candidates_ext[:, ri]                       # [b, C, depth+1]
    cprob_ext = torch.cat([cprob, torch.ones(b, 1)], dim=-1)
    cart_candidates_prob = cprob_ext[:, ri]
    logits = node_logits[:, ri]                                        # tree_logits[:, retrieve_indices]
    if greedy_row0:
        # request 0: make path 0 agree with the target argmax (greedy full accept)
        am = node_logits.argmax(-1)
        for d in range(1, 4):
            node = _EAGLE_RETRIEVE[0][d]
            cart_candidates[0, 0, d] = am[0, _EAGLE_RETRIEVE[0][d - 1]]
            tree_candidates[0, node] = cart_candidates[0, 0, d]
        cart_candidates[0, 1, 1] = cart_candidates[0, 0, 1]
    op = [draft_probs[:, layer] for layer in _EAGLE_LAYER_PARENTS]  # op[i][batch][inlayer parent]
    return logits, cart_candidates, cart_candidates_prob, op, tree_candidates


# eagle/modeling_eagle.py evaluate_posterior, greedy branch (natively batched) + the accepted
# tokens and argmax bonus token from update_inference_inputs.
def eagle_modeling_batched_greedy(logits, candidates, tree_candidates, finish_flag):
    bs = tree_candidates.size(0)
    posterior_mask = (
            candidates[:, :, 1:].to(logits.device) == torch.argmax(logits[:, :, :-1], dim=-1)
    ).int()
    candidates_accept_length = (torch.cumprod(posterior_mask, dim=-1)).sum(dim=-1)
    accept_length = candidates_accept_length.max(dim=1).values
    best_candidate = torch.argmax(candidates_accept_length, dim=-1).to(torch.long)

    bt = tuple(range(bs))
    logits_batch = logits[bt, best_candidate, accept_length, :]
    accept_length = accept_length.tolist()

    for batch in range(bs):
        if finish_flag[batch]:
            accept_length[batch] = 0

    best_candidate = best_candidate.tolist()
    # update_inference_inputs: tokens kept + next token from sample_p (greedy: argmax)
    max_acccept_len = max(accept_length)
    ab = tuple(range(bs))
    new_input_ids = candidates[ab, best_candidate, : max_acccept_len + 1, ...]
    prob = logits_batch
    token = torch.argmax(prob, dim=-1)
    token = token[:, None]
    return best_candidate, accept_length, new_input_ids, token


def _make_eagle_greedy(seed):
    logits, cart, _, _, tree = _make_eagle_tree(seed, greedy_row0=True)
    finish_flag = torch.tensor([False, False, True])
    return logits, cart, tree, finish_flag


# eagle/model/utils.py evaluate_posterior, sampling branch (EAGLE-2/3, qx = 1.0, python
# random.random()), written for batch 1; looped over requests. Followed by the bonus-token draw
# of update_inference_inputs (torch.multinomial(sample_p, 1)).
_EAGLE_LP = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(12)])


def _eagle_utils_evaluate_posterior_sampled(logits, candidates, logits_processor):
    accept_length = 1
    accept_cand = candidates[0][:1]
    best_candidate = 0
    for i in range(1, candidates.shape[1]):
        if i != accept_length:
            break
        adjustflag = False
        is_eq = (candidates[:, :accept_length] == accept_cand).all(dim=1)
        fi = torch.nonzero(is_eq, as_tuple=True)[0][0]
        gt_logits = logits[fi, i - 1][None]
        gt_logits = logits_processor(None, gt_logits)[0]
        gtp = torch.softmax(gt_logits, dim=0)
        candidates_set = []
        for j in range(candidates.shape[0]):
            if is_eq[j]:
                x = candidates[j, i]
                xi = x.item()
                if xi in candidates_set or xi == -1:
                    continue
                candidates_set.append(xi)
                r = random.random()
                px = gtp[xi]
                qx = 1.0
                acp = px / qx
                if r <= acp:
                    accept_cand = torch.cat((accept_cand, x[None]), dim=0)
                    accept_length += 1
                    best_candidate = j
                    break
                else:
                    gtp[xi] = 0
                    gtp = gtp / gtp.sum()
                    adjustflag = True
    if adjustflag and accept_length != candidates.shape[1]:
        sample_p = gtp
    else:
        gt_logits = logits[best_candidate, accept_length - 1][None]
        gt_logits = logits_processor(None, gt_logits)[0]
        sample_p = torch.softmax(gt_logits, dim=0)
    return torch.tensor(best_candidate), accept_length - 1, sample_p


def eagle_utils_evaluate_posterior_sampled(logits, candidates):
    outs = []
    for b in range(logits.shape[0]):
        best_candidate, accept_length, sample_p = _eagle_utils_evaluate_posterior_sampled(
            logits[b], candidates[b], _EAGLE_LP)
        accepted = candidates[b][None, best_candidate, : accept_length + 1]
        token = torch.multinomial(sample_p, 1)
        token = token[None]
        outs.append((best_candidate, accept_length, sample_p, accepted, token))
    return outs


def _make_eagle_sampled(seed):
    random.seed(seed)  # the original draws its uniforms from python's `random`
    logits, cart, _, _, _ = _make_eagle_tree(seed)
    return logits, cart


# eagle/modeling_eagle.py evaluate_posterior, sampling branch (natively batched; draft probs
# qx from cart_candidates_prob, residual built from the parent's draft distribution op with the
# siblings already tried masked out), + token draw of update_inference_inputs.
_EAGLE_P_INDICES = [[-1, 0, 0, 0], [-1, 0, 0, 0], [-1, 0, 1, 0], [-1, 0, 0, 0]]


def _eagle_b_indices():
    t = torch.tensor
    return [[[], [], [], []], [[], [], t([4]), []], [[], t([1]), [], []], [[], t([1, 2]), [], []]]


def _eagle_modeling_evaluate_posterior_sampled(logits, candidates, logits_processor, cart_candidates_prob, op,
                                               p_indices, tree_candidates, b_indices, finish_flag):
    cart_candidates_prob = cart_candidates_prob.to(logits.device)
    bs = cart_candidates_prob.size(0)

    logits = logits_processor(None, logits)
    probs = torch.softmax(logits, dim=-1)

    best_candidate_list = []
    accept_length_list = []
    sample_p_list = []

    for batch in range(bs):
        accept_length = 1
        accept_cand = candidates[batch, 0, :1]
        best_candidate = 0
        for i in range(1, candidates.shape[2]):
            if i != accept_length:
                break
            adjustflag = False
            is_eq = (candidates[batch, :, :accept_length] == accept_cand).all(dim=1)
            fi = torch.nonzero(is_eq, as_tuple=True)[0][0]
            gtp = probs[batch, fi, i - 1]
            candidates_set = []
            for j in range(candidates.shape[1]):
                if is_eq[j]:
                    x = candidates[batch, j, i]
                    xi = x.item()
                    if xi in candidates_set or xi == -1:
                        continue
                    candidates_set.append(xi)
                    r = random.random()
                    px = gtp[xi]
                    qx = cart_candidates_prob[batch, j, i]
                    if qx <= 0:
                        continue
                    acp = px / qx
                    if r <= acp:
                        accept_cand = torch.cat((accept_cand, x[None]), dim=0)
                        accept_length += 1
                        best_candidate = j
                        break
                    else:
                        q = op[i - 1][batch][p_indices[j][i]].clone()
                        b = b_indices[j][i]
                        if len(b) > 0:
                            mask = tree_candidates[batch][b]
                            q[mask] = 0
                            q = q / q.sum()
                        gtp = gtp - q
                        gtp[gtp < 0] = 0
                        gtp = gtp / gtp.sum()
                        adjustflag = True
        if adjustflag and accept_length != candidates.shape[1]:
            sample_p = gtp
        else:
            sample_p = probs[batch, best_candidate, accept_length - 1]
        best_candidate_list.append(best_candidate)
        accept_length_list.append(accept_length - 1)
        sample_p_list.append(sample_p)

    for batch in range(bs):
        if finish_flag[batch]:
            accept_length_list[batch] = 0

    return best_candidate_list, accept_length_list, sample_p_list


def eagle_modeling_batched_sampled(logits, candidates, cart_candidates_prob, op0, op1, op2, tree_candidates,
                                   finish_flag):
    op = [op0, op1, op2]
    best_candidate, accept_length, sample_p = _eagle_modeling_evaluate_posterior_sampled(
        logits, candidates, _EAGLE_LP_4D, cart_candidates_prob, op, _EAGLE_P_INDICES, tree_candidates,
        _eagle_b_indices(), finish_flag)
    bs = len(best_candidate)
    max_acccept_len = max(accept_length)
    ab = tuple(range(bs))
    new_input_ids = candidates[ab, best_candidate, : max_acccept_len + 1, ...]
    prob = sample_p
    if isinstance(prob, list):
        prob = torch.stack(prob)
    token = torch.multinomial(prob, 1)
    return best_candidate, accept_length, prob, new_input_ids, token


_EAGLE_LP_4D = LogitsProcessorList([TemperatureLogitsWarper(0.9), TopKLogitsWarper(16)])


def _make_eagle_batched_sampled(seed):
    random.seed(seed)
    logits, cart, cprob, op, tree = _make_eagle_tree(seed, b=4)
    finish_flag = [False, False, False, True]
    return (logits, cart, cprob, op[0], op[1], op[2], tree, finish_flag)


# ==============================================================================================
# 15-16. hao-ai-lab/LookaheadDecoding  lade/decoding.py  (batch-1 code, looped over requests)
# ==============================================================================================

def _lade_greedy_verify_one(next_token_logits, guess_logits, guess_tokens, unfinished_sequences, GUESS_SIZE,
                            pad_token_id):
    # jacobi_greedy_search_multilevel: argmax + verification branch match (windows filled)
    next_tokens_scores = next_token_logits
    next_tokens = torch.argmax(next_tokens_scores, dim=-1)
    next_tokens = next_tokens * unfinished_sequences + pad_token_id * (1 - unfinished_sequences)

    first_guess = next_tokens.item()
    max_hit = 0
    max_hit_idx = -1  # (undefined in the original until a hit)
    hits = [first_guess] + [0] * (GUESS_SIZE - 1)

    if guess_tokens is not None:
        guess_results = torch.argmax(guess_logits, dim=-1)[0].tolist()
        for eg in range(len(guess_results) // GUESS_SIZE):
            egx = eg * GUESS_SIZE
            correct = [first_guess] + guess_results[egx:egx + GUESS_SIZE]
            myguess = guess_tokens[egx:egx + GUESS_SIZE]
            gg = 0
            for gg in range(len(myguess)):
                if myguess[gg] != correct[gg]:
                    break
            if gg > max_hit:
                max_hit = gg
                max_hit_idx = eg
                hits[:max_hit + 1] = correct[:max_hit + 1]
    return hits, max_hit, max_hit_idx


def lookahead_jacobi_greedy_verify(next_token_logits, guess_logits, guess_tokens, unfinished_sequences):
    GUESS_SIZE = 4
    outs = []
    for b in range(next_token_logits.shape[0]):
        outs.append(_lade_greedy_verify_one(next_token_logits[b:b + 1], guess_logits[b:b + 1],
                                            guess_tokens[b].tolist(), unfinished_sequences[b:b + 1],
                                            GUESS_SIZE, 0))
    return outs


def _make_lade(seed, greedy=True, b=B, n_guess=3, gsize=4, v=V):
    g = _gen(seed)
    next_token_logits = torch.randn(b, v, generator=g) * 2.5
    guess_logits = torch.randn(b, n_guess * gsize, v, generator=g) * 2.5
    first = next_token_logits.argmax(-1)
    gres = guess_logits.argmax(-1)
    guess_tokens = torch.randint(0, v, (b, n_guess * gsize), generator=g)
    # guess n-gram eg: [first_guess, gres[egx], gres[egx+1], ...] correct up to a per-(row, eg) cut
    cuts = torch.randint(0, gsize + 1, (b, n_guess), generator=g)
    for row in range(b):
        for eg in range(n_guess):
            egx = eg * gsize
            for gg in range(int(cuts[row, eg])):
                guess_tokens[row, egx + gg] = first[row] if gg == 0 else gres[row, egx + gg - 1]
    unfinished = torch.ones(b, dtype=torch.long)
    if greedy:
        unfinished[-1] = 0
        return next_token_logits, guess_logits, guess_tokens, unfinished
    return next_token_logits, guess_logits, guess_tokens


_LADE_WARPER = TemperatureLogitsWarper(0.8)


def _lade_sample_verify_one(next_token_logits, guess_logits_out, guess_tokens, GUESS_SIZE, logits_warper,
                            input_ids=None):
    # jacobi_sample_multilevel: specinfer-style multi-draft verification of the n-gram pool
    next_token_scores = logits_warper(input_ids, next_token_logits)
    probs_next = torch.nn.functional.softmax(next_token_scores, dim=-1)[0]
    hits = []
    guess_logits = logits_warper(input_ids, guess_logits_out[0])
    guess_probs = torch.nn.functional.softmax(guess_logits, dim=-1)
    guess_indices = list(range(guess_logits_out.size(1) // GUESS_SIZE))
    for idx_in_ngram in range(GUESS_SIZE):
        g_idx = 0
        is_accept = False
        while g_idx < len(guess_indices):
            guess_idx = guess_indices[g_idx]
            guess_offset = guess_idx * GUESS_SIZE
            draft_guess = guess_tokens[guess_offset + idx_in_ngram]
            prob_accept = min(1, probs_next[draft_guess].item())
            sample_prob = random.random()
            if sample_prob < prob_accept:
                hits.append(draft_guess)
                is_accept = True
                max_hit_idx = guess_idx
                new_guess_indices = []
                for guess_idx_n in guess_indices:
                    guess_offset_n = guess_idx_n * GUESS_SIZE
                    new_draft_guess = guess_tokens[guess_offset_n + idx_in_ngram]
                    if new_draft_guess == draft_guess:
                        new_guess_indices.append(guess_idx_n)
                guess_indices = new_guess_indices
                break
            else:
                probs_next[draft_guess] = 0
                probs_next = probs_next / probs_next.sum()
                g_idx += 1
        if is_accept:
            probs_next = guess_probs[guess_offset + idx_in_ngram]
            continue
        else:
            new_token_gen = torch.multinomial(probs_next, num_samples=1).item()
            hits.append(new_token_gen)
            break
    max_hit = len(hits) - 1
    return hits, max_hit


def lookahead_jacobi_sample_verify(next_token_logits, guess_logits, guess_tokens):
    GUESS_SIZE = 4
    outs = []
    for b in range(next_token_logits.shape[0]):
        outs.append(_lade_sample_verify_one(next_token_logits[b:b + 1], guess_logits[b:b + 1],
                                            guess_tokens[b].tolist(), GUESS_SIZE, _LADE_WARPER))
    return outs


def _make_lade_sample(seed):
    random.seed(seed)
    g = _gen(seed)
    b, n_guess, gsize = 3, 3, 4
    next_token_logits = torch.randn(b, V, generator=g) * 3.0
    guess_logits = torch.randn(b, n_guess * gsize, V, generator=g) * 3.0
    # n-gram eg predicts token idx from next_token_logits (idx 0) or guess_logits[egx + idx - 1]
    guess_tokens = torch.empty(b, n_guess * gsize, dtype=torch.long)
    for row in range(b):
        for eg in range(n_guess):
            egx = eg * gsize
            for gg in range(gsize):
                src = next_token_logits[row] if gg == 0 else guess_logits[row, egx + gg - 1]
                guess_tokens[row, egx + gg] = torch.multinomial(torch.softmax(src / 0.8, -1), 1, generator=g)
    return next_token_logits, guess_logits, guess_tokens


# ==============================================================================================

ENTRIES = [
    dict(name="gptfast_speculative_decode_probs_rowloop",
         source="pytorch-labs/gpt-fast, generate.py, speculative_decode (verify tail after the target forward; "
                "commit 32971d3, 2024-09-15)",
         kind="whole_step", fn=gptfast_speculative_decode_probs, make=_make_gptfast_probs),
    dict(name="gptfast_speculative_decode_topk_logits_k1",
         source="pytorch-labs/gpt-fast, generate.py, speculative_decode + logits_to_probs(top_k) + sample "
                "(commit 32971d3), K=1",
         kind="whole_step", fn=gptfast_speculative_decode_topk_k1, make=_make_gptfast_topk_k1),
    dict(name="hf_utils_speculative_sampling_2025_is_done",
         source="huggingface/transformers, src/transformers/generation/utils.py, _speculative_sampling "
                "(commit 000034a4, 2025, with is_done_candidate)",
         kind="whole_step", fn=hf_speculative_sampling_2025, make=_make_hf_sampling),
    dict(name="hf_utils_assisted_greedy_2025_is_done",
         source="huggingface/transformers, src/transformers/generation/utils.py, "
                "GenerationMixin._assisted_decoding step 3 case 2 greedy (commit 000034a4, 2025)",
         kind="greedy", fn=hf_assisted_greedy_2025, make=_make_hf_greedy),
    dict(name="hf_utils_speculative_sampling_5_24_ensemble_weight",
         source="huggingface/transformers 5.24.0 (installed wheel), generation/utils.py, _speculative_sampling "
                "with assistant_ensemble_weight (DIVERSE), 2026",
         kind="whole_step", fn=hf_speculative_sampling_5_24_ensemble, make=_make_hf_sampling_524),
    dict(name="hf_utils_assisted_greedy_5_24_ensemble_eos_crop",
         source="huggingface/transformers 5.24.0 (installed wheel), generation/utils.py, _assisted_decoding "
                "step 3 greedy with ensemble argmax + max_length/EOS crop, 2026",
         kind="greedy", fn=hf_assisted_greedy_5_24_ensemble_eos, make=_make_hf_greedy_524),
    dict(name="lucidrains_speculative_decoding_step",
         source="lucidrains/speculative-decoding, speculative_decoding/speculative_decoding.py, "
                "speculative_decoding (verify + adjusted prob + bonus token; commit 72171ac)",
         kind="whole_step", fn=lucidrains_speculative_decoding_step,
         make=lambda seed: _make_lucidrains(seed, prefix=2)),
    dict(name="lucidrains_prophet_accept_ratio",
         source="lucidrains/speculative-decoding, speculative_decoding/speculative_decoding_with_prophet.py, "
                "speculative_decoding_with_prophet_model (accept test only; commit 72171ac)",
         kind="ratio", fn=lucidrains_prophet_accept,
         make=lambda seed: _make_lucidrains(seed, b=4, k=5, v=29)),
    dict(name="lucidrains_same_model_residual",
         source="lucidrains/speculative-decoding, speculative_decoding/speculative_decoding.py, "
                "speculative_decoding_with_same_model (adjusted_prob / prob_next / multinomial; commit 72171ac)",
         kind="residual", fn=lucidrains_same_model_residual, make=_make_lucidrains_residual),
    dict(name="medusa_evaluate_posterior_typical_fast",
         source="FasterDecoding/Medusa, medusa/model/utils.py, evaluate_posterior (sampling='typical', "
                "fast=True; commit e2a5d20)",
         kind="typical", fn=medusa_evaluate_posterior_typical_fast, make=_make_medusa),
    dict(name="medusa_legacy_evaluate_posterior_greedy",
         source="FasterDecoding/Medusa, medusa/model/utils_legacy.py, evaluate_posterior (temperature == 0; "
                "commit e2a5d20)",
         kind="greedy", fn=medusa_legacy_evaluate_posterior_greedy, make=_make_medusa_greedy),
    dict(name="medusa_evaluate_posterior_typical_sampled_mask",
         source="FasterDecoding/Medusa, medusa/model/utils.py, get_typical_posterior_mask + evaluate_posterior "
                "(sampling='typical', fast=False; commit e2a5d20)",
         kind="typical", fn=medusa_evaluate_posterior_typical_sampled,
         make=lambda seed: _make_medusa(seed, b=3, c=4, scale=4.0)),
    dict(name="eagle_modeling_eagle_batched_greedy",
         source="SafeAILab/EAGLE, eagle/modeling_eagle.py, evaluate_posterior (logits_processor is None) + "
                "update_inference_inputs token pick (commit cb7e084, 2026-02)",
         kind="greedy", fn=eagle_modeling_batched_greedy, make=_make_eagle_greedy),
    dict(name="eagle_utils_evaluate_posterior_sampled_qx1",
         source="SafeAILab/EAGLE, eagle/model/utils.py, evaluate_posterior (sampling branch, EAGLE-2/3) + "
                "update_inference_inputs multinomial (commit cb7e084)",
         kind="whole_step", fn=eagle_utils_evaluate_posterior_sampled, make=_make_eagle_sampled),
    dict(name="eagle_modeling_eagle_batched_sampled_tree_residual",
         source="SafeAILab/EAGLE, eagle/modeling_eagle.py, evaluate_posterior (sampling branch with "
                "cart_candidates_prob / op / p_indices / b_indices) + update_inference_inputs (commit cb7e084)",
         kind="whole_step", fn=eagle_modeling_batched_sampled, make=_make_eagle_batched_sampled),
    dict(name="lookahead_jacobi_greedy_verify",
         source="hao-ai-lab/LookaheadDecoding, lade/decoding.py, jacobi_greedy_search_multilevel "
                "(verification-branch match; commit eed010d)",
         kind="greedy", fn=lookahead_jacobi_greedy_verify, make=_make_lade),
    dict(name="lookahead_jacobi_sample_verify",
         source="hao-ai-lab/LookaheadDecoding, lade/decoding.py, jacobi_sample_multilevel "
                "(specinfer-style n-gram pool verification; commit eed010d)",
         kind="whole_step", fn=lookahead_jacobi_sample_verify, make=_make_lade_sample),
]
