"""Held-out corpus A: speculative-decoding verify steps transcribed from public codebases.

Each entry is a pure function of tensor (and, where the original takes them, Python
int / list) arguments plus torch's global RNG.  Adaptations common to all entries:
  * classes / configs / metrics counters / logging dropped; methods become functions;
  * Triton kernels with no PyTorch fallback in the codebase are transcribed as the
    per-request Python loops they describe (one program per request -> one loop trip);
  * ``pin_memory=True`` dropped (CPU-only torch refuses it); ``device`` is taken from
    the inputs;
  * per-request ``torch.Generator`` dicts are empty (unseeded requests), so the global
    RNG is what gets used, exactly as in the originals for unseeded requests.
"""
import torch
from torch.nn.utils.rnn import pad_sequence

V = 32  # small vocab used by every make()


# ---------------------------------------------------------------------------
# input builders (deterministic from seed via a private torch.Generator)
# ---------------------------------------------------------------------------

def _gen(seed):
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def _not_equal_to(tok, g, vocab=V):
    # a token guaranteed to differ from `tok`
    off = torch.randint(1, vocab, tok.shape, generator=g)
    return (tok + off) % vocab


def _greedy_drafts(target_argmax, cuts, g):
    """target_argmax: [B, K] -> drafts equal to argmax up to cut[b], a mismatch at cut[b],
    random afterwards."""
    B, K = target_argmax.shape
    drafts = target_argmax.clone()
    for b in range(B):
        c = cuts[b % len(cuts)]
        if c < K:
            drafts[b, c] = _not_equal_to(target_argmax[b, c], g)
            if c + 1 < K:
                drafts[b, c + 1:] = torch.randint(0, V, (K - c - 1,), generator=g)
    return drafts


def _padded_probs(seed, B, K, vocab=V, scale=2.0, noise=0.8):
    g = _gen(seed)
    tgt_logits = torch.randn(B, K + 1, vocab, generator=g) * scale
    dft_logits = 0.7 * tgt_logits[:, :K] + noise * torch.randn(B, K, vocab, generator=g)
    target_probs = tgt_logits.softmax(-1)
    draft_probs = dft_logits.softmax(-1)
    draft_ids = torch.multinomial(draft_probs.reshape(B * K, vocab), 1,
                                  generator=g).reshape(B, K)
    return g, target_probs, draft_probs, draft_ids


def _ragged(seed, num_draft_tokens, scale=2.0, noise=0.8):
    """Flattened (vLLM v1 style) layout: rows of all requests concatenated."""
    g = _gen(seed)
    N = sum(num_draft_tokens)
    tgt_logits = torch.randn(N, V, generator=g) * scale
    dft_logits = 0.7 * tgt_logits + noise * torch.randn(N, V, generator=g)
    draft_probs = dft_logits.softmax(-1)
    draft_ids = torch.multinomial(draft_probs, 1, generator=g).view(-1)
    cu = torch.tensor(num_draft_tokens, dtype=torch.int32).cumsum(0).to(torch.int32)
    B = len(num_draft_tokens)
    bonus = torch.randint(0, V, (B, 1), generator=g, dtype=torch.int32)
    return g, tgt_logits, draft_probs, draft_ids, cu, bonus


def _ragged_greedy_drafts(tgt_logits, num_draft_tokens, cuts, g):
    am = tgt_logits.argmax(-1)
    out = am.clone()
    start = 0
    for r, n in enumerate(num_draft_tokens):
        c = cuts[r % len(cuts)]
        if c < n:
            out[start + c] = _not_equal_to(am[start + c], g)
            if c + 1 < n:
                out[start + c + 1:start + n] = torch.randint(0, V, (n - c - 1,), generator=g)
        start += n
    return out


# ===========================================================================
# vLLM v0 (vllm/model_executor/layers/rejection_sampler.py, ~v0.4, early 2024)
# ===========================================================================

def _v0_get_accepted(target_probs, draft_probs, draft_token_ids):
    batch_size, k, _ = draft_probs.shape
    batch_indices = torch.arange(batch_size, device=target_probs.device)[:, None]
    probs_indicies = torch.arange(k, device=target_probs.device)
    selected_draft_probs = draft_probs[batch_indices, probs_indicies, draft_token_ids]
    selected_target_probs = target_probs[batch_indices, probs_indicies, draft_token_ids]
    uniform_rand = torch.rand(batch_size, k, dtype=torch.float32,
                              device=target_probs.device)
    capped_ratio = torch.minimum(selected_target_probs / selected_draft_probs,
                                 torch.full((1,), 1, device=target_probs.device))
    accepted = uniform_rand < capped_ratio
    return accepted


def _v0_get_recovered_probs(target_probs, draft_probs):
    _, k, _ = draft_probs.shape
    difference = target_probs - draft_probs
    f = torch.clamp(difference, min=torch.finfo(torch.float32).tiny)
    recovered_probs = f / torch.sum(f, dim=-1).reshape(-1, k, 1)
    return recovered_probs


def _v0_multinomial(probs, num_samples: int):
    # original is @torch.jit.script; decorator dropped
    if num_samples > 1:
        probs = probs[:, None, :].expand(probs.shape[0], num_samples,
                                         probs.shape[1]).contiguous().view(
                                             -1, probs.shape[1])
    q = torch.empty_like(probs).exponential_(1.0)
    return probs.div_(q).argmax(dim=1).view(-1, num_samples)


def _v0_create_output(accepted, recovered_token_ids, draft_token_ids, bonus_token_ids):
    bonus_token_ids = bonus_token_ids.squeeze()
    batch_size, k = recovered_token_ids.shape
    limits = (accepted == 0).max(1).indices
    limits[~(accepted == 0).any(1)] = k
    indices = torch.arange(k, device=accepted.device).unsqueeze(0)
    accepted_mask = indices < limits.unsqueeze(1)
    after_false_mask = indices == limits.unsqueeze(1)
    output_with_bonus_tokens = -torch.ones((batch_size, k + 1), dtype=torch.int64,
                                           device=accepted.device)
    output = output_with_bonus_tokens[:, :k]
    output[:, :k] = torch.where(accepted_mask, draft_token_ids,
                                -torch.ones_like(draft_token_ids))
    output_with_bonus_tokens[:, -1] = torch.where(output[:, -1] != -1, bonus_token_ids, -1)
    output.mul_(~after_false_mask).add_(recovered_token_ids.mul(after_false_mask))
    return output_with_bonus_tokens


def vllm_v0_rejection_sampler_forward(target_probs, bonus_token_ids, draft_probs,
                                      draft_token_ids):
    batch_size, k, vocab_size = draft_probs.shape
    accepted = _v0_get_accepted(target_probs, draft_probs, draft_token_ids)
    recovered_probs = _v0_get_recovered_probs(target_probs, draft_probs).reshape(
        batch_size * k, vocab_size)
    recovered_token_ids = _v0_multinomial(recovered_probs, num_samples=1).reshape(
        batch_size, k)
    return _v0_create_output(accepted, recovered_token_ids, draft_token_ids,
                             bonus_token_ids)


def _make_v0_forward(seed):
    g, tp, dp, ids = _padded_probs(seed, B=4, K=3)
    bonus = torch.randint(0, V, (4, 1), generator=g)
    return tp[:, :3].contiguous(), bonus, dp, ids


def vllm_v0_recovered_probs(target_probs, draft_probs):
    return _v0_get_recovered_probs(target_probs, draft_probs)


def _make_v0_recovered(seed):
    _, tp, dp, _ = _padded_probs(seed, B=3, K=4, vocab=29)
    return tp[:, :4].contiguous(), dp


# vLLM v0 typical acceptance (vllm/model_executor/layers/typical_acceptance_sampler.py)
def vllm_v0_typical_accepted(target_with_bonus_probs, draft_token_ids):
    posterior_threshold, posterior_alpha = 0.09, 0.3   # vLLM's CLI defaults
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
    accepted_mask = candidates_prob > threshold
    return accepted_mask


def _make_v0_typical(seed):
    _, tp, _, ids = _padded_probs(seed, B=4, K=3, scale=2.5)
    return tp, ids


# ===========================================================================
# vLLM v1 forward_native (vllm/v1/sample/rejection_sampler.py, Feb-Mar 2025,
# PyTorch-native path; padded layout built from list[list[int]] drafts)
# ===========================================================================
INVALID_TOKEN_ID = -1


def _v1n_convert_2d_probs(probs, sample_lens):
    cumulative_lens = torch.cumsum(torch.tensor(sample_lens, device=probs.device), dim=0)
    split_indices = cumulative_lens[:-1].tolist()
    chunks = torch.tensor_split(probs, split_indices, dim=0)
    padded_probs = pad_sequence(chunks, batch_first=True, padding_value=0.0)
    return padded_probs


def _v1n_create_uniform_samples(seeded_seqs, batch_size, k, device):
    uniform_rand = torch.rand(batch_size, k, device=device)
    if seeded_seqs:
        for idx, generator in seeded_seqs.items():
            uniform_rand[idx, :] = torch.rand(1, k, device=device, generator=generator)
    return uniform_rand


def _v1n_random_sample(probs, generators):
    q = torch.empty_like(probs)
    if len(generators) != probs.shape[0]:
        q.exponential_()
    if generators:
        for i, generator in generators.items():
            q[i].exponential_(generator=generator)
    return probs.div_(q).argmax(dim=-1).view(-1)


