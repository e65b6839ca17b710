"""Held-out corpus: speculative-decoding verify steps transcribed from public codebases.

Each entry keeps the spelling of the original (its ops, order, .item()/.tolist() calls, python
loops, dtype casts, in-place ops).  Batch-1 originals are batched with a python loop over rows
that keeps the per-row spelling.  Randomness is drawn inside fn exactly where the original draws
it (torch global RNG, or python `random`, which make() seeds).
"""
import random

import torch
import torch.distributions as dist
import torch.nn.functional as F

V = 32


# ----------------------------------------------------------------------------- input helpers
def _g(seed):
    return torch.Generator().manual_seed(seed)


def _correlated(g, B, K, V=V, scale=1.5, noise=0.8):
    """Target logits [B,K+1,V], draft logits [B,K,V] close to the target, draft ids sampled
    from the draft distribution, so that some drafts pass p/q tests and some fail."""
    t_logits = torch.randn(B, K + 1, V, generator=g) * scale
    d_logits = t_logits[:, :K] + noise * torch.randn(B, K, V, generator=g)
    p = torch.softmax(t_logits, dim=-1)
    q = torch.softmax(d_logits, dim=-1)
    ids = torch.multinomial(q.reshape(-1, V), 1, generator=g).reshape(B, K)
    return t_logits, d_logits, p, q, ids


def _follow_then_break(g, ref, cuts, V=V):
    """Copy `ref` ([..., K]) up to a per-row cut, then put a different token at the cut and
    random tokens after it.  cut == K means the whole row follows `ref`."""
    out = ref.contiguous().clone()
    K = ref.shape[-1]
    flat = out.view(-1, K)
    for r, c in enumerate(cuts):
        if c < K:
            flat[r, c] = (flat[r, c] + 1 + torch.randint(0, V - 1, (1,), generator=g)) % V
            if c + 1 < K:
                flat[r, c + 1:] = torch.randint(0, V, (K - c - 1,), generator=g)
    return flat.reshape(ref.shape)


# ============================================================================= flashinfer
# flashinfer-ai/flashinfer, flashinfer/trace/templates/sampling.py,
# _chain_speculative_sampling_reference (the torch reference the trace test
# tests/trace/test_chain_speculative_sampling_reference_correctness.py checks the kernel against)
# The original is decorated with @torch.no_grad(); the decorator is written here as the
# equivalent `with torch.no_grad():` block (see report: the decorator form trips Dynamo's
# global-import of this harness-loaded module, independent of the backend).
def flashinfer_chain_speculative_sampling_reference(draft_probs, draft_token_ids, target_probs):
    with torch.no_grad():
        B, S = draft_token_ids.shape
        dp = draft_probs.to(torch.float32)
        tp = target_probs.to(torch.float32)
        out = torch.full((B, S + 1), -1, dtype=torch.int32, device=draft_token_ids.device)
        for b in range(B):
            for s in range(S):
                tok = int(draft_token_ids[b, s].item())
                if tp[b, s, tok] >= dp[b, s, tok]:
                    out[b, s] = tok
                else:
                    out[b, s] = int(tp[b, s].argmax().item())
                    break
            else:
                out[b, S] = int(tp[b, S].argmax().item())
        return out


def _make_flashinfer(seed):
    g = _g(seed)
    _, _, p, q, ids = _correlated(g, 4, 4, noise=0.3)
    return (q, ids.to(torch.int32), p)


# ============================================================================= vLLM v1 tests
# vllm-project/vllm, tests/v1/sample/test_rejection_sampler.py, native_sample_recovered_tokens
# (PyTorch reference for the triton recovered-token kernel).  No per-request generators here
# (the test's generators dict is empty in the unseeded case), so only the global q.exponential_().
def vllm_v1_native_sample_recovered_tokens(max_spec_len, num_draft_tokens, cu_num_draft_tokens,
                                           draft_token_ids, draft_probs, target_probs):
    batch_size = len(num_draft_tokens)
    vocab_size = target_probs.shape[-1]
    q_dtype = torch.float32

    q = torch.empty((batch_size, vocab_size), dtype=q_dtype, device=target_probs.device)
    q.exponential_()

    inv_q = q.reciprocal()

    out = torch.empty_like(draft_token_ids)

    for req_idx in range(batch_size):
        start_idx = 0 if req_idx == 0 else int(cu_num_draft_tokens[req_idx - 1].item())
        end_idx = int(cu_num_draft_tokens[req_idx].item())
        num_tokens = end_idx - start_idx

        for pos in range(max_spec_len):
            if pos >= num_tokens:
                continue
            token_idx = start_idx + pos

            if draft_probs is None:
                prob = target_probs[token_idx].clone()
                draft_token_id = draft_token_ids[token_idx]
                prob[draft_token_id] = 0.0
            else:
                prob = (target_probs[token_idx] - draft_probs[token_idx]).clamp_min_(0.0)

            score = prob * inv_q[req_idx]
            recovered_id = torch.argmax(score, dim=-1)
            out[token_idx] = recovered_id
    return out


def _make_vllm_v1_recovered(seed, ragged, with_draft):
    g = _g(seed)
    B, K = 3, 4
    _, _, p, q, ids = _correlated(g, B, K)
    num_draft = [4, 2, 3] if ragged else [K] * B
    rows_p, rows_q, rows_ids = [], [], []
    for b, n in enumerate(num_draft):
        rows_p.append(p[b, :n])
        rows_q.append(q[b, :n])
        rows_ids.append(ids[b, :n])
    target_probs = torch.cat(rows_p)
    draft_probs = torch.cat(rows_q) if with_draft else None
    draft_ids = torch.cat(rows_ids).to(torch.int32)
    cu = torch.tensor(num_draft).cumsum(0).to(torch.int32)
    return (max(num_draft), num_draft, cu, draft_ids, draft_probs, target_probs)


# ============================================================================= vLLM V0 sampler
# vllm-project/vllm, vllm/model_executor/layers/rejection_sampler.py @700e4a36 (RejectionSampler
# forward / _batch_modified_rejection_sampling / _get_accepted / _get_recovered_probs /
# _multinomial, torch path, unseeded) + vllm/model_executor/layers/spec_decode_base_sampler.py
# @584e4376 SpecDecodeBaseSampler._create_output (the metric counters are dropped).
def _v0_get_accepted(target_probs, draft_probs, draft_token_ids):
    batch_size, k, _ = draft_probs.shape
    batch_indices = torch.arange(batch_size, device=target_probs.device)[:, None]
    probs_indicies = torch.arange(k, device=target_probs.device)

    selected_draft_probs = draft_probs[batch_indices, probs_indicies, draft_token_ids]
    selected_target_probs = target_probs[batch_indices, probs_indicies, draft_token_ids]

    uniform_rand = torch.rand_like(selected_target_probs)

    capped_ratio = torch.minimum(
        selected_target_probs / selected_draft_probs,
        torch.full((1, ), 1, device=target_probs.device))
    accepted = uniform_rand < capped_ratio
    return accepted


def _v0_get_recovered_probs(target_probs, draft_probs):
    _, k, _ = draft_probs.shape
    difference = target_probs - draft_probs
    f = torch.clamp(difference, min=torch.finfo(torch.float32).tiny)
    recovered_probs = f / torch.sum(f, dim=-1).reshape(-1, k, 1)
    return recovered_probs


def _v0_multinomial(probs, num_samples, k):
    if num_samples > 1:
        probs = probs[:, None, :].expand(probs.shape[0], num_samples,
                                         probs.shape[1]).contiguous().view(-1, probs.shape[1])
    q = torch.empty_like(probs)
    q.exponential_(1.0)
    return probs.div_(q).argmax(dim=1).view(-1, num_samples)


