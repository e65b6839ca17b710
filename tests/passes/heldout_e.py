"""Held-out corpus E: speculative-decoding verify steps transcribed from public codebases.

Every entry is a batched, pure function of tensor arguments (plus torch's global RNG where the
original draws random numbers itself).  Where the original handles a single request, it is run
once per row in a Python loop, keeping the original's per-request spelling.  Sources were read
from the stored snapshots named in each ``source`` string; adaptations are described in the
comment above each function.
"""
import torch
import torch.nn.functional as F


# ----------------------------------------------------------------------------------------------
# shared input builders (deterministic, driven by a torch.Generator seeded with ``seed``)
# ----------------------------------------------------------------------------------------------
def _gen(seed):
    return torch.Generator().manual_seed(int(seed))


def _cut_drafts(g, top, K, cuts):
    """Drafts equal ``top`` (the target's choice) up to a per-row cut, then one wrong token."""
    drafts = top[..., :K].clone()
    for b, c in enumerate(cuts):
        if c < K:
            bump = int(torch.randint(1, 1000, (1,), generator=g))
            drafts[b, c] = top[b, c] + bump  # caller reduces modulo V
    return drafts


def _greedy_case(seed, B=4, K=3, V=29, cuts=(0, 1, 3, 2), scale=2.0):
    g = _gen(seed)
    logits = torch.randn(B, K + 1, V, generator=g) * scale
    top = logits.argmax(-1)
    drafts = _cut_drafts(g, top, K, cuts) % V
    # make sure the "wrong" token really differs from the argmax
    for b, c in enumerate(cuts):
        if c < K and drafts[b, c] == top[b, c]:
            drafts[b, c] = (top[b, c] + 1) % V
    return g, logits, top, drafts


def _spec_case(seed, B=4, K=3, V=32, noise=0.9, scale=1.5):
    """Correlated target/draft distributions and draft ids sampled from the draft."""
    g = _gen(seed)
    t_logits = torch.randn(B, K + 1, V, generator=g) * scale
    d_logits = t_logits[:, :K] + noise * torch.randn(B, K, V, generator=g)
    target_probs = torch.softmax(t_logits, dim=-1)
    draft_probs = torch.softmax(d_logits, dim=-1)
    draft_ids = torch.multinomial(draft_probs.reshape(-1, V), 1, generator=g).view(B, K)
    return g, t_logits, d_logits, target_probs, draft_probs, draft_ids


# ==============================================================================================
# 1. ModelTC/lightllm -- ModeBackend._verify_mtp (Python loop over the per-request row groups)
# Adaptation: requests are small stand-in objects holding ``req_id`` and ``mtp_gen_token_ids``
# (filled the way _update_reqs_mtp_gen_token_ids does, from a numpy array); rows are laid out
# request-major [main row, mtp row 1..K], as prepare_decode_inputs does in MTP mode.  The caller
# (normal_mtp_decode) then indexes next_token_ids_cpu[verify_ok_req_indexes]; that is returned too.
# ==============================================================================================
class _LightReq:
    def __init__(self, req_id):
        self.req_id = req_id
        self.mtp_gen_token_ids = []


def _lightllm_group_mtp_run_reqs(reqs, next_token_ids_cpu, input_mem_indexes):
    if not reqs:
        return []
    grouped_reqs = []
    current_group = [(reqs[0], next_token_ids_cpu[0], input_mem_indexes[0], 0)]
    for i in range(1, len(reqs)):
        req = reqs[i]
        if req.req_id == current_group[-1][0].req_id:
            current_group.append((req, next_token_ids_cpu[i], input_mem_indexes[i], i))
        else:
            grouped_reqs.append(current_group)
            current_group = [(req, next_token_ids_cpu[i], input_mem_indexes[i], i)]
    grouped_reqs.append(current_group)
    return grouped_reqs


def lightllm_verify_mtp(next_token_ids_gpu, mtp_draft_ids, mem_indexes):
    B, K = mtp_draft_ids.shape
    # per-request objects with their pending MTP draft ids
    reqs = [_LightReq(b) for b in range(B)]
    draft_cpu = mtp_draft_ids.detach().cpu().numpy()
    for b, req in enumerate(reqs):
        for token_id in draft_cpu[b]:
            req.mtp_gen_token_ids.append(token_id)
    run_reqs = [req for req in reqs for _ in range(K + 1)]

    next_token_ids_cpu = next_token_ids_gpu.detach().cpu().numpy()
    mem_indexes_cpu = mem_indexes.detach().cpu().numpy()

    verify_ok_reqs = []
    verify_ok_req_indexes = []
    verify_ok_req_last_indexes = []
    need_free_mem_indexes = []
    accept_nums = []
    grouped_reqs = _lightllm_group_mtp_run_reqs(run_reqs, next_token_ids_cpu, mem_indexes_cpu)
    for req_group in grouped_reqs:
        pre_req, pre_out_token_id, _, pre_index = req_group[0]
        verify_ok_reqs.append(pre_req)
        verify_ok_req_indexes.append(pre_index)
        need_verify = True
        verify_ok_count = 0
        for i in range(1, len(req_group)):
            cur_req, cur_out_token_id, cur_mem_index, cur_index = req_group[i]
            # the draft fed to this row equals the previous row's target output -> verified
            if need_verify and cur_req.mtp_gen_token_ids[i - 1] == pre_out_token_id:
                verify_ok_reqs.append(cur_req)
                verify_ok_req_indexes.append(cur_index)
                pre_req, pre_out_token_id, _, pre_index = (cur_req, cur_out_token_id, cur_mem_index, cur_index)
                verify_ok_count += 1
                continue
            need_verify = False
            need_free_mem_indexes.append(int(cur_mem_index))
        verify_ok_req_last_indexes.append(verify_ok_req_indexes[-1])
        pre_req.mtp_gen_token_ids = []
        accept_nums.append(verify_ok_count)

    accepted_tokens = torch.from_numpy(next_token_ids_cpu[verify_ok_req_indexes])
    return verify_ok_req_indexes, verify_ok_req_last_indexes, need_free_mem_indexes, accept_nums, accepted_tokens