def vllm_v1_native_greedy(draft_token_ids, target_logits):
    # all_greedy: compute_probs returns the logits unchanged
    draft_token_ids = [torch.tensor(x, dtype=int, device='cpu') for x in draft_token_ids]
    draft_token_ids_tensor = pad_sequence(draft_token_ids, batch_first=True,
                                          padding_value=INVALID_TOKEN_ID)
    draft_token_ids_tensor = draft_token_ids_tensor.to(target_logits.device)
    sample_lens = [len(x) + 1 for x in draft_token_ids]
    target_probs = _v1n_convert_2d_probs(target_logits, sample_lens)
    # forward_native, all_greedy branch
    target_token_ids_tensor = target_probs.argmax(dim=-1)
    accept_mask = (target_token_ids_tensor[:, :-1] == draft_token_ids_tensor).cumprod(dim=1)
    valid_mask = target_token_ids_tensor != INVALID_TOKEN_ID
    generate_mask = torch.cat([
        accept_mask,
        torch.zeros(accept_mask.size(0), 1, device=accept_mask.device)
    ], dim=1).to(torch.bool) & valid_mask
    zeros_mask = (generate_mask == 0)
    first_zero_idx = zeros_mask.float().argmax(dim=1)
    rows_with_zero = zeros_mask.any(dim=1)
    generate_mask[rows_with_zero, first_zero_idx[rows_with_zero]] = 1
    output_token_ids = target_token_ids_tensor
    output_token_ids[~generate_mask] = INVALID_TOKEN_ID
    return output_token_ids


def _make_v1n_greedy(seed):
    g = _gen(seed)
    lens = [3, 3, 2, 3]
    rows = []
    drafts = []
    for r, n in enumerate(lens):
        logits = torch.randn(n + 1, V, generator=g) * 2.0
        am = logits.argmax(-1)
        d = _greedy_drafts(am[None, :n], [[0, 1, 2, 3][r]], g)[0]
        rows.append(logits)
        drafts.append(d.tolist())
    return drafts, torch.cat(rows, 0)


def vllm_v1_native_random(draft_token_ids, draft_probs, bonus_token_ids_tensor, target_probs):
    generators = {}
    draft_token_ids = [torch.tensor(x, dtype=int, device='cpu') for x in draft_token_ids]
    draft_token_ids_tensor = pad_sequence(draft_token_ids, batch_first=True,
                                          padding_value=INVALID_TOKEN_ID)
    draft_token_ids_tensor = draft_token_ids_tensor.to(target_probs.device)
    sample_lens = [len(x) + 1 for x in draft_token_ids]
    target_probs = _v1n_convert_2d_probs(target_probs, sample_lens)
    # forward_native, random branch
    batch_size = draft_token_ids_tensor.size(0)
    max_spec_len = draft_token_ids_tensor.size(1)
    invalid_idx = draft_token_ids_tensor == INVALID_TOKEN_ID
    draft_token_ids_tensor[invalid_idx] = 0
    draft_token_probs = draft_probs.gather(
        dim=-1, index=draft_token_ids_tensor.unsqueeze(-1)).squeeze(-1)
    target_token_probs = target_probs.gather(
        dim=-1, index=draft_token_ids_tensor.unsqueeze(-1)).squeeze(-1)
    draft_token_probs[invalid_idx] = float('inf')
    uniform_samples = _v1n_create_uniform_samples(generators, batch_size, max_spec_len,
                                                  target_probs.device)
    accepted = uniform_samples <= target_token_probs / draft_token_probs
    accept_mask = accepted.cumprod(dim=1)
    accepted_token_ids = (draft_token_ids_tensor * accept_mask +
                          INVALID_TOKEN_ID * (1 - accept_mask))
    bonus_prob = torch.clamp(target_probs[:, :-1, :] - draft_probs, min=1e-5)
    normalized_bonus_prob = bonus_prob / bonus_prob.sum(dim=-1, keepdim=True)
    recovered_token_ids = _v1n_random_sample(normalized_bonus_prob,
                                             generators).reshape(batch_size, max_spec_len)
    recovered_bonus_token_ids = torch.cat([recovered_token_ids, bonus_token_ids_tensor], dim=1)
    generate_mask = torch.cat([
        accept_mask,
        torch.zeros(batch_size, 1, device=accept_mask.device)
    ], dim=1).to(torch.bool)
    zeros_mask = (generate_mask == 0)
    first_zero_idx = zeros_mask.float().argmax(dim=1)
    output_token_ids = torch.cat([
        accepted_token_ids,
        torch.full((batch_size, 1), fill_value=INVALID_TOKEN_ID, device=accept_mask.device)
    ], dim=1)
    output_token_ids[torch.arange(batch_size), first_zero_idx] = recovered_bonus_token_ids[
        torch.arange(batch_size), first_zero_idx]
    return output_token_ids


def _make_v1n_random(seed):
    g = _gen(seed)
    lens = [3, 2, 3, 3]
    B, K = len(lens), max(lens)
    tgt_rows, drafts = [], []
    draft_probs = torch.zeros(B, K, V)
    for r, n in enumerate(lens):
        tl = torch.randn(n + 1, V, generator=g) * 2.0
        dl = 0.7 * tl[:n] + 0.8 * torch.randn(n, V, generator=g)
        dp = dl.softmax(-1)
        draft_probs[r, :n] = dp
        drafts.append(torch.multinomial(dp, 1, generator=g).view(-1).tolist())
        tgt_rows.append(tl.softmax(-1))
    bonus = torch.randint(0, V, (B, 1), generator=g)
    return drafts, draft_probs, bonus, torch.cat(tgt_rows, 0)


# vLLM v1, Mar 2025 revision of vllm/v1/sample/rejection_sampler.py (padded layout,
# recovered tokens computed in PyTorch before the Triton random kernel; commit not
# pinned -- found in the code index)
def vllm_v1_mar2025_recovered_tokens(draft_token_ids, draft_probs, target_probs):
    batch_size, max_spec_len = draft_token_ids.shape
    vocab_size = target_probs.shape[-1]
    device = target_probs.device
    num_draft_tokens = [max_spec_len] * batch_size
    generators = {}
    is_ngram = draft_probs is None
    if is_ngram:
        probs = target_probs[:, :-1].clone()
        safe_draft_token_ids = torch.where(draft_token_ids == INVALID_TOKEN_ID, 0,
                                           draft_token_ids)
        probs.scatter_(2, safe_draft_token_ids.unsqueeze(-1), 0)
    else:
        probs = torch.clamp(target_probs[:, :-1] - draft_probs,
                            min=torch.finfo(torch.float32).tiny)
    probs /= probs.sum(dim=-1, keepdim=True)
    q = torch.empty((batch_size, vocab_size), dtype=torch.float32, device=device)
    q.exponential_()
    for i, generator in generators.items():
        if num_draft_tokens[i] > 0:
            q[i].exponential_(generator=generator)
    q = q.unsqueeze(dim=1)
    recovered_token_ids = probs.div_(q).argmax(dim=-1)
    recovered_token_ids = recovered_token_ids.view(batch_size, max_spec_len)
    return recovered_token_ids


def _make_v1_mar2025(seed):
    _, tp, dp, ids = _padded_probs(seed, B=3, K=4)
    return ids, dp, tp


# ===========================================================================
# vLLM v1 current (vllm/v1/sample/rejection_sampler.py, 2025-2026, commit 7f6fc1c5):
# ragged/flattened layout (draft_token_ids [N], cu_num_draft_tokens [B]).
# Its Triton kernels have no PyTorch fallback in vLLM, so each kernel is transcribed
# as the per-request loop it runs (one Triton program == one loop trip).
# ===========================================================================
PLACEHOLDER_TOKEN_ID = -1
GREEDY_TEMPERATURE = 0


def _v1_expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
    batch_size = x.shape[0]
    expanded_x = x.new_empty(num_tokens)
    for req_idx in range(batch_size):               # expand_kernel
        start_idx = 0 if req_idx == 0 else int(cu_num_tokens[req_idx - 1])
        end_idx = int(cu_num_tokens[req_idx])
        src_val = x[req_idx]
        src_val = torch.where(src_val == replace_from, replace_to, src_val)
        expanded_x[start_idx:end_idx] = src_val
    return expanded_x


def _v1_generate_uniform_probs(num_tokens, num_draft_tokens, generators, device):
    uniform_probs = torch.rand((num_tokens,), dtype=torch.float64, device=device)
    start_idx = 0
    for req_idx, n in enumerate(num_draft_tokens):
        if n == 0:
            continue
        end_idx = start_idx + n
        generator = generators.get(req_idx)
        if generator is not None:
            uniform_probs[start_idx:end_idx].uniform_(generator=generator)
        start_idx = end_idx
    return uniform_probs


def _v1_greedy_kernel(output_token_ids, cu_num_draft_tokens, draft_token_ids, target_argmax,
                      bonus_token_ids, is_greedy, max_spec_len):
    for req_idx in range(output_token_ids.shape[0]):
        greedy = True if is_greedy is None else bool(is_greedy[req_idx])
        if not greedy:
            continue
        start_idx = 0 if req_idx == 0 else int(cu_num_draft_tokens[req_idx - 1])
        end_idx = int(cu_num_draft_tokens[req_idx])
        num_draft_tokens = end_idx - start_idx
        rejected = False
        for pos in range(num_draft_tokens):
            if not rejected:
                draft_token_id = draft_token_ids[start_idx + pos]
                target_argmax_id = target_argmax[start_idx + pos]
                output_token_ids[req_idx, pos] = target_argmax_id
                if draft_token_id != target_argmax_id:
                    rejected = True
        if not rejected:
            output_token_ids[req_idx, num_draft_tokens] = bonus_token_ids[req_idx, 0]


