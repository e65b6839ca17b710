"""Held-out corpus C: speculative-decoding verify steps transcribed from public codebases.

Each entry is a batched PyTorch rendering of one verify step, keeping the original's
spelling (ops, order, loops, .item()/.tolist() calls, dtype casts).  Where the original is
batch-1 (romsto, feifeibear, mlx) the batch is a Python loop over rows, as its author would
have written it; where it is MLX or Triton it is written in the equivalent torch ops.
"""
import torch
from torch.nn import functional as F


# ----------------------------------------------------------------------------------------
# shared input builders (all deterministic from `seed`)
# ----------------------------------------------------------------------------------------

def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _corr_logits(g, B, K, V, scale=2.0, noise=0.6, n_target=None):
    """target logits [B, K+1, V] (or n_target positions) and correlated draft logits [B, K, V]."""
    T = K + 1 if n_target is None else n_target
    tgt = torch.randn(B, T, V, generator=g) * scale
    dft = 0.7 * tgt[:, :K] + noise * torch.randn(B, K, V, generator=g) * scale
    return tgt, dft


def _greedy_drafts(g, target_argmax, cuts, V):
    """draft ids equal to target argmax up to a per-row cut, different from it from the cut on."""
    B, K = target_argmax.shape
    d = target_argmax.clone()
    for b, c in enumerate(cuts):
        if c < K:
            off = 1 + torch.randint(0, V - 1, (K - c,), generator=g)
            d[b, c:] = (target_argmax[b, c:] + off) % V
    return d


def _sample_rows(g, probs):
    B, K, V = probs.shape
    return torch.multinomial(probs.reshape(B * K, V), 1, generator=g).reshape(B, K)


# ========================================================================================
# 1. mlx-examples  llms/speculative_decoding/decoder.py  SpeculativeDecoder._get_num_accept
#    (+ the new_tokens assembly in speculative_decode).  MLX -> torch.  log-space ratio test
#    with a `delta` margin, `(accept.tolist() + [False]).index(False)`, argmax bonus token.
# ========================================================================================

def mlx_examples_get_num_accept(draft_tokens, draft_probs, logits, delta=0.1):
    # draft_tokens [B, K] (greedy draft), draft_probs [B, K] (draft log-probs of those ids),
    # logits [B, K+1, V] target logits over [last token, drafts]
    B = draft_tokens.shape[0]
    nums, outs = [], []
    for b in range(B):
        model_logits = logits[b, :-1]
        dt = draft_tokens[b]
        model_probs = torch.take_along_dim(model_logits, dt[:, None], dim=-1).squeeze(-1)
        model_probs -= torch.logsumexp(model_logits.to(torch.float32), dim=-1)
        unis = torch.rand(dt.numel())
        log_unis = torch.log(torch.maximum(unis - delta, torch.tensor(0.0)))
        accept_toks = log_unis <= (model_probs - draft_probs[b])
        num_to_accept = (accept_toks.tolist() + [False]).index(False)
        new_tokens = dt[:num_to_accept]
        new_tokens = torch.cat([new_tokens, torch.argmax(logits[b, num_to_accept], dim=-1, keepdim=True)])
        nums.append(num_to_accept)
        outs.append(new_tokens)
    return torch.tensor(nums), outs


def _make_mlx_examples_get_num_accept(seed, B=4, K=4, V=32):
    g = _gen(seed)
    tgt, dft = _corr_logits(g, B, K, V, scale=1.5)
    # SpeculativeDecoder._generate (draft=True): x = argmax(logits); logprob = logits[x] - logsumexp(f32)
    x = torch.argmax(dft, dim=-1)
    lognorm = torch.logsumexp(dft.to(torch.float32), dim=-1)
    logprob = dft.gather(-1, x[..., None]).squeeze(-1) - lognorm
    return x, logprob, tgt


# ========================================================================================
# 2. mlx-examples  llms/mlx_lm/utils.py  speculative_generate_step, first version
#    (commit 93c5cfd7, 2025-01-10).  _step: `logits - mx.logsumexp(logits, keepdims=True)`
#    with NO axis (normalises over the whole [1, n_predict, V] block), argmax sampler,
#    .tolist() and a while-loop over ints.
# ========================================================================================

def mlx_lm_utils_v0_speculative_step(logits, draft_tokens):
    # logits [B, K+1, V]: model(y[None]) over [y, draft_tokens]; draft_tokens [B, K]
    B, num_draft = draft_tokens.shape
    ns, emitted, emitted_lps = [], [], []
    for b in range(B):
        lg = logits[b:b + 1, -(num_draft + 1):, :]
        logprobs = lg - torch.logsumexp(lg, dim=tuple(range(lg.ndim)), keepdim=True)
        y = torch.argmax(logprobs, dim=-1).squeeze(0)
        tokens, logprobs = y, logprobs.squeeze(0)
        dts = draft_tokens[b].tolist()
        tokens = tokens.tolist()
        n = 0
        out, lps = [], []
        while n < num_draft:
            tn, dtn, lpn = tokens[n], dts[n], logprobs[n]
            if tn != dtn:
                break
            n += 1
            out.append(tn)
            lps.append(lpn)
        out.append(tokens[n])
        lps.append(logprobs[n])
        ns.append(n)
        emitted.append(torch.tensor(out))
        emitted_lps.append(torch.stack(lps))
    return ns, emitted, emitted_lps


def _make_mlx_lm_utils_v0(seed, B=4, K=3, V=29):
    g = _gen(seed)
    tgt, _ = _corr_logits(g, B, K, V)
    d = _greedy_drafts(g, tgt[:, :K].argmax(-1), cuts=[0, 1, K, 2][:B], V=V)
    return tgt, d


# ========================================================================================
# 3. mlx-lm  mlx_lm/generate.py  speculative_generate_step (HEAD d78bf58, 2026) with a
#    logits_processors list (sample_utils.make_repetition_penalty): per-position loop in
#    _step that appends the *sampled* token to prev_tokens, `logits - logsumexp(axis=-1,
#    keepdims=True)`, argmax sampler, tolist + while loop, prev_tokens rewind.
# ========================================================================================

def _mlx_repetition_penalty(tokens, logits, penalty=1.5, context_size=20):
    if len(tokens) > 0:
        tokens = tokens[-context_size:]
        selected_logits = logits[:, tokens]
        selected_logits = torch.where(
            selected_logits < 0,
            selected_logits * penalty,
            selected_logits / penalty,
        )
        logits[:, tokens] = selected_logits
    return logits