def _make_lightllm_verify_mtp(seed):
    B, K, V = 4, 3, 29
    g, logits, top, drafts = _greedy_case(seed, B, K, V, cuts=(0, 2, 3, 1))
    # row b*(K+1)+j is the target output after consuming draft j-1 (j=0: the main row)
    next_token_ids = top.reshape(-1).to(torch.int64)
    mem_indexes = torch.arange(100, 100 + B * (K + 1), dtype=torch.int32)
    return next_token_ids, drafts.to(torch.int64), mem_indexes


# ==============================================================================================
# 2. ModelTC/LightLLM -- mtp_verify (Triton _fwd_kernel_mtp_verify) written out in torch, one
# loop iteration per Triton program (one per request).  Masked loads become clamp+where, tl.min
# becomes .min(), masked stores become boolean-mask scatter.  Variable rows per request
# (b_req_mtp_start_loc), including a request with a single draft (K=1).
# ==============================================================================================
def lightllm_mtp_verify_torch(req_to_next_token_ids, b_req_mtp_start_loc, new_next_token_ids, b_req_idx):
    BLOCK_SIZE = 16
    max_mtp_step = req_to_next_token_ids.shape[1]
    assert max_mtp_step <= BLOCK_SIZE
    num_reqs = b_req_mtp_start_loc.shape[0]
    req_mtp_all_num = b_req_idx.shape[0]
    mtp_accept_len = torch.empty((num_reqs,), dtype=torch.int32)
    accepted_index = torch.empty((req_mtp_all_num,), dtype=torch.int32)

    offset = torch.arange(0, BLOCK_SIZE)
    for cur_index in range(num_reqs):
        req_start_loc = b_req_mtp_start_loc[cur_index]
        if cur_index + 1 < num_reqs:
            req_start_end = b_req_mtp_start_loc[cur_index + 1]
        else:
            req_start_end = torch.tensor(req_mtp_all_num, dtype=b_req_mtp_start_loc.dtype)
        req_mtp_num = req_start_end - req_start_loc
        cur_req_idx = b_req_idx[req_start_loc]
        req_offset = req_start_loc + offset

        load_mask = offset + 1 < req_mtp_num
        col = torch.clamp(offset + 1, max=max_mtp_step - 1)
        cur_next_token_id = torch.where(load_mask, req_to_next_token_ids[cur_req_idx.long(), col], -1)
        row = torch.clamp(req_offset, max=req_mtp_all_num - 1)
        cur_new_next_token_id = torch.where(load_mask, new_next_token_ids[row.long()], -2)

        match_mask = cur_next_token_id == cur_new_next_token_id
        mismatch_positions = torch.where(match_mask, BLOCK_SIZE, offset)
        first_mismatch_pos = torch.min(mismatch_positions)
        accept_len = first_mismatch_pos + 1
        mtp_accept_len[cur_index] = accept_len
        accpeted_index = torch.where(offset < accept_len, 1, 0)
        store_mask = offset < req_mtp_num
        accepted_index[req_offset[store_mask].long()] = accpeted_index[store_mask].to(torch.int32)
    return mtp_accept_len, accepted_index


def _make_lightllm_mtp_verify_torch(seed):
    g = _gen(seed)
    V = 29
    rows_per_req = [4, 4, 2, 4]          # K = 3, 3, 1, 3
    cuts = [0, 3, 1, 1]                  # accepted drafts per request (3 / 1 = all)
    slots = [4, 1, 0, 3]                 # b_req_idx slot of each request
    total = sum(rows_per_req)
    logits = torch.randn(total, V, generator=g) * 2.0
    new_next_token_ids = logits.argmax(-1).to(torch.int32)
    req_to_next_token_ids = torch.full((6, 5), -1, dtype=torch.int32)
    b_req_idx = torch.empty(total, dtype=torch.int32)
    starts = []
    loc = 0
    for r, n in enumerate(rows_per_req):
        starts.append(loc)
        b_req_idx[loc:loc + n] = slots[r]
        req_to_next_token_ids[slots[r], 0] = int(torch.randint(0, V, (1,), generator=g))
        for j in range(n - 1):           # draft j sits in column j+1, checked against row j
            tok = int(new_next_token_ids[loc + j])
            if j == cuts[r]:
                tok = (tok + int(torch.randint(1, V, (1,), generator=g))) % V
            req_to_next_token_ids[slots[r], j + 1] = tok
        loc += n
    b_req_mtp_start_loc = torch.tensor(starts, dtype=torch.int32)
    return req_to_next_token_ids, b_req_mtp_start_loc, new_next_token_ids, b_req_idx