def _v1_random_kernel(output_token_ids, cu_num_draft_tokens, draft_token_ids, draft_probs,
                      target_probs, bonus_token_ids, recovered_token_ids, uniform_probs,
                      is_greedy, max_spec_len, vocab_size, NO_DRAFT_PROBS):
    for req_idx in range(output_token_ids.shape[0]):
        if bool(is_greedy[req_idx]):
            continue
        start_idx = 0 if req_idx == 0 else int(cu_num_draft_tokens[req_idx - 1])
        end_idx = int(cu_num_draft_tokens[req_idx])
        num_draft_tokens = end_idx - start_idx
        rejected = False
        for pos in range(num_draft_tokens):
            if not rejected:
                draft_token_id = draft_token_ids[start_idx + pos]
                if NO_DRAFT_PROBS:
                    draft_prob = 1
                else:
                    draft_prob = draft_probs[start_idx + pos, draft_token_id]
                target_prob = target_probs[start_idx + pos, draft_token_id]
                uniform_prob = uniform_probs[start_idx + pos]
                if draft_prob > 0 and target_prob / draft_prob >= uniform_prob:
                    token_id = draft_token_id
                else:
                    rejected = True
                    token_id = recovered_token_ids[start_idx + pos]
                output_token_ids[req_idx, pos] = token_id
        if not rejected:
            output_token_ids[req_idx, num_draft_tokens] = bonus_token_ids[req_idx, 0]


def _v1_sample_recovered_tokens(max_spec_len, num_draft_tokens, cu_num_draft_tokens,
                                draft_token_ids, draft_probs, target_probs, generators, device):
    batch_size = len(num_draft_tokens)
    vocab_size = target_probs.shape[-1]
    q = torch.empty((batch_size, vocab_size), dtype=torch.float32, device=device)
    q.exponential_()
    for i, generator in generators.items():
        if num_draft_tokens[i] > 0:
            q[i].exponential_(generator=generator)
    recovered_token_ids = torch.empty_like(draft_token_ids)
    vocab_offset = torch.arange(vocab_size, device=device)
    for req_idx in range(batch_size):               # sample_recovered_tokens_kernel
        start_idx = 0 if req_idx == 0 else int(cu_num_draft_tokens[req_idx - 1])
        end_idx = int(cu_num_draft_tokens[req_idx])
        for pos in range(max_spec_len):
            if pos >= end_idx - start_idx:
                continue
            if draft_probs is None:
                draft_token_id = draft_token_ids[start_idx + pos]
                prob = torch.where(vocab_offset != draft_token_id,
                                   target_probs[start_idx + pos], 0)
            else:
                prob = torch.maximum(target_probs[start_idx + pos] - draft_probs[start_idx + pos],
                                     torch.zeros((), device=device))
            recovered_token_ids[start_idx + pos] = torch.argmax(prob / q[req_idx], dim=-1)
    return recovered_token_ids


def vllm_v1_rejection_sample_greedy(draft_token_ids, num_draft_tokens, max_spec_len,
                                    cu_num_draft_tokens, target_logits, bonus_token_ids):
    # all_greedy batch: sampling constraints are a no-op, then softmax, then argmax
    target_probs = target_logits.softmax(dim=-1, dtype=torch.float32)
    batch_size = len(num_draft_tokens)
    output_token_ids = torch.full((batch_size, max_spec_len + 1), PLACEHOLDER_TOKEN_ID,
                                  dtype=torch.int32, device=target_probs.device)
    is_greedy = None
    target_argmax = target_probs.argmax(dim=-1)
    _v1_greedy_kernel(output_token_ids, cu_num_draft_tokens, draft_token_ids, target_argmax,
                      bonus_token_ids, is_greedy, max_spec_len)
    return output_token_ids


def _make_v1_greedy(seed):
    lens = [3, 1, 4, 2, 4]
    g, tl, _, _, cu, bonus = _ragged(seed, lens)
    ids = _ragged_greedy_drafts(tl, lens, [0, 1, 4, 1, 2], g).to(torch.int32)
    return ids, lens, max(lens), cu, tl, bonus


def vllm_v1_rejection_sample_mixed(draft_token_ids, num_draft_tokens, max_spec_len,
                                   cu_num_draft_tokens, draft_probs, target_logits,
                                   bonus_token_ids, temperature):
    generators = {}
    num_tokens = draft_token_ids.shape[0]
    # apply_sampling_constraints (temperature only; no top-k / top-p in this batch)
    target_logits = target_logits.to(torch.float32).clone()
    temp = _v1_expand_batch_to_tokens(temperature, cu_num_draft_tokens, num_tokens,
                                      replace_from=GREEDY_TEMPERATURE, replace_to=1)
    target_logits.div_(temp.unsqueeze(-1))
    target_probs = target_logits.softmax(dim=-1, dtype=torch.float32)
    # rejection_sample
    batch_size = len(num_draft_tokens)
    vocab_size = target_probs.shape[-1]
    device = target_probs.device
    output_token_ids = torch.full((batch_size, max_spec_len + 1), PLACEHOLDER_TOKEN_ID,
                                  dtype=torch.int32, device=device)
    is_greedy = temperature == GREEDY_TEMPERATURE
    target_argmax = target_probs.argmax(dim=-1)
    _v1_greedy_kernel(output_token_ids, cu_num_draft_tokens, draft_token_ids, target_argmax,
                      bonus_token_ids, is_greedy, max_spec_len)
    uniform_probs = _v1_generate_uniform_probs(num_tokens, num_draft_tokens, generators, device)
    recovered_token_ids = _v1_sample_recovered_tokens(
        max_spec_len, num_draft_tokens, cu_num_draft_tokens, draft_token_ids, draft_probs,
        target_probs, generators, device)
    _v1_random_kernel(output_token_ids, cu_num_draft_tokens, draft_token_ids, draft_probs,
                      target_probs, bonus_token_ids, recovered_token_ids, uniform_probs,
                      is_greedy, max_spec_len, vocab_size, NO_DRAFT_PROBS=draft_probs is None)
    return output_token_ids


def _make_v1_mixed(seed):
    lens = [3, 2, 4, 3]
    g, tl, dp, ids, cu, bonus = _ragged(seed, lens)
    temperature = torch.tensor([1.0, 0.0, 0.8, 1.0])
    return ids.to(torch.int32), lens, max(lens), cu, dp, tl, bonus, temperature


def _make_v1_ngram(seed):
    # ngram drafter: no draft probs; one request with zero drafts; one with K=1
    lens = [2, 0, 3, 1]
    g, tl, _, _, cu, bonus = _ragged(seed, lens)
    ids = _ragged_greedy_drafts(tl, lens, [1, 0, 2, 0], g).to(torch.int32)
    temperature = torch.tensor([1.0, 1.0, 0.7, 1.0])
    return ids, lens, max(lens), cu, None, tl, bonus, temperature


# ===========================================================================
# vllm-ascend (vllm_ascend/sample/rejection_sampler.py @ 182b75ea, Aug 2026):
# the PyTorch (non-Triton) paths of rejection_sample.
# ===========================================================================

def _asc_greedy_spec_len_1(output_token_ids, draft_token_ids, target_argmax, bonus_token_ids):
    batch_size = output_token_ids.size(0)
    num_tokens = draft_token_ids.size(0)
    assert batch_size == num_tokens
    accept_req_mask = draft_token_ids == target_argmax
    output_token_ids[:, 0] = target_argmax
    bonus_token_ids = bonus_token_ids.squeeze(1)
    output_token_ids[:, 1] = torch.where(accept_req_mask, bonus_token_ids, output_token_ids[:, 1])


def _asc_greedy(output_token_ids, cu_num_draft_tokens, draft_token_ids, target_argmax,
                bonus_token_ids, draft_tokens_per_req, max_spec_len, is_greedy=None):
    batch_size = output_token_ids.size(0)
    num_tokens = draft_token_ids.size(0)
    device = output_token_ids.device
    draft_tokens_per_req = torch.tensor(draft_tokens_per_req).to(device, non_blocking=True)
    if is_greedy is None:
        is_greedy = torch.ones(batch_size, dtype=torch.bool, device=device)
    start_indices = cu_num_draft_tokens - draft_tokens_per_req
    req_ids = torch.arange(batch_size, device=device)
    token_req_ids = torch.repeat_interleave(req_ids, draft_tokens_per_req)
    token_positions = torch.arange(num_tokens, device=device) - start_indices[token_req_ids]
    mismatch_global = draft_token_ids != target_argmax
    if max_spec_len == 0:
        first_mismatch_pos_per_req = torch.zeros(batch_size, dtype=torch.long, device=device)
    else:
        pos_matrix = torch.full((batch_size, max_spec_len), -1, dtype=torch.long, device=device)
        pos_matrix[token_req_ids, token_positions] = token_positions
        mismatch_matrix = torch.full((batch_size, max_spec_len), False, dtype=torch.bool,
                                     device=device)
        mismatch_matrix[token_req_ids, token_positions] = mismatch_global
        mismatch_positions = torch.where(mismatch_matrix, pos_matrix, max_spec_len * 2)
        first_mismatch_pos_per_req, _ = torch.min(mismatch_positions, dim=1)
        no_mismatch_mask = first_mismatch_pos_per_req == max_spec_len * 2
        first_mismatch_pos_per_req[no_mismatch_mask] = draft_tokens_per_req[no_mismatch_mask]
    copy_len = torch.minimum(first_mismatch_pos_per_req + 1, draft_tokens_per_req)
    copy_indices = torch.arange(max_spec_len + 1, device=device).expand(batch_size, -1)
    copy_mask = copy_indices < copy_len.unsqueeze(1)
    greedy_mask = is_greedy.unsqueeze(1)
    final_copy_mask = copy_mask & greedy_mask
    global_idx = start_indices.unsqueeze(1) + copy_indices
    copy_tokens = target_argmax
    output_token_ids[final_copy_mask] = copy_tokens[global_idx[final_copy_mask]].to(
        output_token_ids.dtype)
    needs_bonus = is_greedy & (first_mismatch_pos_per_req >= draft_tokens_per_req)
    if torch.any(needs_bonus):
        bonus_rows = torch.where(needs_bonus)[0]
        bonus_cols = draft_tokens_per_req[bonus_rows]
        bonus_token_ids = bonus_token_ids.squeeze(1)
        output_token_ids[bonus_rows, bonus_cols] = bonus_token_ids[bonus_rows]