def mlx_lm_speculative_step_with_processors(prev_tokens_in, y_in, draft_tokens, logits_in):
    # prev_tokens_in [B, P] context; y_in [B] last accepted token; draft_tokens [B, K];
    # logits_in [B, K+1, V] model logits over [y, drafts]
    logits_processors = [_mlx_repetition_penalty]
    sampler = lambda x: torch.argmax(x, dim=-1)

    def _process_and_sample(tokens, logits):
        if logits_processors:
            for processor in logits_processors:
                logits = processor(tokens, logits)
        logprobs = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
        y = sampler(logprobs)
        return y, logprobs

    B, num_draft = draft_tokens.shape
    results = []
    for b in range(B):
        prev_tokens = prev_tokens_in[b]
        y = torch.cat([y_in[b:b + 1], draft_tokens[b]])
        n_predict = num_draft + 1
        logits = logits_in[b:b + 1].clone()  # mx slices are copies
        logits = logits[:, -n_predict:, :]
        out_y, out_logprobs = [], []
        if n_predict > 1:
            y = y[: -(n_predict - 1)]
        for i in range(n_predict):
            prev_tokens = torch.cat([prev_tokens, y]) if prev_tokens is not None else y
            y, logprobs = _process_and_sample(prev_tokens, logits[:, i, :])
            out_y.append(y)
            out_logprobs.append(logprobs)
        tokens, logprobs = torch.cat(out_y, dim=0), torch.cat(out_logprobs, dim=0)
        dts = draft_tokens[b].tolist()
        tokens = tokens.tolist()
        n = 0
        emitted, lps = [], []
        while n < num_draft:
            tn, dtn, lpn = tokens[n], dts[n], logprobs[n]
            if tn != dtn:
                break
            n += 1
            emitted.append(tn)
            lps.append(lpn)
        emitted.append(tokens[n])
        lps.append(logprobs[n])
        prev_tokens = prev_tokens[: -max(num_draft - n, 1)]
        results.append((n, torch.tensor(emitted), torch.stack(lps), prev_tokens))
    return results


def _make_mlx_lm_processors(seed, B=3, K=4, V=32, P=6):
    g = _gen(seed)
    tgt, _ = _corr_logits(g, B, K, V)
    prev = torch.randint(0, V, (B, P), generator=g)
    y = torch.randint(0, V, (B,), generator=g)
    d = _greedy_drafts(g, tgt[:, :K].argmax(-1), cuts=[K, 1, 0][:B], V=V)
    return prev, y, d, tgt


# ========================================================================================
# 4. LMDeploy  lmdeploy/pytorch/spec_decode/reject_sampler.py  rejection_sample ->
#    greedy_reject_sampler, first version (commit c77593721, 2025-11-26, ALL_GREEDY only).
#    cumsum-of-matches == arange trick, argmin first diff, -1 placeholders, bonus via where.
# ========================================================================================

def lmdeploy_v0_rejection_sample(target_probs, draft_token_ids, bonus_token_ids):
    # target_probs [B, K, V] (target logits at the draft positions), draft ids [B, K],
    # bonus_token_ids [B, 1]
    target_argmax_tokens = target_probs.argmax(dim=-1)
    draft_token_ids, target_token_ids = draft_token_ids, target_argmax_tokens
    masks = draft_token_ids == target_token_ids
    batch_size, num_spec_tokens = draft_token_ids.shape
    range_data = torch.arange(num_spec_tokens, device=draft_token_ids.device)[None, :]
    equals = (masks.cumsum(dim=1) - 1) == range_data
    num_rejected_tokens = num_spec_tokens - equals.sum(dim=1)
    first_diff_indices = torch.argmin(equals.int(), dim=1, keepdim=True)
    keeps = range_data.repeat(batch_size, 1) <= first_diff_indices
    keeps = keeps | equals
    keep_token_ids = torch.where(keeps, target_token_ids, -1)
    keep_bonus_ids = torch.where(equals[:, -1:], bonus_token_ids, -1)
    output_token_ids = torch.cat([keep_token_ids, keep_bonus_ids], dim=1)
    last_indices = (torch.cat([keeps, equals[:, -1:]], dim=1).cumsum(dim=1) - 1)[:, -1].flatten()
    last_token_ids = output_token_ids[torch.arange(batch_size, device=draft_token_ids.device), last_indices]
    return output_token_ids, num_rejected_tokens, last_token_ids


def _make_lmdeploy_v0(seed, B=5, K=4, V=32):
    g = _gen(seed)
    tgt, _ = _corr_logits(g, B, K, V)
    d = _greedy_drafts(g, tgt[:, :K].argmax(-1), cuts=[0, 2, K, 1, 3][:B], V=V)
    bonus = tgt[:, K].argmax(-1, keepdim=True)
    return tgt[:, :K].contiguous(), d, bonus


# ========================================================================================
# 5. LMDeploy  reject_sampler.py  torch_greedy_rejection_sample (HEAD 12c877c74, 2026-04),
#    K=1 variant with 1-D bonus ids (the `bonus_token_ids.ndim == 1` unsqueeze path).
# ========================================================================================

def lmdeploy_torch_greedy_rejection_sample(target_probs, draft_token_ids, bonus_token_ids):
    draft_probs = None
    assert draft_probs is None or draft_probs.is_contiguous()
    if bonus_token_ids.ndim == 1:
        bonus_token_ids = bonus_token_ids.unsqueeze(-1)
    target_token_ids = target_probs.argmax(dim=-1)

    masks = draft_token_ids == target_token_ids
    batch_size, num_spec_tokens = draft_token_ids.shape
    range_data = torch.arange(num_spec_tokens, device=draft_token_ids.device)[None, :]
    equals = (masks.cumsum(dim=1) - 1) == range_data
    num_rejected_tokens = num_spec_tokens - equals.sum(dim=1)
    first_diff_indices = torch.argmin(equals.int(), dim=1, keepdim=True)
    keeps = range_data.repeat(batch_size, 1) <= first_diff_indices
    keeps = keeps | equals
    keep_token_ids = torch.where(keeps, target_token_ids, -1)
    keep_bonus_ids = torch.where(equals[:, -1:], bonus_token_ids, -1)
    output_token_ids = torch.cat([keep_token_ids, keep_bonus_ids], dim=1)
    last_indices = (torch.cat([keeps, equals[:, -1:]], dim=1).cumsum(dim=1) - 1)[:, -1].flatten()
    last_token_ids = output_token_ids[torch.arange(batch_size, device=draft_token_ids.device), last_indices]
    return output_token_ids, num_rejected_tokens, last_token_ids


def _make_lmdeploy_k1(seed, B=4, K=1, V=29):
    g = _gen(seed)
    tgt, _ = _corr_logits(g, B, K, V)
    d = _greedy_drafts(g, tgt[:, :K].argmax(-1), cuts=[0, 1, 1, 0][:B], V=V)
    bonus = tgt[:, K].argmax(-1)
    return tgt[:, :K].contiguous(), d, bonus


# ========================================================================================
# 6. LMDeploy  reject_sampler.py  rejection_sample, random path (HEAD 12c877c74): torch host
#    code as written (softmax(dtype=f32), float64 uniforms, q.exponential_(), reciprocal)
#    with the three Triton kernels written as torch per-request/per-position loops
#    (Gumbel-max recovered token from max(p - q, 0) * inv_q; `draft_prob > 0 and
#    target/draft >= u`), then _extract_outputs.  all-random batch, draft_probs given.
# ========================================================================================

