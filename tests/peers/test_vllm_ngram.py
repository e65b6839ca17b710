"""vLLM's n-gram proposer tests, restated for `npuspec.runtime.NgramProposer`.

Source: vllm-project/vllm, tests/v1/spec_decode/test_ngram.py. Ported cases:
test_find_longest_matched_ngram_and_propose_tokens, test_ngram_proposer (single requests, the
empty context, the multi-request batch, the batch where one request is still in prefill, the
long context past the multi-thread threshold) and test_ngram_drafts_do_not_depend_on_thread_count
(here: on how the batch is formed). The leader-rank and thread-budget tests have no counterpart
(npuspec drafts in the engine's own process).

API mapping. vLLM's proposer is stateless: each call gets a [B, max_len] token array padded with
-1 plus the true lengths, and `num_speculative_tokens` for every request (an empty
`sampled_token_ids` entry marks a request still in prefill). npuspec's proposer keeps each
request's context (`start_request`, then `extend` after every verify step) and takes K per
request, so a padded row becomes the request's real tokens and "in prefill" becomes K = 0.
"""
import random

import pytest

from npuspec.runtime import NgramProposer


def propose(context, nmin, nmax, k):
    """One request's proposal for `context` (the stateless call vLLM's tests make)."""
    p = NgramProposer(prompt_lookup_min=nmin, prompt_lookup_max=nmax)
    p.start_request("r", context)
    return p.propose(["r"], k)[0]


# (context, min n, max n, K, expected drafts); the first nine are vLLM's cases for the
# longest-match helper, the rest those of its proposer test
CASES = [
    ([1, 2, 3, 4, 1, 2, 3, 5, 6], 2, 2, 2, []),
    ([1, 2, 3, 4, 1, 2, 3], 2, 2, 3, [4, 1, 2]),
    ([1, 2, 3, 4, 1, 2, 3], 2, 2, 2, [4, 1]),
    ([1, 2, 3, 4, 1, 2, 3], 1, 1, 3, [4, 1, 2]),
    ([1, 2, 3, 4, 1, 2, 3], 1, 1, 2, [4, 1]),
    ([1, 3, 6, 2, 3, 4, 1, 2, 3], 2, 2, 3, [4, 1, 2]),
    ([1, 3, 6, 2, 3, 4, 1, 2, 3], 1, 1, 2, [6, 2]),  # the earliest occurrence of "3" wins
    ([1, 2, 3, 4, 5], 2, 2, 2, []),                  # no match at all
    ([1, 2, 3, 4, 1, 2, 3], 4, 4, 2, []),            # no 4-gram repeats
    ([1, 2, 3, 4, 1, 2, 3], 3, 4, 2, [4, 1]),        # ... but a 3-gram does
    ([2, 3, 4, 5, 1, 2, 3, 4, 1, 2, 3, 4], 3, 4, 2, [1, 2]),  # the 4-gram beats the 3-gram
    ([3, 4, 5, 2, 3, 4, 1, 2, 3, 4], 2, 4, 2, [1, 2]),        # the 3-gram beats the 2-gram
    ([1, 2, 3, 100, 1, 2, 3, 200, 1, 2, 3, 300, 1, 2, 3], 3, 3, 2, [100, 1]),  # first of many
    ([], 2, 2, 2, []),                                # empty context
]


@pytest.mark.parametrize("context,nmin,nmax,k,want", CASES)
def test_vllm_cases(context, nmin, nmax, k, want):
    assert propose(context, nmin, nmax, k) == want


@pytest.mark.parametrize("context,nmin,nmax,k,want", CASES)
def test_vllm_cases_built_incrementally(context, nmin, nmax, k, want):
    # the mapping onto npuspec's stateful API must not matter: a context that arrives as a
    # prompt plus any number of verify steps drafts what the whole context drafts
    for cut in range(len(context) + 1):
        p = NgramProposer(prompt_lookup_min=nmin, prompt_lookup_max=nmax)
        p.start_request("r", context[:cut])
        for t in context[cut:]:
            p.extend("r", [t])
        assert p.propose(["r"], k) == [want], cut


