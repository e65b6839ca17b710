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


def _engine_drafts(monkeypatch, method: str, head: str, hybrid: str = ""):
    """(outputs, [(req_id, tokens so far, drafts)] per head request-step) of a greedy run."""
    seen = []
    real = EagleProposer.draft_requests

    def spy(self, reqs, k, temps, gens, want_probs=True):
        d = real(self, reqs, k, temps, gens, want_probs)
        seen.extend((r.req_id, len(r.tokens), d.tokens[b].copy(), float(d.conf[b, 0]))
                    for b, r in enumerate(reqs))
        return d
    monkeypatch.setattr(EagleProposer, "draft_requests", spy)
    spec = {"method": method, "model": head, "num_speculative_tokens": 4}
    if hybrid == "hybrid":  # suffix drafts whenever its tree has one; first passes wait
        spec.update(enable_suffix_decoding=True, suffix_min_score=0.0)
    elif hybrid == "defer":  # every other step's first pass waits until the head drafts
        calls = []
        real_on_verify = EagleProposer.on_verify

        def on_verify(self, *a, **kw):
            calls.append(1)
            return real_on_verify(self, *a, defer=len(calls) % 2 == 0)
        monkeypatch.setattr(EagleProposer, "on_verify", on_verify)
    llm = LLM("tiny", speculative_config=spec, enforce_eager=True)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=40))
    return llm, outs, seen


@pytest.mark.parametrize("method,head,mode", [("eagle3", "tiny-eagle3", ""),
                                              ("eagle", "tiny-eagle", ""),
                                              ("eagle3", "tiny-eagle3", "hybrid"),
                                              ("mtp", None, "defer")])
def test_engine_drafts_are_the_teacher_forced_predictions(monkeypatch, method, head, mode):
    """hybrid: the head's first passes after suffix steps are deferred and caught up in one
    prefill-shaped call before the next step's (on_verify); defer: every other step's first
    pass waits for the head's next draft (draft_requests catches up). Either way its drafts
    must be the same as if it had passed every step."""
    llm, outs, seen = _engine_drafts(monkeypatch, method, head, mode)
    if mode:
        head_proposer = llm.proposer.model if mode == "hybrid" else llm.proposer
        assert head_proposer.caught_up > 5, head_proposer.caught_up
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
            logits = [m.logits(lh)[0] for lh, _ in chain]                 # [N-1, V] per step
            preds = [lg.argmax(-1) for lg in logits]
            conf0 = torch.softmax(logits[0].float(), -1).amax(-1)           # [N-1]
        for req, n, drafts, conf in seen:
            t = n - 2  # the pending row: its token is the last one, its feature the one before
            if req != o.request_id or t + 2 >= len(seq):
                continue
            hits[0][1] += 1
            hits[0][0] += int(preds[0][t] == drafts[0])
            # the draft's confidence is its max softmax: the same logits, not only the argmax
            assert abs(conf - float(conf0[t])) < 1e-4, (req, n, conf, float(conf0[t]))
            if drafts[0] == seq[t + 2] and t + 3 < len(seq):  # chain step 1 read the gold token
                hits[1][1] += 1
                hits[1][0] += int(preds[1][t] == drafts[1])
    assert hits[0][1] >= 10 and hits[1][1] >= 5, hits  # both cases were exercised
    assert hits[0][0] == hits[0][1] and hits[1][0] == hits[1][1], hits
