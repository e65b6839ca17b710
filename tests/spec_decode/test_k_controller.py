"""The online K controller (npuspec/spec_decode/k_controller.py) against synthetic step costs
and acceptances whose optimum is computed by hand or by brute force."""
import numpy as np
import pytest

from npuspec.config import SpeculativeConfig
from npuspec.spec_decode import k_controller as kc

KS = (0, 1, 2, 4)


def rows_exact(b, k):
    return b


def cost_fn(fixed, per_token):
    """A step's seconds: a fixed part plus a part per verified token (rows * (K+1))."""
    return lambda rows, k: fixed + per_token * rows * (k + 1)


def make(ks=KS, cost=cost_fn(1.0, 0.0), batches=(1,), explore_every=10**9):
    ctl = kc.KController(ks, rows_exact, explore_every=explore_every)
    for b in batches:
        for k in ks:
            ctl.record_verify(b, k, cost(b, k))
    return ctl


def teach(ctl, slots, c, p=1.0, steps=200, seed=0):
    """Feed K_max steps whose drafts exist with prob p at each position and whose i-th draft is
    accepted with prob c given the first i-1 were."""
    rng = np.random.default_rng(seed)
    k = ctl.k_max
    for _ in range(steps):
        L = np.array([k if rng.random() < p else 0 for _ in slots])
        A = np.array([next((i for i in range(l) if rng.random() >= c), l) for l in L])
        ctl.observe(slots, k, L, k, A)


def brute_best(ks, c, p, cost, b):
    """argmax over K of b * (1 + sum_{i<=K} p c^i) / cost(b, K)."""
    rate = [b * (1 + sum(p * c ** i for i in range(1, k + 1))) / cost(b, k) for k in ks]
    return ks[int(np.argmax(rate))]


@pytest.mark.parametrize("c,fixed,per_token,b", [
    (0.9, 1.0, 0.0, 1),     # verify cost flat in K: speculate as far as possible
    (0.9, 0.0, 1.0, 8),     # cost proportional to tokens: every draft must pay for itself
    (0.0, 1.0, 0.01, 4),    # nothing is ever accepted: K = 0
    (0.7, 1.0, 0.05, 16),   # somewhere in between
    (0.5, 1.0, 0.2, 2),
])
def test_the_chosen_k_maximises_expected_tokens_per_second(c, fixed, per_token, b):
    cost = cost_fn(fixed, per_token)
    ctl = make(cost=cost, batches=(b,))
    slots = ctl.slots([f"r{i}" for i in range(b)])
    teach(ctl, slots, c, steps=400)
    # the learnt estimate is close to the truth ...
    est = ctl.c[slots].mean(0)
    if c > 0:
        np.testing.assert_allclose(est[0], c, atol=0.1)
    # ... and the choice is the brute-force optimum under it
    want = brute_best(list(KS), c, 1.0, cost, b)
    got = ctl.choose_before(slots)
    assert (got.k, got.k_draft, got.explore) == (want, want, False), (got, want, est)


def test_known_optima_by_hand():
    # cost flat, c = 0.9: K = 4 gives 1 + .9 + .81 + .729 + .656 = 4.10 tokens per unit
    ctl = make()
    s = ctl.slots(["a"])
    teach(ctl, s, 0.9)
    assert ctl.choose_before(s).k == 4
    # cost 1 + K: K = 1 gives 1.9 / 2 = .95 < K = 0's 1.0, and so on: K = 0
    ctl = make(cost=lambda r, k: 1.0 + k)
    s = ctl.slots(["a"])
    teach(ctl, s, 0.9)
    assert ctl.choose_before(s).k == 0


def test_load_changes_the_choice():
    """One request: K = 4 pays. 64 requests on a compute-bound cost: K = 0."""
    cost = lambda rows, k: 0.01 + 0.001 * rows * (k + 1)  # noqa: E731
    ctl = make(cost=cost, batches=(1, 64))
    s1 = ctl.slots(["r0"])
    teach(ctl, s1, 0.8)
    assert ctl.choose_before(s1).k == 4
    s64 = ctl.slots([f"r{i}" for i in range(64)])
    teach(ctl, s64, 0.8)
    assert ctl.choose_before(s64).k == 0


