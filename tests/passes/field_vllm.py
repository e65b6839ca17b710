"""Field corpus entries: vLLM v0, vLLM v1 and vllm-ascend (see field_corpus.py)."""
from __future__ import annotations

import torch

from field_inputs import B, K, PLACEHOLDER, RAGGED, V, _dists, _greedy_drafts, _ragged


# ============================================================================================
# vLLM v0: vllm/model_executor/layers/{rejection_sampler,typical_acceptance_sampler,
# spec_decode_base_sampler}.py
# ============================================================================================
def _v0_create_output(accepted, substitute_ids, draft_ids, bonus_ids):
    """SpecDecodeBaseSampler._create_output: -1 after the first rejection, the substitute at it,
    the bonus in the last column when the row ran through."""
    bsz, k = substitute_ids.shape
    bonus_ids = bonus_ids.squeeze(-1)
    limits = (accepted == 0).max(1).indices
    limits[~(accepted == 0).any(1)] = k
    cols = torch.arange(k, device=accepted.device).unsqueeze(0)
    before_first_reject = cols < limits.unsqueeze(1)
    at_first_reject = cols == limits.unsqueeze(1)
    full = -torch.ones((bsz, k + 1), dtype=torch.int64, device=accepted.device)
    head = full[:, :k]
    head[:, :k] = torch.where(before_first_reject, draft_ids, -torch.ones_like(draft_ids))
    full[:, -1] = torch.where(head[:, -1] != -1, bonus_ids, -1)
    head.mul_(~at_first_reject).add_(substitute_ids.mul(at_first_reject))
    return full


def vllm_v0_rejection_sampler(target_probs, bonus_token_ids, draft_probs, draft_token_ids):
    bsz, k, vocab = draft_probs.shape
    dev = target_probs.device
    # _get_accepted: p(x), q(x) by advanced indexing, uniforms shaped like them, strict `<`
    b_idx = torch.arange(bsz, device=dev)[:, None]
    k_idx = torch.arange(k, device=dev)
    draft_px = draft_probs[b_idx, k_idx, draft_token_ids]
    target_px = target_probs[b_idx, k_idx, draft_token_ids]
    u = torch.rand_like(target_px)
    capped = torch.minimum(target_px / draft_px, torch.full((1,), 1, device=dev))
    accepted = u < capped
    # _get_recovered_probs: (p - q) floored at float32's smallest normal, normalised per row
    diff = target_probs - draft_probs
    floored = torch.clamp(diff, min=torch.finfo(torch.float32).tiny)
    recovered_probs = (floored / torch.sum(floored, dim=-1).reshape(-1, k, 1)).reshape(
        bsz * k, vocab)
    # _multinomial (no seeded requests): an Exp(1) race that divides the probs in place
    race = torch.empty_like(recovered_probs)
    race.exponential_(1.0)
    recovered = recovered_probs.div_(race).argmax(dim=1).view(-1, 1).reshape(bsz, k)
    return _v0_create_output(accepted, recovered, draft_token_ids, bonus_token_ids)


def vllm_v0_typical_acceptance(target_with_bonus_probs, bonus_token_ids, draft_token_ids):
    posterior_threshold, posterior_alpha = 0.09, 0.3      # vLLM's defaults
    target_probs = target_with_bonus_probs[:, :-1]
    # _evaluate_accepted_tokens
    cand_p = torch.gather(target_probs, dim=-1, index=draft_token_ids.unsqueeze(-1)).squeeze(-1)
    entropy = -torch.sum(target_probs * torch.log(target_probs + 1e-5), dim=-1)
    threshold = torch.minimum(
        torch.ones_like(entropy, device=target_probs.device) * posterior_threshold,
        torch.exp(-entropy) * posterior_alpha)
    accepted = cand_p > threshold
    # _get_recovered_token_ids: the target's argmax fills the first rejected slot
    recovered = torch.argmax(target_probs, dim=-1)
    return _v0_create_output(accepted, recovered, draft_token_ids, bonus_token_ids)


def _make_v0(seed):
    g, _, _, p, q, ids = _dists(seed)
    return p[:, :K].contiguous(), torch.randint(0, V, (B, 1), generator=g), q, ids


def _make_v0_typical(seed):
    g, _, _, p, _, ids = _dists(seed)
    return p, torch.randint(0, V, (B, 1), generator=g), ids


