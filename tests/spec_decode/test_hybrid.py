"""The hybrid drafter's choice (npuspec/spec_decode/hybrid.py), with scripted suffix and model
drafters where the right pick is known: per request, the suffix draft when its score (the sum
of its path probabilities) reaches the threshold; the model's loop only for the rest; q one-hot
on suffix rows and the head's q on model rows; the model's running acceptance as the default
threshold; and the config keys with their errors."""
import types

import numpy as np
import pytest
import torch

from npuspec.config import SpeculativeConfig
from npuspec.spec_decode.base import CONF_MIN, DraftBatch, Drafts, Proposer
from npuspec.spec_decode.hybrid import (DEFAULT_MODEL_ACCEPTED, EMA, EXPLORE_EVERY,
                                        TIME_EMA, HybridProposer)

V = 8


class ScriptedSuffix:
    """Drafts and path probabilities given per request id."""

    def __init__(self, script):
        self.script = script
        self.calls = []

    def propose_batch_with_probs(self, req_ids, caps):
        self.calls.append(list(req_ids))
        return [tuple(x[:c] for x in self.script[r]) for r, c in zip(req_ids, caps)]

    def start_request(self, *a):
        self.calls.append(("start",) + a)

    def extend(self, *a):
        self.calls.append(("extend",) + a)

    def stop_request(self, *a):
        self.calls.append(("stop",) + a)

    def forget_responses(self):
        self.calls.append("forget")


class ScriptedModel(Proposer):
    """Drafts token 10*row + i (mod V) at position i, with q peaked on it, conf 0.5."""
    features = ((1,), False)
    module = None

    def __init__(self):
        self.batches = []
        self.events = []

    def start_request(self, req_id, prompt):
        self.events.append(("start", req_id))

    def extend(self, req_id, new_tokens):
        self.events.append(("extend", req_id, list(new_tokens)))

    def stop_request(self, req_id):
        self.events.append(("stop", req_id))

    def propose(self, req_ids, max_tokens):
        return [[7] * k for k in max_tokens]

    def draft_batch(self, batch):
        self.batches.append(batch)
        B, K = len(batch.reqs), batch.k
        tok = np.array([[(3 + i) % V for i in range(K)] for _ in range(B)], dtype=np.int64)
        probs = None
        if batch.want_probs:
            probs = torch.full((B, K, V), 0.5 / (V - 1))
            probs.scatter_(2, torch.as_tensor(tok)[:, :, None], 0.5)
        return Drafts(tok, probs, np.full((B, K), 0.5))


def _reqs(*ids):
    return [types.SimpleNamespace(req_id=r) for r in ids]


def _hybrid(script, min_score=None):
    return HybridProposer(ScriptedModel(), ScriptedSuffix(script), V, torch.device("cpu"),
                          min_score)


SCRIPT = {"a": ([5, 6, 1], [0.9, 0.8, 0.6]),   # score 2.3
          "b": ([2], [0.3]),                   # score 0.3
          "c": ([], [])}                       # no match


def test_each_request_takes_the_suffix_draft_only_when_its_score_reaches_the_threshold():
    h = _hybrid(SCRIPT, min_score=1.0)
    d = h.draft_batch(DraftBatch(_reqs("a", "b", "c"), 3, [3, 3, 3], None))
    assert d.tokens.tolist() == [[5, 6, 1], [3, 4, 5], [3, 4, 5]]
    assert d.probs is None  # greedy step
    # the model's loop ran for b and c only
    assert [r.req_id for r in h.model.batches[0].reqs] == ["b", "c"]
    # suffix confidences are the conditional probabilities p_j / p_(j-1)
    np.testing.assert_allclose(d.conf[0], [0.9, 0.8 / 0.9, 0.6 / 0.8])
    np.testing.assert_allclose(d.conf[1:], 0.5)
    assert h.picks == {"suffix": 1, "model": 2, "none": 0}


def test_no_model_loop_when_every_request_takes_the_suffix():
    h = _hybrid(SCRIPT, min_score=0.0)
    d = h.draft_batch(DraftBatch(_reqs("a", "b"), 3, [2, 3], None))
    assert d.tokens.tolist() == [[5, 6, -1], [2, -1, -1]]  # caps respected, -1 padded
    assert h.model.batches == []
    assert d.conf[0, 2] == CONF_MIN