def _asc_sample_recovered_tokens_pytorch(output_token_ids, cu_num_draft_tokens, draft_token_ids,
                                         draft_probs, target_probs, q, vocab_size,
                                         IS_NGRAM=False):
    device = output_token_ids.device
    num_tokens = output_token_ids.shape[0]
    if num_tokens == 0:
        return
    cu_start = torch.cat([torch.tensor([0]).to(device, non_blocking=True),
                          cu_num_draft_tokens[:-1]])
    cu_end = cu_num_draft_tokens
    token_indices = torch.arange(num_tokens, device=device)
    token_indices_expanded = token_indices[:, None]
    cu_start_expanded = cu_start[None, :]
    cu_end_expanded = cu_end[None, :]
    in_range_mask = (token_indices_expanded >= cu_start_expanded) & (
        token_indices_expanded < cu_end_expanded)
    token_to_batch = torch.argmax(in_range_mask.int(), dim=1)
    has_match = in_range_mask.any(dim=1)
    token_to_batch = torch.where(has_match, token_to_batch, 0)
    if IS_NGRAM:
        token_indices = torch.arange(num_tokens, device=device)
        modified_target_probs = target_probs.clone()
        valid_draft_mask = draft_token_ids != PLACEHOLDER_TOKEN_ID
        modified_target_probs[token_indices[valid_draft_mask],
                              draft_token_ids[valid_draft_mask]] = 0
        prob = modified_target_probs
    else:
        prob = torch.maximum(target_probs - draft_probs,
                             torch.tensor(0.0).to(device, non_blocking=True))
    q_values = q[token_to_batch]
    epsilon = 1e-10
    q_values_safe = torch.where(q_values == 0, epsilon, q_values)
    q_values_safe = torch.where(torch.isinf(q_values), epsilon, q_values_safe)
    prob_over_q = prob / q_values_safe
    prob_over_q = torch.where((q_values == 0) | torch.isinf(q_values), -1e10, prob_over_q)
    recovered_ids = torch.argmax(prob_over_q, dim=1)
    output_token_ids[:] = recovered_ids


def _asc_sample_recovered_tokens(max_spec_len, num_draft_tokens, cu_num_draft_tokens,
                                 draft_token_ids, draft_probs, target_probs, generators, device):
    batch_size = len(num_draft_tokens)
    vocab_size = target_probs.shape[-1]
    q = torch.empty((batch_size, vocab_size), dtype=torch.float32, device=device)
    q.exponential_()
    num_draft_tensor = torch.tensor(num_draft_tokens).to(device, non_blocking=True)
    has_draft_mask = num_draft_tensor > 0
    for i, generator in generators.items():
        temp_q = torch.empty_like(q[i])
        temp_q.exponential_(generator=generator)
        q[i] = torch.where(has_draft_mask[i], temp_q, q[i])
    recovered_token_ids = torch.empty_like(draft_token_ids)
    _asc_sample_recovered_tokens_pytorch(recovered_token_ids, cu_num_draft_tokens,
                                         draft_token_ids, draft_probs, target_probs, q,
                                         vocab_size, IS_NGRAM=draft_probs is None)
    return recovered_token_ids


def _asc_random_pytorch(output_token_ids, cu_num_draft_tokens, draft_token_ids, draft_probs,
                        target_probs, bonus_token_ids, recovered_token_ids, uniform_probs,
                        is_greedy, max_spec_len, vocab_size, IS_NGRAM=False,
                        ENTROPY_VERIFY=False, POSTERIOR_THRESHOLD=0.95, POSTERIOR_ALPHA=0.4,
                        EPSILON=1e-10, ori_target_probs=None):
    batch_size = output_token_ids.shape[0]
    device = output_token_ids.device
    zero_device = torch.tensor([0]).to(device, non_blocking=True)
    cu_start = torch.cat([zero_device, cu_num_draft_tokens[:-1]])
    cu_end = cu_num_draft_tokens
    num_draft_per_batch = cu_end - cu_start
    max_draft_len = max_spec_len
    pos_indices = torch.arange(max_draft_len).to(device, non_blocking=True)[None, :]
    valid_mask = pos_indices < num_draft_per_batch[:, None]
    global_token_indices = cu_start[:, None] + pos_indices
    global_token_indices = global_token_indices.clamp(0, draft_token_ids.shape[0] - 1)
    draft_tokens = draft_token_ids[global_token_indices]
    placeholder_mask = draft_tokens == PLACEHOLDER_TOKEN_ID
    safe_draft_tokens = draft_tokens.masked_fill(placeholder_mask, 0)
    if IS_NGRAM:
        ones_cpu = torch.ones(1, dtype=torch.float32)
        draft_token_probs = ones_cpu.to(device, non_blocking=True).expand_as(draft_tokens)
    else:
        flat_indices = global_token_indices.flatten()
        flat_draft_tokens = safe_draft_tokens.flatten()
        flat_draft_probs = draft_probs[flat_indices, flat_draft_tokens]
        draft_token_probs = flat_draft_probs.view(batch_size, max_draft_len)
    flat_indices = global_token_indices.flatten()
    flat_draft_tokens = safe_draft_tokens.flatten()
    flat_target_probs = target_probs[flat_indices, flat_draft_tokens]
    target_token_probs = flat_target_probs.view(batch_size, max_draft_len)
    uniform_token_probs = uniform_probs[global_token_indices]
    recovered_tokens = recovered_token_ids[global_token_indices]
    zero_threshold = torch.tensor([0.0], dtype=torch.float32).to(device, non_blocking=True)
    if ENTROPY_VERIFY:
        entropy_probs = ori_target_probs if ori_target_probs is not None else target_probs
        all_target_dist = entropy_probs[global_token_indices]
        entropy = -(all_target_dist * torch.log(all_target_dist + EPSILON)).sum(dim=-1)
        exp_neg_entropy = torch.exp(-entropy * POSTERIOR_ALPHA)
        posterior_threshold_device = torch.tensor(POSTERIOR_THRESHOLD, device=device,
                                                  dtype=torch.float32)
        threshold = torch.minimum(exp_neg_entropy, posterior_threshold_device)
        modified_uniform_token_probs = threshold * uniform_token_probs
        acceptance_condition = (draft_token_probs > zero_threshold) & (
            target_token_probs / draft_token_probs >= modified_uniform_token_probs)
    else:
        acceptance_condition = (draft_token_probs > zero_threshold) & (
            target_token_probs / draft_token_probs >= uniform_token_probs)
    acceptance_condition = acceptance_condition & (~placeholder_mask)
    first_rejection = (~acceptance_condition) & valid_mask
    default_pos = torch.full([batch_size, 1], max_draft_len).to(device, non_blocking=True)
    first_reject_pos = torch.where(first_rejection.any(dim=1, keepdim=True),
                                   first_rejection.float().argmax(dim=1, keepdim=True),
                                   default_pos)
    pos_mask = pos_indices >= first_reject_pos
    should_skip = pos_mask & valid_mask
    final_acceptance = acceptance_condition & (~should_skip)
    non_greedy_mask = ~is_greedy
    update_mask = non_greedy_mask[:, None] & valid_mask & (~should_skip)
    first_reject_mask = (pos_indices == first_reject_pos) & valid_mask & non_greedy_mask[:, None]
    final_update_mask = update_mask | first_reject_mask
    final_tokens = torch.where(
        first_reject_mask, recovered_tokens,
        torch.where(final_acceptance, draft_tokens, output_token_ids[:, :max_draft_len]))
    output_token_ids[:, :max_draft_len] = torch.where(final_update_mask, final_tokens,
                                                      output_token_ids[:, :max_draft_len])
    no_rejection = first_reject_pos.squeeze(1) >= num_draft_per_batch
    should_add_bonus = non_greedy_mask & no_rejection
    bonus_positions = num_draft_per_batch
    seq_len = output_token_ids.shape[1]
    all_positions = torch.arange(seq_len).to(device, non_blocking=True)[None, :]
    batch_bonus_positions = bonus_positions[:, None]
    max_spec_len_device = torch.tensor([max_spec_len]).to(device, non_blocking=True)
    valid_bonus_pos = bonus_positions < (max_spec_len_device + 1)
    final_bonus_mask = should_add_bonus & valid_bonus_pos
    bonus_pos_match = all_positions == batch_bonus_positions
    bonus_pos_mask = bonus_pos_match & final_bonus_mask[:, None]
    bonus_values_expanded = bonus_token_ids.view(-1, 1).expand(-1, seq_len)
    output_token_ids[:] = torch.where(bonus_pos_mask, bonus_values_expanded, output_token_ids)