def test_prefill_waiting_for_budget_is_charged_to_each_draft_position():
    """16 requests, c = 0.5 per position, cost 1 + 0.01 per verified token: K = 0 gives
    16 / 1.16 = 13.8 tokens per unit, K = 1 24 / 1.32 = 18.2, K = 2 28 / 1.48 = 18.9, K = 4
    31 / 1.80 = 17.2. While prompts wait for the budget each verify token of K pushes a
    prefill token (0.05 here) to a later step: K = 1 then costs 1.32 + 16 * 0.05 = 2.12
    (11.3), K = 2 3.08 (9.1), K = 4 5.00 (6.2), so K = 0 is best; once the prompts are in,
    K = 2 again. Without a measured prefill rate nothing is charged."""
    ctl = make(cost=cost_fn(1.0, 0.01), batches=(16,))
    s = ctl.slots([f"r{i}" for i in range(16)])
    teach(ctl, s, 0.5, steps=400)
    assert ctl.choose_before(s).k == 2
    ctl.prefill_pending = True
    assert ctl.choose_before(s).k == 2          # no prefill rate measured yet
    ctl.record_prefill(0.05)
    assert ctl.choose_before(s).k == 0
    assert ctl.choose_after(kc.Choice(4, 4), s, np.full(16, 4)) == 0
    ctl.prefill_pending = False
    assert ctl.choose_before(s).k == 2
    ctl.record_prefill(0.15)                    # a running average
    assert ctl.prefill_tok_s == pytest.approx(0.05 + kc.ALPHA_TIME * 0.10)


def test_without_drafts_the_draft_is_not_verified():
    """ngram with nothing to copy: drafting at K_max found no drafts, so the step runs K = 0;
    with two drafts per request, K = 2 (the tokens past them cost and cannot be accepted)."""
    ctl = make(cost=cost_fn(1.0, 0.01), batches=(3,))
    s = ctl.slots(["a", "b", "c"])
    teach(ctl, s, 0.9)
    ch = kc.Choice(k_draft=4, k=4)
    assert ctl.choose_after(ch, s, np.array([0, 0, 0])) == 0
    assert ctl.choose_after(ch, s, np.array([2, 2, 1])) == 2
    assert ctl.choose_after(ch, s, np.array([4, 0, 0])) == 4
    # never more than was drafted
    assert ctl.choose_after(kc.Choice(k_draft=1, k=1), s, np.array([1, 1, 1])) <= 1


def test_exploration_runs_k_max_every_n_steps_and_is_not_cut():
    ctl = make(cost=lambda r, k: 1.0 + k, explore_every=5)
    s = ctl.slots(["a"])
    teach(ctl, s, 0.9)
    picks = [ctl.choose_before(s) for _ in range(10)]
    assert [p.explore for p in picks] == [False] * 4 + [True] + [False] * 4 + [True]
    assert all(p.k == 4 for p in picks if p.explore)
    assert all(p.k == 0 for p in picks if not p.explore)
    assert ctl.choose_after(picks[4], s, np.array([4])) == 4
    assert ctl.choose_after(picks[4], s, np.array([3])) == 4   # K = 2 would cut a draft
    assert ctl.choose_after(picks[4], s, np.array([0])) == 0   # nothing to verify


def test_an_unmeasured_step_is_tried_first():
    ctl = kc.KController(KS, rows_exact)
    s = ctl.slots(["a"])
    assert ctl.choose_before(s).k == 4          # nothing measured: the largest K first
    for k in (4, 2):
        ctl.record_verify(1, k, 1.0)
    assert ctl.choose_before(s).k == 1          # then the largest unmeasured one
    ctl.record_verify(1, 1, 1.0)
    ctl.record_verify(1, 0, 1.0)
    assert ctl.choose_before(s).k == 4          # all measured, flat cost, prior c = 0.6