# ==============================================================================================
# 3./4. kvcache-ai/ktransformers -- KTransformersInterface.verify_speculative_decoding and
# verify_by_tokenid.  The repository keeps only the per-token helpers (its caller is gone), so the
# per-request driver below walks the K drafts, stops at the first rejection and samples a bonus
# token from the last target row when all drafts pass.  Probabilities are fp16, as sampling()
# produces them (`torch.softmax(...).half()`).
# ==============================================================================================
def _kt_verify_speculative_decoding(main_prob, draft_prob, draft_token, p):
    q = main_prob[draft_token]
    accept_prob = min(1.0, (q / p).item())
    if torch.rand(()) <= accept_prob:
        return draft_token, True
    else:
        new_prob = main_prob - draft_prob
        new_prob = torch.clamp(new_prob, min=0.0)
        new_prob /= new_prob.sum()
        token = torch.multinomial(new_prob, 1).item()
        return token, False


def ktransformers_verify_speculative_decoding(target_probs, draft_probs, draft_ids):
    B, K = draft_ids.shape
    out_tokens, accept_nums = [], []
    for b in range(B):
        tokens = []
        n_accepted = 0
        for i in range(K):
            draft_token = draft_ids[b, i].item()
            p = draft_probs[b, i, draft_token].item()
            token, accepted = _kt_verify_speculative_decoding(target_probs[b, i], draft_probs[b, i], draft_token, p)
            tokens.append(token)
            if not accepted:
                break
            n_accepted += 1
        if n_accepted == K:
            tokens.append(torch.multinomial(target_probs[b, K], 1).item())
        out_tokens.append(tokens)
        accept_nums.append(n_accepted)
    return out_tokens, accept_nums


def _make_ktransformers_verify_speculative_decoding(seed):
    g, t_logits, d_logits, tp, dp, ids = _spec_case(seed, B=4, K=3, V=32, noise=0.7)
    return tp.half(), dp.half(), ids


def _kt_verify_by_tokenid(main_token, draft_token):
    return main_token, main_token == draft_token


def ktransformers_verify_by_tokenid(logits, draft_ids):
    # sampling(..., do_sample=False): next_token = argmax, probs = softmax
    next_token = torch.argmax(logits, dim=-1)
    B, K = draft_ids.shape
    out_tokens, accept_nums = [], []
    for b in range(B):
        tokens = []
        n_accepted = 0
        for i in range(K):
            main_token, accepted = _kt_verify_by_tokenid(next_token[b, i].item(), draft_ids[b, i].item())
            tokens.append(main_token)
            if not accepted:
                break
            n_accepted += 1
        if n_accepted == K:
            tokens.append(next_token[b, K].item())
        out_tokens.append(tokens)
        accept_nums.append(n_accepted)
    return out_tokens, accept_nums


def _make_ktransformers_verify_by_tokenid(seed):
    g, logits, top, drafts = _greedy_case(seed, B=4, K=3, V=29, cuts=(1, 3, 0, 2))
    return logits, drafts


# ==============================================================================================
# 5. sgl-project/SpecForge -- compute_accept_len and the accept-length telemetry of the DFlash
# family block slice (teacher-forced drafts, per-block accepted prefix).  Drafts come from the
# draft head's argmax over each block; valid positions come from the eval weight mask.
# ==============================================================================================
def _specforge_compute_accept_len(pred_ids_4d, target_ids_4d, valid_mask_4d):
    correct = (pred_ids_4d == target_ids_4d) | (~valid_mask_4d)
    accept_prefix = correct.long().cumprod(dim=2) * valid_mask_4d.long()
    return accept_prefix.sum(dim=2).float()


def specforge_dflash_accept_len(final_logits, target_ids, eval_weight_mask):
    with torch.no_grad():
        predicted_ids = final_logits.argmax(dim=-1)
        binary_accuracy_mask = eval_weight_mask > 0.5
        correct_num = ((predicted_ids == target_ids) & binary_accuracy_mask).sum().float()
        accuracy_den = eval_weight_mask.sum()
        valid_mask = eval_weight_mask > 0
        accepted = _specforge_compute_accept_len(predicted_ids, target_ids, valid_mask)
        valid_blocks = valid_mask.any(dim=-1).float()
        accept_num = ((accepted + 1.0) * valid_blocks).sum()
        accept_den = valid_blocks.sum()
    return accepted, correct_num, accuracy_den, accept_num, accept_den