def test_sampled_step_q_is_one_hot_on_suffix_rows_and_the_heads_elsewhere():
    h = _hybrid(SCRIPT, min_score=1.0)
    temps = np.array([0.7, 1.0, 0.0])
    d = h.draft_batch(DraftBatch(_reqs("a", "b", "c"), 3, [3, 3, 3], temps))
    q = d.probs
    assert q.shape == (3, 3, V)
    for i, t in enumerate([5, 6, 1]):
        assert q[0, i, t] == 1 and q[0, i].sum() == 1
    sub = h.model.batches[0]
    np.testing.assert_array_equal(sub.temps, temps[[1, 2]])  # the model rows' temperatures
    for b in (1, 2):
        for i in range(3):
            assert q[b, i, (3 + i) % V] == 0.5
            assert q[b, i].sum() == pytest.approx(1.0)


def test_default_threshold_follows_the_models_running_acceptance():
    h = _hybrid(SCRIPT)
    assert h.threshold() == DEFAULT_MODEL_ACCEPTED
    h.draft_batch(DraftBatch(_reqs("b"), 3, [3], None))  # b: 0.3 < 1.0 -> model
    h.extend("b", [1, 2, 3, 4])                          # 3 drafts accepted + the bonus
    want = DEFAULT_MODEL_ACCEPTED + EMA * (3 - DEFAULT_MODEL_ACCEPTED)
    assert h.threshold() == pytest.approx(want)
    h.draft_batch(DraftBatch(_reqs("a"), 3, [3], None))  # a: suffix; its steps do not count
    h.extend("a", [9])
    assert h.threshold() == pytest.approx(want)
    # both drafters see every request's tokens
    assert ("extend", "a", [9]) in h.model.events and ("extend", "a", [9]) in h.suffix.calls


def test_the_head_runs_only_when_its_tokens_pay_for_its_measured_cost():
    h = _hybrid(SCRIPT)  # adaptive: no suffix_min_score
    h.model_accepted = 0.2
    h.t_round, h.t_loop = 1.0, 0.5
    reqs = _reqs("b", "c")  # b: suffix score 0.3 >= 0.2 takes it; c (no match) prefers the head
    # with the head: (1 + 0.3) + (1 + 0.2) = 2.5 tokens in 1.5 s; without: 2.3 in 1.0 s
    d = h.draft_batch(DraftBatch(reqs, 3, [3, 3], None))
    assert h.model.batches == [] and d.tokens.tolist() == [[2, -1, -1], [-1, -1, -1]]
    assert h.picks == {"suffix": 1, "model": 0, "none": 1}
    h.t_loop = 0.05  # now 2.5 / 1.05 s beats 2.3 / 1.0 s
    h.t_round = 1.0
    d = h.draft_batch(DraftBatch(reqs, 3, [3, 3], None))
    assert [r.req_id for r in h.model.batches[0].reqs] == ["c"]
    assert d.tokens.tolist() == [[2, -1, -1], [3, 4, 5]]
    # a request that got no draft does not move the head's running acceptance
    before = h.model_accepted
    h._source["b"] = "none"
    h.extend("b", [1])
    assert h.model_accepted == before


def test_the_timed_decision_is_the_agreed_one():
    """Under tensor parallelism with the head sharded the engine sets `agree` to rank 0's
    broadcast: the step follows the agreed decision, not this rank's own clock."""
    h = _hybrid(SCRIPT)
    h.model_accepted, h.t_round, h.t_loop = 0.2, 1.0, 0.05  # this rank: the head pays
    asked = []
    h.agree = lambda pays: asked.append(pays) or False        # rank 0 decided it does not
    d = h.draft_batch(DraftBatch(_reqs("b", "c"), 3, [3, 3], None))
    assert asked == [True] and h.model.batches == []
    assert d.tokens.tolist() == [[2, -1, -1], [-1, -1, -1]]
    h.agree = lambda pays: asked.append(pays) or True         # and the other way round
    h.t_loop = 10.0                                           # this rank: it does not pay
    d = h.draft_batch(DraftBatch(_reqs("b", "c"), 3, [3, 3], None))
    assert asked[-1] is False and [r.req_id for r in h.model.batches[0].reqs] == ["c"]
    h.agree = lambda pays: asked.append(pays) or pays
    h.draft_batch(DraftBatch(_reqs("b"), 3, [3], None))       # every row takes the suffix:
    assert len(asked) == 2                                    # nothing to decide, no exchange