def run_cheap(ctl, s, L, A, steps):
    """Steps of a token drafter: choose, draft L (or nothing when skipped), verify, observe."""
    picks = []
    for _ in range(steps):
        ch = ctl.choose_before_cheap(len(s))
        lengths = np.full(len(s), L if ch.k_draft else 0)
        k = ctl.choose_after(ch, s, lengths)
        ctl.observe(s, ch.k_draft, lengths, k, np.minimum(lengths, A))
        picks.append((ch.k_draft, k, ch.explore))
    return picks


def test_a_token_drafter_stops_drafting_when_it_does_not_pay_and_keeps_checking():
    # a drafter costing 1 s per request per step, verify 1 s whatever K: drafts of 4 with
    # none accepted never pay for the drafting
    ctl = make(explore_every=8)
    ctl.record_draft(4, 1, 1.0)
    s = ctl.slots(["a"])
    picks = run_cheap(ctl, s, L=4, A=0, steps=40)
    assert ctl.draft_value < 1
    late = picks[20:]
    assert [p for p in late if p[0]] and all(p[2] for p in late if p[0])  # only explorations
    assert sum(1 for p in late if p[0]) in (len(late) // 8, len(late) // 8 + 1)
    # the same drafter whose drafts are all accepted: drafting pays, every step drafts
    ctl = make(explore_every=8)
    ctl.record_draft(4, 1, 1.0)
    s = ctl.slots(["a"])
    picks = run_cheap(ctl, s, L=4, A=4, steps=40)
    assert ctl.draft_value > 1 and all(p[:2] == (4, 4) for p in picks[5:])


def test_a_drafter_that_costs_next_to_nothing_keeps_drafting_through_dry_spells():
    """No drafts for 40 steps, drafting at 10 µs against a 1 s step: skipping would save
    nothing measurable and miss the next drafts, so every step drafts."""
    ctl = make(explore_every=8)
    ctl.record_draft(4, 1, 1e-5)
    s = ctl.slots(["a"])
    picks = run_cheap(ctl, s, L=0, A=0, steps=40)
    assert kc.DRAFT_SKIP_BELOW < ctl.draft_value < 1
    assert all(p[0] == 4 for p in picks)


def test_the_value_of_drafting_is_kept_per_batch_size():
    """A load change: drafting pays at one request (every draft accepted, verify flat in K)
    and not at 32 (verify cost per token, none accepted). After the 32 leave, the lone request
    drafts again at once: the value learnt at 32 does not hold it back."""
    ctl = make(cost=lambda rows, k: 1.0 + (rows > 1) * rows * (k + 1), batches=(1, 32))
    ctl.record_draft(4, 1, 0.05)
    one = ctl.slots(["a"])
    assert all(p[:2] == (4, 4) for p in run_cheap(ctl, one, L=4, A=4, steps=20))
    many = ctl.slots(["a"] + [f"b{i}" for i in range(31)])
    picks = run_cheap(ctl, many, L=4, A=0, steps=40)
    assert ctl.draft_value < kc.DRAFT_SKIP_BELOW and picks[-1][0] == 0   # skipping at 32
    one = ctl.slots(["a"])
    assert all(p[:2] == (4, 4) for p in run_cheap(ctl, one, L=4, A=4, steps=5))
    assert ctl.draft_values[kc._bucket(1)] > 1 > ctl.draft_values[kc._bucket(32)]
    assert [kc._bucket(b) for b in (1, 2, 3, 4, 7, 8, 64)] == [1, 2, 2, 3, 3, 4, 7]


def test_host_time_is_kept_per_graph_not_per_request():
    """The host's time around a step is mostly fixed per step: measured at one request it must
    not be charged 64 times at 64 requests. A (rows, K) pair whose host time is unmeasured
    takes its K's figure per request."""
    ctl = make(batches=(1, 64))
    ctl.record_book(1, 0, 1, 0.5)      # 0.5 s at one request ...
    ctl.record_book(64, 0, 64, 0.5)    # ... and at 64: fixed
    assert ctl.costs.cost(64, 1, draft=False) == [1.0 + 0.5]
    assert ctl.costs.cost(1, 1, draft=False) == [1.0 + 0.5]
    ctl.record_book(1, 1, 1, 0.25)     # K = 1 measured at one request only
    assert ctl.costs.cost(64, 2, draft=False)[1] == 1.0 + 64 * 0.25


def test_drafter_time_is_kept_per_batch_size():
    """A drafter's time is mostly fixed per step (a Python loop's set-up, one call): measured
    at one request it must not be charged 16 times at 16 requests once 16's own figure is in.
    A size not measured takes its K's latest figure."""
    ctl = make(batches=(1, 16))
    c, ki = ctl.costs, ctl.costs.ki[4]
    ctl.record_draft(4, 1, 0.5)                 # 0.5 s at one request
    assert c.draft_per_request(ki, 16) == 0.5   # nothing at 16 yet: the latest, one request's
    ctl.record_draft(4, 16, 0.5)                # ... and 0.5 s at 16: fixed
    assert c.draft_per_request(ki, 16) == 0.5 / 16 and c.draft_per_request(ki, 1) == 0.5
    assert c.draft_per_request(ki, 64) == c.draft_per_request(ki, 4) == 0.5 / 16  # latest
    assert c.draft_per_request(c.ki[2], 16) == 0.0   # K = 2 never measured
    assert ctl.draft_s == {(kc._bucket(1), 4): 0.5, (kc._bucket(16), 4): 0.5 / 16}
    assert c.cost(16, len(KS), draft=True)[-1] == 1.0 + 16 * (0.5 / 16)
    # the choice: half the drafts accepted pay for a 0.5 s drafter at 16 requests (48 tokens
    # in 1.5 s against 16 in 1 s); one figure per request (6.5 s) had skipped drafting
    picks = run_cheap(ctl, ctl.slots([f"r{i}" for i in range(16)]), L=4, A=2, steps=20)
    assert ctl.draft_value > 1 and all(p[0] == 4 for p in picks)


def test_draft_cost_counts_before_drafting():
    """A drafter costing 1 s per request per step at K = 4 (and nothing at K = 2) moves the
    choice from 4 to 2 under a flat verify cost."""
    ctl = make()
    s = ctl.slots(["a"])
    teach(ctl, s, 0.5)
    assert ctl.choose_before(s).k == 4
    ctl.record_draft(4, 1, 1.0)
    ctl.record_draft(2, 1, 0.0)
    assert ctl.choose_before(s).k == 2


def test_new_requests_start_from_the_pool_and_slots_are_reused():
    ctl = make()
    a = ctl.slots(["a"])
    teach(ctl, a, 0.0, steps=300)
    b = ctl.slots(["b"])
    assert ctl.c[b[0], 0] < 0.2                      # learnt from a through the pool
    ctl.forget("a")
    assert ctl.slots(["c"])[0] == a[0]                # a's row, reinitialised from the pool
    np.testing.assert_allclose(ctl.c[a[0]], ctl.pool_c)
    many = ctl.slots([f"x{i}" for i in range(100)])   # grows past the first allocation
    assert len(set(many.tolist())) == 100 and a[0] not in many and b[0] not in many


def test_observe_learns_availability_and_acceptance_separately():
    ctl = make()
    s = ctl.slots(["a"])
    teach(ctl, s, 1.0, p=0.5, steps=400)
    np.testing.assert_allclose(ctl.p[s[0]], 0.5, atol=0.25)  # a running average of coin flips
    np.testing.assert_allclose(ctl.c[s[0]], 1.0, atol=1e-6)  # c learns only where drafted


def test_undisturbed_names_compiles_captures_and_fallbacks():
    """A timed region across which `counters.disturbed` moved is dropped: replays do not move
    it; compiles, captures, cache loads and eager fallbacks do."""
    from npuspec._counters import Counters
    c = Counters()
    c.bump("graph_replays", 8)
    assert c.disturbed == 0
    for key in ("graphs_captured", "eager_fallbacks", "cache_misses", "cache_hits"):
        before = c.disturbed
        c.bump(key)
        assert c.disturbed == before + 1, key


def test_host_time_is_small_at_batch_64():
    """Functional check only (the figure is `npuspec bench dynk`'s): one step's three
    calls at batch 64 run and return a K from the captured set."""
    ctl = make(batches=(64,))
    s = ctl.slots([f"r{i}" for i in range(64)])
    ch = ctl.choose_before(s)
    k = ctl.choose_after(ch, s, np.full(64, 4))
    ctl.observe(s, ch.k_draft, np.full(64, 4), k, np.full(64, k // 2))
    assert k in KS


def test_candidate_ks():
    assert kc.candidate_ks(1) == (0, 1)
    assert kc.candidate_ks(4) == (0, 1, 2, 4)
    assert kc.candidate_ks(7) == (0, 1, 2, 4, 7)


def test_config_auto_and_errors():
    auto = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": "auto"})
    assert auto.online_k and auto.num_speculative_tokens == 4 and auto.k_values() == KS
    assert SpeculativeConfig.from_dict(auto.to_dict()) == auto
    on = SpeculativeConfig.from_dict({"method": "suffix", "num_speculative_tokens": 8,
                                      "k_controller": "online"})
    assert on.k_values() == (0, 1, 2, 4, 8)
    # a tuned table is the online controller's prior: its K are captured as well
    prior = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4,
                                         "k_controller": "online",
                                         "num_speculative_tokens_per_batch_size": [[1, 8, 3]]})
    assert prior.online_k and prior.k_values() == (0, 1, 2, 3, 4)
    # tensor parallelism: the ranks are fed rank 0's times (tests/engine/test_tp.py)
    assert SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": "auto"},
                                       tensor_parallel_size=2).online_k
    bad = [({"k_controller": "sometimes"}, "k_controller"),
           ({"num_speculative_tokens": "auto", "k_controller": "fixed"}, "k_controller"),
           ({"num_speculative_tokens": "auto", "rejection_sample_method": "synthetic",
             "synthetic_acceptance_length": 2.0}, "synthetic_acceptance_length"),
           ({"k_controller": "online", "rejection_sample_method": "synthetic",
             "synthetic_acceptance_rates": [0.5]}, "synthetic_acceptance_rates")]
    for extra, key in bad:
        d = {"method": "ngram", "num_speculative_tokens": 4, **extra}
        with pytest.raises(ValueError, match=key):
            SpeculativeConfig.from_dict(d)