# ============================================================================================
# vLLM v1 (early 2025): vllm/v1/sample/rejection_sampler.py, RejectionSampler.forward_native
# (padded [B, max_spec_len(+1), V] layout built by pad_sequence / _convert_2d_probs)
# ============================================================================================
def vllm_v1_native_greedy(draft_token_ids_tensor, target_probs):
    # all_greedy: target_probs holds the logits (compute_probs returns them unchanged)
    target_ids = target_probs.argmax(dim=-1)
    accept_mask = (target_ids[:, :-1] == draft_token_ids_tensor).cumprod(dim=1)
    not_pad = target_ids != PLACEHOLDER
    gen = torch.cat([accept_mask, torch.zeros(accept_mask.size(0), 1, device=accept_mask.device)],
                    dim=1).to(torch.bool) & not_pad
    zero_slots = gen == 0
    first_zero = zero_slots.float().argmax(dim=1)
    has_zero = zero_slots.any(dim=1)
    gen[has_zero, first_zero[has_zero]] = 1
    out = target_ids
    out[~gen] = PLACEHOLDER
    return out


def _v1_random_native(ids, draft_probs, bonus_ids, target_probs):
    bsz, spec = ids.shape
    pad = ids == PLACEHOLDER
    ids[pad] = 0
    draft_px = draft_probs.gather(dim=-1, index=ids.unsqueeze(-1)).squeeze(-1)
    target_px = target_probs.gather(dim=-1, index=ids.unsqueeze(-1)).squeeze(-1)
    draft_px[pad] = float("inf")                 # padded slots are never accepted
    u = torch.rand(bsz, spec, device=target_probs.device)          # _create_uniform_samples
    accepted = u <= target_px / draft_px
    accept_mask = accepted.cumprod(dim=1)
    kept = ids * accept_mask + PLACEHOLDER * (1 - accept_mask)
    resid = torch.clamp(target_probs[:, :-1, :] - draft_probs, min=1e-5)
    resid_n = resid / resid.sum(dim=-1, keepdim=True)
    # ops/topk_topp_sampler.random_sample without generators: probs.div_(Exp(1)).argmax
    expo = torch.empty_like(resid_n)
    expo.exponential_()
    recovered = resid_n.div_(expo).argmax(dim=-1).view(-1).reshape(bsz, spec)
    rec_or_bonus = torch.cat([recovered, bonus_ids], dim=1)
    gen = torch.cat([accept_mask, torch.zeros(bsz, 1, device=accept_mask.device)],
                    dim=1).to(torch.bool)
    first_zero = (gen == 0).float().argmax(dim=1)
    out = torch.cat([kept, torch.full((bsz, 1), fill_value=PLACEHOLDER, device=accept_mask.device)],
                    dim=1)
    out[torch.arange(bsz), first_zero] = rec_or_bonus[torch.arange(bsz), first_zero]
    return out


def vllm_v1_native_random(draft_token_ids_tensor, draft_probs, bonus_token_ids, target_probs):
    # forward() builds the padded id tensor afresh each call (pad_sequence); the clone stands
    # for that, since forward_native writes 0 into its padded slots
    return _v1_random_native(draft_token_ids_tensor.clone(), draft_probs, bonus_token_ids,
                             target_probs)


def vllm_v1_native_ngram(draft_token_ids_tensor, bonus_token_ids, target_probs):
    ids = draft_token_ids_tensor.clone()
    # _create_greedy_token_probs: one-hot draft "probabilities" for n-gram drafts
    bsz, n = ids.shape
    onehot = torch.zeros(bsz, n, target_probs.size(-1), dtype=torch.float,
                         device=target_probs.device)
    real = ids != PLACEHOLDER
    safe = ids.clone()
    safe[~real] = 0
    onehot.scatter_(dim=2, index=safe.unsqueeze(-1), src=real.unsqueeze(-1).float())
    return _v1_random_native(ids, onehot, bonus_token_ids, target_probs)


def _v1_padded(seed, greedy=False):
    g, t_logits, _, p, q, ids = _dists(seed)
    if greedy:
        ids = _greedy_drafts(t_logits.argmax(-1)[:, :K], g)
    src = t_logits if greedy else p
    target = torch.zeros(B, K + 1, V)
    drafts = torch.full((B, K), PLACEHOLDER, dtype=torch.int64)
    dprobs = torch.zeros(B, K, V)
    for i, n in enumerate(RAGGED):
        target[i, :n + 1] = src[i, :n + 1]
        drafts[i, :n] = ids[i, :n]
        dprobs[i, :n] = q[i, :n]
    return g, drafts, dprobs, target


def _make_v1_greedy(seed):
    _, drafts, _, target = _v1_padded(seed, greedy=True)
    return drafts, target