PLACEHOLDER_TOKEN_ID = -1


def _lmdeploy_extract_outputs(output_token_ids, num_spec_tokens):
    batch_size = output_token_ids.size(0)
    valid_mask = output_token_ids != PLACEHOLDER_TOKEN_ID
    num_accepted = valid_mask.sum(dim=1)
    num_rejected_tokens = num_spec_tokens + 1 - num_accepted
    last_token_ids = output_token_ids[torch.arange(batch_size, device=output_token_ids.device), num_accepted - 1]
    return output_token_ids, num_rejected_tokens, last_token_ids


def lmdeploy_rejection_sample_random(target_logits, draft_token_ids, bonus_token_ids, draft_probs):
    assert draft_probs is None or draft_probs.is_contiguous()
    if not draft_token_ids.is_contiguous():
        draft_token_ids = draft_token_ids.contiguous()
    if not target_logits.is_contiguous():
        target_logits = target_logits.contiguous()

    batch_size, num_spec_tokens = draft_token_ids.shape
    vocab_size = target_logits.shape[-1]
    device = target_logits.device

    output_token_ids = torch.full((batch_size, num_spec_tokens + 1), PLACEHOLDER_TOKEN_ID,
                                  dtype=torch.long, device=device)
    target_probs = target_logits.softmax(dim=-1, dtype=torch.float32)
    uniform_probs = torch.rand((batch_size, num_spec_tokens), dtype=torch.float64, device=device)
    q = torch.empty((batch_size, vocab_size), dtype=torch.float32, device=device)
    q.exponential_()
    inv_q = q.reciprocal()

    # sample_recovered_tokens_kernel, grid (batch_size, num_spec_tokens)
    recovered_token_ids = torch.empty((batch_size, num_spec_tokens), dtype=torch.long, device=device)
    for req_idx in range(batch_size):
        for pos in range(num_spec_tokens):
            prob = torch.maximum(target_probs[req_idx, pos] - draft_probs[req_idx, pos], torch.tensor(0.0))
            score = prob * inv_q[req_idx]
            recovered_token_ids[req_idx, pos] = torch.argmax(score)

    # rejection_random_sample_kernel, grid (batch_size,)
    for req_idx in range(batch_size):
        rejected = False
        for pos in range(num_spec_tokens):
            if not rejected:
                draft_token_id = draft_token_ids[req_idx, pos]
                draft_prob = draft_probs[req_idx, pos, draft_token_id]
                target_prob = target_probs[req_idx, pos, draft_token_id]
                uniform_prob = uniform_probs[req_idx, pos]
                if draft_prob > 0 and target_prob / draft_prob >= uniform_prob:
                    token_id = draft_token_id
                else:
                    rejected = True
                    token_id = recovered_token_ids[req_idx, pos]
                output_token_ids[req_idx, pos] = token_id
        if not rejected:
            output_token_ids[req_idx, num_spec_tokens] = bonus_token_ids[req_idx]

    return _lmdeploy_extract_outputs(output_token_ids, num_spec_tokens)


def _make_lmdeploy_random(seed, B=4, K=4, V=32):
    g = _gen(seed)
    tgt, dft = _corr_logits(g, B, K, V, scale=1.2, noise=0.35, n_target=K)
    dft = dft / 0.7
    q = dft.softmax(-1).contiguous()
    d = _sample_rows(g, q)
    bonus = torch.randint(0, V, (B,), generator=g)
    return tgt, d, bonus, q


# ========================================================================================
# 7. romsto/Speculative-Decoding  sampling/speculative_decoding.py  speculative_generate
#    (b08d133, 2024-12): verify block with NucleusProcessor(temperature, top_p):
#    r = torch.rand(gamma), fractions = p / q, Python loop `if r[i] > fractions[0,i,tok]`,
#    max_fn via torch.where, multinomial, pad-then-write of the output ids.
# ========================================================================================

def _romsto_nucleus(logits, temperature=0.9, top_p=0.9):
    # utils/logits_processor.py NucleusProcessor._process + LogitsProcessor.__call__
    sorted_logits, sorted_indices = torch.sort(logits, descending=True)
    cumulative_probs = torch.cumsum(F.softmax(sorted_logits, dim=-1), dim=-1)
    sorted_indices_to_remove = cumulative_probs > top_p
    sorted_indices_to_remove[..., 1:] = sorted_indices_to_remove[..., :-1].clone()
    sorted_indices_to_remove[..., 0] = 0
    sorted_logits[sorted_indices_to_remove] = -1e20
    proc = torch.gather(sorted_logits, -1, sorted_indices.argsort(-1))
    return F.softmax(proc / temperature, dim=-1)


def _romsto_max_fn(x):
    x_max = torch.where(x > 0, x, torch.zeros_like(x))
    x_max_sum = torch.sum(x_max, dim=-1, keepdim=True)
    return x_max / x_max_sum


def romsto_speculative_generate_verify(target_logits, q_all, draft_ids, pad_token_id=0):
    # target_logits [B, K+1, V] = Mp.logits[..., cur-1 : cur+gamma, :]; q_all [B, K, V]
    # (drafter probs after the processor); draft_ids [B, K]
    B, corrected_gamma = draft_ids.shape
    out = torch.full((B, corrected_gamma + 1), pad_token_id, dtype=torch.long)
    out[:, :corrected_gamma] = draft_ids
    accepted = []
    for b in range(B):
        q = q_all[b:b + 1]
        p = _romsto_nucleus(target_logits[b:b + 1, :corrected_gamma, :])
        r = torch.rand(corrected_gamma)
        fractions = p / q
        n = corrected_gamma
        for i in range(corrected_gamma):
            if r[i] > fractions[0, i, draft_ids[b, i]]:
                n = i
                break
        if n == corrected_gamma:
            p_p = target_logits[b:b + 1, corrected_gamma, :]
            p_p = _romsto_nucleus(p_p)
        else:
            p_p = _romsto_max_fn(p[..., n, :] - q[0, n, :])
        x = torch.multinomial(p_p, num_samples=1)
        out[b, n:corrected_gamma] = pad_token_id
        out[b, n] = x
        accepted.append(n)
    return out, accepted


def _make_romsto_spec(seed, B=4, K=4, V=32):
    g = _gen(seed)
    tgt, dft = _corr_logits(g, B, K, V, scale=1.2, noise=0.25)
    dft = dft / 0.7
    q = _romsto_nucleus(dft)
    d = _sample_rows(g, q)
    return tgt, q, d


# ========================================================================================
# 8. romsto/Speculative-Decoding  ngram_assisted/ngram_assisted.py
#    ngram_assisted_speculative_generate verify with GreedyProcessor: per-position
#    `logits_processor.sample(p[0, i, :])` (argmax.unsqueeze(-1)) compared with `!=` on
#    tensors, p_p from the last logits or p[..., n, :], write-back into input_ids.
# ========================================================================================