def _make_specforge_dflash_accept_len(seed):
    g = _gen(seed)
    B, NB, BS, V = 2, 3, 4, 32
    logits = torch.randn(B, NB, BS, V, generator=g) * 2.0
    pred = logits.argmax(-1)
    target = pred.clone()
    cuts = [[0, 2, 4], [1, 4, 3]]
    for b in range(B):
        for n in range(NB):
            c = cuts[b][n]
            if c < BS:
                target[b, n, c] = (pred[b, n, c] + 1 + int(torch.randint(0, V - 1, (1,), generator=g))) % V
    mask = torch.ones(B, NB, BS)
    mask[1, 2, 2:] = 0.0                 # padded tail of the last block
    mask[0, 1, 0] = 0.0                  # an unsupervised anchor position
    return logits, target, mask


# ==============================================================================================
# 6./7. huggingface/optimum-habana -- GaudiGenerationMixin._assisted_decoding, step 3 case 2
# (candidate tokens vs the target's selected tokens).  The original is batch 1 (`.sum()` over the
# whole tensor), so it runs once per row; `is_done_candidate` is the per-row Python bool the
# stopping criteria return.  The target logits arrive in bf16 and are cast with .to(float32).
# ==============================================================================================
def _habana_select(candidate_input_ids, outputs_logits, is_done_candidate, do_sample):
    cur_len = candidate_input_ids.shape[1] - (outputs_logits.shape[1] - 1)
    candidate_length = candidate_input_ids.shape[1] - cur_len
    new_logits = outputs_logits[:, -candidate_length - 1 :].to(dtype=torch.float32)
    if do_sample:
        probs = new_logits.softmax(dim=-1)
        selected_tokens = torch.multinomial(probs[0, :, :], num_samples=1).squeeze(1)[None, :]
    else:
        selected_tokens = new_logits.argmax(dim=-1)
    candidate_new_tokens = candidate_input_ids[:, cur_len:]
    n_matches = ((~(candidate_new_tokens == selected_tokens[:, :-1])).cumsum(dim=-1) < 1).sum()
    if is_done_candidate and n_matches == candidate_length:
        n_matches -= 1
    valid_tokens = selected_tokens[:, : n_matches + 1]
    return valid_tokens, n_matches


def habana_assisted_greedy(candidate_input_ids, outputs_logits, is_done):
    out = []
    for b in range(candidate_input_ids.shape[0]):
        out.append(_habana_select(candidate_input_ids[b : b + 1], outputs_logits[b : b + 1], is_done[b], False))
    return out


def habana_assisted_sample_match(candidate_input_ids, outputs_logits, is_done):
    out = []
    for b in range(candidate_input_ids.shape[0]):
        out.append(_habana_select(candidate_input_ids[b : b + 1], outputs_logits[b : b + 1], is_done[b], True))
    return out


def _make_habana(seed, scale=2.0):
    B, K, V, P = 4, 3, 29, 5
    g, logits, top, drafts = _greedy_case(seed, B, K, V, cuts=(0, 3, 2, 3), scale=scale)
    prompt = torch.randint(0, V, (B, P), generator=g)
    candidate_input_ids = torch.cat([prompt, drafts], dim=-1)
    # the model is asked for logits_to_keep = candidate_length + 1 rows
    outputs_logits = logits.to(torch.bfloat16)
    # re-derive drafts from the bf16 logits so the argmax agrees after the cast
    top_bf = outputs_logits[:, -K - 1 :].float().argmax(-1)
    cuts = (0, 3, 2, 3)
    for b, c in enumerate(cuts):
        d = top_bf[b, :K].clone()
        if c < K:
            d[c] = (d[c] + 1) % V
        candidate_input_ids[b, P:] = d
    is_done = [False, False, False, True]
    return candidate_input_ids, outputs_logits, is_done


def _make_habana_sample(seed):
    return _make_habana(seed, scale=4.0)


# ==============================================================================================
# 8./9. intel/ipex-llm -- speculative_generate verify block (do_sample and greedy branches).
# Batch 1 in the original; run per row.  In the sampling branch `random_probs` is drawn before
# drafting (torch.rand(max_step_draft, dtype=model dtype)), so it is an input here (fp16, longer
# than the number of drafted tokens, as when drafting stops early).
# ==============================================================================================
def _ipex_multinomial_sample_one_no_sync(probs_sort):
    q = torch.empty_like(probs_sort).exponential_(1)
    return torch.argmax(probs_sort / q, dim=-1, keepdim=True).to(dtype=torch.int64)