def _v0_create_output(accepted, substitute_token_ids, draft_token_ids, bonus_token_ids):
    batch_size, k = substitute_token_ids.shape
    bonus_token_ids = bonus_token_ids.squeeze(-1)
    limits = (accepted == 0).max(1).indices
    limits[~(accepted == 0).any(1)] = k

    indices = torch.arange(k, device=accepted.device).unsqueeze(0)
    accepted_mask = indices < limits.unsqueeze(1)
    after_false_mask = indices == limits.unsqueeze(1)

    output_with_bonus_tokens = -torch.ones((batch_size, k + 1), dtype=torch.int64,
                                           device=accepted.device)
    output = output_with_bonus_tokens[:, :k]

    output[:, :k] = torch.where(accepted_mask, draft_token_ids, -torch.ones_like(draft_token_ids))

    output_with_bonus_tokens[:, -1] = torch.where(output[:, -1] != -1, bonus_token_ids, -1)

    output.mul_(~after_false_mask).add_(substitute_token_ids.mul(after_false_mask))
    return output_with_bonus_tokens


def vllm_v0_rejection_sampler_forward(target_probs, bonus_token_ids, draft_probs, draft_token_ids):
    batch_size, k, vocab_size = draft_probs.shape
    accepted = _v0_get_accepted(target_probs, draft_probs, draft_token_ids)
    recovered_probs = _v0_get_recovered_probs(target_probs, draft_probs).reshape(
        batch_size * k, vocab_size)
    recovered_token_ids = _v0_multinomial(recovered_probs, num_samples=1, k=k).reshape(batch_size, k)
    return _v0_create_output(accepted, recovered_token_ids, draft_token_ids, bonus_token_ids)


def _make_vllm_v0_rejection(seed):
    g = _g(seed)
    B, K = 4, 4
    _, _, p, q, ids = _correlated(g, B, K)
    bonus = torch.randint(0, V, (B, 1), generator=g)
    return (p[:, :K].contiguous(), bonus, q, ids)


# vllm-project/vllm, vllm/model_executor/layers/typical_acceptance_sampler.py @60b5eb0c
# TypicalAcceptanceSampler.forward/_evaluate_accepted_tokens/_get_recovered_token_ids
# + the same _create_output as above.  Defaults posterior_threshold=0.09, posterior_alpha=0.3.
def vllm_v0_typical_acceptance_sampler(target_with_bonus_probs, bonus_token_ids, draft_probs,
                                       draft_token_ids, posterior_threshold=0.09,
                                       posterior_alpha=0.3):
    target_probs = target_with_bonus_probs[:, :-1]
    device = target_probs.device
    candidates_prob = torch.gather(
        target_probs, dim=-1, index=draft_token_ids.unsqueeze(-1)).squeeze(-1)
    epsilon = 1e-5
    posterior_entropy = -torch.sum(target_probs * torch.log(target_probs + epsilon), dim=-1)
    threshold = torch.minimum(
        torch.ones_like(posterior_entropy, device=device) * posterior_threshold,
        torch.exp(-posterior_entropy) * posterior_alpha,
    )
    accepted = candidates_prob > threshold
    recovered_token_ids = torch.argmax(target_probs, dim=-1)
    return _v0_create_output(accepted, recovered_token_ids, draft_token_ids, bonus_token_ids)


def _make_vllm_typical(seed):
    g = _g(seed)
    B, K = 4, 4
    t_logits = torch.randn(B, K + 1, V, generator=g) * 3.0
    p = torch.softmax(t_logits, dim=-1)
    ids = _follow_then_break(g, p[:, :K].argmax(-1), [0, 2, 4, 3])
    q = torch.softmax(torch.randn(B, K, V, generator=g), dim=-1)  # unused by the sampler
    bonus = torch.randint(0, V, (B, 1), generator=g)
    return (p, bonus, q, ids)


# ============================================================================= vLLM block verify
# vllm-project/vllm, vllm/v1/sample/rejection_sampler.py @974eaf34:
# rejection_random_sample_block_verify_pytorch + sample_recovered_tokens_blockwise_pytorch (the
# PyTorch references exercised by tests/v1/sample/test_rejection_sampler_block_verify.py), called
# the way rejection_sample() calls them on its block path (uniform float64 coins first, then one
# Exp(1) q row per request, softmax(dtype=float32) of the target logits, PLACEHOLDER -1 output).
def _block_verify_pytorch(output_token_ids, cu_num_draft_tokens, draft_token_ids, draft_probs,
                          target_probs, bonus_token_ids, recovered_token_ids, uniform_probs,
                          is_greedy, max_spec_len, vocab_size):
    del vocab_size
    batch_size = output_token_ids.shape[0]
    device = output_token_ids.device

    cu_start = torch.cat([torch.zeros(1, dtype=cu_num_draft_tokens.dtype, device=device),
                          cu_num_draft_tokens[:-1]])
    num_draft_per_batch = cu_num_draft_tokens - cu_start
    gamma = num_draft_per_batch.to(torch.long)

    i_indices = torch.arange(1, max_spec_len + 1, device=device)[None, :]
    valid_mask = i_indices <= num_draft_per_batch[:, None]

    global_token_indices = (cu_start[:, None] + i_indices - 1).clamp(0, draft_token_ids.shape[0] - 1)
    draft_tokens = draft_token_ids[global_token_indices]
    flat_indices = global_token_indices.flatten()
    flat_draft_tokens = draft_tokens.flatten()

    draft_token_probs = draft_probs[flat_indices, flat_draft_tokens].view(batch_size, max_spec_len)
    target_token_probs = target_probs[flat_indices, flat_draft_tokens].view(batch_size, max_spec_len)
    uniform_token_probs = uniform_probs[global_token_indices]
    recovered_tokens = recovered_token_ids[global_token_indices]

    ratio = torch.where(
        draft_token_probs > 0,
        target_token_probs / draft_token_probs.clamp(min=1e-10),
        torch.zeros_like(draft_token_probs),
    )

    p_prefix = torch.ones((batch_size, max_spec_len + 1), dtype=torch.float32, device=device)
    for k in range(max_spec_len):
        p_prefix[:, k + 1] = (p_prefix[:, k] * ratio[:, k]).clamp(max=1.0)

    p_grid = p_prefix[:, 1:]
    h_block = torch.zeros((batch_size, max_spec_len), dtype=torch.float32, device=device)
    intermediate_mask = i_indices < num_draft_per_batch[:, None]

    if torch.any(intermediate_mask):
        residual_mass = torch.zeros_like(p_grid)
        flat_intermediate_mask = intermediate_mask.flatten()
        flat_current_token_indices = flat_indices[flat_intermediate_mask]
        flat_p_grid = p_grid.flatten()[flat_intermediate_mask]
        flat_residual_mass = torch.clamp(
            flat_p_grid[:, None] * target_probs[flat_current_token_indices]
            - draft_probs[flat_current_token_indices],
            min=0.0,
        ).sum(dim=-1)
        residual_mass[intermediate_mask] = flat_residual_mass

        denom = residual_mass + (1.0 - p_grid)
        h_block = torch.where(
            intermediate_mask,
            torch.where(denom > 0, residual_mass / denom, torch.zeros_like(denom)),
            h_block,
        )

    batch_indices = torch.arange(batch_size, device=device)
    last_pos = (gamma - 1).clamp(min=0)
    h_block[batch_indices, last_pos] = p_prefix[batch_indices, gamma.clamp(max=max_spec_len)]

    non_greedy_mask = (~is_greedy)[:, None]
    accepted_mask = (valid_mask & (uniform_token_probs.to(torch.float32) <= h_block)
                     & non_greedy_mask)

    last_accept_i = (
        torch.where(accepted_mask, i_indices.to(torch.long),
                    torch.zeros_like(i_indices, dtype=torch.long))
        .max(dim=1)
        .values
    )

    accept_span = (i_indices <= last_accept_i[:, None]) & valid_mask & non_greedy_mask
    output_token_ids[:, :max_spec_len] = torch.where(
        accept_span, draft_tokens, output_token_ids[:, :max_spec_len])

    reject_mask = (i_indices == last_accept_i[:, None] + 1) & valid_mask & non_greedy_mask
    output_token_ids[:, :max_spec_len] = torch.where(
        reject_mask, recovered_tokens, output_token_ids[:, :max_spec_len])

    all_positions = torch.arange(max_spec_len + 1, device=device)[None, :]
    bonus_mask = (
        (last_accept_i[:, None] >= num_draft_per_batch[:, None])
        & non_greedy_mask
        & (all_positions == num_draft_per_batch[:, None])
    )
    output_token_ids[:] = torch.where(
        bonus_mask,
        bonus_token_ids.expand(-1, max_spec_len + 1).to(output_token_ids.dtype),
        output_token_ids,
    )