def _asc_block_verify_pytorch(output_token_ids, cu_num_draft_tokens, draft_token_ids, draft_probs,
                              target_probs, bonus_token_ids, recovered_token_ids, uniform_probs,
                              is_greedy, max_spec_len, vocab_size, IS_NGRAM=False):
    batch_size = output_token_ids.shape[0]
    device = output_token_ids.device
    zero_device = torch.tensor([0]).to(device, non_blocking=True)
    cu_start = torch.cat([zero_device, cu_num_draft_tokens[:-1]])
    cu_end = cu_num_draft_tokens
    num_draft_per_batch = (cu_end - cu_start)[:, None]
    pos_indices = torch.arange(max_spec_len).to(device, non_blocking=True)[None, :]
    valid_mask = pos_indices < num_draft_per_batch
    global_token_indices = cu_start[:, None] + pos_indices
    global_token_indices = global_token_indices.clamp(0, draft_token_ids.shape[0] - 1)
    draft_tokens = draft_token_ids[global_token_indices]
    placeholder_mask = draft_tokens == PLACEHOLDER_TOKEN_ID
    safe_draft_tokens = draft_tokens.masked_fill(placeholder_mask, 0)
    if IS_NGRAM:
        draft_token_probs = torch.ones(1, dtype=torch.float32).to(
            device, non_blocking=True).expand_as(draft_tokens)
    else:
        flat_indices = global_token_indices.flatten()
        flat_draft_tokens = safe_draft_tokens.flatten()
        flat_draft_probs = draft_probs[flat_indices, flat_draft_tokens]
        draft_token_probs = flat_draft_probs.view(batch_size, max_spec_len)
    flat_indices = global_token_indices.flatten()
    flat_draft_tokens = safe_draft_tokens.flatten()
    flat_target_probs = target_probs[flat_indices, flat_draft_tokens]
    target_token_probs = flat_target_probs.view(batch_size, max_spec_len)
    uniform_token_probs = uniform_probs[global_token_indices]
    recovered_tokens = recovered_token_ids[global_token_indices]
    pi = target_token_probs / draft_token_probs
    pi = pi.clamp(max=1.0)
    pi = torch.cumprod(pi, dim=-1)
    cum_uniform_token_probs = torch.cumprod(uniform_token_probs, dim=-1)
    legal_mask = (draft_token_probs > 0) & (pi >= cum_uniform_token_probs)
    legal_mask = legal_mask & valid_mask & (~placeholder_mask)
    last_accept_pos = torch.where(
        legal_mask.any(dim=-1, keepdim=True),
        (max_spec_len - legal_mask.flip(dims=[-1]).float().argmax(dim=-1, keepdim=True) - 1),
        -1,
    )
    non_greedy_mask = (~is_greedy)[:, None]
    accept_mask = (pos_indices <= last_accept_pos) & valid_mask & non_greedy_mask
    output_token_ids[:, :max_spec_len] = torch.where(accept_mask, draft_tokens,
                                                     output_token_ids[:, :max_spec_len])
    reject_mask = (pos_indices == last_accept_pos + 1) & valid_mask & non_greedy_mask
    output_token_ids[:, :max_spec_len] = torch.where(reject_mask, recovered_tokens,
                                                     output_token_ids[:, :max_spec_len])
    bonus_mask = (last_accept_pos + 1 >= num_draft_per_batch) & non_greedy_mask
    all_positions = torch.arange(max_spec_len + 1).to(device, non_blocking=True)[None, :]
    bonus_pos_match = all_positions == num_draft_per_batch
    bonus_mask = bonus_mask & bonus_pos_match
    bonus_values_expanded = bonus_token_ids.view(-1, 1).expand(-1, max_spec_len + 1)
    output_token_ids[:] = torch.where(bonus_mask, bonus_values_expanded, output_token_ids)


def _asc_recovered_blockwise_pytorch(output_token_ids, cu_num_draft_tokens, draft_token_ids,
                                     draft_probs, target_probs, q, vocab_size, IS_NGRAM=False):
    device = output_token_ids.device
    num_tokens = output_token_ids.shape[0]
    batch_size = cu_num_draft_tokens.shape[0]
    if num_tokens == 0:
        return
    cu_start = torch.cat([torch.tensor([0]).to(device, non_blocking=True),
                          cu_num_draft_tokens[:-1]])
    cu_end = cu_num_draft_tokens
    token_indices = torch.arange(num_tokens, device=device)
    in_range_mask = (token_indices[:, None] >= cu_start[None, :]) & (
        token_indices[:, None] < cu_end[None, :])
    token_to_batch = torch.argmax(in_range_mask.int(), dim=1)
    token_to_batch = torch.where(in_range_mask.any(dim=1), token_to_batch,
                                 torch.zeros_like(token_to_batch))
    pos_in_seq = token_indices - cu_start[token_to_batch]
    max_spec_len = int((cu_end - cu_start).max().item())
    if IS_NGRAM:
        draft_token_scalar_probs = torch.ones(num_tokens, device=device, dtype=torch.float32)
    else:
        valid_draft_mask = draft_token_ids != PLACEHOLDER_TOKEN_ID
        safe_draft_token_ids = draft_token_ids.masked_fill(~valid_draft_mask, 0)
        draft_token_scalar_probs = draft_probs[token_indices, safe_draft_token_ids]
        draft_token_scalar_probs = torch.where(valid_draft_mask, draft_token_scalar_probs,
                                               torch.zeros_like(draft_token_scalar_probs))
    valid_draft_mask = draft_token_ids != PLACEHOLDER_TOKEN_ID
    safe_draft_token_ids = draft_token_ids.masked_fill(~valid_draft_mask, 0)
    target_token_scalar_probs = target_probs[token_indices, safe_draft_token_ids]
    target_token_scalar_probs = torch.where(valid_draft_mask, target_token_scalar_probs,
                                            torch.zeros_like(target_token_scalar_probs))
    per_token_ratio = torch.where(
        draft_token_scalar_probs > 0,
        target_token_scalar_probs / draft_token_scalar_probs.clamp(min=1e-10),
        torch.zeros_like(target_token_scalar_probs),
    )
    ratio_grid = torch.ones(batch_size, max_spec_len, device=device, dtype=torch.float32)
    ratio_grid[token_to_batch, pos_in_seq] = per_token_ratio
    p_prefix = torch.ones(batch_size, max_spec_len + 1, device=device, dtype=torch.float32)
    for k in range(max_spec_len):
        p_prefix[:, k + 1] = (p_prefix[:, k] * ratio_grid[:, k]).clamp(max=1.0)
    p_i = p_prefix[token_to_batch, pos_in_seq]
    p_i_expanded = p_i[:, None]
    if IS_NGRAM:
        modified_target = target_probs.clone()
        modified_target[token_indices[valid_draft_mask], draft_token_ids[valid_draft_mask]] = 0.0
        residual = torch.clamp(p_i_expanded * modified_target, min=0.0)
    else:
        residual = torch.clamp(p_i_expanded * target_probs - draft_probs, min=0.0)
    q_values = q[token_to_batch]
    epsilon = 1e-10
    q_values_safe = torch.where(q_values == 0, epsilon, q_values)
    q_values_safe = torch.where(torch.isinf(q_values), epsilon, q_values_safe)
    prob_over_q = torch.where((q_values == 0) | torch.isinf(q_values),
                              torch.full_like(residual, -1e10), residual / q_values_safe)
    output_token_ids[:] = torch.argmax(prob_over_q, dim=1)


def vllm_ascend_greedy_ragged(draft_token_ids, num_draft_tokens, max_spec_len,
                              cu_num_draft_tokens, target_logits, bonus_token_ids):
    # rejection_sample, all_greedy, no Triton, not (all spec_len == 1)
    batch_size = len(num_draft_tokens)
    output_token_ids = torch.empty((batch_size, max_spec_len + 1), dtype=torch.int32,
                                   device=target_logits.device)
    output_token_ids.fill_(PLACEHOLDER_TOKEN_ID)
    target_argmax = target_logits.argmax(dim=-1).view(-1)
    if min(num_draft_tokens) == 1 and max(num_draft_tokens) == 1:
        _asc_greedy_spec_len_1(output_token_ids, draft_token_ids, target_argmax,
                               bonus_token_ids)
    else:
        _asc_greedy(output_token_ids, cu_num_draft_tokens, draft_token_ids, target_argmax,
                    bonus_token_ids, num_draft_tokens, max_spec_len, None)
    return output_token_ids


def _make_asc_greedy(seed):
    lens = [4, 2, 3, 4, 1]
    g, tl, _, _, cu, bonus = _ragged(seed, lens)
    ids = _ragged_greedy_drafts(tl, lens, [4, 0, 1, 2, 1], g).to(torch.int32)
    return ids, lens, max(lens), cu, tl, bonus


def _make_asc_spec1(seed):
    lens = [1, 1, 1, 1]
    g, tl, _, _, cu, bonus = _ragged(seed, lens)
    ids = _ragged_greedy_drafts(tl, lens, [0, 1, 1, 0], g).to(torch.int32)
    return ids, lens, 1, cu, tl, bonus


def _asc_expand_pytorch(output_ptr, input_ptr, cu_num_tokens_ptr, replace_from, replace_to,
                        MAX_NUM_TOKENS):
    device = cu_num_tokens_ptr.device
    batch_size = input_ptr.shape[0]
    num_tokens = output_ptr.shape[0]
    if batch_size == 0 or num_tokens == 0:
        return
    cu_start = torch.cat([torch.tensor([0]).to(device, non_blocking=True),
                          cu_num_tokens_ptr[:-1]])
    cu_end = cu_num_tokens_ptr
    token_indices = torch.arange(num_tokens, device=device)[:, None]
    cu_start_exp = cu_start[None, :]
    cu_end_exp = cu_end[None, :]
    in_range = (token_indices >= cu_start_exp) & (token_indices < cu_end_exp)
    replaced_input = torch.where(input_ptr == replace_from, replace_to, input_ptr).float()
    token_values = torch.einsum("tb,b->t", in_range.float(), replaced_input)
    needs_update = in_range.any(dim=1)
    output_ptr[:] = torch.where(needs_update, token_values, output_ptr)


def _asc_expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
    expanded_x = x.new_empty(num_tokens)
    _asc_expand_pytorch(expanded_x, x, cu_num_tokens, replace_from, replace_to,
                        MAX_NUM_TOKENS=128)
    return expanded_x


def _asc_apply_top_k_top_p_pytorch(logits, k, p):
    # vllm_ascend/sample/sampler.py _apply_top_k_top_p_pytorch, enable_reduce_sample off
    if p is None and k is None:
        return logits
    probs = logits.softmax(dim=-1)
    probs_sort, _ = probs.sort(dim=-1, descending=False)
    if k is not None:
        top_k_count = probs_sort.size(1) - k.to(torch.long)
        top_k_count = top_k_count.unsqueeze(dim=1)
        top_k_cutoff = probs_sort.gather(-1, top_k_count)
        no_top_k_mask = (k == logits.shape[1]).unsqueeze(dim=1)
        top_k_cutoff.masked_fill_(no_top_k_mask, -float("inf"))
        elements_to_discard = probs < top_k_cutoff
        logits.masked_fill_(elements_to_discard, -float("inf"))
    if p is not None:
        cumprob = torch.cumsum(probs_sort, dim=-1)
        top_p_mask = cumprob <= 1 - p.unsqueeze(dim=1)
        top_p_mask[:, -1] = False
        top_p_count = top_p_mask.sum(dim=-1).unsqueeze(1)
        top_p_cutoff = probs_sort.gather(-1, top_p_count)
        elements_to_discard = probs < top_p_cutoff
        logits.masked_fill_(elements_to_discard, -float("inf"))
    return logits