def _make_v1_random(seed):
    g, drafts, dprobs, target = _v1_padded(seed)
    return drafts, dprobs, torch.randint(0, V, (B, 1), generator=g), target


def _make_v1_ngram(seed):
    g, drafts, _, target = _v1_padded(seed)
    return drafts, torch.randint(0, V, (B, 1), generator=g), target


# ============================================================================================
# vllm-ascend: vllm_ascend/sample/rejection_sampler.py, the PyTorch (no-Triton) paths of
# rejection_sample (ragged layout: flat [N] drafts, [N, V] probs, cu_num_draft_tokens [B])
# ============================================================================================
def _ascend_recovered(cu_num_draft_tokens, draft_token_ids, draft_probs, target_probs, q):
    """sample_recovered_tokens_pytorch, normal (non-reduce) mode."""
    dev = target_probs.device
    n_tok = draft_token_ids.shape[0]
    recovered = torch.empty_like(draft_token_ids)
    starts = torch.cat([torch.tensor([0]).to(dev), cu_num_draft_tokens[:-1]])
    ends = cu_num_draft_tokens
    tok = torch.arange(n_tok, device=dev)
    in_req = (tok[:, None] >= starts[None, :]) & (tok[:, None] < ends[None, :])
    tok_req = torch.argmax(in_req.int(), dim=1)
    tok_req = torch.where(in_req.any(dim=1), tok_req, 0)
    if draft_probs is None:      # n-gram: the draft's own token zeroed in the target
        tok = torch.arange(n_tok, device=dev)
        resid = target_probs.clone()
        has_draft = draft_token_ids != PLACEHOLDER
        resid[tok[has_draft], draft_token_ids[has_draft]] = 0
    else:
        resid = torch.maximum(target_probs - draft_probs, torch.tensor(0.0).to(dev))
    q_tok = q[tok_req]
    q_safe = torch.where(q_tok == 0, 1e-10, q_tok)
    q_safe = torch.where(torch.isinf(q_tok), 1e-10, q_safe)
    score = resid / q_safe
    score = torch.where((q_tok == 0) | torch.isinf(q_tok), -1e10, score)
    recovered[:] = torch.argmax(score, dim=1)
    return recovered


def _ascend_gather(cu_num_draft_tokens, draft_token_ids, draft_probs, target_probs, max_spec_len,
                   bsz):
    """The [B, max_spec_len] grid both random paths build from the ragged layout."""
    dev = target_probs.device
    starts = torch.cat([torch.tensor([0]).to(dev), cu_num_draft_tokens[:-1]])
    n_req = cu_num_draft_tokens - starts
    pos = torch.arange(max_spec_len).to(dev)[None, :]
    in_req = pos < n_req[:, None]
    gidx = (starts[:, None] + pos).clamp(0, draft_token_ids.shape[0] - 1)
    drafts = draft_token_ids[gidx]
    is_ph = drafts == PLACEHOLDER
    safe = drafts.masked_fill(is_ph, 0)
    if draft_probs is None:
        draft_px = torch.ones(1, dtype=torch.float32).to(dev).expand_as(drafts)
    else:
        draft_px = draft_probs[gidx.flatten(), safe.flatten()].view(bsz, max_spec_len)
    target_px = target_probs[gidx.flatten(), safe.flatten()].view(bsz, max_spec_len)
    return n_req, pos, in_req, gidx, drafts, is_ph, draft_px, target_px


def _ascend_random(out, cu, draft_ids, draft_probs, target_probs, bonus_ids, recovered, uniform,
                   is_greedy, max_spec_len):
    """rejection_random_sample_pytorch (no entropy verify, no synthetic mode)."""
    bsz, dev = out.shape[0], out.device
    n_req, pos, in_req, gidx, drafts, is_ph, draft_px, target_px = _ascend_gather(
        cu, draft_ids, draft_probs, target_probs, max_spec_len, bsz)
    u = uniform[gidx]
    rec = recovered[gidx]
    zero = torch.tensor([0.0], dtype=torch.float32).to(dev)
    ok = (draft_px > zero) & (target_px / draft_px >= u)
    ok = ok & (~is_ph)
    rejects = (~ok) & in_req
    no_reject = torch.full([bsz, 1], max_spec_len).to(dev)
    first_rej = torch.where(rejects.any(dim=1, keepdim=True),
                            rejects.float().argmax(dim=1, keepdim=True), no_reject)
    skip = (pos >= first_rej) & in_req
    keep = ok & (~skip)
    sampled = ~is_greedy
    update = sampled[:, None] & in_req & (~skip)
    at_rej = (pos == first_rej) & in_req & sampled[:, None]
    toks = torch.where(at_rej, rec, torch.where(keep, drafts, out[:, :max_spec_len]))
    out[:, :max_spec_len] = torch.where(update | at_rej, toks, out[:, :max_spec_len])
    bonus_rows = sampled & (first_rej.squeeze(1) >= n_req)
    width = out.shape[1]
    cols = torch.arange(width).to(dev)[None, :]
    bonus_rows = bonus_rows & (n_req < (torch.tensor([max_spec_len]).to(dev) + 1))
    bonus_at = (cols == n_req[:, None]) & bonus_rows[:, None]
    out[:] = torch.where(bonus_at, bonus_ids.view(-1, 1).expand(-1, width), out)