def _blockwise_recovered_pytorch(output_token_ids, cu_num_draft_tokens, draft_token_ids,
                                 draft_probs, target_probs, q, vocab_size):
    del vocab_size
    device = output_token_ids.device
    num_tokens = output_token_ids.shape[0]
    batch_size = cu_num_draft_tokens.shape[0]
    if num_tokens == 0:
        return

    cu_start = torch.cat([torch.zeros(1, dtype=cu_num_draft_tokens.dtype, device=device),
                          cu_num_draft_tokens[:-1]])
    token_indices = torch.arange(num_tokens, device=device)
    in_range_mask = (token_indices[:, None] >= cu_start[None, :]) & (
        token_indices[:, None] < cu_num_draft_tokens[None, :])
    token_to_batch = torch.argmax(in_range_mask.int(), dim=1)
    token_to_batch = torch.where(in_range_mask.any(dim=1), token_to_batch,
                                 torch.zeros_like(token_to_batch))
    pos_in_seq = token_indices - cu_start[token_to_batch]

    max_spec_len = int((cu_num_draft_tokens - cu_start).max().item())

    draft_token_scalar_probs = draft_probs[token_indices, draft_token_ids]
    target_token_scalar_probs = target_probs[token_indices, draft_token_ids]
    per_token_ratio = torch.where(
        draft_token_scalar_probs > 0,
        target_token_scalar_probs / draft_token_scalar_probs.clamp(min=1e-10),
        torch.zeros_like(target_token_scalar_probs),
    )

    ratio_grid = torch.ones((batch_size, max_spec_len), device=device, dtype=torch.float32)
    ratio_grid[token_to_batch, pos_in_seq] = per_token_ratio

    p_prefix = torch.ones((batch_size, max_spec_len + 1), device=device, dtype=torch.float32)
    for k in range(max_spec_len):
        p_prefix[:, k + 1] = (p_prefix[:, k] * ratio_grid[:, k]).clamp(max=1.0)

    p_i = p_prefix[token_to_batch, pos_in_seq]
    p_i_expanded = p_i[:, None]

    residual = torch.clamp(p_i_expanded * target_probs - draft_probs, min=0.0)

    q_values = q[token_to_batch]
    eps = 1e-10
    q_values_safe = torch.where(q_values == 0, eps, q_values)
    q_values_safe = torch.where(torch.isinf(q_values), eps, q_values_safe)
    prob_over_q = torch.where(
        (q_values == 0) | torch.isinf(q_values),
        torch.full_like(residual, -1e10),
        residual / q_values_safe,
    )

    output_token_ids[:] = torch.argmax(prob_over_q, dim=1).to(output_token_ids.dtype)


def vllm_v1_block_verify_step(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens,
                              draft_probs, target_logits, bonus_token_ids, temperature):
    batch_size = len(num_draft_tokens)
    num_tokens = draft_token_ids.shape[0]
    vocab_size = target_logits.shape[-1]
    device = target_logits.device
    output_token_ids = torch.full((batch_size, max_spec_len + 1), -1, dtype=torch.int32,
                                  device=device)
    is_greedy = temperature == 0
    uniform_probs = torch.rand((num_tokens,), dtype=torch.float64, device=device)
    target_probs = target_logits.softmax(dim=-1, dtype=torch.float32)
    q = torch.empty((batch_size, vocab_size), dtype=torch.float32, device=device)
    q.exponential_()
    recovered_token_ids = torch.empty_like(draft_token_ids)
    _blockwise_recovered_pytorch(recovered_token_ids, cu_num_draft_tokens, draft_token_ids,
                                 draft_probs, target_probs, q, vocab_size)
    _block_verify_pytorch(output_token_ids, cu_num_draft_tokens, draft_token_ids, draft_probs,
                          target_probs, bonus_token_ids, recovered_token_ids, uniform_probs,
                          is_greedy, max_spec_len, vocab_size)
    return output_token_ids


def _make_vllm_block(seed):
    g = _g(seed)
    B, K = 3, 4
    t_logits, _, _, q, ids = _correlated(g, B, K, noise=0.5)
    num_draft = [4, 3, 4]
    tl_rows, q_rows, id_rows = [], [], []
    for b, n in enumerate(num_draft):
        tl_rows.append(t_logits[b, :n])
        q_rows.append(q[b, :n])
        id_rows.append(ids[b, :n])
    cu = torch.tensor(num_draft).cumsum(0).to(torch.int32)
    bonus = torch.randint(0, V, (B, 1), generator=g)
    temperature = torch.ones(B)
    return (torch.cat(id_rows), num_draft, max(num_draft), cu, torch.cat(q_rows).contiguous(),
            torch.cat(tl_rows).contiguous(), bonus, temperature)


# ============================================================================= SGLang
# sgl-project/sglang, python/sglang/srt/speculative/eagle_utils.py, verify_tree_greedy_native
# (the torch-native NPU fallback of sgl_kernel.verify_tree_greedy; 2025 revision).  Buffers are
# created the way sgl-kernel/tests/speculative/test_eagle_utils.py creates them.
def _sglang_verify_tree_greedy_native(predicts, accept_index, accept_token_num, candidates,
                                      retrive_index, retrive_next_token, retrive_next_sibling,
                                      target_predict, topk=-1):
    batch_size, num_draft_tokens = candidates.shape

    if num_draft_tokens == 2 and accept_index.shape[1] == 2 and topk == 1:
        comparison_result = candidates[:, 1] == target_predict[:, 0]

        predicts = target_predict.flatten()

        accept_index = torch.arange(
            0, num_draft_tokens * batch_size, device=candidates.device, dtype=torch.long
        ).reshape(batch_size, num_draft_tokens)
        comparison_result = comparison_result.to(torch.int64)
        accept_index_mask = accept_index[:, 1] * comparison_result
        accept_index[:, 1] = accept_index_mask - (1 - comparison_result)

        accept_token_num = comparison_result.int()
        return predicts, accept_index, accept_token_num

    for bx in range(batch_size):
        cur_candidates = candidates[bx]
        cur_retrive_index = retrive_index[bx]
        cur_next_token = retrive_next_token[bx]
        cur_next_sibling = retrive_next_sibling[bx]
        cur_target = target_predict[bx]

        last_accepted_idx = cur_retrive_index[0]
        accept_index[bx, 0] = last_accepted_idx
        num_accepted = 0
        cur_node = 0

        for _ in range(1, num_draft_tokens):
            cur_node = cur_next_token[cur_node]
            found = False
            while cur_node != -1:
                draft_idx = cur_retrive_index[cur_node]
                draft_token = cur_candidates[cur_node]
                target_token = cur_target[last_accepted_idx - num_draft_tokens * bx]

                if draft_token == target_token:
                    predicts[last_accepted_idx] = target_token
                    num_accepted += 1
                    accept_index[bx, num_accepted] = draft_idx
                    last_accepted_idx = draft_idx
                    found = True
                    break
                else:
                    cur_node = cur_next_sibling[cur_node]
            if not found:
                break

        accept_token_num[bx] = num_accepted
        predicts[last_accepted_idx] = cur_target[last_accepted_idx - num_draft_tokens * bx]
    return predicts, accept_index, accept_token_num