def romsto_ngram_assisted_verify(target_logits, draft_ids, temperature=1.0):
    proc = lambda logits: F.softmax(logits / temperature, dim=-1)  # GreedyProcessor.__call__
    sample = lambda probs: torch.argmax(probs, dim=-1).unsqueeze(-1)  # GreedyProcessor.sample
    B, corrected_gamma = draft_ids.shape
    input_ids = torch.zeros((B, corrected_gamma + 1), dtype=torch.long)
    ns = []
    for b in range(B):
        copied = draft_ids[b:b + 1]
        p = proc(target_logits[b:b + 1, :corrected_gamma, :])
        n = corrected_gamma
        for i in range(corrected_gamma):
            s = sample(p[0, i, :])
            if copied[0, i] != s:
                n = i
                break
        if n == corrected_gamma:
            p_p = target_logits[b:b + 1, corrected_gamma, :]
            p_p = proc(p_p)
        else:
            p_p = p[..., n, :]
        x = sample(p_p)
        input_ids[b, 0:n] = copied[0, 0:n]
        input_ids[b, n] = x
        ns.append(n)
    return input_ids, torch.tensor(ns)


def _make_romsto_ngram(seed, B=4, K=5, V=29):
    g = _gen(seed)
    tgt, _ = _corr_logits(g, B, K, V)
    d = _greedy_drafts(g, tgt[:, :K].argmax(-1), cuts=[3, 0, K, 1][:B], V=V)
    return tgt, d


# ========================================================================================
# feifeibear/LLMSpeculativeSampling  sampling/utils.py helpers (main 59a209d)
# ========================================================================================

def _ff_top_k_top_p_filter(logits, top_k=0, top_p=0.0):
    if top_k > 0:
        filter = torch.topk(logits, min(top_k, logits.size(-1)))[0]
        logits[logits < filter[:, [-1]]] = float('-inf')
    if top_p > 0.0:
        sorted_logits, sorted_indices = torch.sort(logits, descending=True)
        cumulative_probs = torch.cumsum(F.softmax(sorted_logits, dim=-1), dim=-1)
        filter = cumulative_probs > top_p
        filter[..., 1:] = filter[..., :-1].clone()
        filter[..., 0] = 0
        indices_to_remove = filter.scatter(1, sorted_indices, filter)
        logits[indices_to_remove] = float('-inf')
    return logits


def _ff_norm_logits(logits, temperature, top_k, top_p):
    assert logits.dim() == 2
    logits = logits / temperature
    logits = _ff_top_k_top_p_filter(logits, top_k=top_k, top_p=top_p)
    probs = F.softmax(logits, dim=1)
    return probs


def _ff_sample(probs, num_samples=1):
    idx_next = torch.multinomial(probs, num_samples=num_samples)
    if (idx_next.item() == 0):
        raise RuntimeError
    return idx_next


def _ff_max_fn(x):
    x_max = torch.where(x > 0, x, torch.zeros_like(x))
    x_max_sum = torch.sum(x_max, dim=1, keepdim=True)
    return x_max / x_max_sum


def _ff_logits(g, B, K, V, n_target=None):
    tgt, dft = _corr_logits(g, B, K, V, scale=1.5, noise=0.25, n_target=n_target)
    dft = dft / 0.7
    tgt[..., 0] = -1e4  # token 0 never sampled (sample() raises on id 0)
    dft[..., 0] = -1e4
    return tgt, dft


def _ff_draft_from(g, dft, temperature, top_k, top_p):
    B, K, V = dft.shape
    q = torch.stack([_ff_norm_logits(dft[:, i, :].clone(), temperature, top_k, top_p) for i in range(K)], 1)
    return _sample_rows(g, q)


# ========================================================================================
# 9. feifeibear  sampling/speculative_sampling.py  speculative_sampling (Google version,
#    main 59a209d) verifying against KVCacheModel._prob_history: the per-position in-place
#    norm_logits loop of KVCacheModel._forward_with_kvcache (top_k filter), then
#    `r > p[:, P+i-1, j] / q[:, P+i-1, j]` with torch.rand(1), max_fn residual / last-position
#    sample, each through sample() with its .item() == 0 check.
# ========================================================================================

def feifeibear_v1_kvcache_verify(prefix, target_logits, draft_logits, draft_ids,
                                 temperature=0.8, top_k=12, top_p=0.0):
    # prefix [B, 1] last accepted token; target_logits [B, K+1, V] (target forward over x);
    # draft_logits [B, K, V] (approx forwards); draft_ids [B, K]
    B, gamma = draft_ids.shape
    outs = []
    for b in range(B):
        # KVCacheModel._forward_with_kvcache: prob history = logits normalised in place
        target_prob_history = target_logits[b:b + 1].clone()  # fresh `outputs.logits`
        for i in range(target_prob_history.shape[-2]):
            target_prob_history[:, i, :] = _ff_norm_logits(target_prob_history[:, i, :], temperature, top_k, top_p)
        approx_prob_history = draft_logits[b:b + 1].clone()
        for i in range(approx_prob_history.shape[-2]):
            approx_prob_history[:, i, :] = _ff_norm_logits(approx_prob_history[:, i, :], temperature, top_k, top_p)

        pre = prefix[b:b + 1]
        prefix_len = pre.shape[1]
        x = torch.cat((pre, draft_ids[b:b + 1]), dim=1)
        # histories cover positions prefix_len-1 .. ; index with offset prefix_len-1
        off = prefix_len - 1
        n = prefix_len + gamma - 1
        for i in range(gamma):
            r = torch.rand(1)
            j = x[:, prefix_len + i]
            if r > (target_prob_history[:, prefix_len + i - 1 - off, j]) / (approx_prob_history[:, prefix_len + i - 1 - off, j]):
                n = prefix_len + i - 1
                break
        assert n >= prefix_len - 1
        pre = x[:, :n + 1]
        if n < prefix_len + gamma - 1:
            t = _ff_sample(_ff_max_fn(target_prob_history[:, n - off, :] - approx_prob_history[:, n - off, :]))
        else:
            assert n - off == target_prob_history.shape[1] - 1
            t = _ff_sample(target_prob_history[:, -1, :])
        pre = torch.cat((pre, t), dim=1)
        outs.append(pre)
    return outs


def _make_ff_v1(seed, B=4, K=4, V=32):
    g = _gen(seed)
    tgt, dft = _ff_logits(g, B, K, V)
    d = _ff_draft_from(g, dft, 0.8, 12, 0.0)
    prefix = torch.randint(1, V, (B, 1), generator=g)
    return prefix, tgt, dft, d


# ========================================================================================
# 10. feifeibear  speculative_sampling.py  speculative_sampling_v2 (DeepMind version, main
#     59a209d): in-place norm_logits loops over q and p (top_p filter, bool scatter),
#     `r < torch.min(torch.tensor([1]), p/q)`, residual sampled inside the loop on reject,
#     is_all_accept flag, bonus from p[:, -1, :].
# ========================================================================================

