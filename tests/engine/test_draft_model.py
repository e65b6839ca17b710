"""DraftModelProposer: the proposer protocol (spec_decode/base.py), its K/V catch-up,
probabilities and confidences."""
import numpy as np
import pytest
import torch

from npuspec import LLM, SamplingParams
from npuspec.models import load_model
from npuspec.runtime import DraftModelProposer

PROMPT = [9, 8, 7, 9, 8, 7, 9, 8]


@pytest.fixture(scope="module")
def greedy_tokens(ckpt):
    llm = LLM(ckpt, enforce_eager=True, max_model_len=64)
    return llm.generate({"prompt_token_ids": PROMPT},
                        SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].token_ids


def test_self_draft_predicts_greedy_continuation(ckpt, greedy_tokens):
    _, model = load_model(ckpt)
    p = DraftModelProposer(model, num_slots=2, max_len=64)
    p.start_request("a", PROMPT)
    p.start_request("b", [1, 2, 3])
    assert p.propose(["a"], 5) == [greedy_tokens[:5]]
    p.extend("a", greedy_tokens[:3])  # as if 2 drafts were accepted plus one target token
    assert p.propose(["a", "b"], [4, 0]) == [greedy_tokens[3:7], []]
    p.stop_request("a")
    p.start_request("a", PROMPT + greedy_tokens[:6])  # the slot is reused
    assert p.propose(["a"], 3) == [greedy_tokens[6:9]]


def test_draft_probs_and_confidences(ckpt):
    _, model = load_model(ckpt)
    p = DraftModelProposer(model, num_slots=2, max_len=64)
    p.start_request("a", PROMPT)
    p.start_request("b", [4, 5])
    gens = [torch.Generator().manual_seed(1), None]
    d = p.draft(["a", "b"], 3, temperature=np.array([0.7, 0.0]), generators=gens)
    assert d.tokens.shape == (2, 3) and d.probs.shape == (2, 3, 300) and d.conf.shape == (2, 3)
    torch.testing.assert_close(d.probs.sum(-1), torch.ones(2, 3))
    assert ((d.conf >= 1e-6) & (d.conf <= 1)).all()
    # the greedy row drafts the argmax of its q (temperature 1 for greedy rows) and reports it
    q1 = d.probs[1]
    assert d.tokens[1].tolist() == q1.argmax(-1).tolist()
    np.testing.assert_allclose(d.conf[1], q1.max(-1).values.double().numpy(), rtol=1e-6)
    # sampled drafts come from q: each drafted token has q > 0
    assert all(d.probs[0, i, d.tokens[0, i]] > 0 for i in range(3))


def test_seeded_draws_reproduce(ckpt):
    _, model = load_model(ckpt)
    outs = []
    for _ in range(2):
        p = DraftModelProposer(model, num_slots=1, max_len=64)
        p.start_request("a", PROMPT)
        d = p.draft(["a"], 4, temperature=np.array([1.5]),
                    generators=[torch.Generator().manual_seed(5)])
        outs.append(d.tokens.tolist())
    assert outs[0] == outs[1]


def test_protocol_errors(ckpt):
    _, model = load_model(ckpt)
    p = DraftModelProposer(model, num_slots=1, max_len=64)
    p.start_request("a", [1])
    with pytest.raises(ValueError, match="already active"):
        p.start_request("a", [1])
    with pytest.raises(RuntimeError, match="no free draft cache slot"):
        p.start_request("b", [1])
    with pytest.raises(KeyError, match="unknown request"):
        p.extend("zz", [1])
    with pytest.raises(KeyError, match="unknown request"):
        p.stop_request("zz")
    with pytest.raises(ValueError, match="max_tokens"):
        p.propose(["a"], -1)
    assert p.propose(["a"], 0) == [[]]