def sglang_verify_tree_greedy(candidates, retrive_index, retrive_next_token, retrive_next_sibling,
                              target_logits, num_spec_step, topk):
    target_predict = torch.argmax(target_logits, dim=-1)
    bs, num_draft_tokens = candidates.shape
    predicts = torch.full((bs * num_draft_tokens,), -1, dtype=torch.int32, device=candidates.device)
    accept_index = torch.full((bs, num_spec_step), -1, dtype=torch.int32, device=candidates.device)
    accept_token_num = torch.full((bs,), 0, dtype=torch.int32, device=candidates.device)
    return _sglang_verify_tree_greedy_native(
        predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
        retrive_next_sibling, target_predict, topk=topk)


def _make_sglang_chain(seed, K, B):
    g = _g(seed)
    N = K + 1  # root (verified token) + K chain drafts
    t_logits = torch.randn(B, N, V, generator=g) * 2
    tp = t_logits.argmax(-1)
    cuts = [[0, K // 2, K][b % 3] for b in range(B)]
    drafts = _follow_then_break(g, tp[:, :K], cuts)
    root = torch.randint(0, V, (B, 1), generator=g)
    candidates = torch.cat([root, drafts], dim=1)
    retrive_index = torch.arange(B * N).reshape(B, N)
    nxt = torch.arange(1, N + 1).repeat(B, 1)
    nxt[:, -1] = -1
    sib = torch.full((B, N), -1, dtype=torch.int64)
    topk = 1 if K == 1 else -1
    return (candidates, retrive_index, nxt, sib, t_logits, K + 1, topk)


def _make_sglang_tree(seed):
    # tree layout of sgl-kernel/tests/speculative/test_eagle_utils.py, random target logits
    g = _g(seed)
    B, N = 2, 6
    t_logits = torch.randn(B, N, V, generator=g) * 2
    tp = t_logits.argmax(-1)
    nxt = torch.tensor([[1, 2, -1, 4, 5, -1], [4, 2, 3, -1, 5, -1]])
    sib = torch.tensor([[-1, 3, -1, -1, -1, -1], [-1, -1, -1, -1, 1, -1]])
    cand = torch.randint(0, V, (B, N), generator=g)
    # row 0: first child (1) wrong, its sibling (3) right, then 4 right, 5 wrong
    cand[0, 1] = (tp[0, 0] + 1) % V
    cand[0, 3] = tp[0, 0]
    cand[0, 4] = tp[0, 3]
    cand[0, 5] = (tp[0, 4] + 3) % V
    # row 1: first child (4) wrong, sibling 1 right, then 2 and 3 right (full depth)
    cand[1, 4] = (tp[1, 0] + 2) % V
    cand[1, 1] = tp[1, 0]
    cand[1, 2] = tp[1, 1]
    cand[1, 3] = tp[1, 2]
    retrive_index = torch.arange(B * N).reshape(B, N)
    return (cand, retrive_index, nxt, sib, t_logits, 4, -1)


# ============================================================================= ReDrafter
# apple/ml-recurrent-drafter, recurrent_drafting/recurrent_drafting.py @d4f4a726:
# _greedy_accept_candidate_tokens minus the KV-cache/input_ids update
# (_greedy_choose_from_candidates + _greedy_prepare_next_input).
def _select_one_per_row(x, batch_index):
    return x[torch.arange(x.shape[0], device=x.device), batch_index]


def redrafter_greedy_accept_candidate_tokens(beams_by_drafter, logits_by_llm, last_hidden_state):
    beams_by_llm = torch.argmax(logits_by_llm, dim=-1)
    beams_by_drafter_without_init = beams_by_drafter[:, :, 1:]
    beams_by_llm_without_last = beams_by_llm[:, :, :-1]
    compare = beams_by_drafter_without_init == beams_by_llm_without_last
    n_tokens_in_seqs = torch.sum(torch.cumprod(compare, dim=-1), dim=-1)
    n_tokens_in_seq, seq_in_beam = torch.max(n_tokens_in_seqs, dim=-1)

    selected_seqs = _select_one_per_row(beams_by_llm, seq_in_beam)
    next_tokens = _select_one_per_row(selected_seqs, n_tokens_in_seq)
    selected_last_hidden_state = _select_one_per_row(last_hidden_state, seq_in_beam)
    accepted_last_token_state = _select_one_per_row(selected_last_hidden_state, n_tokens_in_seq)
    return accepted_last_token_state, next_tokens, n_tokens_in_seq, seq_in_beam


def _make_redrafter_greedy(seed):
    g = _g(seed)
    B, W, L, H = 3, 3, 5, 8
    logits = torch.randn(B, W, L, V, generator=g) * 2
    llm = logits.argmax(-1)
    cuts = [0, 1, 2, 4, 0, 3, 1, 4, 2]  # per (batch, beam)
    drafted = _follow_then_break(g, llm[:, :, :-1], cuts)
    init = torch.randint(0, V, (B, 1, 1), generator=g).expand(B, W, 1)
    beams = torch.cat([init, drafted], dim=-1)
    hidden = torch.randn(B, W, L, H, generator=g)
    return (beams, logits, hidden)


# apple/ml-recurrent-drafter, recurrent_drafting/recurrent_drafting.py @d4f4a726:
# _accept_candidate_tokens minus the KV-cache update (log_softmax, _choose_from_candidates,
# _prepare_next_input with the relu(p - q) resample and Categorical sample).
def redrafter_accept_candidate_tokens(beams, log_probs_by_drafter, logits_by_llm,
                                      last_hidden_state, temperature):
    log_probs_by_llm = (logits_by_llm / temperature).log_softmax(dim=-1)

    # _choose_from_candidates
    lp_llm = log_probs_by_llm[:, :, :-1, :]
    drafted_tokens = beams[..., 1:]
    drafted_tokens = drafted_tokens.unsqueeze(dim=-1)
    by_drafter = torch.gather(log_probs_by_drafter, dim=-1, index=drafted_tokens).squeeze(dim=-1)
    by_llm = torch.gather(lp_llm, dim=-1, index=drafted_tokens).squeeze(dim=-1)
    compare = torch.lt(torch.rand(by_drafter.shape, device=by_drafter.device),
                       torch.exp(by_llm - by_drafter))
    n_tokens_in_seqs = torch.sum(
        torch.cumsum(compare, dim=-1) == torch.arange(1, compare.shape[-1] + 1, device=compare.device),
        dim=-1,
    )
    n_tokens_in_seq, seq_in_beam = torch.max(n_tokens_in_seqs, dim=-1)

    # _prepare_next_input
    candidate_length = log_probs_by_drafter.shape[-2]
    last_log_probs_by_llm = log_probs_by_llm[:, :, -1, :]
    log_probs_by_llm = log_probs_by_llm[:, :, :-1, :]

    selected_log_probs_by_drafter = _select_one_per_row(log_probs_by_drafter, seq_in_beam)
    selected_log_probs_by_llm = _select_one_per_row(log_probs_by_llm, seq_in_beam)
    selected_last_log_probs_by_llm = _select_one_per_row(last_log_probs_by_llm, seq_in_beam)
    selected_last_hidden_state = _select_one_per_row(last_hidden_state, seq_in_beam)

    entire_beam_accepted = torch.eq(n_tokens_in_seq, candidate_length).unsqueeze(dim=-1)
    beam_last_probs = torch.exp(selected_last_log_probs_by_llm)
    next_token_index = n_tokens_in_seq - (n_tokens_in_seq == candidate_length).to(
        n_tokens_in_seq.dtype)
    next_token_log_probs_by_drafter = _select_one_per_row(selected_log_probs_by_drafter,
                                                          next_token_index)
    next_token_log_probs_by_llm = _select_one_per_row(selected_log_probs_by_llm, next_token_index)
    probs = torch.relu(
        torch.exp(next_token_log_probs_by_llm) - torch.exp(next_token_log_probs_by_drafter))
    probs = torch.where(entire_beam_accepted, beam_last_probs, probs)
    # the module sets dist.Distribution.set_default_validate_args(False) globally
    next_tokens = dist.Categorical(probs=probs, validate_args=False).sample()
    accepted_last_token_state = _select_one_per_row(selected_last_hidden_state, n_tokens_in_seq)
    return accepted_last_token_state, next_tokens, n_tokens_in_seq, seq_in_beam


def _make_redrafter_sample(seed):
    g = _g(seed)
    B, W, L, H = 3, 2, 5, 8
    T = 0.8
    logits = torch.randn(B, W, L, V, generator=g) * 2
    lp_drafter = (logits[:, :, :-1] / T + 0.6 * torch.randn(B, W, L - 1, V, generator=g)).log_softmax(-1)
    drafted = torch.multinomial(lp_drafter.exp().reshape(-1, V), 1, generator=g).reshape(B, W, L - 1)
    init = torch.randint(0, V, (B, 1, 1), generator=g).expand(B, W, 1)
    beams = torch.cat([init, drafted], dim=-1)
    hidden = torch.randn(B, W, L, H, generator=g)
    return (beams, lp_drafter, logits, hidden, T)


# ============================================================================= Spec-Bench
# hemingkx/Spec-Bench, model/sps/decoding.py @fd2c1cd7, _speculative_sampling (HF assisted
# generation, algorithm 1 of Leviathan et al.), batch 1 -> python loop over rows.
def _sps_speculative_sampling(candidate_input_ids, candidate_logits, candidate_length, new_logits,
                              last_assistant_token_is_eos, max_matches):
    new_candidate_input_ids = candidate_input_ids[:, -candidate_length:]
    q = candidate_logits.softmax(dim=-1)
    q_i = q[:, torch.arange(candidate_length), new_candidate_input_ids].squeeze(0, 1)
    p = new_logits.softmax(dim=-1)
    p_i = p[:, torch.arange(candidate_length), new_candidate_input_ids].squeeze(0, 1)
    probability_ratio = p_i / q_i

    r_i = torch.rand_like(probability_ratio)
    is_accepted = r_i <= probability_ratio
    n_matches = ((~is_accepted).cumsum(dim=-1) < 1).sum()

    if last_assistant_token_is_eos and n_matches == candidate_length:
        n_matches -= 1
        valid_tokens = new_candidate_input_ids[:, : n_matches + 1]
    else:
        n_matches = min(n_matches, max_matches)

        gamma = min(candidate_logits.shape[1], max_matches)
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


def specbench_sps_speculative_sampling(candidate_input_ids, candidate_logits, new_logits,
                                       candidate_length, max_matches):
    valid, matches = [], []
    for b in range(candidate_input_ids.shape[0]):
        vt, n = _sps_speculative_sampling(candidate_input_ids[b:b + 1], candidate_logits[b:b + 1],
                                          candidate_length, new_logits[b:b + 1], False, max_matches)
        valid.append(vt)
        matches.append(n)
    return valid, matches


def _make_sps(seed):
    g = _g(seed)
    B, K, P = 4, 4, 3
    t_logits, d_logits, _, _, ids = _correlated(g, B, K, noise=0.6)
    prompt = torch.randint(0, V, (B, P), generator=g)
    cand = torch.cat([prompt, ids], dim=1)
    return (cand, d_logits, t_logits, K, 100)


# hemingkx/Spec-Bench, model/pld/pld.py @fd2c1cd7, greedy_search_pld (the verify lines after the
# forward pass), batch 1 -> python loop over rows.
def specbench_pld_greedy_verify(candidate_input_ids, new_logits, candidate_length, max_len, cur_len):
    valid, matches = [], []
    for b in range(candidate_input_ids.shape[0]):
        row_logits = new_logits[b:b + 1]
        row_ids = candidate_input_ids[b:b + 1]
        selected_tokens = row_logits.argmax(dim=-1)
        candidate_new_tokens = row_ids[:, -candidate_length:]
        n_matches = ((~(candidate_new_tokens == selected_tokens[:, :-1])).cumsum(dim=-1) < 1).sum()
        n_matches = min(n_matches, max_len - cur_len - 1)
        valid_tokens = selected_tokens[:, : n_matches + 1]
        valid.append(valid_tokens)
        matches.append(n_matches)
    return valid, matches


def _make_pld(seed):
    g = _g(seed)
    B, K, P = 4, 5, 6
    t_logits = torch.randn(B, K + 1, V, generator=g) * 2
    drafts = _follow_then_break(g, t_logits[:, :K].argmax(-1), [0, 2, 5, 4])
    prompt = torch.randint(0, V, (B, P), generator=g)
    cand = torch.cat([prompt, drafts], dim=1)
    return (cand, t_logits, K, 256, P)


# hemingkx/Spec-Bench, model/medusa/utils.py @fd2c1cd7, evaluate_posterior (temperature == 0
# branch, and the typical-acceptance branch), batch 1 over candidate paths -> loop over rows.
def _medusa_evaluate_posterior(logits, candidates, temperature, posterior_threshold,
                               posterior_alpha):
    if temperature == 0:
        posterior_mask = (
            candidates[:, 1:].to(logits.device) == torch.argmax(logits[:, :-1], dim=-1)
        ).int()
        candidates_accept_length = (torch.cumprod(posterior_mask, dim=1)).sum(dim=1)
        accept_length = candidates_accept_length.max()
        if accept_length == 0:
            best_candidate = torch.tensor(0, dtype=torch.long, device=candidates.device)
        else:
            best_candidate = torch.argmax(candidates_accept_length).to(torch.long)
        return best_candidate, accept_length
    posterior_prob = torch.softmax(logits[:, :-1] / temperature, dim=-1)
    candidates_prob = torch.gather(
        posterior_prob, dim=-1, index=candidates[:, 1:].unsqueeze(-1)).squeeze(-1)
    posterior_entropy = -torch.sum(posterior_prob * torch.log(posterior_prob + 1e-5), dim=-1)
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
        likelihood = torch.sum(torch.log(candidates_prob[best_candidates, :accept_length]), dim=-1)
        best_candidate = best_candidates[torch.argmax(likelihood)]
    return best_candidate, accept_length


def specbench_medusa_evaluate_posterior(logits, candidates, temperature, posterior_threshold,
                                        posterior_alpha):
    best, lens = [], []
    for b in range(logits.shape[0]):
        bc, al = _medusa_evaluate_posterior(logits[b], candidates[b], temperature,
                                            posterior_threshold, posterior_alpha)
        best.append(bc)
        lens.append(al)
    return best, lens


def _make_medusa(seed, temperature, cuts):
    g = _g(seed)
    B, C, L = 3, 3, 5
    logits = torch.randn(B, C, L, V, generator=g) * 3
    root = torch.randint(0, V, (B, 1, 1), generator=g).expand(B, C, 1)
    drafts = _follow_then_break(g, logits[:, :, :-1].argmax(-1), cuts)
    candidates = torch.cat([root, drafts], dim=-1)
    return (logits, candidates, temperature, 0.09, 0.3)


# hemingkx/Spec-Bench, model/hydra/utils.py @fd2c1cd7, evaluate_posterior (typical branch with the
# per-path max_accepts cap = torch.sum(retrieve_indices > 0, dim=1)), loop over rows.
def _hydra_evaluate_posterior(logits, candidates, temperature, posterior_threshold,
                              posterior_alpha, max_accepts):
    if temperature == 0:
        posterior_mask = (candidates[:, 1:] == torch.argmax(logits[:, :-1], dim=-1)).int()
        candidates_accept_length = (torch.cumprod(posterior_mask, dim=1)).sum(dim=1)
        accept_length = (torch.minimum(candidates_accept_length, max_accepts)).max()
        if accept_length == 0:
            best_candidate = torch.tensor(0, dtype=torch.long, device=candidates.device)
        else:
            best_candidate = torch.argmax(candidates_accept_length).to(torch.long)
        return best_candidate, accept_length
    posterior_prob = torch.softmax(logits[:, :-1] / temperature, dim=-1)
    candidates_prob = torch.gather(
        posterior_prob, dim=-1, index=candidates[:, 1:].unsqueeze(-1)).squeeze(-1)
    posterior_entropy = -torch.sum(posterior_prob * torch.log(posterior_prob + 1e-5), dim=-1)
    threshold = torch.minimum(
        torch.ones_like(posterior_entropy) * posterior_threshold,
        torch.exp(-posterior_entropy) * posterior_alpha,
    )
    posterior_mask = candidates_prob > threshold
    candidates_accept_length = (torch.cumprod(posterior_mask, dim=1)).sum(dim=1)

    accept_length = (torch.minimum(candidates_accept_length, max_accepts)).max()
    if accept_length == 0:
        best_candidate = torch.tensor(0, dtype=torch.long, device=candidates.device)
    else:
        best_candidates = torch.where(
            torch.minimum(candidates_accept_length, max_accepts) == accept_length)[0]
        likelihood = torch.sum(torch.log(candidates_prob[best_candidates, :accept_length]), dim=-1)
        best_candidate = best_candidates[torch.argmax(likelihood)]
    return best_candidate, accept_length


def specbench_hydra_evaluate_posterior(logits, candidates, temperature, posterior_threshold,
                                       posterior_alpha, retrieve_indices):
    max_accepts = torch.sum(retrieve_indices > 0, dim=1)
    best, lens = [], []
    for b in range(logits.shape[0]):
        bc, al = _hydra_evaluate_posterior(logits[b], candidates[b], temperature,
                                           posterior_threshold, posterior_alpha, max_accepts)
        best.append(bc)
        lens.append(al)
    return best, lens


def _make_hydra(seed):
    g = _g(seed)
    B, C, L = 3, 3, 5
    logits = torch.randn(B, C, L, V, generator=g) * 3
    root = torch.randint(0, V, (B, 1, 1), generator=g).expand(B, C, 1)
    drafts = _follow_then_break(g, logits[:, :, :-1].argmax(-1), [0, 1, 4, 2, 4, 3, 4, 0, 2])
    candidates = torch.cat([root, drafts], dim=-1)
    # retrieve_indices of a small tree: path 1 is one node shorter (padded with -1)
    retrieve_indices = torch.tensor([[0, 1, 4, 7, 9], [0, 2, 5, 8, -1], [0, 3, 6, 10, 11]])
    return (logits, candidates, 0.7, 0.09, 0.3, retrieve_indices)


# hemingkx/Spec-Bench, model/rest/rest/model/utils.py @fd2c1cd7, evaluate_posterior (top_p branch)
# + get_nucleus_posterior_mask: drafts are matched exactly against tokens multinomially sampled
# from the temperature/top-p filtered target; loop over rows.
def _rest_get_nucleus_posterior_mask(logits, candidates, temperature, top_p):
    logits = logits[:, :-1] / temperature
    n_samples, n_tokens = logits.shape[0], logits.shape[1]
    logits = logits.view(n_samples * n_tokens, -1)
    probs = F.softmax(logits, dim=-1)
    sorted_logits, sorted_indices = torch.sort(probs, descending=True)
    cum_probs = torch.cumsum(sorted_logits, dim=-1)
    sorted_indices_to_remove = cum_probs > top_p
    sorted_indices_to_remove[..., 1:] = sorted_indices_to_remove[..., :-1].clone()
    sorted_indices_to_remove[..., 0] = 0
    indices_to_remove = sorted_indices_to_remove.scatter(dim=1, index=sorted_indices,
                                                         src=sorted_indices_to_remove)
    logits[indices_to_remove] = float('-inf')
    sampled_tokens = torch.multinomial(F.softmax(logits, dim=-1), 1)
    sampled_tokens = sampled_tokens.view(n_samples, n_tokens)
    posterior_mask = (candidates[:, 1:] == sampled_tokens).int()
    return posterior_mask


def specbench_rest_evaluate_posterior_nucleus(logits, candidates, temperature, top_p):
    best, lens = [], []
    for b in range(logits.shape[0]):
        posterior_mask = _rest_get_nucleus_posterior_mask(logits[b], candidates[b], temperature, top_p)
        candidates_accept_length = (torch.cumprod(posterior_mask, dim=1)).sum(dim=1)
        accept_length = candidates_accept_length.max()
        if accept_length == 0:
            best_candidate = torch.tensor(0, dtype=torch.long, device=candidates.device)
        else:
            best_candidate = torch.argmax(candidates_accept_length).to(torch.long)
        best.append(best_candidate)
        lens.append(accept_length)
    return best, lens


def _make_rest(seed):
    g = _g(seed)
    B, C, L = 3, 3, 5
    logits = torch.randn(B, C, L, V, generator=g) * 4
    root = torch.randint(0, V, (B, 1, 1), generator=g).expand(B, C, 1)
    drafts = _follow_then_break(g, logits[:, :, :-1].argmax(-1), [4, 2, 0, 4, 4, 1, 3, 4, 0])
    candidates = torch.cat([root, drafts], dim=-1)
    return (logits, candidates, 0.7, 0.8)


# hemingkx/Spec-Bench, model/lade/decoding.py @fd2c1cd7, greedy_search_chat (lookahead decoding:
# the n-gram guess verification with .item()/.tolist() and python compares), loop over rows.
def specbench_lookahead_verify(out_logits, guess_logits, guess_tokens, GUESS_SIZE):
    hits_out, max_hits, accepted = [], [], []
    for b in range(out_logits.shape[0]):
        next_token_logits = out_logits[b:b + 1]
        next_tokens_scores = next_token_logits
        next_tokens = torch.argmax(next_tokens_scores, dim=-1)

        max_hit = 0
        first_guess = next_tokens.item()
        hits = [first_guess] + [0] * (GUESS_SIZE - 1)

        guess_list = guess_tokens[b].tolist()  # lookahead keeps its guesses as a python list
        guess_results = torch.argmax(guess_logits[b:b + 1], dim=-1)[0].tolist()
        for eg in range(len(guess_results) // GUESS_SIZE):
            egx = eg * GUESS_SIZE
            correct = [first_guess] + guess_results[egx:egx + GUESS_SIZE]
            myguess = guess_list[egx:egx + GUESS_SIZE]
            gg = 0
            for gg in range(len(myguess)):
                if myguess[gg] != correct[gg]:
                    break
            if gg > max_hit:
                max_hit = gg
                hit_point = eg  # noqa: F841
                hits[:max_hit + 1] = correct[:max_hit + 1]
        hits_out.append(hits)
        max_hits.append(max_hit)
        accepted.append(torch.tensor(hits[:max_hit + 1], device=next_tokens.device,
                                     dtype=next_tokens.dtype).unsqueeze(0))
    return accepted, hits_out, max_hits


def _make_lookahead(seed):
    g = _g(seed)
    B, G, GS = 3, 3, 4
    out_logits = torch.randn(B, V, generator=g) * 2
    guess_logits = torch.randn(B, G * GS, V, generator=g) * 2
    first = out_logits.argmax(-1)
    gres = guess_logits.argmax(-1)
    guess = torch.empty(B, G * GS, dtype=torch.int64)
    cuts = [[1, 0, 2], [4, 2, 3], [0, 1, 0]]
    for b in range(B):
        for eg in range(G):
            egx = eg * GS
            correct = torch.cat([first[b:b + 1], gres[b, egx:egx + GS]])
            ng = correct[:GS].clone()
            c = cuts[b][eg]
            if c < GS:
                ng[c] = (ng[c] + 1 + torch.randint(0, V - 1, (1,), generator=g)) % V
            guess[b, egx:egx + GS] = ng
    return (out_logits, guess_logits, guess, GS)


# hemingkx/Spec-Bench, model/eagle/utils.py @fd2c1cd7, evaluate_posterior (sampling branch: per
# tree level, python random.random() vs p/q, on rejection subtract the masked/renormalised draft
# row and renormalise) + the torch.multinomial(sample_p, 1) of update_inference_inputs; loop over
# rows.  Tree: 2 paths of depth 3 that split at the root (siblings a/d).
class _TemperatureLogitsWarper:  # transformers.TemperatureLogitsWarper
    def __init__(self, temperature):
        self.temperature = temperature

    def __call__(self, input_ids, scores):
        return scores / self.temperature


_EAGLE_PROCESSOR = _TemperatureLogitsWarper(0.7)


def _eagle_evaluate_posterior(logits, candidates, logits_processor, cart_candidates_prob, op,
                              p_indices, tree_candidates, b_indices):
    cart_candidates_prob = cart_candidates_prob.to(logits.device)
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
                qx = cart_candidates_prob[j, i]
                if qx <= 0:
                    continue
                acp = px / qx
                if r <= acp:
                    accept_cand = torch.cat((accept_cand, x[None]), dim=0)
                    accept_length += 1
                    best_candidate = j
                    break
                else:
                    q = op[i - 1][p_indices[j][i]].clone()
                    b = b_indices[j][i]
                    if len(b) > 0:
                        mask = tree_candidates[0][b]
                        q[mask] = 0
                        q = q / q.sum()
                    gtp = gtp - q
                    gtp[gtp < 0] = 0
                    gtp = gtp / gtp.sum()
                    adjustflag = True
    if adjustflag and accept_length != candidates.shape[1]:
        sample_p = gtp
    else:
        gt_logits = logits[best_candidate, accept_length - 1]
        sample_p = torch.softmax(gt_logits, dim=0)
    return torch.tensor(best_candidate), accept_length - 1, sample_p


def specbench_eagle_evaluate_posterior_sampling(logits, candidates, cart_candidates_prob, op0, op1,
                                                op2, tree_candidates, p_indices, b_indices):
    best, lens, tokens = [], [], []
    for r in range(logits.shape[0]):
        op = [op0[r], op1[r], op2[r]]
        bc, al, sample_p = _eagle_evaluate_posterior(
            logits[r], candidates[r], _EAGLE_PROCESSOR, cart_candidates_prob[r], op, p_indices,
            tree_candidates[r], b_indices)
        token = torch.multinomial(sample_p, 1)
        token = token[None]
        best.append(bc)
        lens.append(al)
        tokens.append(token)
    return best, lens, tokens


def _make_eagle(seed):
    random.seed(seed)
    g = _g(seed)
    B = 3
    # draft distributions per depth: op0 children of root, op1 rows (a, d), op2 rows (b, e)
    op0 = torch.softmax(torch.randn(B, 1, V, generator=g) * 2, -1)
    op1 = torch.softmax(torch.randn(B, 2, V, generator=g) * 2, -1)
    op2 = torch.softmax(torch.randn(B, 2, V, generator=g) * 2, -1)
    top2 = op0[:, 0].topk(2, dim=-1).indices          # a, d
    a, d = top2[:, 0], top2[:, 1]
    bb = op1[:, 0].argmax(-1)
    e = op1[:, 1].argmax(-1)
    c = op2[:, 0].argmax(-1)
    f = op2[:, 1].argmax(-1)
    root = torch.randint(0, V, (B,), generator=g)
    candidates = torch.stack([torch.stack([root, a, bb, c], -1), torch.stack([root, d, e, f], -1)], 1)
    tree_candidates = torch.stack([root, a, d, bb, e, c, f], -1)[:, None, :]
    ar = torch.arange(B)
    cart = torch.ones(B, 2, 4)
    cart[:, 0, 1] = op0[ar, 0, a]
    cart[:, 1, 1] = op0[ar, 0, d]
    cart[:, 0, 2] = op1[ar, 0, bb]
    cart[:, 1, 2] = op1[ar, 1, e]
    cart[:, 0, 3] = op2[ar, 0, c]
    cart[:, 1, 3] = op2[ar, 1, f]
    # target logits at each path position, close to the draft distributions
    noise = lambda *s: 0.7 * torch.randn(*s, generator=g)  # noqa: E731
    root_t = op0[:, 0].log() * 0.7 + noise(B, V)
    logits = torch.empty(B, 2, 4, V)
    logits[:, 0, 0] = root_t
    logits[:, 1, 0] = root_t
    logits[:, 0, 1] = op1[:, 0].log() * 0.7 + noise(B, V)
    logits[:, 1, 1] = op1[:, 1].log() * 0.7 + noise(B, V)
    logits[:, 0, 2] = op2[:, 0].log() * 0.7 + noise(B, V)
    logits[:, 1, 2] = op2[:, 1].log() * 0.7 + noise(B, V)
    logits[:, :, 3] = torch.randn(B, 2, V, generator=g)
    p_indices = [[0, 0, 0, 0], [0, 0, 1, 1]]
    b_indices = [[[], [], [], []], [[], [1], [], []]]
    return (logits, candidates, cart, op0, op1, op2, tree_candidates, p_indices, b_indices)


# ============================================================================= entries
ENTRIES = [
    dict(name="flashinfer_chain_speculative_sampling_reference",
         source="flashinfer-ai/flashinfer, flashinfer/trace/templates/sampling.py, "
                "_chain_speculative_sampling_reference (HEAD fb28d724; reference used by "
                "tests/trace/test_chain_speculative_sampling_reference_correctness.py)",
         kind="ratio",
         fn=flashinfer_chain_speculative_sampling_reference,
         make=_make_flashinfer),
    dict(name="vllm_v1_native_sample_recovered_tokens_draft_probs",
         source="vllm-project/vllm, tests/v1/sample/test_rejection_sampler.py, "
                "native_sample_recovered_tokens (draft_probs branch; commit 004fce2d)",
         kind="residual",
         fn=vllm_v1_native_sample_recovered_tokens,
         make=lambda seed: _make_vllm_v1_recovered(seed, ragged=True, with_draft=True)),
    dict(name="vllm_v1_native_sample_recovered_tokens_ngram",
         source="vllm-project/vllm, tests/v1/sample/test_rejection_sampler.py, "
                "native_sample_recovered_tokens (draft_probs=None / ngram branch; commit 004fce2d)",
         kind="residual",
         fn=vllm_v1_native_sample_recovered_tokens,
         make=lambda seed: _make_vllm_v1_recovered(seed, ragged=False, with_draft=False)),
    dict(name="vllm_v0_rejection_sampler_forward_d",
         source="vllm-project/vllm, vllm/model_executor/layers/rejection_sampler.py @700e4a36 "
                "RejectionSampler.forward (torch path) + spec_decode_base_sampler.py @584e4376 "
                "_create_output (tested by tests/samplers/test_rejection_sampler.py)",
         kind="whole_step",
         fn=vllm_v0_rejection_sampler_forward,
         make=_make_vllm_v0_rejection),
    dict(name="vllm_v0_typical_acceptance_sampler_forward",
         source="vllm-project/vllm, vllm/model_executor/layers/typical_acceptance_sampler.py "
                "@60b5eb0c TypicalAcceptanceSampler.forward + _create_output (tested by "
                "tests/samplers/test_typical_acceptance_sampler.py)",
         kind="typical",
         fn=vllm_v0_typical_acceptance_sampler,
         make=_make_vllm_typical),
    dict(name="vllm_v1_block_verify_pytorch_step",
         source="vllm-project/vllm, vllm/v1/sample/rejection_sampler.py @974eaf34, "
                "rejection_random_sample_block_verify_pytorch + "
                "sample_recovered_tokens_blockwise_pytorch as dispatched by rejection_sample "
                "(tests/v1/sample/test_rejection_sampler_block_verify.py)",
         kind="block",
         fn=vllm_v1_block_verify_step,
         make=_make_vllm_block),
    dict(name="sglang_verify_tree_greedy_native_chain_d",
         source="sgl-project/sglang, python/sglang/srt/speculative/eagle_utils.py, "
                "verify_tree_greedy_native (NPU torch fallback, 2025 revision), chain tree, "
                "buffers as in sgl-kernel/tests/speculative/test_eagle_utils.py",
         kind="greedy",
         fn=sglang_verify_tree_greedy,
         make=lambda seed: _make_sglang_chain(seed, K=4, B=3)),
    dict(name="sglang_verify_tree_greedy_native_k1_fastpath_d",
         source="sgl-project/sglang, python/sglang/srt/speculative/eagle_utils.py, "
                "verify_tree_greedy_native (num_draft_tokens == 2, topk == 1 fast path)",
         kind="greedy",
         fn=sglang_verify_tree_greedy,
         make=lambda seed: _make_sglang_chain(seed, K=1, B=4)),
    dict(name="sglang_verify_tree_greedy_native_tree_d",
         source="sgl-project/sglang, python/sglang/srt/speculative/eagle_utils.py, "
                "verify_tree_greedy_native (BFS over next_token/next_sibling; tree of "
                "sgl-kernel/tests/speculative/test_eagle_utils.py)",
         kind="greedy",
         fn=sglang_verify_tree_greedy,
         make=_make_sglang_tree),
    dict(name="redrafter_greedy_accept_candidate_tokens",
         source="apple/ml-recurrent-drafter, recurrent_drafting/recurrent_drafting.py @d4f4a726, "
                "_greedy_accept_candidate_tokens (_greedy_choose_from_candidates + "
                "_greedy_prepare_next_input; KV-cache update omitted)",
         kind="greedy",
         fn=redrafter_greedy_accept_candidate_tokens,
         make=_make_redrafter_greedy),
    dict(name="redrafter_accept_candidate_tokens",
         source="apple/ml-recurrent-drafter, recurrent_drafting/recurrent_drafting.py @d4f4a726, "
                "_accept_candidate_tokens (_choose_from_candidates + _prepare_next_input; "
                "KV-cache update omitted)",
         kind="whole_step",
         fn=redrafter_accept_candidate_tokens,
         make=_make_redrafter_sample),
    dict(name="specbench_sps_speculative_sampling",
         source="hemingkx/Spec-Bench, model/sps/decoding.py @fd2c1cd7, _speculative_sampling "
                "(batch 1, looped over rows)",
         kind="whole_step",
         fn=specbench_sps_speculative_sampling,
         make=_make_sps),
    dict(name="specbench_pld_greedy_verify",
         source="hemingkx/Spec-Bench, model/pld/pld.py @fd2c1cd7, greedy_search_pld (verify "
                "lines; batch 1, looped over rows)",
         kind="greedy",
         fn=specbench_pld_greedy_verify,
         make=_make_pld),
    dict(name="specbench_medusa_evaluate_posterior_greedy",
         source="hemingkx/Spec-Bench, model/medusa/utils.py @fd2c1cd7, evaluate_posterior "
                "(temperature == 0; looped over rows)",
         kind="greedy",
         fn=specbench_medusa_evaluate_posterior,
         make=lambda seed: _make_medusa(seed, 0, [0, 2, 4, 1, 4, 3, 0, 0, 2])),
    dict(name="specbench_medusa_evaluate_posterior_typical",
         source="hemingkx/Spec-Bench, model/medusa/utils.py @fd2c1cd7, evaluate_posterior "
                "(typical acceptance, temperature 0.7; looped over rows)",
         kind="typical",
         fn=specbench_medusa_evaluate_posterior,
         make=lambda seed: _make_medusa(seed, 0.7, [0, 2, 4, 1, 4, 3, 0, 0, 2])),
    dict(name="specbench_hydra_evaluate_posterior_typical",
         source="hemingkx/Spec-Bench, model/hydra/utils.py @fd2c1cd7, evaluate_posterior "
                "(typical, with max_accepts from retrieve_indices; looped over rows)",
         kind="typical",
         fn=specbench_hydra_evaluate_posterior,
         make=_make_hydra),
    dict(name="specbench_rest_evaluate_posterior_nucleus",
         source="hemingkx/Spec-Bench, model/rest/rest/model/utils.py @fd2c1cd7, evaluate_posterior "
                "top_p branch + get_nucleus_posterior_mask (looped over rows)",
         kind="greedy",
         fn=specbench_rest_evaluate_posterior_nucleus,
         make=_make_rest),
    dict(name="specbench_lookahead_guess_verify",
         source="hemingkx/Spec-Bench, model/lade/decoding.py @fd2c1cd7, greedy_search_chat "
                "(n-gram guess verification; looped over rows)",
         kind="greedy",
         fn=specbench_lookahead_verify,
         make=_make_lookahead),
    dict(name="specbench_eagle_evaluate_posterior_sampling",
         source="hemingkx/Spec-Bench, model/eagle/utils.py @fd2c1cd7, evaluate_posterior "
                "(logits_processor branch) + torch.multinomial(sample_p, 1) from "
                "update_inference_inputs (looped over rows)",
         kind="whole_step",
         fn=specbench_eagle_evaluate_posterior_sampling,
         make=_make_eagle),
]
