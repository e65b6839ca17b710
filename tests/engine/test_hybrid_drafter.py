"""The hybrid drafter in the engine (`enable_suffix_decoding` with a model head): greedy output
equals plain decoding uncompiled and captured, both drafters draft within one run, and the
captured head's graphs take the ragged subsets of rows the head drafts for without falling
back to eager. Its sampling is proven lossless in test_hidden_state_lossless.py."""

import npuspec.engine
from npuspec import LLM, SamplingParams
from npuspec._counters import counters
from npuspec.spec_decode.hybrid import HybridProposer

# a prompt that repeats itself (suffix drafts), and ones with little to copy (the head drafts)
PROMPTS = ["def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return a + b\n\n\ndef add(",
           "import os\nimport sys\n", "class Queue:\n    def", "for i in range(10):"]
SP = SamplingParams(temperature=0, max_tokens=24)
# a fixed threshold: the choice reads scores only, so eager and captured runs choose alike (the
# default also weighs the head's measured cost, which differs between them)
SPEC = {"method": "eagle3", "model": "tiny-eagle3", "num_speculative_tokens": 3,
        "enable_suffix_decoding": True, "suffix_min_score": 1.0}


def _tokens(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


def test_greedy_equals_plain_uncompiled_and_captured(monkeypatch):
    monkeypatch.setattr(npuspec.engine, "DEFAULT_LOWERING", "eager")
    plain = _tokens(LLM("tiny", enforce_eager=True, max_model_len=256).generate(PROMPTS, SP))
    runs = {}
    for eager in (True, False):
        llm = LLM("tiny", speculative_config=SPEC, enforce_eager=eager, max_model_len=256,
                  max_num_seqs=4)
        assert isinstance(llm.proposer, HybridProposer)
        before = counters.get("eager_fallbacks", 0)
        assert _tokens(llm.generate(PROMPTS, SP)) == plain, eager
        if not eager:
            assert counters.get("eager_fallbacks", 0) == before
        p = llm.proposer.picks
        assert p["suffix"] > 0 and p["model"] > 0, p
        assert llm.metrics.num_accepted > 0
        runs[eager] = (dict(p), llm.metrics.num_drafted, llm.metrics.num_accepted)
    assert runs[True] == runs[False]  # the captured head drafts what the eager one does


def test_the_default_cost_weighed_choice_keeps_greedy_output():
    spec = {k: v for k, v in SPEC.items() if k != "suffix_min_score"}
    plain = _tokens(LLM("tiny", enforce_eager=True, max_model_len=256).generate(PROMPTS, SP))
    llm = LLM("tiny", speculative_config=spec, enforce_eager=True, max_model_len=256,
              max_num_seqs=4)
    assert _tokens(llm.generate(PROMPTS, SP)) == plain
    h = llm.proposer
    assert h.min_score is None and h.t_round > 0 and h.t_loop > 0  # both were measured
    assert h.picks["suffix"] > 0


def test_a_fixed_min_score_above_every_suffix_score_is_the_head_alone():
    head = LLM("tiny", speculative_config={k: v for k, v in SPEC.items()
                                           if k not in ("enable_suffix_decoding",
                                                        "suffix_min_score")},
               enforce_eager=True, max_model_len=256, max_num_seqs=4)
    ref = head.generate(PROMPTS, SP)
    llm = LLM("tiny", speculative_config=dict(SPEC, suffix_min_score=1e9), enforce_eager=True,
              max_model_len=256, max_num_seqs=4)
    out = llm.generate(PROMPTS, SP)
    assert _tokens(out) == _tokens(ref)
    assert llm.proposer.picks["suffix"] == 0
    assert (llm.metrics.num_drafted, llm.metrics.num_accepted) == \
        (head.metrics.num_drafted, head.metrics.num_accepted)