def test_batch_with_a_short_request():
    # vLLM pads the second row with -1 up to the first's length; here each request has its own
    # context and the padding never exists
    p = NgramProposer(prompt_lookup_min=2, prompt_lookup_max=2)
    p.start_request("a", [1, 2, 3, 1, 2])
    p.start_request("b", [4, 5, 6])
    assert p.propose(["a", "b"], 2) == [[3, 1], []]


def test_batch_with_a_request_in_prefill():
    # vLLM: requests 0 and 2 need drafts, request 1 is still in prefill (no sampled token);
    # here a request that must not draft this step gets K = 0
    p = NgramProposer(prompt_lookup_min=2, prompt_lookup_max=2)
    for rid, ctx in (("0", [1, 2, 3, 1, 2]), ("1", [4, 5, 6]), ("2", [7, 8, 9, 7, 8])):
        p.start_request(rid, ctx)
    assert p.propose(["0", "1", "2"], [2, 0, 2]) == [[3, 1], [], [9, 7]]
    # K = 0 for a request that would have matched gives nothing either
    assert p.propose(["0", "1", "2"], [0, 2, 2]) == [[], [], [9, 7]]


def test_long_context():
    # vLLM's case past its multi-thread threshold (8192 tokens): the context counts up to the
    # threshold and then repeats two tokens from the middle
    n = 8192
    mid = n // 2
    p = NgramProposer(prompt_lookup_min=2, prompt_lookup_max=2)
    p.start_request("long", list(range(n)) + [mid, mid + 1])
    p.start_request("short", [4, 5, 6])
    assert p.propose(["long", "short"], 2) == [[mid + 2, mid + 3], []]


def _brute_force(ctx, nmin, nmax, k):
    """The rule by scanning: longest n first, earliest earlier occurrence, copy what follows
    (continuing periodically when the copy reaches the end of the context)."""
    T = len(ctx)
    for n in range(nmax, nmin - 1, -1):
        if n >= T:
            continue
        tail = ctx[T - n:]
        for s in range(0, T - n):
            if ctx[s:s + n] == tail:
                start = s + n
                return [ctx[start + j % (T - start)] for j in range(k)]
    return []


@pytest.mark.parametrize("batch", [1, 8, 64])
def test_drafts_do_not_depend_on_the_batch(batch):
    # vLLM: raising the numba thread count must not change one draft. npuspec's counterpart:
    # one batched propose, the same requests one at a time and in reverse order all agree,
    # and every draft is the rule's (brute force)
    rng = random.Random(1234 + batch)
    ctx_len, nmin, nmax, k = 4096, 3, 5, 5
    contexts = []
    for _ in range(batch):
        ctx = [rng.randrange(32000) for _ in range(ctx_len)]
        src = rng.randrange(ctx_len - 128)
        ctx[ctx_len - 64:] = ctx[src:src + 64]  # the tail repeats an earlier span
        contexts.append(ctx)
    ids = [str(i) for i in range(batch)]
    together = NgramProposer(prompt_lookup_min=nmin, prompt_lookup_max=nmax)
    for rid, ctx in zip(ids, contexts):
        together.start_request(rid, ctx)
    batched = together.propose(ids, k)
    assert together.propose(ids[::-1], k) == batched[::-1]
    for rid, ctx, got in zip(ids, contexts, batched):
        assert propose(ctx, nmin, nmax, k) == got
        assert got == _brute_force(ctx, nmin, nmax, k)
    assert any(batched)


def test_copy_continues_periodically_past_the_end():
    # npuspec-specific (docs/proposers.md): when the match ends fewer than K tokens before the
    # end, the copy wraps around the repeating text; vLLM's slice stops at the context's end
    # ([3, 1, 2] here)
    assert propose([1, 2, 3, 1, 2], 2, 2, 4) == [3, 1, 2, 3]
    assert propose([7, 7, 7], 1, 1, 5) == [7] * 5
