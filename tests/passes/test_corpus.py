"""A corpus of verify code written the way different codebases write it. Each one compiled with
backend="npuspec" must match (counters move, an npuspec:: op appears) and return exactly what
eager returns from the same RNG state.

The two HF transformers entries run the installed package's own code: `_speculative_sampling`
is called as is; the greedy `n_matches` idiom is inline in `GenerationMixin._assisted_decoding`
(no function of its own), so its statements are read from the installed source with inspect
and compiled as they are."""
import inspect
import re
import textwrap

import pytest
import torch

from npuspec import counters
from passes_helpers import compile_npuspec, three_way

transformers_utils = pytest.importorskip("transformers.generation.utils")

B, K, V = 4, 5, 29


def _greedy(seed, b=B):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, K + 1, V, generator=g)
    t = logits.argmax(-1)[:, :K]
    drafts = torch.where(torch.rand(b, K, generator=g) < 0.8, t, torch.randint(0, V, (b, K), generator=g))
    drafts[0] = t[0]
    return logits, drafts


def _sampling(seed, b=B):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(b, K, V, generator=g), -1)
    q = torch.softmax(torch.randn(b, K, V, generator=g) * 0.3 + p.log() * 0.7, -1)
    ids = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(b, K)
    return p, q, ids


# 1. HF transformers assisted generation, greedy (statements from the installed package) -------
def _hf_assisted_greedy():
    src = textwrap.dedent(inspect.getsource(transformers_utils.GenerationMixin._assisted_decoding))
    wanted = [r"selected_tokens = new_logits\.argmax\(dim=-1\)",
              r"candidate_new_tokens = candidate_input_ids\[:, cur_len:\]",
              r"n_matches = \(\(~\(candidate_new_tokens == selected_tokens\[:, :-1\]\)\)\.cumsum\(dim=-1\) < 1\)\.sum\(\)",
              r"valid_tokens = selected_tokens\[:, : n_matches \+ 1\]"]
    lines = []
    for w in wanted:
        m = re.search(r"^[ \t]*(" + w + r")[ \t]*(#.*)?$", src, re.M)
        assert m, f"transformers changed its assisted-decoding idiom: {w!r} not found"
        lines.append(m.group(1))
    body = "\n    ".join(lines)
    ns = {}
    exec(f"def hf_assisted_greedy(new_logits, candidate_input_ids, cur_len):\n    {body}\n"
         f"    return valid_tokens, n_matches\n", ns)
    return ns["hf_assisted_greedy"]


def test_hf_assisted_greedy():
    fn = _hf_assisted_greedy()
    logits, drafts = _greedy(0, b=1)
    prompt = torch.randint(0, V, (1, 7))
    cand = torch.cat([prompt, drafts], 1)
    cf = compile_npuspec(fn)
    for i, keep in enumerate((K, 2)):                   # all accepted, then a mismatch at 2
        d = cand.clone()
        d[0, 7 + keep:] = (logits.argmax(-1)[0, keep:K] + 1) % V
        out, _ = three_way(fn, (logits, d, 7), family="greedy_accept", compiled=cf, fresh=i == 0,
                           appear=["npuspec.greedy_accept"], gone=["aten.cumsum"])
        assert out[1].item() == keep


# 2. HF transformers `_speculative_sampling`, called from the installed package ---------------
def test_hf_speculative_sampling():
    p, q, ids = _sampling(1, b=1)
    g = torch.Generator().manual_seed(5)
    new_logits = torch.randn(1, K + 1, V, generator=g)
    candidate_logits = torch.randn(1, K, V, generator=g)
    cand = torch.cat([torch.randint(0, V, (1, 3), generator=g), ids], 1)
    fn = transformers_utils._speculative_sampling
    cf = compile_npuspec(fn)
    before = counters.snapshot()
    seen, graphs = set(), ""
    for seed in range(6):                          # rejections at different places, and none
        out, g = three_way(fn, (cand, candidate_logits, K, new_logits), seed=seed, compiled=cf,
                           fresh=False)
        graphs += g
        seen.add(int(out[1]))
    # graph 1 (up to `if n_matches < gamma:`) holds the ratio test and matches, once. The
    # residual piece after the break starts with `q[:, n_matches, :]`, indexing by a 0-d tensor:
    # data-dependent under fake tensors in every AOT backend (inductor, aot_eager too), so Dynamo
    # runs that piece eagerly; see docs/passes.md.
    assert counters.delta(before)["verify_patterns_matched.ratio_accept"] == 1
    assert "npuspec.ratio_accept" in graphs and "aten.cumsum" not in graphs
    assert len(seen) > 1