def test_online_is_the_default_where_k_can_vary(monkeypatch):
    """Unset (the suite pins NPUSPEC_K_CONTROLLER=fixed in tests/conftest.py), an integer K is
    the online controller's upper bound; "fixed" keeps vLLM's meaning; to_dict() says which,
    so another process (a TP rank, another environment) reads the same config back."""
    ngram = {"method": "ngram", "num_speculative_tokens": 4}
    monkeypatch.delenv("NPUSPEC_K_CONTROLLER", raising=False)
    cfg = SpeculativeConfig.from_dict(ngram)
    assert cfg.online_k and cfg.k_values() == KS
    assert cfg.to_dict()["k_controller"] == "online"
    # where K cannot vary the default is fixed; asking for online there is refused
    synth = dict(ngram, rejection_sample_method="synthetic", synthetic_acceptance_length=2.0)
    assert not SpeculativeConfig.from_dict(synth).online_k
    ehs = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
           "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [2, 18]}}}
    assert not SpeculativeConfig.from_dict(ehs).online_k
    with pytest.raises(ValueError, match="k_controller"):
        SpeculativeConfig.from_dict(dict(ehs, k_controller="online"))
    monkeypatch.setenv("NPUSPEC_K_CONTROLLER", "fixed")
    fixed = SpeculativeConfig.from_dict(ngram)
    assert not fixed.online_k and fixed.k_values() == (4,)
    assert fixed.to_dict()["k_controller"] == "fixed"
    monkeypatch.delenv("NPUSPEC_K_CONTROLLER")
    assert SpeculativeConfig.from_dict(fixed.to_dict()) == fixed  # explicit beats the default
    monkeypatch.setenv("NPUSPEC_K_CONTROLLER", "sometimes")
    with pytest.raises(ValueError, match="NPUSPEC_K_CONTROLLER='sometimes'.*'online'.*'fixed'"):
        SpeculativeConfig.from_dict(ngram)