def _asc_apply_sampling_constraints(logits, cu_num_draft_tokens, temperature, top_k, top_p):
    num_tokens = logits.shape[0]
    temperature = _asc_expand_batch_to_tokens(temperature, cu_num_draft_tokens, num_tokens,
                                              replace_from=GREEDY_TEMPERATURE, replace_to=1)
    logits.div_(temperature.unsqueeze(-1))
    k = None
    if top_k is not None:
        k = _asc_expand_batch_to_tokens(top_k, cu_num_draft_tokens, num_tokens)
    p = None
    if top_p is not None:
        p = _asc_expand_batch_to_tokens(top_p, cu_num_draft_tokens, num_tokens)
    return _asc_apply_top_k_top_p_pytorch(logits, k, p)


def vllm_ascend_rejection_sample_mixed(draft_token_ids, num_draft_tokens, max_spec_len,
                                       cu_num_draft_tokens, draft_probs, logits,
                                       bonus_token_ids, temperature, top_k, top_p,
                                       using_block_verify=False, using_entropy_verify=False):
    # AscendRejectionSampler.forward (target part; bonus tokens come in as an input) +
    # apply_sampling_constraints + rejection_sample, non-reduce fallback path, no Triton
    generators = {}
    raw_target_logits = logits.to(torch.float32)
    target_logits = raw_target_logits.clone()
    target_logits = _asc_apply_sampling_constraints(target_logits, cu_num_draft_tokens,
                                                    temperature, top_k, top_p)
    batch_size = len(num_draft_tokens)
    num_tokens = draft_token_ids.shape[0]
    device = target_logits.device
    if using_entropy_verify and raw_target_logits is not None:
        ori_target_probs = raw_target_logits.softmax(dim=-1, dtype=torch.float32)
    else:
        ori_target_probs = None
    output_token_ids = torch.empty((batch_size, max_spec_len + 1), dtype=torch.int32,
                                   device=device)
    output_token_ids.fill_(PLACEHOLDER_TOKEN_ID)
    is_greedy = temperature == GREEDY_TEMPERATURE
    target_argmax = target_logits.argmax(dim=-1).view(-1)
    _asc_greedy(output_token_ids, cu_num_draft_tokens, draft_token_ids, target_argmax,
                bonus_token_ids, num_draft_tokens, max_spec_len, is_greedy)
    vocab_size = target_logits.shape[-1]
    target_probs = target_logits.softmax(dim=-1, dtype=torch.float32)
    uniform_probs = _v1_generate_uniform_probs(num_tokens, num_draft_tokens, generators, device)
    recovered_token_ids = _asc_sample_recovered_tokens(
        max_spec_len, num_draft_tokens, cu_num_draft_tokens, draft_token_ids, draft_probs,
        target_probs, generators, device)
    if not using_block_verify:
        _asc_random_pytorch(output_token_ids, cu_num_draft_tokens, draft_token_ids, draft_probs,
                            target_probs, bonus_token_ids, recovered_token_ids, uniform_probs,
                            is_greedy, max_spec_len, vocab_size, IS_NGRAM=draft_probs is None,
                            ENTROPY_VERIFY=using_entropy_verify, POSTERIOR_THRESHOLD=0.95,
                            POSTERIOR_ALPHA=0.4, EPSILON=1e-10,
                            ori_target_probs=ori_target_probs)
    else:
        _asc_block_verify_pytorch(output_token_ids, cu_num_draft_tokens, draft_token_ids,
                                  draft_probs, target_probs, bonus_token_ids,
                                  recovered_token_ids, uniform_probs, is_greedy, max_spec_len,
                                  vocab_size, IS_NGRAM=draft_probs is None)
    return output_token_ids


def vllm_ascend_block_verify(draft_token_ids, num_draft_tokens, max_spec_len,
                             cu_num_draft_tokens, draft_probs, logits, bonus_token_ids,
                             temperature, top_k, top_p):
    return vllm_ascend_rejection_sample_mixed(
        draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
        logits, bonus_token_ids, temperature, top_k, top_p, using_block_verify=True)


def vllm_ascend_entropy_verify(draft_token_ids, num_draft_tokens, max_spec_len,
                               cu_num_draft_tokens, draft_probs, logits, bonus_token_ids,
                               temperature, top_k, top_p):
    return vllm_ascend_rejection_sample_mixed(
        draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
        logits, bonus_token_ids, temperature, top_k, top_p, using_entropy_verify=True)


def _make_asc_mixed(seed):
    lens = [3, 2, 4, 3]
    g, tl, dp, ids, cu, bonus = _ragged(seed, lens)
    temperature = torch.tensor([1.0, 0.0, 1.0, 0.9])
    top_k = torch.tensor([V, V, 5, V], dtype=torch.int32)
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.85])
    return ids.to(torch.int32), lens, max(lens), cu, dp, tl, bonus, temperature, top_k, top_p


def _make_asc_entropy(seed):
    # flatter target (higher entropy) and noisier drafts so the entropy-relaxed test matters
    lens = [4, 3, 4, 2]
    g, tl, dp, ids, cu, bonus = _ragged(seed, lens, scale=1.0, noise=1.5)
    temperature = torch.tensor([1.0, 1.0, 0.0, 1.0])
    return ids.to(torch.int32), lens, max(lens), cu, dp, tl, bonus, temperature, None, None


def _make_asc_block(seed):
    lens = [4, 4, 3, 4]
    g, tl, dp, ids, cu, bonus = _ragged(seed, lens, noise=0.5)
    temperature = torch.tensor([1.0, 1.0, 1.0, 0.0])
    return ids.to(torch.int32), lens, max(lens), cu, dp, tl, bonus, temperature, None, None


def vllm_ascend_recovered_blockwise(num_draft_tokens, cu_num_draft_tokens, draft_token_ids,
                                    draft_probs, target_probs):
    batch_size = len(num_draft_tokens)
    vocab_size = target_probs.shape[-1]
    q = torch.empty((batch_size, vocab_size), dtype=torch.float32, device=target_probs.device)
    q.exponential_()
    recovered_token_ids = torch.empty_like(draft_token_ids)
    _asc_recovered_blockwise_pytorch(recovered_token_ids, cu_num_draft_tokens, draft_token_ids,
                                     draft_probs, target_probs, q, vocab_size,
                                     IS_NGRAM=draft_probs is None)
    return recovered_token_ids


def _make_asc_blockwise_rec(seed):
    lens = [4, 2, 3]
    g, tl, dp, ids, cu, _ = _ragged(seed, lens)
    return lens, cu, ids.to(torch.int32), dp, tl.softmax(-1)


# ===========================================================================
# SGLang (python/sglang/srt/speculative/eagle_utils.py verify_tree_greedy_native, the
# torch fallback used on NPU, 2025; driven the way EagleVerifyInput.verify in
# eagle_info.py drives it for greedy batches)
# ===========================================================================

def _sgl_verify_tree_greedy_native(predicts, accept_index, accept_token_num, candidates,
                                   retrive_index, retrive_next_token, retrive_next_sibling,
                                   target_predict, topk=-1):
    batch_size, num_draft_tokens = candidates.shape
    if num_draft_tokens == 2 and accept_index.shape[1] == 2 and topk == 1:
        comparison_result = candidates[:, 1] == target_predict[:, 0]
        predicts = target_predict.flatten()
        accept_index = torch.arange(0, num_draft_tokens * batch_size,
                                    device=candidates.device,
                                    dtype=torch.long).reshape(batch_size, num_draft_tokens)
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


def sglang_eagle_verify_greedy(draft_token, retrive_index, retrive_next_token,
                               retrive_next_sibling, next_token_logits, spec_steps, topk):
    bs = retrive_index.shape[0]
    draft_token_num = retrive_index.shape[1]
    candidates = draft_token.reshape(bs, draft_token_num)
    predict_shape = list(next_token_logits.shape)[:-1]
    predict_shape[-1] += 1
    predict = torch.empty(predict_shape, dtype=torch.int32, device=draft_token.device)
    accept_index = torch.full((bs, spec_steps + 1), -1, dtype=torch.int32,
                              device=draft_token.device)
    accept_length = torch.empty((bs,), dtype=torch.int32, device=draft_token.device)
    target_predict = torch.argmax(next_token_logits, dim=-1)
    target_predict = target_predict.reshape(bs, draft_token_num)
    predict, accept_index, accept_length = _sgl_verify_tree_greedy_native(
        predicts=predict, accept_index=accept_index, accept_token_num=accept_length,
        candidates=candidates, retrive_index=retrive_index,
        retrive_next_token=retrive_next_token, retrive_next_sibling=retrive_next_sibling,
        target_predict=target_predict, topk=topk)
    # the tensor part of what verify() does next (request bookkeeping dropped)
    accept_index = accept_index[accept_index != -1]
    verified_id = predict[accept_index]
    evict_mask = torch.full_like(draft_token, True, dtype=torch.bool)
    evict_mask[accept_index] = False
    return verified_id, accept_length, accept_index, evict_mask