def feifeibear_v2_deepmind_verify(prefix, target_logits, draft_logits, draft_ids,
                                  temperature=1.0, top_k=0, top_p=0.9):
    # target_logits [B, K+1, V] = target_model(x).logits[:, P-1:]; draft_logits [B, K, V]
    B, gamma = draft_ids.shape
    outs = []
    for b in range(B):
        q = draft_logits[b:b + 1].clone()
        for i in range(q.shape[1]):
            q[:, i, :] = _ff_norm_logits(q[:, i, :], temperature, top_k, top_p)
        p = target_logits[b:b + 1].clone()
        for i in range(p.shape[1]):
            p[:, i, :] = _ff_norm_logits(p[:, i, :], temperature, top_k, top_p)

        pre = prefix[b:b + 1]
        prefix_len = pre.shape[1]
        x = torch.cat((pre, draft_ids[b:b + 1]), dim=1)
        off = prefix_len - 1
        is_all_accept = True
        n = prefix_len - 1
        for i in range(gamma):
            r = torch.rand(1, device=p.device)
            j = x[:, prefix_len + i]
            if r < torch.min(torch.tensor([1], device=q.device), p[:, prefix_len + i - 1 - off, j] / q[:, prefix_len + i - 1 - off, j]):
                n += 1
            else:
                t = _ff_sample(_ff_max_fn(p[:, n - off, :] - q[:, n - off, :]))
                is_all_accept = False
                break
        pre = x[:, :n + 1]
        if is_all_accept:
            t = _ff_sample(p[:, -1, :])
        pre = torch.cat((pre, t), dim=1)
        outs.append(pre)
    return outs


def _make_ff_v2(seed, B=4, K=3, V=32):
    g = _gen(seed)
    tgt, dft = _ff_logits(g, B, K, V)
    d = _ff_draft_from(g, dft, 1.0, 0, 0.9)
    prefix = torch.randint(1, V, (B, 1), generator=g)
    return prefix, tgt, dft, d


# ========================================================================================
# 11. feifeibear  speculative_sampling.py  speculative_sampling_sfliu (branch `debug`,
#     commit 693a247, 2024-07-25): target run on batch_padding(x) rows, so the target dist of
#     draft i is p[i, -1]; ratio via torch.min(tensor([1]), p[i,-1,j] / q[:, P+i-1, j]);
#     residual max_fn(p[i,-1,:] - q[:, n, :]); bonus from p[-1, -1, :].unsqueeze(0).
# ========================================================================================

def feifeibear_sfliu_verify(prefix, target_rows_logits, draft_logits, draft_ids,
                            temperature=1.0, top_k=0, top_p=0.0):
    # target_rows_logits [B, K, V]: last-position logits of each of the gamma padded rows
    B, gamma = draft_ids.shape
    outs = []
    for b in range(B):
        q = draft_logits[b:b + 1].clone()
        for i in range(q.shape[1]):
            q[:, i, :] = _ff_norm_logits(q[:, i, :], temperature, top_k, top_p)
        p = target_rows_logits[b].unsqueeze(1).clone()  # [gamma, 1, V] = target_model(x_batch).logits
        for i in range(p.shape[1]):
            p[:, i, :] = _ff_norm_logits(p[:, i, :], temperature, top_k, top_p)

        pre = prefix[b:b + 1]
        prefix_len = pre.shape[1]
        x = torch.cat((pre, draft_ids[b:b + 1]), dim=1)
        off = prefix_len - 1
        is_all_accept = True
        n = prefix_len - 1
        for i in range(gamma):
            r = torch.rand(1, device=p.device)
            j = x[:, prefix_len + i]
            if r < torch.min(torch.tensor([1], device=q.device), p[i, -1, j] / q[:, prefix_len + i - 1 - off, j]):
                n += 1
            else:
                t = _ff_sample(_ff_max_fn(p[i, -1, :] - q[:, n - off, :]))
                is_all_accept = False
                break
        pre = x[:, :n + 1]
        if is_all_accept:
            t = _ff_sample(p[-1, -1, :].unsqueeze(0))
        pre = torch.cat((pre, t), dim=1)
        outs.append(pre)
    return outs


def _make_ff_sfliu(seed, B=3, K=4, V=29):
    g = _gen(seed)
    tgt, dft = _ff_logits(g, B, K, V, n_target=K)
    d = _ff_draft_from(g, dft, 1.0, 0, 0.0)
    prefix = torch.randint(1, V, (B, 1), generator=g)
    return prefix, tgt, dft, d


# ========================================================================================
# 12. feifeibear  sampling/utils.py  max_fn + sample (the "reject someone, sample from the
#     pos n" branch): batch-aware max_fn (dim=1, keepdim) then per-row multinomial with the
#     .item() == 0 guard.  Returns the residual probs and the recovered tokens.
# ========================================================================================

def feifeibear_max_fn_residual_sample(p_n, q_n):
    # p_n, q_n [B, V]: target / draft probs at the rejected position
    residual = _ff_max_fn(p_n - q_n)
    ts = []
    for b in range(residual.shape[0]):
        ts.append(_ff_sample(residual[b:b + 1]))
    return residual, torch.cat(ts, dim=0)


def _make_ff_residual(seed, B=4, V=32):
    g = _gen(seed)
    tgt, dft = _ff_logits(g, B, 1, V, n_target=1)
    p = torch.softmax(tgt[:, 0], -1)
    q = torch.softmax(dft[:, 0], -1)
    return p, q


# ========================================================================================
# 13. ArcticInference  arctic_inference/suffix_decoding/simulator.py  (353e102, 2025-10)
#     "Verify speculated tokens" against the ground-truth continuation over a suffix-tree
#     draft (token_ids + parents): list-comprehension children search, for/else break,
#     bonus token from the ground truth.  Batched over requests with .tolist().
# ========================================================================================

def arctic_suffix_simulator_tree_verify(ground_truth_response, tree_token_ids, tree_parents):
    # ground_truth_response [B, L]; tree_token_ids [B, N]; tree_parents [B, N] (-1 = root)
    B = ground_truth_response.shape[0]
    new_tokens_all, num_accept = [], []
    for b in range(B):
        gt = ground_truth_response[b].tolist()
        token_ids = tree_token_ids[b].tolist()
        parents = tree_parents[b].tolist()
        response = []
        accepted_tokens = []
        node = -1
        for token_id in gt[len(response):]:
            children = [i for i, p in enumerate(parents) if p == node]
            for c in children:
                if token_ids[c] == token_id:
                    accepted_tokens.append(token_id)
                    node = c
                    break
            else:
                break
        new_tokens = accepted_tokens.copy()
        response.extend(accepted_tokens)
        if len(response) < len(gt):
            bonus_token = gt[len(response)]
            new_tokens.append(bonus_token)
            response.append(bonus_token)
        new_tokens_all.append(torch.tensor(new_tokens, dtype=ground_truth_response.dtype))
        num_accept.append(len(accepted_tokens))
    return new_tokens_all, torch.tensor(num_accept)