def test_a_prior_table_is_followed_for_the_first_steps_then_the_controller_takes_over():
    """With a tuned table as prior: its K per batch size for PRIOR_STEPS steps (never more than
    the drafts need), then the choice from costs and acceptance."""
    ctl = kc.KController(KS, rows_exact, explore_every=10**9, prior=lambda b: 1 if b < 4 else 0)
    for k in KS:
        ctl.record_verify(2, k, 1.0)  # K is free: with drafts accepted, K_max wins
    slots = ctl.slots(["a", "b"])
    full = np.array([4, 4])
    seen = []
    for _ in range(kc.PRIOR_STEPS):
        ch = ctl.choose_before(slots)
        k = ctl.choose_after(ch, slots, full)
        seen.append(k)
        ctl.observe(slots, ch.k_draft, np.minimum(full, ch.k_draft), k, np.array([k, k]))
    assert seen == [1] * kc.PRIOR_STEPS
    teach(ctl, slots, c=0.95)
    ch = ctl.choose_before(slots)
    assert ctl.choose_after(ch, slots, full) == 4
    # during the prior, a draft shorter than the table's K is verified at the K that holds it
    early = kc.KController(KS, rows_exact, prior=lambda b: 4)
    s = early.slots(["x"])
    assert early.choose_after(kc.Choice(4, 4), s, np.array([2])) == 2