def _ascend_block(out, cu, draft_ids, draft_probs, target_probs, bonus_ids, recovered, uniform,
                  is_greedy, max_spec_len):
    """rejection_random_sample_block_verify_pytorch (no entropy verify)."""
    bsz, dev = out.shape[0], out.device
    n_req, pos, in_req, gidx, drafts, is_ph, draft_px, target_px = _ascend_gather(
        cu, draft_ids, draft_probs, target_probs, max_spec_len, bsz)
    n_req = n_req[:, None]
    u = uniform[gidx]
    rec = recovered[gidx]
    pi = (target_px / draft_px).clamp(max=1.0)
    pi = torch.cumprod(pi, dim=-1)
    u_run = torch.cumprod(u, dim=-1)
    legal = (draft_px > 0) & (pi >= u_run)
    legal = legal & in_req & (~is_ph)
    last_ok = torch.where(
        legal.any(dim=-1, keepdim=True),
        max_spec_len - legal.flip(dims=[-1]).float().argmax(dim=-1, keepdim=True) - 1, -1)
    sampled = (~is_greedy)[:, None]
    take = (pos <= last_ok) & in_req & sampled
    out[:, :max_spec_len] = torch.where(take, drafts, out[:, :max_spec_len])
    at_rej = (pos == last_ok + 1) & in_req & sampled
    out[:, :max_spec_len] = torch.where(at_rej, rec, out[:, :max_spec_len])
    bonus_rows = (last_ok + 1 >= n_req) & sampled
    cols = torch.arange(max_spec_len + 1).to(dev)[None, :]
    bonus_at = bonus_rows & (cols == n_req)
    out[:] = torch.where(bonus_at, bonus_ids.view(-1, 1).expand(-1, max_spec_len + 1), out)


def _ascend_step(cu_num_draft_tokens, draft_token_ids, draft_probs, target_logits, bonus_token_ids,
                 is_greedy, max_spec_len, verify):
    """rejection_sample's non-reduce fallback with all requests sampled: softmax, float64
    uniforms (generate_uniform_probs), per-request Exp(1) rows (sample_recovered_tokens), the
    recovered tokens, then the random (or block) verify into an int32 output."""
    bsz, dev = cu_num_draft_tokens.shape[0], target_logits.device
    n_tok, vocab = target_logits.shape
    out = torch.empty((bsz, max_spec_len + 1), dtype=torch.int32, device=dev)
    out.fill_(PLACEHOLDER)
    target_probs = target_logits.softmax(dim=-1, dtype=torch.float32)
    uniform = torch.rand((n_tok,), dtype=torch.float64, device=dev)
    q = torch.empty((bsz, vocab), dtype=torch.float32, device=dev)
    q.exponential_()
    recovered = _ascend_recovered(cu_num_draft_tokens, draft_token_ids, draft_probs,
                                  target_probs, q)
    verify(out, cu_num_draft_tokens, draft_token_ids, draft_probs, target_probs, bonus_token_ids,
           recovered, uniform, is_greedy, max_spec_len)
    return out


def vllm_ascend_random(cu_num_draft_tokens, draft_token_ids, draft_probs, target_logits,
                       bonus_token_ids, is_greedy, max_spec_len):
    return _ascend_step(cu_num_draft_tokens, draft_token_ids, draft_probs, target_logits,
                        bonus_token_ids, is_greedy, max_spec_len, _ascend_random)


def vllm_ascend_ngram(cu_num_draft_tokens, draft_token_ids, target_logits, bonus_token_ids,
                      is_greedy, max_spec_len):
    return _ascend_step(cu_num_draft_tokens, draft_token_ids, None, target_logits,
                        bonus_token_ids, is_greedy, max_spec_len, _ascend_random)