def _make_arctic_tree(seed, B=3, V=32):
    g = _gen(seed)
    L = 6
    gt = torch.randint(0, V, (B, L), generator=g)
    # tree of 7 nodes: 0,1 children of root; 2,3 of 0; 4 of 2; 5 of 3; 6 of 4
    parents = torch.tensor([-1, -1, 0, 0, 2, 3, 4]).repeat(B, 1)
    tok = torch.randint(0, V, (B, 7), generator=g)
    # row 0: path 1 -> (nothing) matches gt[0] only
    tok[0, 1] = gt[0, 0]
    tok[0, 0] = (gt[0, 0] + 3) % V
    # row 1: path 0 -> 3 -> 5 matches gt[0:3]
    tok[1, 0] = gt[1, 0]; tok[1, 1] = (gt[1, 0] + 1) % V
    tok[1, 3] = gt[1, 1]; tok[1, 2] = (gt[1, 1] + 5) % V
    tok[1, 5] = gt[1, 2]
    # row 2: root children both wrong -> 0 accepted
    tok[2, 0] = (gt[2, 0] + 1) % V; tok[2, 1] = (gt[2, 0] + 2) % V
    return gt, tok, parents


# ========================================================================================
# 14. ArcticInference  arctic_inference/vllm/model_runner.py (HEAD 9d46438, 2026): the
#     suffix-only spec path: _sample -> rejection_sampler(draft_probs=None) all-greedy
#     (rejection_greedy_sample kernel as a torch loop, int32 -1 placeholders), then
#     _suffix_only_rejection_sample's eagle_prepare_next_token_padded kernel (valid mask,
#     last valid token or backup, discard mask) and arctic_proposer.prepare_hidden_states
#     (cu_num_draft_tokens diff, cumsum offsets, valid_mask.sum, clamp, index_select).
# ========================================================================================

def arctic_suffix_only_verify(target_logits, draft_token_ids, discard_request_mask,
                              backup_next_token_ids, cu_num_draft_tokens, sample_hidden_states):
    batch_size, num_spec_tokens = draft_token_ids.shape
    vocab_size = target_logits.shape[-1]
    # bonus token from the plain sampler (greedy), target argmax for the draft positions
    bonus_token_ids = target_logits[:, -1, :].argmax(dim=-1)
    target_argmax = target_logits[:, :-1, :].argmax(dim=-1)
    sampled_token_ids = torch.full((batch_size, num_spec_tokens + 1), -1, dtype=torch.int32)
    for req_idx in range(batch_size):
        rejected = False
        for pos in range(num_spec_tokens):
            if not rejected:
                draft_token_id = draft_token_ids[req_idx, pos]
                target_argmax_id = target_argmax[req_idx, pos]
                sampled_token_ids[req_idx, pos] = target_argmax_id
                if draft_token_id != target_argmax_id:
                    rejected = True
        if not rejected:
            sampled_token_ids[req_idx, num_spec_tokens] = bonus_token_ids[req_idx]

    # _suffix_only_rejection_sample -> eagle_prepare_next_token_padded_kernel[(batch_size,)]
    num_tokens = sampled_token_ids.shape[1]
    next_token_ids = torch.empty(batch_size, dtype=torch.int32)
    valid_counts = torch.empty(batch_size, dtype=torch.int32)
    for req_idx in range(batch_size):
        if discard_request_mask[req_idx]:
            next_token_ids[req_idx] = backup_next_token_ids[req_idx]
            valid_counts[req_idx] = 0
        else:
            token_offs = torch.arange(0, num_tokens)
            token_ids = sampled_token_ids[req_idx]
            is_valid_mask = (token_ids != -1) & (token_ids < vocab_size)
            valid_count = torch.sum(is_valid_mask)
            if valid_count > 0:
                last_valid_index = torch.max(torch.where(is_valid_mask, token_offs, -1))
                last_valid_token = torch.sum(torch.where(token_offs == last_valid_index, token_ids, 0))
                next_token_ids[req_idx] = last_valid_token
            else:
                next_token_ids[req_idx] = backup_next_token_ids[req_idx]
            valid_counts[req_idx] = valid_count

    # ArcticProposer.prepare_hidden_states
    cu = cu_num_draft_tokens
    num_draft_tokens_gpu = torch.cat([cu[0:1], cu[1:] - cu[:-1]])
    num_processed_tokens_per_req = num_draft_tokens_gpu + 1
    offsets = torch.cumsum(num_processed_tokens_per_req, dim=0) - num_processed_tokens_per_req
    valid_mask = (sampled_token_ids != -1) & (sampled_token_ids < vocab_size)
    gen_lens = valid_mask.sum(dim=1).to(dtype=torch.int64)
    last_valid = torch.clamp(gen_lens - 1, min=0)
    hidden_states_idx = offsets + last_valid
    previous_hidden_states = sample_hidden_states.index_select(dim=0, index=hidden_states_idx)
    return sampled_token_ids, next_token_ids, valid_counts, previous_hidden_states


def _make_arctic_suffix_only(seed, B=4, K=3, V=32, H=8):
    g = _gen(seed)
    tgt, _ = _corr_logits(g, B, K, V)
    d = _greedy_drafts(g, tgt[:, :K].argmax(-1), cuts=[0, K, 1, 2][:B], V=V)
    discard = torch.tensor([False, False, False, True][:B])
    backup = torch.randint(0, V, (B,), generator=g).to(torch.int32)
    cu = torch.cumsum(torch.full((B,), K, dtype=torch.int64), 0)
    hs = torch.randn(B * (K + 1), H, generator=g)
    return tgt, d, discard, backup, cu, hs


# ========================================================================================
# 15. turboderp/exllamav2  exllamav2/generator/dynamic.py  ExLlamaV2DynamicGenerator
#     .iterate_gen (f4119ae, 2024-12): per job, per position: sample from
#     batch_logits[a:b, i:i+1, :] (greedy settings -> argmax), then
#     `draft_tokens[j, i].item() != sampled_token.item()` -> rejected = S - 1 - i, break.
# ========================================================================================

