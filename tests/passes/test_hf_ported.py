"""HF transformers' own unit-test case for `_speculative_sampling` (tests/generation/
test_utils.py, UtilsFunctionsTest.test_speculative_sampling: a 10-token vocabulary, three
candidates of which the target accepts two and replaces the third with its only
nonzero-probability token), ported onto our transcription (field_others.py), eager and
compiled with npuspec. The case is theirs, the code ours."""
from __future__ import annotations

import pytest
import torch
from field_others import hf_speculative_sampling

from npuspec import counters

INF = float("inf")


def _row(hot, vocab=10, low=-10.0, high=10.0):
    r = torch.full((vocab,), low)
    r[hot] = high
    return r


def _case():
    ids = torch.tensor([[8, 0, 3, 9, 8, 1, 4, 5]])      # five prompt tokens, candidates 1, 4, 5
    cand = torch.stack([_row(1), _row(4), _row(5)])[None]
    new = torch.stack([_row(1), _row(4), _row(8, low=-INF), torch.full((10,), -10.0)])[None]
    return ids, cand, new, 3


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
def test_two_accepted_then_the_targets_token(lowering, no_fx_cache):
    want_tokens, want_n = [[1, 4, 8]], 2
    for seed in range(5):
        torch.manual_seed(seed)
        tokens, n = hf_speculative_sampling(*_case())
        assert tokens.tolist() == want_tokens and int(n) == want_n
    torch._dynamo.reset()
    f = torch.compile(hf_speculative_sampling, backend="npuspec",
                      options={"lowering": lowering, "capture": False})
    before = counters.snapshot()
    for seed in range(5):
        torch.manual_seed(seed)
        tokens, n = f(*_case())
        assert tokens.tolist() == want_tokens and int(n) == want_n
    # the accept test and count (before `if n_matches < gamma:`) became ratio_accept
    assert counters.delta(before).get("verify_patterns_matched.ratio_accept", 0) >= 1