def vllm_ascend_block_verify(cu_num_draft_tokens, draft_token_ids, draft_probs, target_logits,
                             bonus_token_ids, is_greedy, max_spec_len):
    return _ascend_step(cu_num_draft_tokens, draft_token_ids, draft_probs, target_logits,
                        bonus_token_ids, is_greedy, max_spec_len, _ascend_block)


def vllm_ascend_greedy_spec_len_1(draft_token_ids, target_logits, bonus_token_ids):
    # rejection_sample's argmax, then rejection_greedy_sample_spec_len_1_pytorch
    bsz = bonus_token_ids.shape[0]
    out = torch.empty((bsz, 2), dtype=torch.int32, device=target_logits.device)
    out.fill_(PLACEHOLDER)
    target_argmax = target_logits.argmax(dim=-1).view(-1)
    same = draft_token_ids == target_argmax
    out[:, 0] = target_argmax
    bonus = bonus_token_ids.squeeze(1)
    out[:, 1] = torch.where(same, bonus, out[:, 1])
    return out


def vllm_ascend_greedy(cu_num_draft_tokens, draft_token_ids, target_logits, bonus_token_ids,
                       num_draft_tokens, max_spec_len):
    # rejection_sample's argmax, then rejection_greedy_sample_pytorch (all requests greedy)
    bsz, dev = len(num_draft_tokens), target_logits.device
    out = torch.empty((bsz, max_spec_len + 1), dtype=torch.int32, device=dev)
    out.fill_(PLACEHOLDER)
    target_argmax = target_logits.argmax(dim=-1).view(-1)
    n_tok = draft_token_ids.size(0)
    per_req = torch.tensor(num_draft_tokens).to(dev)
    greedy_rows = torch.ones(bsz, dtype=torch.bool, device=dev)
    starts = cu_num_draft_tokens - per_req
    tok_req = torch.repeat_interleave(torch.arange(bsz, device=dev), per_req)
    tok_pos = torch.arange(n_tok, device=dev) - starts[tok_req]
    mismatch = draft_token_ids != target_argmax
    pos_grid = torch.full((bsz, max_spec_len), -1, dtype=torch.long, device=dev)
    pos_grid[tok_req, tok_pos] = tok_pos
    mis_grid = torch.full((bsz, max_spec_len), False, dtype=torch.bool, device=dev)
    mis_grid[tok_req, tok_pos] = mismatch
    mis_at = torch.where(mis_grid, pos_grid, max_spec_len * 2)
    first_mis, _ = torch.min(mis_at, dim=1)
    none = first_mis == max_spec_len * 2
    first_mis[none] = per_req[none]
    n_copy = torch.minimum(first_mis + 1, per_req)
    cols = torch.arange(max_spec_len + 1, device=dev).expand(bsz, -1)
    copy = (cols < n_copy.unsqueeze(1)) & greedy_rows.unsqueeze(1)
    src = starts.unsqueeze(1) + cols
    out[copy] = target_argmax[src[copy]].to(out.dtype)
    wants_bonus = greedy_rows & (first_mis >= per_req)
    if torch.any(wants_bonus):
        rows = torch.where(wants_bonus)[0]
        out[rows, per_req[rows]] = bonus_token_ids.squeeze(1)[rows]
    return out


def _make_ascend(seed):
    r = _ragged(seed)
    return (r["cu"], r["flat_ids"], r["flat_q"], r["flat_t_logits"], r["bonus"],
            torch.zeros(B, dtype=torch.bool), K)


def _make_ascend_ngram(seed):
    r = _ragged(seed)
    return (r["cu"], r["flat_ids"], r["flat_t_logits"], r["bonus"],
            torch.zeros(B, dtype=torch.bool), K)


def _make_ascend_greedy(seed):
    r = _ragged(seed)
    drafts = _greedy_drafts(r["t_logits"].argmax(-1)[:, :K], r["g"])
    flat = torch.cat([drafts[i, :n] for i, n in enumerate(RAGGED)])
    return r["cu"], flat, r["flat_t_logits"], r["bonus"], list(RAGGED), K


def _make_ascend_len1(seed):
    g, t_logits, _, _, _, _ = _dists(seed, k=1)
    drafts = _greedy_drafts(t_logits.argmax(-1)[:, :1], g)
    drafts[2, 0] = t_logits[2, 0].argmax()  # two requests accept
    return (drafts.view(-1), t_logits[:, 0].contiguous(),
            torch.randint(0, V, (B, 1), generator=g, dtype=torch.int32))
