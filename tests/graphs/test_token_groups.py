"""Token dims of one group with different sizes: npuspec's error, not Dynamo's internal
assertion (issue 34, item 2)."""
import pytest
import torch

from npuspec.compilation.backend import BackendUserError
from npuspec.graphs import mark_token_dim


def step(hidden, drafts):
    return hidden.sum(-1), drafts + 1


def test_one_group_two_sizes_names_both_inputs_and_the_fix():
    torch._dynamo.reset()
    f = torch.compile(step, backend="npuspec", options={"lowering": "eager"})
    B, K, H = 3, 4, 8
    hidden = mark_token_dim(torch.randn(B * (K + 1), H))  # flat tokens, default group
    drafts = mark_token_dim(torch.randint(0, 9, (B, K)))
    with pytest.raises(ValueError) as e:
        f(hidden, drafts)
    msg = str(e.value)
    assert isinstance(e.value, BackendUserError)
    for part in ("hidden", "size 15", "drafts", "size 3", "'rows'", "group='tokens'"):
        assert part in msg, (part, msg)


def test_separate_groups_compile_and_run():
    torch._dynamo.reset()
    f = torch.compile(step, backend="npuspec", options={"lowering": "eager"})
    B, K, H = 3, 4, 8
    hidden = mark_token_dim(torch.randn(B * (K + 1), H), group="tokens")
    drafts = mark_token_dim(torch.randint(0, 9, (B, K)))
    got = f(hidden, drafts)
    want = step(hidden, drafts)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