def exllamav2_dynamic_iterate_gen_verify(batch_logits, draft_tokens):
    # batch_logits [B, K+1, V] (one sequence per job); draft_tokens [B, K]
    logit_mapping = list(range(batch_logits.shape[0] + 1))
    sampled_per_job, accepted_draft, rejected_draft = [], [], []
    j = 0
    for a, b in zip(logit_mapping[:-1], logit_mapping[1:]):
        if a == b:
            continue
        sampled = []
        accepted_draft_tokens, rejected_draft_tokens = 0, 0
        for i in range(batch_logits.shape[1]):
            job_logits = batch_logits[a:b, i:i + 1, :]
            # ExLlamaV2Sampler.sample with greedy settings (top_k = 1)
            sampled_token = job_logits.float().argmax(dim=-1)
            sampled.append(sampled_token)
            if draft_tokens is not None and i < batch_logits.shape[1] - 1:
                if draft_tokens[j, i].item() != sampled_token.item():
                    rejected = batch_logits.shape[1] - 1 - i
                    rejected_draft_tokens += rejected
                    break
                else:
                    accepted_draft_tokens += 1
        j += 1
        sampled_per_job.append(torch.cat(sampled, dim=-1))
        accepted_draft.append(accepted_draft_tokens)
        rejected_draft.append(rejected_draft_tokens)
    return sampled_per_job, torch.tensor(accepted_draft), torch.tensor(rejected_draft)


def _make_exllamav2(seed, B=4, K=4, V=32):
    g = _gen(seed)
    tgt, _ = _corr_logits(g, B, K, V)
    tgt = tgt.half()
    d = _greedy_drafts(g, tgt[:, :K].float().argmax(-1), cuts=[2, 0, K, 1][:B], V=V)
    return tgt, d


# ========================================================================================
# 16. huggingface/text-generation-inference  server/text_generation_server/utils/tokens.py
#     HeterogeneousNextTokenChooser.__call__ with speculated_ids (bab02ff2, 2024-07), greedy
#     choice: scores viewed [B, S, V], per-position choice loop with write-back, log_softmax
#     over [B*S, V], Python accept loop over `validate_speculative.tolist()`, flat `indices`
#     gather, next_logprobs gather, then create_n_gram_speculation for the next step.
# ========================================================================================

def _tgi_create_n_gram_speculation(input_ids, next_ids, accepted_ids, speculate):
    B = accepted_ids.shape[0]
    device = input_ids.device
    seeds = next_ids[accepted_ids.cumsum(dim=-1) - 1]
    indices = (input_ids == seeds.unsqueeze(-1)).max(dim=1).indices + 1
    all_indices = indices.unsqueeze(-1).expand(B, speculate) + torch.arange(speculate, device=device)
    all_indices = torch.clamp(all_indices, max=input_ids.shape[1] - 1)
    speculative_ids = input_ids.gather(dim=-1, index=all_indices)
    return speculative_ids


def _tgi_choose(input_ids, scores, speculate, speculated_ids, choice):
    if speculated_ids is not None:
        B = scores.shape[0] // (speculated_ids.shape[1] + 1)
        S = speculated_ids.shape[1] + 1
        scores = scores.view(B, S, -1)
    else:
        B = scores.shape[0]
        S = 1
        scores = scores.view(B, S, -1)

    next_ids = torch.zeros((B, S), device=scores.device, dtype=torch.long)
    for j in range(S):
        _scores = scores[:, j]
        _next_ids = choice(_scores)
        scores[:, j] = _scores
        next_ids[:, j] = _next_ids
    next_ids = next_ids.view(B * S)
    allscores = scores.view(B * S, -1)
    alllogprobs = torch.log_softmax(allscores, -1)

    if speculated_ids is not None:
        accepted_ids = []
        B = next_ids.shape[0] // (speculated_ids.shape[1] + 1)
        S = speculated_ids.shape[1] + 1
        indices = []
        for i in range(B):
            _next_ids = next_ids[i * S: (i + 1) * S]
            _speculated_ids = speculated_ids[i]
            validate_speculative = _next_ids[:-1] == _speculated_ids
            index = i * S
            accepted = 1
            indices.append(index)
            for valid in validate_speculative.tolist():
                if valid:
                    index += 1
                    accepted += 1
                    indices.append(index)
                else:
                    break
            accepted_ids.append(accepted)
        accepted_ids = torch.tensor(accepted_ids, device=input_ids.device, dtype=input_ids.dtype)
        next_ids = next_ids[indices]
        logprobs = alllogprobs[indices]
        indices = torch.arange(B, device=input_ids.device) * S
    else:
        accepted_ids = torch.ones_like(next_ids)
        logprobs = alllogprobs

    next_logprobs = torch.gather(logprobs, 1, next_ids.view(-1, 1)).view(-1)

    if speculate > 0:
        speculative_ids = _tgi_create_n_gram_speculation(input_ids, next_ids, accepted_ids, speculate)
    else:
        speculative_ids = None
    return next_ids, next_logprobs, alllogprobs, accepted_ids, speculative_ids


def tgi_next_token_chooser_greedy_ngram(input_ids, scores, speculated_ids):
    # input_ids [B, L]; scores [B*(K+1), V] (flat, as the model returns); speculated_ids [B, K]
    greedy = lambda logits: logits.argmax(dim=-1)  # Greedy.__call__
    scores = scores.clone()  # the chooser writes the processed scores back into its input
    return _tgi_choose(input_ids, scores, speculated_ids.shape[1], speculated_ids, greedy)


def _make_tgi_greedy(seed, B=4, K=3, V=32, L=12):
    g = _gen(seed)
    tgt, _ = _corr_logits(g, B, K, V)
    d = _greedy_drafts(g, tgt[:, :K].argmax(-1), cuts=[K, 0, 1, 2][:B], V=V)
    input_ids = torch.randint(0, V, (B, L), generator=g)
    return input_ids, tgt.reshape(B * (K + 1), V), d


# ========================================================================================
# 17. TGI  tokens.py  same __call__, HeterogeneousSampling choice (mixed do_sample): greedy
#     rows by `torch.argmax(logits, -1, out=out)`, sampled rows by Sampling.__call__ (softmax,
#     `q = empty_like(probs).exponential_(1, generator=...)`, `probs.div_(q).argmax()`),
#     per-request torch.Generator seeded from the request's seed.  speculate = 0.
# ========================================================================================

def tgi_next_token_chooser_heterogeneous_sampling(input_ids, scores, speculated_ids):
    do_sample = [True, False, True, False][: input_ids.shape[0]]
    seeds = [1234, 5, 77, 9][: input_ids.shape[0]]
    generators = {}
    greedy_indices = []
    for i, (sample, seed) in enumerate(zip(do_sample, seeds)):
        if sample:
            gen = torch.Generator("cpu")
            gen.manual_seed(seed)
            generators[i] = gen
        else:
            greedy_indices.append(i)

    def sampling(logits, generator):
        probs = torch.nn.functional.softmax(logits, -1)
        q = torch.empty_like(probs).exponential_(1, generator=generator)
        return probs.div_(q).argmax()

    def choice(logits):
        out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
        if greedy_indices:
            torch.argmax(logits, -1, out=out)
        for i, generator in generators.items():
            out[i] = sampling(logits[i], generator)
        return out

    scores = scores.clone()
    return _tgi_choose(input_ids, scores, 0, speculated_ids, choice)