def _sgl_tree_inputs(g, bs, n, next_token, next_sibling, target_predict, candidates):
    retrive_index = (torch.arange(bs)[:, None] * n + torch.arange(n)[None, :]).long()
    rnt = torch.tensor(next_token, dtype=torch.long).expand(bs, n).contiguous()
    rns = torch.tensor(next_sibling, dtype=torch.long).expand(bs, n).contiguous()
    logits = torch.randn(bs * n, V, generator=g) * 0.5
    logits[torch.arange(bs * n), target_predict.reshape(-1)] += 10.0
    return candidates.reshape(-1), retrive_index, rnt, rns, logits


def _make_sgl_tree(seed):
    # tree: 0 -> {1, 2}; 1 -> {3, 4}; 3 -> {5}   (topk=2, depth 3)
    g = _gen(seed)
    bs, n = 4, 6
    tp = torch.randint(0, V, (bs, n), generator=g)
    cand = torch.randint(0, V, (bs, n), generator=g)

    def ne(x):
        return _not_equal_to(x, g)
    cand[0, 1], cand[0, 2] = ne(tp[0, 0]), ne(tp[0, 0])                    # nothing accepted
    cand[1, 1], cand[1, 2] = ne(tp[1, 0]), tp[1, 0]                        # sibling 2 accepted
    cand[2, 1], cand[2, 3], cand[2, 4] = tp[2, 0], ne(tp[2, 1]), tp[2, 1]  # 1 then sibling 4
    cand[3, 1], cand[3, 3], cand[3, 5] = tp[3, 0], tp[3, 1], tp[3, 3]      # full depth
    args = _sgl_tree_inputs(g, bs, n, [1, 3, -1, 5, -1, -1], [-1, 2, -1, 4, -1, -1], tp, cand)
    return (*args, 3, 2)


def _make_sgl_chain(seed):
    g = _gen(seed)
    bs, n = 4, 4
    tp = torch.randint(0, V, (bs, n), generator=g)
    drafts = _greedy_drafts(tp[:, :n - 1], [0, 1, 3, 2], g)
    cand = torch.cat([torch.randint(0, V, (bs, 1), generator=g), drafts], dim=1)
    args = _sgl_tree_inputs(g, bs, n, [1, 2, 3, -1], [-1, -1, -1, -1], tp, cand)
    return (*args, 3, 1)


def _make_sgl_k1(seed):
    g = _gen(seed)
    bs, n = 5, 2
    tp = torch.randint(0, V, (bs, n), generator=g)
    drafts = _greedy_drafts(tp[:, :1], [0, 1, 1, 0, 1], g)
    cand = torch.cat([torch.randint(0, V, (bs, 1), generator=g), drafts], dim=1)
    args = _sgl_tree_inputs(g, bs, n, [1, -1], [-1, -1], tp, cand)
    return (*args, 1, 1)


# ===========================================================================
# TensorRT-LLM PyTorch backend
# ===========================================================================

# tensorrt_llm/_torch/speculative/mtp.py, MTPWorker.sample_and_accept_draft_tokens
# (greedy torch path, 2025)
def trtllm_mtp_sample_and_accept(logits, draft_tokens_flat, num_contexts, batch_size,
                                 mtp_num_modules):
    num_gens = batch_size - num_contexts
    accepted_tokens = torch.empty((batch_size, (mtp_num_modules + 1)), dtype=torch.int,
                                  device=logits.device)
    num_accepted_tokens = torch.ones(batch_size, dtype=torch.int, device=logits.device)
    target_tokens = torch.argmax(logits, dim=-1)
    accepted_tokens[:num_contexts, 0] = target_tokens[:num_contexts]
    gen_target_tokens = target_tokens[num_contexts:].reshape(num_gens, mtp_num_modules + 1)
    accepted_tokens[num_contexts:, :] = gen_target_tokens
    draft_tokens = draft_tokens_flat.reshape(num_gens, mtp_num_modules)
    num_accepted_tokens[num_contexts:] += torch.cumprod(
        (draft_tokens == gen_target_tokens[:, :mtp_num_modules]).int(), dim=-1).sum(1)
    # context rows only have column 0 written (torch.empty elsewhere): return the
    # written parts only so the result is deterministic
    return accepted_tokens[:num_contexts, :1], accepted_tokens[num_contexts:], num_accepted_tokens


def _make_trt_mtp(seed):
    g = _gen(seed)
    nc, ng, K = 1, 4, 3
    ctx_logits = torch.randn(nc, V, generator=g) * 2
    gen_logits = torch.randn(ng, K + 1, V, generator=g) * 2
    drafts = _greedy_drafts(gen_logits.argmax(-1)[:, :K], [0, 1, 3, 2], g).to(torch.int32)
    logits = torch.cat([ctx_logits, gen_logits.reshape(-1, V)], 0)
    return logits, drafts.reshape(-1), nc, nc + ng, K


# tensorrt_llm/_torch/speculative/interface.py _sample_and_accept_draft_tokens_base with
# allow_advanced_sampling, i.e. one_model_sampler.sampling_batch_spec_dec_one_model ->
# forward_native (torch top-k/top-p + exponential-race sampling). The @torch.compile
# decorator on sampling_batch_spec_dec_one_model is dropped.
def _trt_apply_top_k_top_p(logits, k, p):
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    if k is not None:
        top_k_mask = logits_sort.size(1) - k.to(torch.long)
        top_k_mask = top_k_mask.clamp(min=0)
        top_k_mask = logits_sort.gather(1, top_k_mask.unsqueeze(dim=1))
        top_k_mask = logits_sort < top_k_mask
        logits_sort.masked_fill_(top_k_mask, -float("inf"))
    if p is not None:
        probs_sort = logits_sort.softmax(dim=-1)
        probs_sum = torch.cumsum(probs_sort, dim=-1, out=probs_sort)
        top_p_mask = probs_sum <= 1 - p.unsqueeze(dim=1)
        top_p_mask[:, -1] = False
        logits_sort.masked_fill_(top_p_mask, -float("inf"))
    logits = logits_sort.scatter(dim=-1, index=logits_idx, src=logits_sort)
    return logits


def _trt_sampling_batch_spec_dec_one_model(logits, temperatures, top_k, top_p):
    logits = logits.div_(temperatures.unsqueeze(dim=1))          # apply_temperature
    logits = _trt_apply_top_k_top_p(logits, top_k, top_p)         # forward_native
    probs = logits.softmax(dim=-1, dtype=torch.float32)
    q = torch.empty_like(probs).exponential_()                    # random_sample
    return probs.div_(q).argmax(dim=-1).view(-1)


def trtllm_accept_base_advanced_sampling(logits, draft_tokens, temperatures, top_ks, top_ps,
                                         num_contexts, batch_size, max_draft_len):
    num_gens = batch_size - num_contexts
    logits = logits.clone()  # the sampler divides the caller's logits in place
    if logits.dim() == 1:
        logits = logits.unsqueeze(0)
    accepted_tokens = torch.empty((batch_size, max_draft_len + 1), dtype=torch.int,
                                  device=logits.device)
    num_accepted_tokens = torch.ones(batch_size, dtype=torch.int, device=logits.device)
    num_tokens = num_contexts + num_gens * (max_draft_len + 1)
    target_tokens = _trt_sampling_batch_spec_dec_one_model(
        logits, temperatures[:num_tokens], top_ks[:num_tokens], top_ps[:num_tokens])
    accepted_tokens[:num_contexts, 0] = target_tokens[:num_contexts]
    gen_target_tokens = target_tokens[num_contexts:].reshape(num_gens, max_draft_len + 1)
    accepted_tokens[num_contexts:, :] = gen_target_tokens
    num_accepted_tokens[num_contexts:] += torch.cumprod(
        (draft_tokens == gen_target_tokens[:, :max_draft_len]).int(), dim=-1).sum(1)
    return accepted_tokens[:num_contexts, :1], accepted_tokens[num_contexts:], num_accepted_tokens


def _make_trt_adv(seed):
    g = _gen(seed)
    nc, ng, K = 1, 4, 3
    n_tok = nc + ng * (K + 1)
    logits = torch.randn(n_tok, V, generator=g) * 3
    gen = logits[nc:].reshape(ng, K + 1, V)
    drafts = _greedy_drafts(gen.argmax(-1)[:, :K], [0, 1, 3, 2], g).to(torch.int32)
    temperatures = torch.full((n_tok,), 0.3)
    temperatures[nc + (K + 1):nc + 2 * (K + 1)] = 1.0
    top_ks = torch.full((n_tok,), V, dtype=torch.int32)
    top_ks[nc + 2 * (K + 1):] = 4
    top_ps = torch.ones(n_tok)
    top_ps[-(K + 1):] = 0.8
    return logits, drafts, temperatures, top_ks, top_ps, nc, nc + ng, K


# tensorrt_llm/_torch/pyexecutor/sampling_utils.py get_rejected_indices / sample_rejected,
# driven per request as TorchSampler._process_draft_tokens_rejection_sampling does
# (two-model draft/target path). generator=None -> the global RNG.
def _trt_get_rejected_indices(draft_probs, target_probs, generator, draft_tokens):
    device = draft_probs.device
    num_draft_tokens = draft_probs.size(0)
    draft_tokens = draft_tokens[:num_draft_tokens]
    token_idx = torch.arange(num_draft_tokens, dtype=torch.int32, device=device)
    draft_tokens_cuda = torch.tensor(draft_tokens, dtype=torch.int32).to(device=device,
                                                                         non_blocking=True)
    p = draft_probs[token_idx, draft_tokens_cuda]
    q = target_probs.squeeze(0)[token_idx, draft_tokens_cuda]
    accept_probs = torch.minimum(torch.ones((), device=device, dtype=q.dtype), q / p)
    rejected_indices = (torch.rand(accept_probs.shape, generator=generator,
                                   device=accept_probs.device) > accept_probs).nonzero()
    return rejected_indices


