"""Field corpus entries: MLX, LMDeploy, romsto and feifeibear (see field_corpus.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from field_inputs import B, K, PLACEHOLDER, V, _dists, _greedy_drafts


# ============================================================================================
# MLX: mlx-lm mlx_lm/generate.py speculative_generate_step; mlx-examples
# llms/speculative_decoding/decoder.py SpeculativeDecoder._get_num_accept / speculative_decode
# ============================================================================================
def mlx_lm_speculative_greedy(logits, draft_tokens):
    # _process_and_sample with the default sampler (argmax of the log-probs), then the accept
    # loop `while n < num_draft: if tokens[n] != draft_tokens[n]: break; n += 1`, batched over
    # requests with a still-matching flag; tokens[n] is the target's own token yielded after
    logprobs = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    tokens = torch.argmax(logprobs, dim=-1)
    num_draft = draft_tokens.shape[1]
    n = torch.zeros(tokens.shape[0], dtype=torch.long, device=tokens.device)
    matching = torch.ones(tokens.shape[0], dtype=torch.bool, device=tokens.device)
    for i in range(num_draft):
        matching = matching & (tokens[:, i] == draft_tokens[:, i])
        n = n + matching
    after = tokens.gather(1, n[:, None]).squeeze(1)
    return tokens, n, after


def mlx_examples_num_accept(draft_tokens, draft_logprobs, logits):
    # _get_num_accept on logits[:-1] (log-space ratio test, delta = 0), then the target's argmax
    # at the first rejected row; batched over requests, `(accept.tolist() + [False]).index(False)`
    # as the first False of the flags with a False appended
    delta = 0.0
    model_logits = logits[:, :-1]
    model_lp = torch.take_along_dim(model_logits, draft_tokens[..., None], dim=-1).squeeze(-1)
    model_lp = model_lp - torch.logsumexp(model_logits.float(), dim=-1)
    unis = torch.rand(draft_tokens.shape)
    log_unis = torch.log(torch.maximum(unis - delta, torch.tensor(0.0)))
    accept_toks = log_unis <= (model_lp - draft_logprobs)
    flags = torch.cat([accept_toks, torch.zeros_like(accept_toks[:, :1])], dim=1)
    num_to_accept = torch.eq(flags, False).int().argmax(dim=1)
    rows = torch.arange(logits.shape[0], device=logits.device)
    nxt = torch.argmax(logits[rows, num_to_accept], dim=-1, keepdim=True)
    return num_to_accept, nxt


def _make_mlx_lm(seed):
    g, t_logits, _, _, _, _ = _dists(seed)
    return t_logits, _greedy_drafts(t_logits.argmax(-1)[:, :K], g)


def _make_mlx_examples(seed):
    _, t_logits, d_logits, _, _, ids = _dists(seed)
    d_lp = d_logits.log_softmax(-1).gather(-1, ids[..., None]).squeeze(-1)
    return ids, d_lp, t_logits


# ============================================================================================
# LMDeploy: lmdeploy/pytorch/spec_decode/reject_sampler.py
# ============================================================================================
def lmdeploy_torch_greedy(target_logits, draft_token_ids, bonus_token_ids):
    # torch_greedy_rejection_sample (target_logits [B, K, V], bonus [B] or [B, 1])
    if bonus_token_ids.ndim == 1:
        bonus_token_ids = bonus_token_ids.unsqueeze(-1)
    target_ids = target_logits.argmax(dim=-1)
    same = draft_token_ids == target_ids
    bsz, n_spec = draft_token_ids.shape
    steps = torch.arange(n_spec, device=draft_token_ids.device)[None, :]
    equals = (same.cumsum(dim=1) - 1) == steps
    num_rejected = n_spec - equals.sum(dim=1)
    first_diff = torch.argmin(equals.int(), dim=1, keepdim=True)
    keeps = steps.repeat(bsz, 1) <= first_diff
    keeps = keeps | equals
    kept_ids = torch.where(keeps, target_ids, -1)
    bonus_ids = torch.where(equals[:, -1:], bonus_token_ids, -1)
    out = torch.cat([kept_ids, bonus_ids], dim=1)
    last_idx = (torch.cat([keeps, equals[:, -1:]], dim=1).cumsum(dim=1) - 1)[:, -1].flatten()
    last = out[torch.arange(bsz, device=draft_token_ids.device), last_idx]
    return out, num_rejected, last


def _lmdeploy_recovered(target_probs, draft_probs):
    """rejection_sample's Exp(1) rows and inverse, and sample_recovered_tokens_kernel as tensor
    ops: argmax over the vocab of max(p - q, 0) * (1 / E)."""
    bsz, _, vocab = target_probs.shape
    q = torch.empty((bsz, vocab), dtype=torch.float32, device=target_probs.device)
    q.exponential_()
    inv_q = q.reciprocal()
    resid = torch.maximum(target_probs - draft_probs, torch.tensor(0.0))
    return (resid * inv_q[:, None, :]).argmax(dim=-1)


def lmdeploy_recovered_tokens(target_probs, draft_probs):
    return _lmdeploy_recovered(target_probs, draft_probs)


def lmdeploy_rejection_sample(target_logits, draft_token_ids, bonus_token_ids, draft_probs, top_k):
    # rejection_sample with a per-request policy (top_k == 1 is greedy): the greedy and random
    # Triton kernels as loops over draft positions on [B] tensors, then _extract_outputs
    bsz, n_spec = draft_token_ids.shape
    dev = target_logits.device
    is_greedy = top_k == 1
    is_all_random = not is_greedy.any().item()
    out = torch.full((bsz, n_spec + 1), PLACEHOLDER, dtype=torch.long, device=dev)
    if not is_all_random:
        target_argmax = target_logits.argmax(dim=-1)
        running = torch.ones(bsz, dtype=torch.bool, device=dev)
        for pos in range(n_spec):          # rejection_greedy_sample_kernel
            out[:, pos] = torch.where(running & is_greedy, target_argmax[:, pos], out[:, pos])
            running = running & (draft_token_ids[:, pos] == target_argmax[:, pos])
        out[:, n_spec] = torch.where(running & is_greedy, bonus_token_ids, out[:, n_spec])
    target_probs = target_logits.softmax(dim=-1, dtype=torch.float32)
    uniform = torch.rand((bsz, n_spec), dtype=torch.float64, device=dev)
    recovered = _lmdeploy_recovered(target_probs, draft_probs)
    rejected = torch.zeros(bsz, dtype=torch.bool, device=dev)
    for pos in range(n_spec):              # rejection_random_sample_kernel
        tok = draft_token_ids[:, pos]
        draft_px = draft_probs[:, pos].gather(-1, tok[:, None]).squeeze(-1)
        target_px = target_probs[:, pos].gather(-1, tok[:, None]).squeeze(-1)
        ok = (draft_px > 0) & (target_px / draft_px >= uniform[:, pos])
        write = ~rejected & ~is_greedy
        out[:, pos] = torch.where(write, torch.where(ok, tok, recovered[:, pos]), out[:, pos])
        rejected = rejected | ~ok
    out[:, n_spec] = torch.where(~rejected & ~is_greedy, bonus_token_ids, out[:, n_spec])
    valid = out != PLACEHOLDER                                     # _extract_outputs
    num_accepted = valid.sum(dim=1)
    num_rejected = n_spec + 1 - num_accepted
    last = out[torch.arange(bsz, device=dev), num_accepted - 1]
    return out, num_rejected, last


def _make_lmdeploy_greedy(seed):
    g, t_logits, _, _, _, _ = _dists(seed)
    drafts = _greedy_drafts(t_logits.argmax(-1)[:, :K], g)
    return t_logits[:, :K].contiguous(), drafts, torch.randint(0, V, (B,), generator=g)


def _make_lmdeploy_recovered(seed):
    _, _, _, p, q, _ = _dists(seed)
    return p[:, :K].contiguous(), q


def _make_lmdeploy_random(seed):
    g, t_logits, _, _, q, ids = _dists(seed)
    return (t_logits[:, :K].contiguous(), ids, torch.randint(0, V, (B,), generator=g), q,
            torch.tensor([0, 1, 0, 0]))


# ============================================================================================
# romsto/Speculative-Decoding: sampling/speculative_decoding.py (speculative_generate, max_fn),
# utils/logits_processor.py (MultinomialProcessor)
# ============================================================================================
def _romsto_max_fn(x):
    x_max = torch.where(x > 0, x, torch.zeros_like(x))
    x_max_sum = torch.sum(x_max, dim=-1, keepdim=True)
    return x_max / x_max_sum


def romsto_speculative_generate(target_logits, q, drafts):
    # one verify step, B = 1: target_logits [1, gamma+1, V] for the drafted positions and the
    # next one, q [1, gamma, V] the drafter's probs, drafts [gamma] the drafted ids
    temperature = 1.0
    gamma = q.shape[1]
    p = F.softmax(target_logits[..., :gamma, :] / temperature, dim=-1)
    r = torch.rand(gamma, device=q.device)
    fractions = p / q
    n = gamma
    for i in range(gamma):
        if r[i] > fractions[0, i, drafts[i]]:
            n = i
            break
    if n == gamma:
        p_p = F.softmax(target_logits[..., gamma, :] / temperature, dim=-1)
    else:
        p_p = _romsto_max_fn(p[..., n, :] - q[0, n, :])
    x = torch.multinomial(p_p, num_samples=1)
    return n, x


def romsto_max_fn_residual(target_rows, draft_rows):
    # the rejection branch (max_fn, then MultinomialProcessor.sample) for B requests' rows [B, V]
    return torch.multinomial(_romsto_max_fn(target_rows - draft_rows), num_samples=1)


def _make_romsto(seed):
    _, t_logits, _, _, q, ids = _dists(seed, b=1)
    return t_logits, q, ids[0]


# ============================================================================================
# feifeibear/LLMSpeculativeSampling: sampling/speculative_sampling.py (speculative_sampling_v2),
# sampling/utils.py (max_fn, sample)
# ============================================================================================
def _ff_max_fn(x):
    x_max = torch.where(x > 0, x, torch.zeros_like(x))
    x_max_sum = torch.sum(x_max, dim=1, keepdim=True)
    return x_max / x_max_sum


def _ff_sample(probs, num_samples=1):
    idx_next = torch.multinomial(probs, num_samples=num_samples)
    if idx_next.item() == 0:
        raise RuntimeError
    return idx_next


def feifeibear_speculative_sampling_v2(x, q, p, prefix_len, gamma):
    # one verify step of the loop, B = 1: x [1, prefix_len + gamma] (prefix and drafts), q/p the
    # normalised draft/target rows [1, prefix_len + gamma (- 1), V]
    is_all_accept = True
    n = prefix_len - 1
    for i in range(gamma):
        r = torch.rand(1, device=p.device)
        j = x[:, prefix_len + i]
        if r < torch.min(torch.tensor([1], device=q.device),
                         p[:, prefix_len + i - 1, j] / q[:, prefix_len + i - 1, j]):
            n += 1
        else:
            t = _ff_sample(_ff_max_fn(p[:, n, :] - q[:, n, :]))
            is_all_accept = False
            break
    prefix = x[:, :n + 1]
    if is_all_accept:
        t = _ff_sample(p[:, -1, :])
    return torch.cat((prefix, t), dim=1)


def feifeibear_max_fn_sample(target_row, draft_row):
    # the rejection branch: sample(max_fn(p[:, n, :] - q[:, n, :])); B = 1 (`.item()` in sample)
    return _ff_sample(_ff_max_fn(target_row - draft_row))


def _make_feifeibear(seed):
    g, _, _, p, q, ids = _dists(seed, b=1, zero_token0=True)
    prefix_len = 3
    prompt = torch.randint(1, V, (1, prefix_len), generator=g)
    x = torch.cat([prompt, ids], 1)
    pad_q = torch.softmax(torch.randn(1, prefix_len - 1, V, generator=g), -1)
    pad_p = torch.softmax(torch.randn(1, prefix_len - 1, V, generator=g), -1)
    return x, torch.cat([pad_q, q], 1), torch.cat([pad_p, p], 1), prefix_len, K


def _make_ff_rows(seed):
    _, _, _, p, q, _ = _dists(seed, b=1, zero_token0=True)
    return p[:, 1].contiguous(), q[:, 1].contiguous()