# 3. vLLM-v0-like greedy: target argmax, cumprod, bonus/recovered token by gather ------------
def vllm_style(target_logits, draft_token_ids):
    target_argmax = target_logits.argmax(dim=-1)
    accepted = draft_token_ids == target_argmax[:, :-1]
    num_accepted = accepted.cumprod(dim=1).sum(dim=1)
    next_token = target_argmax.gather(1, num_accepted.unsqueeze(1)).squeeze(1)
    return next_token, num_accepted


# 4. Medusa-like: candidates row starts with the last token, .int() mask, torch.cumprod ---------
def medusa_style(logits, candidates):
    posterior_mask = (candidates[:, 1:] == torch.argmax(logits[:, :-1], dim=-1)).int()
    candidates_accept_length = (torch.cumprod(posterior_mask, dim=1)).sum(dim=1)
    return candidates_accept_length


# 5. EAGLE-like: torch.eq, int32 cummin ---------------------------------------------------
def eagle_style(logits, draft):
    target_ids = torch.argmax(logits, dim=2)
    accept = torch.eq(draft, target_ids[:, :-1]).to(torch.int32).cummin(dim=-1).values.sum(-1)
    return accept, target_ids


# 6. a whole greedy step with masked_fill output ------------------------------------------
def masked_step(logits, drafts):
    tgt = torch.argmax(logits, dim=2)
    n_acc = torch.cumprod((drafts == tgt[:, :drafts.size(1)]).long(), 1).sum(1)
    idx = torch.arange(tgt.size(1), device=tgt.device).unsqueeze(0)
    return tgt.masked_fill(idx > n_acc.unsqueeze(1), -1), n_acc + 1


# 7. Leviathan et al. as a paper reimplementation: float64 uniforms, gather, cumsum test -------
def leviathan_style(p, q, x):
    r = torch.rand(x.shape, dtype=torch.float64).to(torch.float32)
    p_x = torch.gather(p, 2, x[:, :, None])[:, :, 0]
    q_x = torch.gather(q, 2, x[:, :, None])[:, :, 0]
    n = ((~(r <= p_x / q_x)).cumsum(-1) < 1).sum(-1)
    return n, r


# 8. ngram / prompt-lookup drafts (one-hot, no draft probs) in a sampling batch ---------------
def ngram_onehot_style(probs, q_unused, draft_ids):
    uniform = torch.rand_like(draft_ids, dtype=torch.float32)
    target_prob = probs.gather(-1, draft_ids.unsqueeze(-1)).squeeze(-1)
    return (target_prob >= uniform).long().cumprod(-1).sum(-1)


# 9. vLLM-v1-like recovered tokens: exponential race over the residual -------------------------
def vllm_recovered_style(target_probs, draft_probs, ids):
    q = torch.empty_like(target_probs).exponential_()
    return (torch.clamp(target_probs - draft_probs, min=0) / q).argmax(dim=-1)


# 10. Gumbel-max over the normalised residual with the user's Gumbel draws ---------------------
def gumbel_style(p, q, ids):
    gumbels = -torch.log(-torch.log(torch.rand_like(p)))
    residual = torch.clamp(p - q, min=0)
    residual = residual / residual.sum(dim=-1, keepdim=True)
    return torch.argmax(torch.log(residual) + gumbels, dim=-1)


# 11. gpt-fast's verify, batched and without the host sync: min(1, target/draft) and the user's
#     own draws; gpt-fast names the draft distribution p and the target q
def gpt_fast_batched_style(target_probs, draft_probs, draft_tokens, uniforms, exp_noise):
    k = draft_tokens.shape[1]
    p = draft_probs.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
    q = torch.gather(target_probs[:, :k], 2, draft_tokens.unsqueeze(2)).squeeze(2)
    accept_draft_prob = torch.minimum(torch.ones(()), q / p)
    accept_length = (uniforms <= accept_draft_prob).cumprod(dim=1).sum(dim=1)
    new = torch.clamp(target_probs[:, :k] - draft_probs, min=0)
    recovered = (new / exp_noise[:, None, :]).argmax(dim=-1)
    bonus = (target_probs[:, k] / exp_noise).argmax(dim=-1)
    next_token = torch.cat([recovered, bonus[:, None]], 1).gather(1, accept_length[:, None])
    return next_token.squeeze(1), accept_length


