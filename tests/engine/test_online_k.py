"""The online K controller in the engine (`k_controller: online`, or `num_speculative_tokens:
"auto"`): greedy output equals plain decoding with K changing between steps, captured and not,
for a token drafter and a model head; warm-up measures every captured (rows, K) step; a time
taken across a compile or a fallback is not used; the K of every step is in the metrics. Its
sampling is proven lossless in test_hidden_state_lossless.py ("eagle3-online")."""

import numpy as np

import npuspec.engine
from npuspec import LLM, SamplingParams
from npuspec._counters import counters
from npuspec.engine.k_online import OnlineK
from npuspec.spec_decode.k_controller import PRIOR_C

# one prompt that repeats itself (drafts accepted) and some with little to copy
PROMPTS = ["def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return a + b\n\n\ndef add(",
           "import os\nimport sys\n", "class Queue:\n    def", "for i in range(10):"]
SP = SamplingParams(temperature=0, max_tokens=32)


def _tokens(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


def _plain():
    return _tokens(LLM("tiny", enforce_eager=True, max_model_len=256).generate(PROMPTS, SP))


def test_captured_ngram_greedy_equals_plain_with_k_changing(monkeypatch):
    monkeypatch.setattr(npuspec.engine, "DEFAULT_LOWERING", "eager")
    plain = _plain()
    llm = LLM("tiny", speculative_config={"method": "ngram", "num_speculative_tokens": "auto"},
              max_model_len=256, max_num_seqs=4)
    assert llm.k_values == (0, 1, 2, 4)
    ctl = llm.online.ctl
    # warm-up timed every captured (rows, K) step once
    want = {(size // (k + 1), k) for k in llm.k_values for size in llm.runner.plans[k]}
    assert want <= set(ctl.verify_s), want - set(ctl.verify_s)
    before = counters.snapshot()
    assert _tokens(llm.generate(PROMPTS, SP)) == plain
    assert counters.delta(before).get("eager_fallbacks", 0) == 0
    m = llm.metrics
    assert len(m.k_trace) == m.num_engine_steps == sum(m.steps_by_k.values())
    assert set(m.steps_by_k) <= set(llm.k_values)
    assert m.steps_by_k.get(0, 0) > 0 and sum(v for k, v in m.steps_by_k.items() if k) > 0
    assert m.num_accepted > 0


def test_uncaptured_model_heads_and_suffix_greedy_equal_plain():
    plain = _plain()
    for spec in ({"method": "eagle3", "model": "tiny-eagle3", "num_speculative_tokens": 4,
                  "k_controller": "online"},
                 {"method": "suffix", "num_speculative_tokens": "auto"},
                 # with the confidence budget: it cuts each request's drafts first, the
                 # controller then chooses from the lengths left
                 {"method": "dspark", "model": "tiny-dspark", "num_speculative_tokens": 7,
                  "k_controller": "online", "dynamic_spec_config": {
                      "method": "dspark", "method_params": {"min_verify_tokens": 0}}}):
        llm = LLM("tiny", speculative_config=spec, enforce_eager=True, max_model_len=256,
                  max_num_seqs=4)
        assert _tokens(llm.generate(PROMPTS, SP)) == plain, spec["method"]
        m = llm.metrics
        assert len([k for k in m.steps_by_k if k]) >= 2, (spec["method"], m.steps_by_k)
        # without capture each (rows, K) pair is measured the first time it runs
        assert llm.online.ctl.verify_s, spec["method"]


def test_fixed_k_is_unchanged_and_traced():
    llm = LLM("tiny", speculative_config={"method": "ngram", "num_speculative_tokens": 3},
              enforce_eager=True, max_model_len=256, max_num_seqs=4)
    assert llm.online is None and llm.k_values == (3,)
    llm.generate(PROMPTS, SP)
    assert set(llm.metrics.steps_by_k) == {3}
    assert {k for _, k in llm.metrics.k_trace} == {3}


class _Req:
    def __init__(self, rid):
        self.req_id = rid


def test_a_step_disturbed_by_a_fallback_or_compile_is_not_timed():
    online = OnlineK((0, 1, 2), lambda b, k: b, cheap_drafter=True)
    batch = [_Req("a"), _Req("b")]

    def drafting(bump):
        def fn(reqs, k):
            if bump:
                counters.bump(bump)
            return np.full((len(reqs), k), 7, dtype=np.int64), None
        return fn
    drafts, _, k = online.draft(batch, drafting(None))
    assert k == 2 and drafts.shape == (2, 2)  # nothing measured yet: the largest K first
    res = np.array([[7, 7, 1, 3], [7, 1, -1, 2]])
    online.verified(2, k, res, 0.5, 0.01)
    assert online.ctl.verify_s == {(2, 2): 0.5} and online.ctl.book_s
    assert online.ctl.draft_s  # the drafter's time was kept (recorded with the step's)
    # acceptance learnt: request a took both drafts, b one
    s = online.ctl.slots(["a", "b"])
    assert online.ctl.c[s[0], 1] > online.ctl.c[s[1], 1]
    for bump in ("graphs_captured", "eager_fallbacks", "cache_misses"):
        # across the drafting: the drafter's time is dropped
        online.ctl.costs.draft_s[:] = np.nan
        drafts, _, k = online.draft(batch, drafting(bump))
        # across the verify step: its time is dropped
        counters.bump(bump)
        old = dict(online.ctl.verify_s)
        online.verified(2, k, np.array([[7] * (k + 1) + [1]] * 2), 9.0, 0.01)
        assert online.ctl.verify_s == old, bump
        assert not online.ctl.draft_s, bump


def test_ranks_fed_rank_0s_times_choose_the_same_k():
    """Tensor parallelism: each rank's controller sees the same drafts and results but times
    its own steps. Fed rank 0's times (`agree_with`), a rank that measured the opposite costs
    makes rank 0's choices, step for step; without it, it parts ways."""
    rng = np.random.default_rng(0)
    ks = (0, 1, 2, 4)

    def run(shared: bool):
        r0 = OnlineK(ks, lambda b, k: b, cheap_drafter=False)
        r1 = OnlineK(ks, lambda b, k: b, cheap_drafter=False)
        sent = {}
        if shared:  # what TP.broadcast_floats / broadcast_object do between processes
            r0.agree_with(lambda xs: sent.setdefault("x", list(xs)),
                          lambda o: sent.setdefault("o", o))
            r1.agree_with(lambda xs: sent.pop("x"), lambda o: sent.pop("o"))
        r0.seed_times({(2, k): 0.1 + 0.1 * k for k in ks})      # K cheap on rank 0 ...
        r1.seed_times({(2, k): 1.0 - 0.2 * k for k in ks})      # ... dear on rank 1
        sent.pop("o", None)
        batch = [_Req("a"), _Req("b")]
        same = []
        for _ in range(40):
            L = rng.integers(0, 5, 2)
            ks_step = []
            for rank, t_run in ((r0, 0.1), (r1, 0.9)):
                def fn(reqs, k):
                    return np.where(np.arange(k)[None, :] < L[:, None], 7, -1), None
                drafts, _, k = rank.draft(batch, fn)
                res = np.full((2, k + 2), 7)
                res[:, k + 1] = 1 + np.minimum(L, k) // 2
                rank.verified(2, k, res, t_run * (1 + k), 0.001)
                ks_step.append(k)
            sent.clear()
            same.append(ks_step[0] == ks_step[1])
        return same

    assert all(run(shared=True))
    assert not all(run(shared=False))


class _Out:
    def __init__(self, rid):
        self.req_id, self.output = rid, []


def test_a_probe_observes_what_a_k_max_step_would_have_accepted():
    """A probe step keeps its K_max drafts; K_max steps later the leading drafts the target
    went on to emit are observed, as a K_max step accepting that many would have been. The
    probe step's own (cut) result is not observed."""
    ks = (0, 1, 2, 4)
    online = OnlineK(ks, lambda b, k: b, cheap_drafter=True, probes=True)
    twin = OnlineK(ks, lambda b, k: b, cheap_drafter=True)   # fed the same by hand
    for o in (online, twin):
        o.seed_times({(3, k): 1.0 + 10.0 * k for k in ks})   # K = 0 best: drafts are cut
    batch = [_Out("a"), _Out("b"), _Out("c")]
    drafts = np.array([[5, 6, 7, 8], [5, 6, -1, -1], [1, 2, 3, 4]])
    # what the target emits after the probe, step by step: a matches 3 drafts, b both of its
    # 2, c none; c then stops (its 4th token is never known)
    emitted = [[5, 5, 9], [6, 6, 9], [7, 1, 9], [0, 1]]
    online.ctl.since_explore = online.ctl.explore_every - 1  # the next step probes
    online.ctl.last_k = 0
    s = online.ctl.slots(["a", "b", "c"])
    c0 = online.ctl.c[s].copy()
    d, _, k = online.draft(batch, lambda reqs, k: (drafts[:, :k], None))
    assert d.shape[1] == k == 0 and len(online._probes) == 1
    for i, toks in enumerate(emitted):
        for r, t in zip(batch, toks + [None] * (3 - len(toks))):
            if t is not None:
                r.output.append(t)
        online.verified(3, 0, np.ones((3, 2), dtype=np.int64), 1.0, 0.0)
        if i < 3:  # K_max = 4 steps pass before the comparison
            assert len(online._probes) == 1 and np.array_equal(online.ctl.c[s], c0)
        if i + 1 < len(emitted):  # the next steps are not probes
            online.draft(batch, lambda reqs, k: (drafts[:, :k], None))
    assert not online._probes
    t = twin.ctl.slots(["a", "b", "c"])
    # positions known: a 4 (3 matched), b 2 (both), c 3 of 4 drafted (it stopped), none matched
    twin.ctl.observe(t, 4, np.array([4, 2, 3]), 4, np.array([3, 2, 0]))
    assert not np.array_equal(twin.ctl.c[t], c0)
    np.testing.assert_allclose(online.ctl.c[s], twin.ctl.c[t])


def test_a_probe_of_a_request_retired_meanwhile_observes_nothing_for_it():
    ks = (0, 1, 2)
    online = OnlineK(ks, lambda b, k: b, cheap_drafter=True, probes=True)
    online.seed_times({(2, k): 1.0 + 10.0 * k for k in ks})
    batch = [_Out("a"), _Out("b")]
    online.ctl.since_explore = online.ctl.explore_every - 1
    online.ctl.last_k = 0
    online.draft(batch, lambda reqs, k: (np.full((2, k), 3), None))
    online.forget("b")                        # the engine's call on retiring b
    newcomer = online.ctl.slots(["z"])[0]     # takes b's row
    before = online.ctl.c[newcomer].copy()
    for _ in range(2):
        batch[0].output.append(3)
        batch[1].output.append(3)
        online.verified(2, 0, np.ones((2, 2), dtype=np.int64), 1.0, 0.0)
    assert not online._probes
    np.testing.assert_array_equal(online.ctl.c[newcomer], before)
    assert online.ctl.c[online.ctl.slot["a"], 1] > PRIOR_C   # a's two matches were seen


def test_probes_only_where_acceptance_is_emitting_the_draft():
    """Token drafters verified token by token probe; block verify (which accepts more than
    the target emits) and model drafters explore at K_max."""
    def ctl(spec, **kw):
        return LLM("tiny", speculative_config=dict(spec, k_controller="online"),
                   enforce_eager=True, max_model_len=128, max_num_seqs=2, **kw).online.ctl
    ngram = {"method": "ngram", "num_speculative_tokens": 2}
    assert ctl(ngram).probes and ctl({**ngram, "method": "suffix"}).probes
    assert not ctl(ngram, additional_config={
        "rejection_sampler_config": {"enable_block_verify": True}}).probes
    assert not ctl({"method": "draft_model", "model": "tiny", "num_speculative_tokens": 2}).probes


def test_the_same_batch_reuses_its_slots_until_a_request_is_forgotten():
    """OnlineK.draft skips the req_id lookup when the batch is the same requests as last step;
    a retired request (forget) or a changed batch looks the slots up again."""
    online = OnlineK((0, 1, 2), lambda b, k: b, cheap_drafter=True)
    a, b, c = _Req("a"), _Req("b"), _Req("c")
    fn = lambda reqs, k: (np.full((len(reqs), k), 7, dtype=np.int64), None)  # noqa: E731
    lookups = []
    slots_of = online.ctl.slots
    online.ctl.slots = lambda ids: lookups.append(list(ids)) or slots_of(ids)
    online.draft([a, b], fn)
    first = online._slots
    online.draft([a, b], fn)                  # a new list of the same requests
    assert lookups == [["a", "b"]] and online._slots is first
    online.draft([a, c], fn)                  # another batch
    assert lookups[-1] == ["a", "c"]
    online.forget("c")                        # c's row is free for a newcomer now
    online.draft([a, c], fn)
    assert lookups[-1] == ["a", "c"] and len(lookups) == 3
    assert online.ctl.slot["c"] == online._slots[1]   # c took a row again