def ipex_llm_speculative_sample_verify(target_probs, draft_probs, drafted_input_ids, random_probs):
    outs, matched = [], []
    for b in range(drafted_input_ids.shape[0]):
        target_probs_b = target_probs[b]
        draft_tokens = drafted_input_ids[b : b + 1, 1:].squeeze(0)
        drafted_n_tokens = draft_tokens.shape[0]
        draft_probs_b = torch.stack([draft_probs[b, i : i + 1] for i in range(drafted_n_tokens)]).squeeze((1, 2))
        p = draft_probs_b[torch.arange(0, drafted_n_tokens), draft_tokens]
        q = target_probs_b[torch.arange(0, drafted_n_tokens), draft_tokens]
        accept_draft_prob = torch.minimum(torch.ones(()), q[:drafted_n_tokens] / p)
        rejected_locations = (random_probs[b, :drafted_n_tokens] > accept_draft_prob).nonzero()
        if rejected_locations.shape[0] == 0:
            max_matched = drafted_n_tokens + 1
            last_token = _ipex_multinomial_sample_one_no_sync(target_probs_b[-1])
            output_ids = torch.cat([draft_tokens, last_token])
        else:
            max_matched = rejected_locations[0].item()
            p = draft_probs_b[max_matched]
            q = target_probs_b[max_matched]
            resample_prob = q - p
            resample_prob = torch.where(resample_prob > 0, resample_prob, 0.0)
            resample_prob = resample_prob / resample_prob.sum()
            next_token = _ipex_multinomial_sample_one_no_sync(resample_prob)
            output_ids = torch.cat([draft_tokens[:max_matched], next_token])
            max_matched += 1
        outs.append(output_ids.unsqueeze(0))
        matched.append(max_matched)
    return outs, matched


def _make_ipex_llm_sample(seed):
    g, t_logits, d_logits, tp, dp, ids = _spec_case(seed, B=4, K=4, V=32, noise=0.6)
    cur = torch.randint(0, 32, (4, 1), generator=g)
    drafted_input_ids = torch.cat([cur, ids], dim=-1)
    random_probs = torch.rand(4, 6, generator=g).to(torch.float16)
    return tp, dp, drafted_input_ids, random_probs


def ipex_llm_speculative_greedy_verify(logits, drafted_input_ids):
    outs, matched = [], []
    for b in range(logits.shape[0]):
        output_ids = torch.argmax(logits[b : b + 1], dim=-1)        # greedy(logits)
        d = drafted_input_ids[b : b + 1]
        max_matched = ((output_ids[:, :-1] != d[:, 1:]).cumsum(-1) == 0)
        max_matched = max_matched.sum(-1).item() + 1
        max_of_max_matched = output_ids.size(1)
        if max_of_max_matched != max_matched:
            output_ids = output_ids[:, :max_matched]
        outs.append(output_ids)
        matched.append(max_matched)
    return outs, matched


def _make_ipex_llm_greedy(seed):
    g, logits, top, drafts = _greedy_case(seed, B=4, K=4, V=29, cuts=(2, 0, 4, 1))
    cur = torch.randint(0, 29, (4, 1), generator=g)
    return logits, torch.cat([cur, drafts], dim=-1)


# ==============================================================================================
# 10./11. pytorch/torchchat -- Generator.speculative_decode (verify half) with logits_to_probs
# and multinomial_sample_one_no_sync.  Batch 1 in the original; run per row.  Draft tokens are
# int32, as decode_n_tokens produces them; the draft probs come in already stacked.
# ==============================================================================================
def _torchchat_logits_to_probs(logits, temperature=1.0, top_k=None):
    logits = logits / max(temperature, 1e-5 if logits.dtype != torch.float16 else 1e-3)
    if top_k is not None:
        v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
        pivot = v.select(-1, -1).unsqueeze(-1)
        logits = torch.where(logits < pivot, -float("Inf"), logits)
    probs = torch.nn.functional.softmax(logits, dim=-1)
    return probs


def _torchchat_multinomial_sample_one_no_sync(probs_sort):
    q = torch.empty_like(probs_sort).exponential_(1)
    return torch.argmax(probs_sort / q, dim=-1, keepdim=True).to(dtype=torch.int)


def torchchat_speculative_decode_verify(target_logits, draft_probs, draft_tokens):
    results = []
    speculate_k = draft_tokens.shape[1]
    for b in range(draft_tokens.shape[0]):
        device = draft_tokens.device
        target_probs = _torchchat_logits_to_probs(target_logits[b], temperature=0.8, top_k=12)
        dp = draft_probs[b]
        dt = draft_tokens[b]
        p = dp[torch.arange(0, speculate_k, device=device), dt]
        q = target_probs[torch.arange(0, speculate_k, device=device), dt]
        accept_draft_prob = torch.minimum(torch.ones(()), q[:speculate_k] / p)
        rejected_locations = (torch.rand_like(accept_draft_prob) > accept_draft_prob).nonzero()
        if rejected_locations.shape[0] == 0:
            last_token = _torchchat_multinomial_sample_one_no_sync(target_probs[-1])
            results.append(torch.cat([dt, last_token]))
        else:
            accept_length = rejected_locations[0].item()
            p = dp[accept_length]
            q = target_probs[accept_length]
            new = q - p
            new = torch.where(new > 0, new, 0.0)
            new = new / new.sum()
            next_token = _torchchat_multinomial_sample_one_no_sync(new)
            results.append(torch.cat([dt[:accept_length], next_token]))
    return results


def _make_torchchat(seed, K=3):
    g = _gen(seed)
    B, V = 4, 32
    t_logits = torch.randn(B, K + 1, V, generator=g) * 1.5
    d_logits = t_logits[:, :K] + 0.3 * torch.randn(B, K, V, generator=g)
    draft_probs = _torchchat_logits_to_probs(d_logits, temperature=0.8, top_k=12)
    draft_tokens = torch.multinomial(draft_probs.reshape(-1, V), 1, generator=g).view(B, K).to(torch.int)
    return t_logits, draft_probs, draft_tokens