# 12. vLLM-v1-like whole step: per-request Exp(1) vector, -1 padded output ----------------------
def vllm_v1_whole_step_style(target_probs, draft_probs, draft_token_ids, uniform_probs, q):
    num_spec = draft_token_ids.shape[1]
    target_p = target_probs[:, :num_spec]
    draft_p = draft_probs.gather(-1, draft_token_ids.unsqueeze(-1)).squeeze(-1)
    accepted = target_p.gather(-1, draft_token_ids.unsqueeze(-1)).squeeze(-1) / draft_p >= uniform_probs
    num_accepted = ((~accepted).cumsum(dim=-1) < 1).sum(dim=-1)
    recovered = (torch.clamp(target_p - draft_probs, min=0) / q.unsqueeze(1)).argmax(dim=-1)
    bonus = (target_probs[:, -1] / q).argmax(dim=-1)
    token = torch.cat([recovered, bonus.unsqueeze(1)], 1).gather(1, num_accepted.unsqueeze(1)).squeeze(1)
    pos = torch.arange(num_spec + 1, device=target_probs.device).unsqueeze(0)
    padded = torch.nn.functional.pad(draft_token_ids, (0, 1), value=-1)
    out = torch.where(pos < num_accepted.unsqueeze(1), padded, -1)
    return torch.where(pos == num_accepted.unsqueeze(1), token.unsqueeze(1), out), num_accepted


# 13. n-gram drafts (one-hot) with temperature sampling: the draft's probability zeroed ----------
def ngram_temperature_whole_step_style(logits, draft_probs_unused, draft_ids, uniforms, exp_noise):
    probs = torch.softmax(logits / 0.7, dim=-1)                                # [B, K+1, V]
    k = draft_ids.size(1)
    accept = probs[:, :k].gather(2, draft_ids.unsqueeze(2)).squeeze(2) >= uniforms
    n = accept.long().cumprod(dim=1).sum(dim=1)
    residual = probs[:, :k].scatter(2, draft_ids.unsqueeze(2), 0.0)
    rec = (residual / exp_noise[:, None, :]).argmax(dim=2)
    bonus = (probs[:, k] / exp_noise).argmax(dim=1)
    return torch.cat([rec, bonus[:, None]], dim=1).gather(1, n[:, None]).squeeze(1), n


def _whole_step(seed, b=B):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, K + 1, V, generator=g) * 2
    p = torch.softmax(logits, -1)
    q = torch.softmax(torch.randn(b, K, V, generator=g) * 0.3 + logits[:, :K] * 0.7, -1)
    ids = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(b, K)
    u = torch.rand(b, K, dtype=torch.float64, generator=g).float()
    u[0] = 0.0                                      # one request takes the bonus row
    return p, q, ids, u, torch.empty(b, V).exponential_(generator=g)


def _logits_step(seed):
    p, q, ids, u, e = _whole_step(seed)
    return torch.log(p), q, ids, u, e


CORPUS = [
    (vllm_style, _greedy, "greedy_verify", "npuspec.rejection_sample"),
    (medusa_style, None, "greedy_accept", "npuspec.greedy_accept"),
    (eagle_style, _greedy, "greedy_accept", "npuspec.greedy_accept"),
    (masked_step, _greedy, "greedy_verify", "npuspec.rejection_sample"),
    (leviathan_style, _sampling, "ratio_accept", "npuspec.ratio_accept"),
    (ngram_onehot_style, _sampling, "ratio_accept", "npuspec.ratio_accept"),
    (vllm_recovered_style, _sampling, "residual", "npuspec.residual_sample"),
    (gumbel_style, _sampling, "residual", "npuspec.residual_sample"),
    (gpt_fast_batched_style, _whole_step, "sample_verify", "npuspec.rejection_sample"),
    (vllm_v1_whole_step_style, _whole_step, "sample_verify", "npuspec.rejection_sample"),
    (ngram_temperature_whole_step_style, _logits_step, "sample_verify", "npuspec.rejection_sample"),
]


def _medusa_inputs(seed):
    logits, drafts = _greedy(seed)
    last = torch.randint(0, V, (B, 1))
    return logits, torch.cat([last, drafts], 1)


@pytest.mark.parametrize("fn,make,family,op", CORPUS, ids=[c[0].__name__ for c in CORPUS])
def test_corpus_spelling(fn, make, family, op):
    args = _medusa_inputs(3) if make is None else make(3)
    three_way(fn, args, family=family, appear=[op], seed=11)


def test_corpus_is_large_enough():
    assert len(CORPUS) + 2 >= 8  # + the two HF transformers entries above