def _make_tgi_sampling(seed, B=4, K=3, V=29, L=10):
    g = _gen(seed)
    tgt, _ = _corr_logits(g, B, K, V, scale=3.0)
    d = _greedy_drafts(g, tgt[:, :K].argmax(-1), cuts=[K, 1, 2, 0][:B], V=V)
    input_ids = torch.randint(0, V, (B, L), generator=g)
    return input_ids, tgt.reshape(B * (K + 1), V), d


# ----------------------------------------------------------------------------------------

ENTRIES = [
    dict(name="mlx_examples_spec_decoder_get_num_accept",
         source="ml-explore/mlx-examples, llms/speculative_decoding/decoder.py, SpeculativeDecoder._get_num_accept + new_tokens assembly in speculative_decode (HEAD 7ddca42; file 4c9f9f9b)",
         kind="ratio", fn=mlx_examples_get_num_accept, make=_make_mlx_examples_get_num_accept),
    dict(name="mlx_examples_mlx_lm_utils_speculative_generate_step_v0",
         source="ml-explore/mlx-examples, llms/mlx_lm/utils.py, speculative_generate_step (_step + verify loop, first version, commit 93c5cfd7)",
         kind="greedy", fn=mlx_lm_utils_v0_speculative_step, make=_make_mlx_lm_utils_v0),
    dict(name="mlx_lm_generate_speculative_generate_step_logits_processors",
         source="ml-explore/mlx-lm, mlx_lm/generate.py, speculative_generate_step (_step with logits_processors, _process_and_sample, verify loop; HEAD d78bf58) + mlx_lm/sample_utils.py make_repetition_penalty",
         kind="greedy", fn=mlx_lm_speculative_step_with_processors, make=_make_mlx_lm_processors),
    dict(name="lmdeploy_reject_sampler_greedy_v0",
         source="InternLM/lmdeploy, lmdeploy/pytorch/spec_decode/reject_sampler.py, rejection_sample + greedy_reject_sampler (commit c77593721, first version)",
         kind="greedy", fn=lmdeploy_v0_rejection_sample, make=_make_lmdeploy_v0),
    dict(name="lmdeploy_torch_greedy_rejection_sample_k1",
         source="InternLM/lmdeploy, lmdeploy/pytorch/spec_decode/reject_sampler.py, torch_greedy_rejection_sample (HEAD 12c877c74), K=1, 1-D bonus ids",
         kind="greedy", fn=lmdeploy_torch_greedy_rejection_sample, make=_make_lmdeploy_k1),
    dict(name="lmdeploy_rejection_sample_random_path",
         source="InternLM/lmdeploy, lmdeploy/pytorch/spec_decode/reject_sampler.py, rejection_sample random path + sample_recovered_tokens_kernel / rejection_random_sample_kernel / _extract_outputs (HEAD 12c877c74; Triton kernels as torch loops)",
         kind="whole_step", fn=lmdeploy_rejection_sample_random, make=_make_lmdeploy_random),
    dict(name="romsto_speculative_generate_verify_nucleus",
         source="romsto/Speculative-Decoding, sampling/speculative_decoding.py, speculative_generate (verify block: rand, p/q loop, max_fn, multinomial; b08d133) + utils/logits_processor.py NucleusProcessor",
         kind="whole_step", fn=romsto_speculative_generate_verify, make=_make_romsto_spec),
    dict(name="romsto_ngram_assisted_greedy_verify",
         source="romsto/Speculative-Decoding, ngram_assisted/ngram_assisted.py, ngram_assisted_speculative_generate (verify block with GreedyProcessor; b08d133)",
         kind="greedy", fn=romsto_ngram_assisted_verify, make=_make_romsto_ngram),
    dict(name="feifeibear_v1_google_kvcache_prob_history",
         source="feifeibear/LLMSpeculativeSampling, sampling/speculative_sampling.py, speculative_sampling (v1 Google) + sampling/kvcache_model.py KVCacheModel._forward_with_kvcache prob history + sampling/utils.py (main 59a209d)",
         kind="whole_step", fn=feifeibear_v1_kvcache_verify, make=_make_ff_v1),
    dict(name="feifeibear_v2_deepmind_top_p",
         source="feifeibear/LLMSpeculativeSampling, sampling/speculative_sampling.py, speculative_sampling_v2 (DeepMind; main 59a209d) + sampling/utils.py norm_logits/top_k_top_p_filter/max_fn/sample",
         kind="whole_step", fn=feifeibear_v2_deepmind_verify, make=_make_ff_v2),
    dict(name="feifeibear_sfliu_batch_padding_variant",
         source="feifeibear/LLMSpeculativeSampling, sampling/speculative_sampling.py, speculative_sampling_sfliu (branch debug, commit 693a247)",
         kind="whole_step", fn=feifeibear_sfliu_verify, make=_make_ff_sfliu),
    dict(name="feifeibear_max_fn_residual_sample",
         source="feifeibear/LLMSpeculativeSampling, sampling/utils.py, max_fn + sample (residual branch of speculative_sampling; main 59a209d)",
         kind="residual", fn=feifeibear_max_fn_residual_sample, make=_make_ff_residual),
    dict(name="arctic_suffix_simulator_tree_verify",
         source="snowflakedb/ArcticInference, arctic_inference/suffix_decoding/simulator.py, suffix decoding simulate loop 'Verify speculated tokens' + bonus (353e102)",
         kind="greedy", fn=arctic_suffix_simulator_tree_verify, make=_make_arctic_tree),
    dict(name="arctic_suffix_only_greedy_verify_prepare_hidden",
         source="snowflakedb/ArcticInference, arctic_inference/vllm/model_runner.py _sample/_suffix_only_rejection_sample + arctic_inference/vllm/spec_dec/arctic_proposer.py prepare_hidden_states (HEAD 9d46438; vLLM greedy-rejection and eagle_prepare_next_token_padded kernels as torch loops)",
         kind="greedy", fn=arctic_suffix_only_verify, make=_make_arctic_suffix_only),
    dict(name="exllamav2_dynamic_iterate_gen_draft_verify",
         source="turboderp/exllamav2, exllamav2/generator/dynamic.py, ExLlamaV2DynamicGenerator.iterate_gen (draft-token check; f4119ae), greedy sampler settings",
         kind="greedy", fn=exllamav2_dynamic_iterate_gen_verify, make=_make_exllamav2),
    dict(name="tgi_next_token_chooser_speculated_greedy_ngram",
         source="huggingface/text-generation-inference, server/text_generation_server/utils/tokens.py, HeterogeneousNextTokenChooser.__call__ + create_n_gram_speculation + Greedy (bab02ff2)",
         kind="greedy", fn=tgi_next_token_chooser_greedy_ngram, make=_make_tgi_greedy),
    dict(name="tgi_next_token_chooser_heterogeneous_sampling",
         source="huggingface/text-generation-inference, server/text_generation_server/utils/tokens.py, HeterogeneousNextTokenChooser.__call__ with HeterogeneousSampling/Sampling (bab02ff2)",
         kind="greedy", fn=tgi_next_token_chooser_heterogeneous_sampling, make=_make_tgi_sampling),
]