def test_a_declined_head_still_runs_every_explore_every_steps():
    h = _hybrid(SCRIPT)
    h.model_accepted, h.t_round, h.t_loop = 0.0, 1.0, 10.0
    h.clock = lambda: 0.0  # every measured time is 0: the t_loop update keeps it finite
    runs = []
    for _ in range(2 * EXPLORE_EVERY):
        n = len(h.model.batches)
        h.draft_batch(DraftBatch(_reqs("c"), 3, [3], None))
        runs.append(len(h.model.batches) > n)
        h.t_loop = 10.0  # keep declining between explorations
    assert sum(runs) == 2 and runs[EXPLORE_EVERY - 1] and runs[-1]


def test_round_and_loop_times_are_measured_between_calls():
    h = _hybrid(SCRIPT)
    ticks = iter([0.0, 0.1, 0.4,      # call 1: start, loop start, loop end (0.3 s loop)
                  2.0, 2.1, 2.2,      # call 2: round = 2.0 - 0.0 - 0.3 = 1.7; loop 0.1
                  100.0])             # call 3: an idle gap (> GAP_MAX rounds) is not a round
    h.clock = lambda: next(ticks)
    h.draft_batch(DraftBatch(_reqs("c"), 3, [3], None))
    assert h.t_loop == pytest.approx(0.3) and h.t_round is None
    h.draft_batch(DraftBatch(_reqs("c"), 3, [3], None))
    assert h.t_round == pytest.approx(1.7)
    assert h.t_loop == pytest.approx(0.3 + TIME_EMA * (0.1 - 0.3))
    h.min_score = 0.0  # a fixed threshold: no cost check; c has no suffix draft -> the head
    h.clock = lambda: 100.0
    h.draft_batch(DraftBatch(_reqs("c"), 3, [3], None))
    assert h.t_round == pytest.approx(1.7)
    h.finish_call([])
    assert h._last is None


def test_request_hooks_reach_both_drafters():
    h = _hybrid(SCRIPT)
    h.start_request("a", [1, 2])
    h.stop_request("a")
    h.forget_responses()
    assert h.model.events == [("start", "a"), ("stop", "a")]
    assert h.suffix.calls == [("start", "a", [1, 2]), ("stop", "a"), "forget"]
    assert h.features == ((1,), False)


def test_plain_propose_mixes_the_two():
    h = _hybrid(SCRIPT, min_score=1.0)
    assert h.propose(["a", "b"], 2) == [[5, 6], [7, 7]]


BASE = {"method": "eagle3", "model": "tiny-eagle3", "num_speculative_tokens": 3}


def test_config_keys_round_trip():
    c = SpeculativeConfig.from_dict(dict(BASE, enable_suffix_decoding=True, suffix_min_score=1.5,
                                         suffix_decoding_max_tree_depth=16))
    assert c.enable_suffix_decoding and c.suffix_min_score == 1.5
    assert c.suffix_decoding_max_tree_depth == 16 and c.suffix_decoding_min_token_prob == 0.1
    assert SpeculativeConfig.from_dict(c.to_dict()) == c
    assert SpeculativeConfig.from_dict(BASE).enable_suffix_decoding is None


@pytest.mark.parametrize("extra, tp, match", [
    ({"method": "ngram", "model": None, "enable_suffix_decoding": True}, 1,
     r"enable_suffix_decoding=True: pairs suffix decoding with a model head.*remove it"),
    ({"suffix_min_score": 1.0}, 1, r"suffix_min_score=1.0: applies only with enable_suffix"),
    ({"enable_suffix_decoding": True, "suffix_min_score": -1}, 1,
     r"suffix_min_score=-1.0: must be >= 0"),
    ({"enable_suffix_decoding": "yes"}, 1, r"enable_suffix_decoding='yes'"),
    ({"suffix_decoding_max_tree_depth": 8}, 1,
     r"suffix_decoding_max_tree_depth=8: applies only to method 'suffix' or with "
     r"enable_suffix_decoding"),
])
def test_bad_hybrid_keys_name_the_key_and_the_fix(extra, tp, match):
    d = {k: v for k, v in dict(BASE, **extra).items() if v is not None}
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_dict(d, tensor_parallel_size=tp)