def _make_torchchat_k1(seed):
    return _make_torchchat(seed, K=1)


# ==============================================================================================
# 12./13. FasterDecoding/REST -- evaluate_posterior (greedy branch, and the top_p branch through
# get_nucleus_posterior_mask).  Candidates are retrieval-tree paths [C, L+1] per request (batch 1
# in the original); run once per request.
# ==============================================================================================
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
    indices_to_remove = sorted_indices_to_remove.scatter(dim=1, index=sorted_indices, src=sorted_indices_to_remove)
    logits[indices_to_remove] = float("-inf")
    sampled_tokens = torch.multinomial(F.softmax(logits, dim=-1), 1)
    sampled_tokens = sampled_tokens.view(n_samples, n_tokens)
    posterior_mask = (candidates[:, 1:] == sampled_tokens).int()
    return posterior_mask


def _rest_evaluate_posterior(logits, candidates, temperature, top_p=0.8):
    if temperature == 0:
        posterior_mask = (candidates[:, 1:] == torch.argmax(logits[:, :-1], dim=-1)).int()
        candidates_accept_length = (torch.cumprod(posterior_mask, dim=1)).sum(dim=1)
        accept_length = candidates_accept_length.max()
        if accept_length == 0:
            best_candidate = torch.tensor(0, dtype=torch.long, device=candidates.device)
        else:
            best_candidate = torch.argmax(candidates_accept_length).to(torch.long)
        return best_candidate, accept_length
    elif top_p > 0:
        assert top_p < 1.0, "top_p should between 0 and 1"
        posterior_mask = _rest_get_nucleus_posterior_mask(logits, candidates, temperature, top_p)
        candidates_accept_length = (torch.cumprod(posterior_mask, dim=1)).sum(dim=1)
        accept_length = candidates_accept_length.max()
        if accept_length == 0:
            best_candidate = torch.tensor(0, dtype=torch.long, device=candidates.device)
        else:
            best_candidate = torch.argmax(candidates_accept_length).to(torch.long)
        return best_candidate, accept_length
    else:
        raise NotImplementedError


def rest_evaluate_posterior_greedy(logits, candidates):
    return [_rest_evaluate_posterior(logits[b], candidates[b], 0.0) for b in range(logits.shape[0])]


def rest_evaluate_posterior_nucleus(logits, candidates):
    return [_rest_evaluate_posterior(logits[b], candidates[b], 0.7, top_p=0.8) for b in range(logits.shape[0])]


def _tree_case(seed, B=3, C=4, L=3, V=29, scale=2.0, cut_table=((0, 0, 0, 0), (1, 2, 0, 1), (3, 1, 2, 3))):
    g = _gen(seed)
    logits = torch.randn(B, C, L + 1, V, generator=g) * scale
    top = logits.argmax(-1)                       # [B, C, L+1]
    candidates = torch.empty(B, C, L + 1, dtype=torch.long)
    for b in range(B):
        base = int(torch.randint(0, V, (1,), generator=g))
        for c in range(C):
            candidates[b, c, 0] = base
            candidates[b, c, 1:] = top[b, c, :L]
            cut = cut_table[b][c]
            if cut < L:
                candidates[b, c, 1 + cut] = (top[b, c, cut] + 1 + int(torch.randint(0, V - 1, (1,), generator=g))) % V
    return logits, candidates


def _make_rest_greedy(seed):
    return _tree_case(seed)


def _make_rest_nucleus(seed):
    return _tree_case(seed, scale=4.0)


# ==============================================================================================
# 14./15. zankner/Hydra -- evaluate_posterior (greedy branch with max_accepts, and the typical
# acceptance branch with posterior_threshold / posterior_alpha).  Per request, as in REST.
# ==============================================================================================
def _hydra_evaluate_posterior(logits, candidates, temperature, posterior_threshold, posterior_alpha, max_accepts):
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
    candidates_prob = torch.gather(posterior_prob, dim=-1, index=candidates[:, 1:].unsqueeze(-1)).squeeze(-1)
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
        best_candidates = torch.where(torch.minimum(candidates_accept_length, max_accepts) == accept_length)[0]
        likelihood = torch.sum(torch.log(candidates_prob[best_candidates, :accept_length]), dim=-1)
        best_candidate = best_candidates[torch.argmax(likelihood)]
    return best_candidate, accept_length


def hydra_evaluate_posterior_greedy(logits, candidates, max_accepts):
    return [
        _hydra_evaluate_posterior(logits[b], candidates[b], 0, 0.09, 0.3, max_accepts)
        for b in range(logits.shape[0])
    ]


def hydra_evaluate_posterior_typical(logits, candidates, max_accepts):
    return [
        _hydra_evaluate_posterior(logits[b], candidates[b], 0.7, 0.09, 0.3, max_accepts)
        for b in range(logits.shape[0])
    ]


