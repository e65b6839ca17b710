"""What the engine drafts is what training scored: a chain head's first draft at each step
equals the teacher-forced argmax of `dense_chain` at the same row of the finished sequence,
and its second draft does too wherever the first was right (the chain then read the gold
token). A gap between training's held-out acceptance and the engine's is then the data's,
not a serving path that feeds the head other features, tokens or positions."""
from __future__ import annotations

import pytest
import torch

from npuspec import LLM, SamplingParams
from npuspec.spec_decode.eagle import EagleProposer
from npuspec.train.chain import dense_chain

PROMPTS = ["def fibonacci(n):\n    ", "import os\n\nclass Config:\n    def __init__(self"]


def _engine_drafts(monkeypatch, method: str, head: str):
    """(outputs, [(req_id, tokens so far, drafts)] per request-step) of a greedy run."""
    seen = []
    real = EagleProposer.draft_requests

    def spy(self, reqs, k, temps, gens, want_probs=True):
        d = real(self, reqs, k, temps, gens, want_probs)
        seen.extend((r.req_id, len(r.tokens), d.tokens[b].copy()) for b, r in enumerate(reqs))
        return d
    monkeypatch.setattr(EagleProposer, "draft_requests", spy)
    spec = {"method": method, "model": head, "num_speculative_tokens": 4}
    if head is None:
        spec.pop("model")
    llm = LLM("tiny", speculative_config=spec, enforce_eager=True)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=40))
    return llm, outs, seen


@pytest.mark.parametrize("method,head", [("eagle3", "tiny-eagle3"), ("eagle", "tiny-eagle")])
def test_engine_drafts_are_the_teacher_forced_predictions(monkeypatch, method, head):
    llm, outs, seen = _engine_drafts(monkeypatch, method, head)
    m, target = llm.proposer.module, llm.model
    aux, final = llm.proposer.features
    hits = {0: [0, 0], 1: [0, 0]}
    for o in outs:
        seq = list(o.prompt_token_ids) + list(o.outputs[0].token_ids)
        ids = torch.tensor([seq])                                         # [1, N]
        with torch.inference_mode():
            _, feats = target.forward_causal(ids, aux_ids=aux, final=final)
            steps = [ids[:, 1:], torch.cat([ids[:, 2:], ids[:, :1]], dim=1)]
            chain = dense_chain(m, steps, feats[:, :-1])
            preds = [m.logits(lh).argmax(-1)[0] for lh, _ in chain]      # [N-1] per step
        for req, n, drafts in seen:
            t = n - 2  # the pending row: its token is the last one, its feature the one before
            if req != o.request_id or t + 2 >= len(seq):
                continue
            hits[0][1] += 1
            hits[0][0] += int(preds[0][t] == drafts[0])
            if drafts[0] == seq[t + 2] and t + 3 < len(seq):  # chain step 1 read the gold token
                hits[1][1] += 1
                hits[1][0] += int(preds[1][t] == drafts[1])
    assert hits[0][1] >= 30 and hits[1][1] >= 10, hits  # both cases were exercised
    assert hits[0][0] == hits[0][1] and hits[1][0] == hits[1][1], hits
