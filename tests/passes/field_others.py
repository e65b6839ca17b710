"""Field corpus entries: SGLang, gpt-fast, HF transformers, lucidrains, Medusa and EAGLE
(see field_corpus.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from field_inputs import B, K, V, _dists, _gen, _greedy_drafts


# ============================================================================================
# SGLang
# ============================================================================================
def sglang_dflash_greedy(candidates, next_token_logits):
    # python/sglang/srt/speculative/dflash_utils.py compute_dflash_accept_len_and_bonus, fed by
    # the DFlash verify's `argmax(next_token_logits).view(bs, draft_token_num)`
    bs, block = candidates.shape
    target_predict = torch.argmax(next_token_logits, dim=-1).view(bs, block)
    hits = candidates[:, 1:] == target_predict[:, :-1]
    accept_len = hits.to(torch.int32).cumprod(dim=1).sum(dim=1)
    bonus = target_predict[torch.arange(bs, device=target_predict.device), accept_len]
    return accept_len, bonus.to(torch.int64)


def sglang_tree_greedy_chain(candidates, next_token_logits):
    # python/sglang/srt/speculative/eagle_utils.py verify_tree_greedy_native, its fast path
    # (two verify tokens, topk 1), fed by the greedy verify's argmax reshaped to [bs, 2]
    bs, n_verify = candidates.shape
    target_predict = torch.argmax(next_token_logits, dim=-1).reshape(bs, n_verify)
    hit = candidates[:, 1] == target_predict[:, 0]
    predicts = target_predict.flatten()
    accept_index = torch.arange(0, n_verify * bs, device=candidates.device,
                                dtype=torch.long).reshape(bs, n_verify)
    hit = hit.to(torch.int64)
    kept = accept_index[:, 1] * hit
    accept_index[:, 1] = kept - (1 - hit)
    accept_token_num = hit.int()
    return predicts, accept_index, accept_token_num


SENTINEL = 999999


def sglang_block_verify_reference(candidates, target_probs, draft_probs, coins, coin_final):
    # the vectorised torch reference of block verification (arXiv:2403.10444, Algorithm 3) in
    # SGLang's unit test of chain_block_speculative_sampling_triton (`block_verify_reference`)
    dev = candidates.device
    bs, slots = candidates.shape
    gamma = slots - 1
    vocab_size = target_probs.shape[-1]
    run_p = torch.ones(bs, device=dev)
    tau = torch.zeros(bs, dtype=torch.long, device=dev)
    z_at_tau = torch.zeros(bs, device=dev)
    p_at_tau = torch.ones(bs, device=dev)
    for i in range(1, gamma + 1):
        tok = candidates[:, i]
        t_i = target_probs[:, i - 1].gather(1, tok[:, None]).squeeze(1)
        d_i = draft_probs[:, i - 1].gather(1, tok[:, None]).squeeze(1)
        d_fine = (d_i == d_i) & (d_i > 0)
        ratio = torch.where(d_fine, t_i / torch.where(d_fine, d_i, torch.ones_like(d_i)),
                            torch.where(t_i > 0, torch.ones_like(t_i), torch.zeros_like(t_i)))
        run_p = torch.minimum(run_p * ratio, torch.ones_like(run_p))
        if i < gamma:
            z = torch.clamp(run_p[:, None] * target_probs[:, i]
                            - torch.nan_to_num(draft_probs[:, i], nan=0.0), min=0.0).sum(-1)
        else:
            z = torch.zeros_like(run_p)
        den = z + 1.0 - run_p
        h_safe = torch.where(den > 0, z / torch.where(den > 0, den, torch.ones_like(den)),
                             torch.ones_like(den))
        h = run_p if i == gamma else h_safe
        move = coins[:, i - 1] < h
        tau = torch.where(move, torch.full_like(tau, i), tau)
        z_at_tau = torch.where(move, z, z_at_tau)
        p_at_tau = torch.where(move, run_p, p_at_tau)
    z_root = torch.clamp(target_probs[:, 0] - torch.nan_to_num(draft_probs[:, 0], nan=0.0),
                         min=0.0).sum(-1)
    z_at_tau = torch.where(tau > 0, z_at_tau, z_root)
    all_in = tau == gamma
    row_t = target_probs.gather(1, tau[:, None, None].expand(bs, 1, vocab_size)).squeeze(1)
    row_d = draft_probs.gather(1, torch.clamp(tau, max=gamma - 1)[:, None, None]
                               .expand(bs, 1, vocab_size)).squeeze(1)
    weights = torch.where(all_in[:, None], row_t,
                          torch.clamp(p_at_tau[:, None] * row_t - torch.nan_to_num(row_d, nan=0.0),
                                      min=0.0))
    mass = torch.where(all_in, row_t.sum(-1), z_at_tau)
    cdf = weights.cumsum(-1)
    cut = (coin_final * mass)[:, None]
    first = (cdf > cut).float().argmax(-1)
    final = torch.where(cdf[:, -1] > cut[:, 0], first, torch.full_like(first, vocab_size - 1))
    predict_map = torch.full((bs, slots), SENTINEL, dtype=torch.long, device=dev)
    for i in range(1, gamma + 1):
        predict_map[:, i - 1] = torch.where(tau >= i, candidates[:, i], predict_map[:, i - 1])
    predict_map.scatter_(1, tau[:, None], final[:, None])
    return tau.to(torch.int32), predict_map


def _make_dflash(seed):
    g, t_logits, _, _, _, _ = _dists(seed)
    drafts = _greedy_drafts(t_logits.argmax(-1)[:, :K], g)
    cands = torch.cat([torch.randint(0, V, (B, 1), generator=g), drafts], 1)
    return cands, t_logits.reshape(B * (K + 1), V)


def _make_tree_chain(seed):
    g, t_logits, _, _, _, _ = _dists(seed, k=1)
    drafts = _greedy_drafts(t_logits.argmax(-1)[:, :1], g)
    drafts[2, 0] = t_logits[2, 0].argmax()
    cands = torch.cat([torch.randint(0, V, (B, 1), generator=g), drafts], 1)
    return cands, t_logits.reshape(B * 2, V)


def _make_sglang_block(seed):
    g, _, _, p, q, ids = _dists(seed)
    qf = torch.cat([q, torch.softmax(torch.randn(B, 1, V, generator=g), -1)], 1)  # [B, K+1, V]
    cands = torch.cat([torch.zeros(B, 1, dtype=torch.long), ids], 1)
    return cands, p, qf, torch.rand(B, K + 1, generator=g), torch.rand(B, generator=g)


# ============================================================================================
# gpt-fast: generate.py (speculative_decode, multinomial_sample_one_no_sync, logits_to_probs)
# ============================================================================================
def _gpt_fast_sample_one(probs_sort):
    expo = torch.empty_like(probs_sort).exponential_(1)
    return torch.argmax(probs_sort / expo, dim=-1, keepdim=True).to(dtype=torch.int)


def gpt_fast_speculative_decode(draft_tokens, draft_probs, target_logits):
    # B = 1; draft_probs [k, V] stacked, target_logits [1, k+1, V] from model_forward
    temperature = 0.8
    speculate_k = draft_tokens.shape[0]
    dev = draft_tokens.device
    target_probs = torch.nn.functional.softmax(target_logits[0] / max(temperature, 1e-5), dim=-1)
    p = draft_probs[torch.arange(0, speculate_k, device=dev), draft_tokens]   # draft
    q = target_probs[torch.arange(0, speculate_k, device=dev), draft_tokens]  # target
    accept_p = torch.minimum(torch.ones(()), q[:speculate_k] / p)
    rejected_at = (torch.rand_like(accept_p) > accept_p).nonzero()
    if rejected_at.shape[0] == 0:            # every draft accepted
        last = _gpt_fast_sample_one(target_probs[-1])
        return torch.cat([draft_tokens, last])
    n = rejected_at[0].item()
    p, q = draft_probs[n], target_probs[n]
    new = q - p
    new = torch.where(new > 0, new, 0.0)
    new = new / new.sum()
    nxt = _gpt_fast_sample_one(new)
    return torch.cat([draft_tokens[:n], nxt])


def gpt_fast_residual(draft_rows, target_rows):
    # the rejection branch of speculative_decode for B requests at their first rejection:
    # rows [B, V] (draft_probs[n], target_probs[n]); `new.sum()` taken per row
    new = target_rows - draft_rows
    new = torch.where(new > 0, new, 0.0)
    new = new / new.sum(dim=-1, keepdim=True)
    return _gpt_fast_sample_one(new)


def _make_gpt_fast(seed):
    _, t_logits, _, _, q, ids = _dists(seed, b=1)
    return ids[0], q[0], t_logits


def _make_rows(seed):
    """(draft row, target row) per request at position 1, [B, V] each."""
    _, _, _, p, q, _ = _dists(seed)
    return q[:, 1].contiguous(), p[:, 1].contiguous()


def _make_rows_tp(seed):
    draft, target = _make_rows(seed)
    return target, draft


# ============================================================================================
# HF transformers: transformers/generation/utils.py
# ============================================================================================
def hf_speculative_sampling(candidate_input_ids, candidate_logits, new_logits, candidate_length):
    # _speculative_sampling (no ensemble weight); B = 1
    new_ids = candidate_input_ids[:, -candidate_length:]
    q = candidate_logits.softmax(dim=-1)
    q_i = q[:, torch.arange(candidate_length), new_ids].squeeze(0, 1)
    p = new_logits.softmax(dim=-1)
    p_i = p[:, torch.arange(candidate_length), new_ids].squeeze(0, 1)
    ratio = p_i / q_i
    r_i = torch.rand_like(ratio)
    accepted = r_i <= ratio
    n_matches = ((~accepted).cumsum(dim=-1) < 1).sum()
    gamma = candidate_logits.shape[1]
    p_next = p[:, n_matches, :]
    if n_matches < gamma:
        q_next = q[:, n_matches, :]
        p_prime = torch.clamp((p_next - q_next), min=0)
        p_prime.div_(p_prime.sum())
    else:
        p_prime = p_next
    t = torch.multinomial(p_prime, num_samples=1).squeeze(1)[None, :]
    if n_matches > 0:
        valid = torch.cat((new_ids[:, :n_matches], t), dim=-1)
    else:
        valid = t
    return valid, n_matches


def hf_assisted_greedy_ensemble(candidate_input_ids, candidate_logits, new_logits, cur_len):
    # GenerationMixin._assisted_decoding, greedy with assistant_ensemble_weight (DIVERSE):
    # argmax of w p + (1 - w) q on the drafted rows, of p on the bonus row; B = 1. The caller's
    # `selected_tokens[:, : n_matches + 1]` slice is left out (a data-dependent slice)
    w = 0.7
    candidate_length = candidate_logits.shape[1]
    p_probs = new_logits[:, :candidate_length, :].softmax(dim=-1)
    q_probs = candidate_logits.softmax(dim=-1)
    nu = w * p_probs + (1.0 - w) * q_probs
    bonus_logits = new_logits[:, candidate_length:, :]
    selected = torch.cat([nu.argmax(dim=-1), bonus_logits.argmax(dim=-1)], dim=-1)
    cand_new = candidate_input_ids[:, cur_len:]
    n_matches = ((~(cand_new == selected[:, :-1])).cumsum(dim=-1) < 1).sum()
    return selected, n_matches


def _make_hf(seed):
    g, t_logits, d_logits, _, _, ids = _dists(seed, b=1)
    prompt = torch.randint(0, V, (1, 3), generator=g)
    return torch.cat([prompt, ids], 1), d_logits, t_logits, K


def _make_hf_greedy(seed):
    g, t_logits, d_logits, _, _, _ = _dists(seed, b=1)
    nu = 0.7 * t_logits[:, :K].softmax(-1) + 0.3 * d_logits.softmax(-1)
    drafts = _greedy_drafts(nu.argmax(-1), g)
    drafts[0, 3] = (drafts[0, 3] + 1) % V  # B = 1: reject at position 3
    prompt = torch.randint(0, V, (1, 3), generator=g)
    return torch.cat([prompt, drafts], 1), d_logits, t_logits, 3


# ============================================================================================
# lucidrains/speculative-decoding: speculative_decoding/speculative_decoding.py
# (speculative_decoding, one verify step; find_first_true_index)
# ============================================================================================
def lucidrains_whole_step(prob, small_prob, q_sampled_out):
    lenience = 1.
    gamma = small_prob.shape[1]
    batch_range = torch.arange(prob.shape[0], device=prob.device, dtype=torch.long)[..., None]
    p, prob_next = prob[:, :-1], prob[:, -1]
    p = p.gather(-1, q_sampled_out)
    q = small_prob.gather(-1, q_sampled_out) * lenience
    p, q = [t.reshape(t.shape[0], t.shape[1]) for t in (p, q)]       # 'b n 1 -> b n'
    r = torch.zeros_like(q).float().uniform_(0, 1)
    accepted = ((r > (p / q)).cumsum(dim=-1) == 0).sum(dim=-1)       # find_first_true_index
    num_rejected = gamma - accepted
    has_rejected = num_rejected > 0
    accepted = accepted.reshape(-1, 1)                                # 'b -> b 1'
    accepted.clamp_(max=gamma - 1)
    adjusted = F.relu(prob[batch_range, accepted] - small_prob[batch_range, accepted])
    adjusted = adjusted / adjusted.sum(dim=-1, keepdim=True)
    adjusted = adjusted.reshape(adjusted.shape[0], adjusted.shape[-1])  # 'b 1 d -> b d'
    prob_next = torch.where(has_rejected.reshape(-1, 1), adjusted, prob_next)
    next_token = torch.multinomial(prob_next, 1)
    return num_rejected, next_token


def _make_lucidrains(seed):
    _, _, _, p, q, ids = _dists(seed)
    return p, q, ids[..., None]


# ============================================================================================
# Medusa: medusa/model/utils.py evaluate_posterior; EAGLE: eagle/model/utils.py
# evaluate_posterior (tree candidates of one request: rows are candidates)
# ============================================================================================
def medusa_greedy_posterior(logits, candidates):
    hit = (candidates[:, 1:] == torch.argmax(logits[:, :-1], dim=-1)).int()
    lens = (torch.cumprod(hit, dim=1)).sum(dim=1)
    accept_length = lens.max()
    if accept_length == 0:
        best = torch.tensor(0, dtype=torch.long, device=candidates.device)
    else:
        best = torch.argmax(lens).to(torch.long)
    return best, accept_length


def medusa_typical_posterior(logits, candidates):
    # sampling="typical", fast=True
    temperature, posterior_threshold, posterior_alpha = 0.7, 0.3, 0.09
    post = torch.softmax(logits[:, :-1] / temperature, dim=-1)
    cand_p = torch.gather(post, dim=-1, index=candidates[:, 1:].unsqueeze(-1)).squeeze(-1)
    entropy = -torch.sum(post * torch.log(post + 1e-5), dim=-1)
    threshold = torch.minimum(torch.ones_like(entropy) * posterior_threshold,
                              torch.exp(-entropy) * posterior_alpha)
    mask = cand_p > threshold
    lens = (torch.cumprod(mask, dim=1)).sum(dim=1)
    accept_length = lens.max()
    if accept_length == 0:
        best = torch.tensor(0, dtype=torch.long, device=candidates.device)
    else:
        tied = torch.where(lens == accept_length)[0]
        likelihood = torch.sum(torch.log(cand_p[tied, :accept_length]), dim=-1)
        best = tied[torch.argmax(likelihood)]
    return best, accept_length


def eagle_greedy_posterior(logits, candidates):
    # logits_processor is None (greedy)
    hit = (candidates[:, 1:].to(logits.device) == torch.argmax(logits[:, :-1], dim=-1)).int()
    lens = (torch.cumprod(hit, dim=1)).sum(dim=1)
    accept_length = lens.max()
    if accept_length == 0:
        best = torch.tensor(0, dtype=torch.long, device=candidates.device)
    else:
        best = torch.argmax(lens).to(torch.long)
    return best, accept_length, logits[best, accept_length]


def eagle_residual_row(gt_logits, xi):
    # the sampled branch after a rejected candidate token xi (a python int, as `x.item()` gives
    # it): zero its probability in the row, renormalise, and draw the next token from it as
    # update_inference_inputs does (`torch.multinomial(sample_p, 1)`); one row, B = 1
    gtp = torch.softmax(gt_logits, dim=0)
    gtp[xi] = 0
    gtp = gtp / gtp.sum()
    return torch.multinomial(gtp, 1)


def _make_tree(seed):
    g, t_logits, _, _, _, _ = _dists(seed)
    target = t_logits.argmax(-1)[:, :K]
    drafts = _greedy_drafts(target, g)
    cands = torch.cat([torch.full((B, 1), 7, dtype=torch.long), drafts], 1)
    return t_logits, cands


def _make_typical(seed):
    _, t_logits, _, _, _, _ = _dists(seed)
    post = (t_logits[:, :K] / 0.7).softmax(-1)
    g = _gen(seed + 1)
    top = post.argsort(-1, descending=True)[..., :2]
    pick = torch.randint(0, 2, (B, K, 1), generator=g)
    drafts = top.gather(-1, pick).squeeze(-1)          # mostly likely tokens: long prefixes
    cands = torch.cat([torch.full((B, 1), 7, dtype=torch.long), drafts], 1)
    return t_logits, cands


def _make_eagle_row(seed):
    _, t_logits, _, _, _, ids = _dists(seed, b=1)
    return t_logits[0, 0].contiguous(), int(ids[0, 0])