def _make_hydra_greedy(seed):
    logits, candidates = _tree_case(seed)
    # max_accepts = torch.sum(retrieve_indices > 0, dim=1) for a 4-path tree of depth <= 3
    max_accepts = torch.tensor([3, 3, 2, 1])
    return logits, candidates, max_accepts


def _make_hydra_typical(seed):
    logits, candidates = _tree_case(seed, scale=3.0)
    max_accepts = torch.tensor([3, 3, 2, 1])
    return logits, candidates, max_accepts


# ==============================================================================================
# 16./17. NVIDIA/Model-Optimizer (EAGLE-3 training / AR validation) --
# AcceptanceRateValidation.check_draft (eager-mode branch: teacher-forced drafts vs ground truth)
# and the acceptance loop of validate_online (drafts vs the target's argmax on the candidate).
# Batch 1 in the original (validate_online raises otherwise); run per row.
# ==============================================================================================
def _modelopt_check_draft(ground_truth, input_ids, draft_tokens):
    if draft_tokens is None:
        return input_ids
    for i in range(draft_tokens.shape[-1]):
        input_id = draft_tokens[:, i : i + 1]
        if ground_truth[:, input_ids.shape[1] : input_ids.shape[1] + 1] == input_id:
            input_ids = torch.cat((input_ids, input_id), dim=-1)
            if input_ids.shape[1] == ground_truth.shape[1]:
                break
        else:
            break
    return input_ids


def modelopt_check_draft(ground_truth, input_ids, draft_tokens):
    return [
        _modelopt_check_draft(ground_truth[b : b + 1], input_ids[b : b + 1], draft_tokens[b : b + 1])
        for b in range(ground_truth.shape[0])
    ]


def _make_modelopt_check_draft(seed):
    g = _gen(seed)
    B, T0, K, V = 4, 6, 3, 29
    ground_truth = torch.randint(0, V, (B, T0 + K), generator=g)
    input_ids = ground_truth[:, :T0].clone()
    draft_tokens = ground_truth[:, T0:].clone()
    for b, c in enumerate((0, 2, 3, 1)):
        if c < K:
            draft_tokens[b, c] = (draft_tokens[b, c] + 1 + int(torch.randint(0, V - 1, (1,), generator=g))) % V
    return ground_truth, input_ids, draft_tokens


def modelopt_validate_online_accept(input_ids, draft_tokens, target_logits):
    outs, accepted_counts = [], []
    for b in range(input_ids.shape[0]):
        ids = input_ids[b : b + 1]
        dts = draft_tokens[b : b + 1]
        max_len = ids.shape[1] + dts.shape[1] + 1
        candidate = torch.cat((ids, dts), dim=-1)
        with torch.no_grad():
            posterior = target_logits[b : b + 1].argmax(dim=-1)
        accepted = 0
        pos = ids.shape[1] - 1
        for i in range(dts.shape[-1]):
            if pos + i >= candidate.shape[1] - 1:
                break
            if posterior[:, pos + i] == dts[:, i]:
                accepted += 1
                ids = torch.cat((ids, dts[:, i : i + 1]), dim=-1)
            else:
                ids = torch.cat((ids, posterior[:, pos + i : pos + i + 1]), dim=-1)
                break
            if ids.shape[1] >= max_len:
                break
        outs.append(ids)
        accepted_counts.append(1 + accepted)
    return outs, accepted_counts


def _make_modelopt_validate_online(seed):
    g = _gen(seed)
    B, T, K, V = 4, 5, 3, 29
    input_ids = torch.randint(0, V, (B, T), generator=g)
    target_logits = torch.randn(B, T + K, V, generator=g) * 2.0
    posterior = target_logits.argmax(-1)
    draft_tokens = posterior[:, T - 1 : T - 1 + K].clone()
    for b, c in enumerate((1, 3, 0, 2)):
        if c < K:
            draft_tokens[b, c] = (draft_tokens[b, c] + 1 + int(torch.randint(0, V - 1, (1,), generator=g))) % V
    return input_ids, draft_tokens, target_logits