def test_one_stalled_step_does_not_move_a_step_time():
    ctl = make()
    for _ in range(3):
        ctl.record_verify(1, 4, 1.0)
    ctl.record_verify(1, 4, 6.0)         # a collection or another process in one step
    assert ctl.step_time(1, 4) == 1.0
    for _ in range(3):                   # a lasting change moves it once most figures agree
        ctl.record_verify(1, 4, 2.0)
    assert ctl.step_time(1, 4) == 2.0


def test_a_k_the_choice_stopped_running_is_measured_again():
    """K = 4's figure is inflated (three times its cost) while the truth is flat: the choice
    avoids K = 4 and so never measures it, until REFRESH_EVERY steps later one step runs
    K = 4 with its old figures dropped; its true cost makes K = 4 the choice from then on."""
    ctl = make(explore_every=10**9)
    for _ in range(kc.VERIFY_WINDOW):
        ctl.record_verify(1, 4, 3.0)
    s = ctl.slots(["a"])
    picks = []
    for _ in range(kc.REFRESH_EVERY + 20):
        ch = ctl.choose_before_cheap(1)
        L = np.full(1, 4)
        k = ctl.choose_after(ch, s, L)
        ctl.observe(s, ch.k_draft, L, k, np.minimum(L, k))       # every draft accepted
        ctl.record_verify(1, k, 1.0)                              # every K costs 1 s
        picks.append(k)
    first = picks.index(4)
    assert set(picks[:first]) == {2} and kc.REFRESH_EVERY - 2 <= first <= kc.REFRESH_EVERY + 2
    # K = 1, not run since the start either, gets its one step right after
    assert picks[first:] == [4, 1] + [4] * (len(picks) - first - 2), picks[first:]
    assert ctl.step_time(1, 4) == 1.0