def _trt_sample_rejected(draft_probs, target_probs, generator, num_accepted):
    last_draft = draft_probs[num_accepted]
    last_target = target_probs[num_accepted]
    new = last_target - last_draft
    new = torch.where(new > 0, new, 0.0)
    new_token = torch.multinomial(new, num_samples=1, generator=generator).squeeze(-1)
    return int(new_token.item())


def trtllm_torch_sampler_rejection(draft_probs, target_probs, draft_tokens, new_tokens):
    new_tokens_tensor = new_tokens.clone()   # [max_draft_len + 1, slots] target-sampled tokens
    num_accepted_per_req = []
    for seq_slot in range(draft_tokens.shape[0]):
        py_draft_tokens = draft_tokens[seq_slot].tolist()
        rejected_indices = _trt_get_rejected_indices(draft_probs[seq_slot],
                                                     target_probs[seq_slot], None,
                                                     py_draft_tokens)
        sample_last = True
        if rejected_indices.numel() == 0:
            num_initially_accepted = len(py_draft_tokens)
            sample_last = False
        else:
            num_initially_accepted = int(rejected_indices[0].item())
        num_accepted = num_initially_accepted
        for i in range(num_accepted):
            new_tokens_tensor[i, seq_slot] = py_draft_tokens[i]
        if sample_last:
            new_token = _trt_sample_rejected(draft_probs[seq_slot], target_probs[seq_slot],
                                             None, num_accepted)
            new_tokens_tensor[num_accepted, seq_slot] = new_token
        num_accepted_per_req.append(num_accepted)
    return new_tokens_tensor, torch.tensor(num_accepted_per_req, dtype=torch.int32)


def _make_trt_two_model(seed):
    g, tp, dp, ids = _padded_probs(seed, B=4, K=3, noise=0.5)
    new_tokens = torch.randint(0, V, (4, 4), generator=g, dtype=torch.int32)
    return dp, tp, ids, new_tokens


# ===========================================================================
ENTRIES = [
    dict(name="vllm_v0_rejection_sampler_forward",
         source="vllm-project/vllm, vllm/model_executor/layers/rejection_sampler.py, "
                "RejectionSampler.forward (+_get_accepted, _get_recovered_probs, _multinomial, "
                "_create_output; v0.4-era, early 2024)",
         kind="whole_step", fn=vllm_v0_rejection_sampler_forward, make=_make_v0_forward),
    dict(name="vllm_v0_get_recovered_probs",
         source="vllm-project/vllm, vllm/model_executor/layers/rejection_sampler.py, "
                "RejectionSampler._get_recovered_probs (v0.4-era)",
         kind="residual", fn=vllm_v0_recovered_probs, make=_make_v0_recovered),
    dict(name="vllm_v0_typical_acceptance_evaluate",
         source="vllm-project/vllm, vllm/model_executor/layers/typical_acceptance_sampler.py, "
                "TypicalAcceptanceSampler.forward slice + _evaluate_accepted_tokens "
                "(commit 0244fee8, late 2024)",
         kind="typical", fn=vllm_v0_typical_accepted, make=_make_v0_typical),
    dict(name="vllm_v1_forward_native_greedy_padded",
         source="vllm-project/vllm, vllm/v1/sample/rejection_sampler.py, RejectionSampler.forward"
                " + forward_native all_greedy branch + _convert_2d_probs (Feb-Mar 2025)",
         kind="greedy", fn=vllm_v1_native_greedy, make=_make_v1n_greedy),
    dict(name="vllm_v1_forward_native_random_padded",
         source="vllm-project/vllm, vllm/v1/sample/rejection_sampler.py, RejectionSampler.forward"
                " + forward_native random branch + _create_uniform_samples + "
                "topk_topp_sampler.random_sample (Feb-Mar 2025)",
         kind="whole_step", fn=vllm_v1_native_random, make=_make_v1n_random),
    dict(name="vllm_v1_mar2025_recovered_tokens",
         source="vllm-project/vllm, vllm/v1/sample/rejection_sampler.py, rejection_sample "
                "recovered-token block (Mar 2025 revision found in the code index; commit not "
                "pinned)",
         kind="residual", fn=vllm_v1_mar2025_recovered_tokens, make=_make_v1_mar2025),
    dict(name="vllm_v1_rejection_sample_greedy_ragged",
         source="vllm-project/vllm, vllm/v1/sample/rejection_sampler.py, rejection_sample "
                "all_greedy path + rejection_greedy_sample_kernel as per-request loop "
                "(commit 7f6fc1c5, 2025-26)",
         kind="greedy", fn=vllm_v1_rejection_sample_greedy, make=_make_v1_greedy),
    dict(name="vllm_v1_rejection_sample_mixed_ragged",
         source="vllm-project/vllm, vllm/v1/sample/rejection_sampler.py, "
                "apply_sampling_constraints(temperature) + rejection_sample (greedy + random "
                "kernels, generate_uniform_probs fp64, sample_recovered_tokens) as loops "
                "(commit 7f6fc1c5)",
         kind="whole_step", fn=vllm_v1_rejection_sample_mixed, make=_make_v1_mixed),
    dict(name="vllm_v1_rejection_sample_ngram_ragged",
         source="vllm-project/vllm, vllm/v1/sample/rejection_sampler.py, rejection_sample with "
                "draft_probs=None (NO_DRAFT_PROBS kernels), a 0-draft and a 1-draft request "
                "(commit 7f6fc1c5)",
         kind="whole_step", fn=vllm_v1_rejection_sample_mixed, make=_make_v1_ngram),
    dict(name="vllm_ascend_greedy_pytorch_ragged",
         source="vllm-project/vllm-ascend, vllm_ascend/sample/rejection_sampler.py, "
                "rejection_sample all_greedy + rejection_greedy_sample_pytorch (182b75ea, 2026)",
         kind="greedy", fn=vllm_ascend_greedy_ragged, make=_make_asc_greedy),
    dict(name="vllm_ascend_greedy_spec_len_1",
         source="vllm-project/vllm-ascend, vllm_ascend/sample/rejection_sampler.py, "
                "rejection_greedy_sample_spec_len_1_pytorch (182b75ea)",
         kind="greedy", fn=vllm_ascend_greedy_ragged, make=_make_asc_spec1),
    dict(name="vllm_ascend_rejection_sample_mixed",
         source="vllm-project/vllm-ascend, vllm_ascend/sample/rejection_sampler.py, "
                "rejection_sample fallback path: rejection_greedy_sample_pytorch + "
                "sample_recovered_tokens(_pytorch) + rejection_random_sample_pytorch (182b75ea)",
         kind="whole_step", fn=vllm_ascend_rejection_sample_mixed, make=_make_asc_mixed),
    dict(name="vllm_ascend_entropy_verify",
         source="vllm-project/vllm-ascend, vllm_ascend/sample/rejection_sampler.py, "
                "rejection_random_sample_pytorch with ENTROPY_VERIFY=True (182b75ea)",
         kind="whole_step", fn=vllm_ascend_entropy_verify, make=_make_asc_entropy),
    dict(name="vllm_ascend_block_verify",
         source="vllm-project/vllm-ascend, vllm_ascend/sample/rejection_sampler.py, "
                "rejection_sample with block verify: rejection_random_sample_block_verify_pytorch"
                " (182b75ea)",
         kind="block", fn=vllm_ascend_block_verify, make=_make_asc_block),
    dict(name="vllm_ascend_recovered_blockwise",
         source="vllm-project/vllm-ascend, vllm_ascend/sample/rejection_sampler.py, "
                "sample_recovered_tokens_blockwise_pytorch (182b75ea)",
         kind="block", fn=vllm_ascend_recovered_blockwise, make=_make_asc_blockwise_rec),
    dict(name="sglang_verify_tree_greedy_native_tree",
         source="sgl-project/sglang, python/sglang/srt/speculative/eagle_utils.py, "
                "verify_tree_greedy_native (BFS loop) driven like EagleVerifyInput.verify "
                "(eagle_info.py), topk=2 tree (2025)",
         kind="greedy", fn=sglang_eagle_verify_greedy, make=_make_sgl_tree),
    dict(name="sglang_verify_tree_greedy_native_chain",
         source="sgl-project/sglang, python/sglang/srt/speculative/eagle_utils.py, "
                "verify_tree_greedy_native on a topk=1 chain (2025)",
         kind="greedy", fn=sglang_eagle_verify_greedy, make=_make_sgl_chain),
    dict(name="sglang_verify_tree_greedy_native_k1_fastpath",
         source="sgl-project/sglang, python/sglang/srt/speculative/eagle_utils.py, "
                "verify_tree_greedy_native 2-token/topk=1 fast path (K=1)",
         kind="greedy", fn=sglang_eagle_verify_greedy, make=_make_sgl_k1),
    dict(name="trtllm_mtp_sample_and_accept_greedy",
         source="NVIDIA/TensorRT-LLM, tensorrt_llm/_torch/speculative/mtp.py, "
                "MTPWorker.sample_and_accept_draft_tokens (torch.argmax path, 2025), mixed "
                "context+generation batch",
         kind="greedy", fn=trtllm_mtp_sample_and_accept, make=_make_trt_mtp),
    dict(name="trtllm_accept_base_advanced_sampling",
         source="NVIDIA/TensorRT-LLM, tensorrt_llm/_torch/speculative/interface.py "
                "_sample_and_accept_draft_tokens_base + one_model_sampler.py "
                "sampling_batch_spec_dec_one_model/forward_native/apply_top_k_top_p/random_sample",
         kind="greedy", fn=trtllm_accept_base_advanced_sampling, make=_make_trt_adv),
    dict(name="trtllm_torch_sampler_rejection_two_model",
         source="NVIDIA/TensorRT-LLM, tensorrt_llm/_torch/pyexecutor/sampling_utils.py "
                "get_rejected_indices + sample_rejected, per request as in "
                "TorchSampler._process_draft_tokens_rejection_sampling",
         kind="whole_step", fn=trtllm_torch_sampler_rejection, make=_make_trt_two_model),
]