# ----------------------------------------------------------------------------------------------
ENTRIES = [
    dict(name="lightllm_verify_mtp_group_loop",
         source="ModelTC/lightllm, lightllm/server/router/model_infer/mode_backend/base_backend.py, "
                "ModeBackend._verify_mtp + _group_mtp_run_reqs (main @ fc72ffab, 2025-07-11; caller "
                "continues_batch/impl_mtp.py normal_mtp_decode)",
         kind="greedy", fn=lightllm_verify_mtp, make=_make_lightllm_verify_mtp),
    dict(name="lightllm_mtp_verify_kernel_torch",
         source="ModelTC/LightLLM, lightllm/common/basemodel/triton_kernel/mtp_utils.py, "
                "mtp_verify/_fwd_kernel_mtp_verify (stored commit 0054d08f; Triton kernel written out in torch)",
         kind="greedy", fn=lightllm_mtp_verify_torch, make=_make_lightllm_mtp_verify_torch),
    dict(name="ktransformers_verify_speculative_decoding_rowloop",
         source="kvcache-ai/ktransformers, archive/ktransformers/server/backend/interfaces/ktransformers.py, "
                "KTransformersInterface.verify_speculative_decoding (@ 95009ea6; same code at a40ecaa6 under "
                "ktransformers/server/...)",
         kind="whole_step", fn=ktransformers_verify_speculative_decoding,
         make=_make_ktransformers_verify_speculative_decoding),
    dict(name="ktransformers_verify_by_tokenid_rowloop",
         source="kvcache-ai/ktransformers, archive/ktransformers/server/backend/interfaces/ktransformers.py, "
                "KTransformersInterface.verify_by_tokenid + sampling(do_sample=False) (@ 95009ea6)",
         kind="greedy", fn=ktransformers_verify_by_tokenid, make=_make_ktransformers_verify_by_tokenid),
    dict(name="specforge_dflash_compute_accept_len",
         source="sgl-project/SpecForge, specforge/algorithms/common/dflash_family_model.py, compute_accept_len "
                "+ block-slice accept telemetry (@ a6b6b023)",
         kind="greedy", fn=specforge_dflash_accept_len, make=_make_specforge_dflash_accept_len),
    dict(name="optimum_habana_assisted_greedy_n_matches",
         source="huggingface/optimum-habana, optimum/habana/transformers/generation/utils.py, "
                "GaudiGenerationMixin._assisted_decoding step 3 case 2, do_sample=False (@ 1d8504c6)",
         kind="greedy", fn=habana_assisted_greedy, make=_make_habana),
    dict(name="optimum_habana_assisted_sampled_match",
         source="huggingface/optimum-habana, optimum/habana/transformers/generation/utils.py, "
                "GaudiGenerationMixin._assisted_decoding step 3 case 2, do_sample=True without candidate "
                "logits (@ 1d8504c6)",
         kind="greedy", fn=habana_assisted_sample_match, make=_make_habana_sample),
    dict(name="ipex_llm_speculative_generate_sample_verify",
         source="intel/ipex-llm, python/llm/src/ipex_llm/transformers/speculative.py, speculative_generate "
                "(do_sample verify block + multinomial_sample_one_no_sync; stored commit 17816181)",
         kind="whole_step", fn=ipex_llm_speculative_sample_verify, make=_make_ipex_llm_sample),
    dict(name="ipex_llm_speculative_generate_greedy_max_matched",
         source="intel/ipex-llm, python/llm/src/ipex_llm/transformers/speculative.py, speculative_generate "
                "(greedy verify block, max_matched + crop; stored commit 17816181)",
         kind="greedy", fn=ipex_llm_speculative_greedy_verify, make=_make_ipex_llm_greedy),
    dict(name="torchchat_speculative_decode_verify",
         source="pytorch/torchchat, torchchat/generate.py, Generator.speculative_decode verify half + "
                "logits_to_probs + multinomial_sample_one_no_sync (@ a1a7f370)",
         kind="whole_step", fn=torchchat_speculative_decode_verify, make=_make_torchchat),
    dict(name="torchchat_speculative_decode_verify_k1",
         source="pytorch/torchchat, torchchat/generate.py, Generator.speculative_decode with speculate_k=1 "
                "(@ a1a7f370)",
         kind="whole_step", fn=torchchat_speculative_decode_verify, make=_make_torchchat_k1),
    dict(name="rest_evaluate_posterior_greedy",
         source="FasterDecoding/REST, rest/model/utils.py, evaluate_posterior temperature==0 (@ 50a5fc19)",
         kind="greedy", fn=rest_evaluate_posterior_greedy, make=_make_rest_greedy),
    dict(name="rest_evaluate_posterior_nucleus",
         source="FasterDecoding/REST, rest/model/utils.py, evaluate_posterior top_p branch + "
                "get_nucleus_posterior_mask (@ 50a5fc19)",
         kind="greedy", fn=rest_evaluate_posterior_nucleus, make=_make_rest_nucleus),
    dict(name="hydra_evaluate_posterior_greedy_max_accepts",
         source="zankner/Hydra, hydra/model/utils.py, evaluate_posterior temperature==0 (@ 3f39fbd2)",
         kind="greedy", fn=hydra_evaluate_posterior_greedy, make=_make_hydra_greedy),
    dict(name="hydra_evaluate_posterior_typical",
         source="zankner/Hydra, hydra/model/utils.py, evaluate_posterior typical acceptance branch (@ 3f39fbd2)",
         kind="typical", fn=hydra_evaluate_posterior_typical, make=_make_hydra_typical),
    dict(name="modelopt_check_draft_eager",
         source="NVIDIA/Model-Optimizer, modelopt/torch/speculative/utils.py, AcceptanceRateValidation.check_draft "
                "(eager-mode branch; stored commit 109993fc)",
         kind="greedy", fn=modelopt_check_draft, make=_make_modelopt_check_draft),
    dict(name="modelopt_validate_online_accept_loop",
         source="NVIDIA/Model-Optimizer, modelopt/torch/speculative/utils.py, AcceptanceRateValidation."
                "validate_online acceptance loop (stored commit 109993fc)",
         kind="greedy", fn=modelopt_validate_online_accept, make=_make_modelopt_validate_online),
]
