"""vLLM's rejection-sampler tests, restated for `npuspec.kernels.rejection_sample`.

Source: vllm-project/vllm, tests/v1/sample/test_rejection_sampler.py. Ported cases:
  greedy: test_perfect_match, test_early_mismatch, test_multiple_sequences,
    test_single_token_sequence, test_empty_sequence, test_multiple_mismatches,
    test_parametrized_cases (and the ragged batch with an empty request of
    test_frequency_penalties, without the penalty);
  random: test_deterministic_when_seeded,
    test_rejection_sampling_approximates_target_distribution, test_top_k, test_top_p,
    test_sample_recovered_tokens, test_sample_recovered_tokens_vocab_boundary,
    test_placeholder_draft_token_rejected_random;
  synthetic: test_synthetic_all_accepted, test_synthetic_all_rejected;
  the inputs of the FLy tests (test_fly_greedy_rescues_mismatch_after_native_acceptance_window,
    test_fly_target_only_sampling_uses_mapped_target_ids,
    test_fly_probabilistic_draft_sampling_uses_probability_ratio,
    test_fly_mixed_greedy_and_random_batch) under standard verification.
Not ported: the logits-processor cases (penalties, bad words, allowed ids), FLy verification
itself and the fp64 race option, which have no counterpart in the op (docs/verify.md,
"Differences from vLLM's / HF's tests").

Layout mapping. vLLM flattens a batch's drafts (ragged, `cu_num_draft_tokens`), scores only the
draft positions and takes the bonus token from a separate (mocked) sampler. npuspec takes
-1-padded drafts [B, K] and logits [B, K+1, V] whose last row (or the row of a request's first
-1) gives the bonus token, so `padded` and `argmax_logits` below build that layout from vLLM's
per-request lists; vLLM's PLACEHOLDER_TOKEN_ID is -1 here too.
"""
import pytest
import torch

from npuspec.kernels import rejection_sample, rejection_sample_reference

FLT_MIN = 1.1754943508222875e-38


def padded(spec_tokens: list[list[int]]) -> torch.Tensor:
    """Ragged per-request drafts -> int64 [B, K] with -1 after each request's drafts."""
    K = max((len(s) for s in spec_tokens), default=0)
    return torch.tensor([s + [-1] * (K - len(s)) for s in spec_tokens], dtype=torch.int64
                        ).reshape(len(spec_tokens), K)


def argmax_logits(target_tokens: list[list[int]], K: int, V: int = 100,
                  base: float = -100.0, peak: float = 100.0) -> torch.Tensor:
    """[B, K+1, V] logits whose row j of request b peaks at target_tokens[b][j] (the target's
    choice at each draft position, then the bonus); rows past a request's list stay flat."""
    logits = torch.full((len(target_tokens), K + 1, V), base)
    for b, toks in enumerate(target_tokens):
        for j, t in enumerate(toks):
            logits[b, j, t] = peak
    return logits


def expected(rows: list[list[int]], K: int) -> torch.Tensor:
    return torch.tensor([r + [-1] * (K + 1 - len(r)) for r in rows], dtype=torch.int32)


def run(impl: str, *args, **kw):
    if impl == "op":
        return rejection_sample(*args, **kw)
    kw.pop("generators", None)
    return rejection_sample_reference(*args, **kw)


IMPLS = ["op", "reference"]

# (vLLM test, drafts per request, target argmax per position incl. bonus, expected output)
GREEDY_CASES = {
    "perfect_match": ([[1, 2, 3]], [[1, 2, 3, 4]], [[1, 2, 3, 4]]),
    "early_mismatch": ([[1, 2, 3]], [[1, 5, 3, 4]], [[1, 5]]),
    "multiple_sequences": ([[1, 2], [3]], [[1, 2, 5], [3, 4]], [[1, 2, 5], [3, 4]]),
    "single_token_sequence": ([[1]], [[1, 2]], [[1, 2]]),
    "empty_sequence": ([[]], [[5]], [[5]]),
    "multiple_mismatches": ([[1, 2, 3], [4, 5, 6]], [[1, 2, 7, 6], [4, 8, 6, 9]],
                            [[1, 2, 7], [4, 8]]),
    "param_perfect_with_bonus": ([[1, 2]], [[1, 2, 3]], [[1, 2, 3]]),
    "param_first_mismatch": ([[1]], [[2, 3]], [[2]]),
    "param_mixed": ([[1, 2], [3, 4]], [[1, 5, 6], [3, 4, 7]], [[1, 5], [3, 4, 7]]),
    # the request layout of vLLM's test_frequency_penalties: one request without drafts
    "ragged_with_empty_request": ([[1, 1, 1], [], [1, 1, 1]], [[1, 1, 1, 1], [7], [1, 1, 15, 1]],
                                  [[1, 1, 1, 1], [7], [1, 1, 15]]),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", sorted(GREEDY_CASES))
def test_greedy_cases(case, impl):
    spec, target, want = GREEDY_CASES[case]
    drafts = padded(spec)
    K = drafts.shape[1]
    tokens, num = run(impl, argmax_logits(target, K), drafts)
    assert torch.equal(tokens, expected(want, K)), tokens
    assert num.tolist() == [len(r) for r in want]
    assert tokens.dtype == num.dtype == torch.int32


@pytest.mark.parametrize("impl", IMPLS)
def test_greedy_minus_one_ends_the_drafts_even_if_later_ones_match(impl):
    # placeholder handling on the greedy path: the first -1 is "no draft", the target's token is
    # emitted there, and a matching draft after it is never looked at
    drafts = torch.tensor([[1, -1, 3], [-1, 2, 3]])
    logits = argmax_logits([[1, 2, 3, 4], [1, 2, 3, 4]], 3)
    tokens, num = run(impl, logits, drafts)
    assert torch.equal(tokens, expected([[1, 2], [1]], 3))
    assert num.tolist() == [2, 1]


# ------------------------------------------------------------------------------- random ------

def _valid(tokens, num, K, V):
    """Structure every output must have: num in [1, K+1], tokens in [0, V) then -1."""
    assert bool(((num >= 1) & (num <= K + 1)).all())
    pos = torch.arange(K + 1)[None, :]
    live = pos < num[:, None].long()
    assert bool(((tokens >= 0) & (tokens < V))[live].all())
    assert bool((tokens[~live] == -1).all())


@pytest.mark.parametrize("frac_seeded", [0.5, 1.0])
@pytest.mark.parametrize("batch_size", [1, 4, 8])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_deterministic_when_seeded(k, batch_size, frac_seeded):
    V, reps = 1000, 5  # vLLM repeats 20 times
    g = torch.Generator().manual_seed(1000 * k + batch_size)
    logits = torch.rand(batch_size, k + 1, V, generator=g)
    drafts = torch.randint(0, V, (batch_size, k), generator=g)
    seeded = [i for i in range(batch_size) if (i + 1) / batch_size <= frac_seeded] or [0]
    temp = torch.ones(batch_size)
    results = []
    for _ in range(reps):
        gens = {i: torch.Generator().manual_seed(i) for i in seeded}
        tokens, num = rejection_sample(logits, drafts, temperature=temp, generators=gens)
        _valid(tokens, num, k, V)
        results.append(tokens)
    for i in seeded:
        for r in results[1:]:
            assert torch.equal(r[i], results[0][i]), (i, r[i], results[0][i])
        # npuspec goes one step further (docs/verify.md, "Draws"): a seeded row's result does
        # not depend on the rest of the batch
        alone, _ = rejection_sample(logits[i:i + 1], drafts[i:i + 1], temperature=temp[:1],
                                    generators={0: torch.Generator().manual_seed(i)})
        assert torch.equal(alone[0], results[0][i])


def _emitted_pdf(q, target_logits, K, N, seed):
    """Frequencies of the tokens emitted at the K draft positions (accepted drafts and recovered
    tokens; -1 excluded) when N requests draft K tokens from q and verify against the target."""
    V = q.shape[0]
    g = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(q, N * K, replacement=True, generator=g).view(N, K)
    logits = target_logits.expand(N, K + 1, V).contiguous()
    u = torch.rand(N, K, dtype=torch.float64, generator=g).float()
    e = torch.empty(N, V).exponential_(generator=g)
    tokens, num = rejection_sample(logits, drafts, q.expand(N, K, V).contiguous(),
                                   temperature=torch.ones(N), uniforms=u, exponentials=e)
    _valid(tokens, num, K, V)
    out = tokens[:, :K].long()
    out = out[out >= 0]
    counts = torch.bincount(out, minlength=V).double()
    return counts / counts.sum(), counts


def _chi_square_pvalue(counts, probs):
    exp = probs.double() * counts.sum()
    stat = ((counts - exp) ** 2 / exp).sum()
    df = counts.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2))


def _approximates_target(seed: int, sizes, multiplier: float = 20.0):
    V, K = 10, 2
    g = torch.Generator().manual_seed(seed)
    q = torch.softmax(torch.rand(V, generator=g), -1)
    target_logits = torch.rand(V, generator=g)
    p = torch.softmax(target_logits, -1).double()
    refs = torch.softmax(torch.rand(100, V, generator=g), -1).double()
    d_target, d_ref, counts = [], [], None
    for i, n in enumerate(sizes):
        est, counts = _emitted_pdf(q, target_logits, K, n, seed * 100 + i)
        d_target.append(float(torch.linalg.vector_norm(est - p)))
        d_ref.append(float(torch.linalg.vector_norm(refs - est, dim=-1).mean()))
    gain_target = d_target[0] / d_target[-1]
    gain_ref = d_ref[0] / d_ref[-1]
    # vLLM's criterion: more samples move the estimate towards the target far faster than
    # towards unrelated distributions
    assert gain_target > multiplier * gain_ref, (d_target, d_ref)
    return counts, p


def test_rejection_sampling_approximates_target_distribution():
    # vLLM's sample sizes; the whole sweep costs well under a second here
    counts, p = _approximates_target(0, [10, 100, 1_000, 10_000, 100_000])
    # and the pooled emitted tokens pass a goodness-of-fit test against the target
    assert _chi_square_pvalue(counts, p) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(10))
def test_rejection_sampling_approximates_target_distribution_full(seed):
    counts, p = _approximates_target(seed, [10, 100, 1_000, 10_000, 100_000, 1_000_000])
    assert _chi_square_pvalue(counts, p) > 1e-4


def _masked_sampling_case(logits_rows, allowed_rows, filter_kw, seed):
    """vLLM's _test_masked_logits: drafts sampled from random draft probs; every emitted token at
    a draft position must be one the top-k/top-p filter keeps for that row."""
    B, K, V = 100, 3, logits_rows.shape[-1]
    g = torch.Generator().manual_seed(seed)
    q = torch.softmax(torch.rand(B * K, V, generator=g), -1)
    drafts = torch.multinomial(q, 1, generator=g).view(B, K)
    logits = torch.cat([logits_rows.view(B, K, V), torch.zeros(B, 1, V)], 1)  # + bonus rows
    gens = {b: torch.Generator().manual_seed(seed * 1000 + b) for b in range(B)}
    tokens, num = rejection_sample(logits, drafts, q.view(B, K, V), temperature=torch.ones(B),
                                   generators=gens, **filter_kw)
    _valid(tokens, num, K, V)
    out = tokens[:, :K].reshape(-1).tolist()
    for i, t in enumerate(out):
        if t != -1:
            assert t in allowed_rows[i], (i, t)
    return out


@pytest.mark.parametrize("top_k", [1, 5, 99])
def test_top_k(top_k):
    B, K, V = 100, 3, 100
    g = torch.Generator().manual_seed(top_k)
    keep = torch.stack([torch.randperm(V, generator=g)[:top_k] for _ in range(B * K)])
    logits = torch.zeros(B * K, V)
    logits.scatter_(1, keep, 0.1)  # a small lead: only the filter keeps the others out
    allowed = [set(r.tolist()) for r in keep]
    out = _masked_sampling_case(logits, allowed,
                                {"top_k": torch.full((B,), top_k, dtype=torch.int64)}, top_k)
    assert any(t != -1 for t in out)


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.99])
def test_top_p(top_p):
    B, K, V = 100, 3, 100
    g = torch.Generator().manual_seed(int(top_p * 100))
    logits = torch.randn(B * K, V, generator=g)
    # the kept set, computed vLLM's way: ascending sort, drop the prefix whose mass stays
    # within 1 - top_p, always keep the most likely token
    sorted_logits, idx = logits.sort(-1)
    mass = sorted_logits.softmax(-1).cumsum(-1)
    dropped = mass <= 1 - top_p
    dropped[:, -1] = False
    allowed = [set(idx[i][~dropped[i]].tolist()) for i in range(B * K)]
    out = _masked_sampling_case(logits, allowed, {"top_p": torch.full((B,), top_p)},
                                int(top_p * 100))
    assert any(t != -1 for t in out)


def _replay_draws(seed: int, K: int, V: int):
    """The draws `rejection_sample` makes for a row seeded with torch.Generator(seed):
    K uniforms (float64 cast to float32) first, then V float32 Exp(1) (docs/verify.md)."""
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(K, dtype=torch.float64, generator=g).float()
    e = torch.empty(V).exponential_(generator=g)
    return u, e


@pytest.mark.parametrize("no_draft_probs", [True, False])
@pytest.mark.parametrize("max_spec_len", [1, 3])
@pytest.mark.parametrize("vocab_size", [100, 8192, 10000])
@pytest.mark.parametrize("batch_size", [1, 100])
def test_sample_recovered_tokens(batch_size, vocab_size, max_spec_len, no_draft_probs):
    # vLLM checks its recovered-token kernel against a loop over requests: argmax of
    # max(p - q, 0) / E (p with the draft zeroed for one-hot drafts), E ~ Exp(1) per request.
    # Here the whole op runs with per-request generators, and every decision is replayed in
    # float64 from the documented draws: accepts while p/q >= u, then that race (or the bonus
    # race argmax p / E after K accepts).
    B, K, V = batch_size, max_spec_len, vocab_size
    g = torch.Generator().manual_seed(B * 7 + K * 131 + V)
    q = torch.softmax(torch.rand(B, K, V, generator=g), -1)
    logits = torch.rand(B, K + 1, V, generator=g)
    drafts = torch.multinomial(q.view(B * K, V), 1, generator=g).view(B, K)
    gens = {b: torch.Generator().manual_seed(b) for b in range(B)}
    tokens, num = rejection_sample(logits, drafts, None if no_draft_probs else q,
                                   temperature=torch.ones(B), generators=gens)
    _valid(tokens, num, K, V)
    p = torch.softmax(logits.double(), -1)
    qq = torch.nn.functional.one_hot(drafts, V).double() if no_draft_probs else q.double()
    rejections = 0
    for b in range(B):
        u, e = _replay_draws(b, K, V)
        inv_e = 1.0 / e.double().clamp_min(FLT_MIN)
        n = 0
        while n < K and float(p[b, n, drafts[b, n]] / qq[b, n, drafts[b, n]]) >= float(u[n]):
            n += 1
        assert int(num[b]) == n + 1, b
        assert tokens[b, :n].tolist() == drafts[b, :n].tolist()
        if n < K:
            rejections += 1
            want = int(((p[b, n] - qq[b, n]).clamp_min(0) * inv_e).argmax())
        else:
            want = int((p[b, K] * inv_e).argmax())
        assert int(tokens[b, n]) == want, (b, n)
    if B > 1:
        assert rejections > 0


@pytest.mark.parametrize("target_is_probs", [False, True], ids=["logits", "probs"])
@pytest.mark.parametrize("no_draft_probs", [True, False])
@pytest.mark.parametrize("vocab_size", [100, 8193, 10000, 151936])
def test_sample_recovered_tokens_vocab_boundary(vocab_size, no_draft_probs, target_is_probs):
    # vLLM's regression (GHSA-8wr5-jm2h-8r4f): when the last vocab tile holds no mass, a
    # recovered id must still be a real token. npuspec's kernels have no tiles, but the same
    # inputs must give ids in [0, V) that never carry zero target probability.
    B, K, V, tile = 2, 3, vocab_size, 8192
    g = torch.Generator().manual_seed(V)
    last_tile = (V // tile) * tile
    p = torch.rand(B, K + 1, V, generator=g)
    if last_tile > 0:
        p[..., last_tile:] = 0.0
    else:
        p = torch.zeros_like(p)
        p[..., 0] = 1.0
    p = p / p.sum(-1, keepdim=True)
    q = torch.softmax(torch.rand(B, K, V, generator=g), -1)
    drafts = (torch.zeros(B, K, dtype=torch.int64) if last_tile == 0
              else torch.randint(0, V, (B, K), generator=g))
    gens = {b: torch.Generator().manual_seed(42 + b) for b in range(B)}
    dp = None if no_draft_probs else q
    if target_is_probs:
        tokens, num = rejection_sample(p, drafts, dp, generators=gens, target_is_probs=True)
    else:
        tokens, num = rejection_sample(p.log(), drafts, dp, temperature=torch.ones(B),
                                       generators=gens)
    _valid(tokens, num, K, V)
    for b in range(B):
        for j in range(int(num[b])):
            t = int(tokens[b, j])
            assert p[b, j, t] > 0, (b, j, t)


@pytest.mark.parametrize("impl", IMPLS)
def test_placeholder_draft_token_rejected_random(impl):
    V = 100
    drafts = padded([[1, V - 1, -1]])
    logits = argmax_logits([[1, V - 1, 7, 9]], 3, V)
    kw = dict(temperature=torch.ones(1))
    if impl == "op":
        kw["generators"] = {0: torch.Generator().manual_seed(0)}
    tokens, num = run(impl, logits, drafts, **kw)
    # vLLM only asks for a valid id at the placeholder; npuspec documents that the token there
    # is drawn from the target p alone, which here puts all its mass on 7
    assert tokens[0].tolist() == [1, V - 1, 7, -1]
    assert num.tolist() == [3]


def _probs_rows(rows: dict, shape) -> torch.Tensor:
    """Probabilities [B, K+1, V] from {(b, j): {token: prob}}; everything else is 0."""
    p = torch.zeros(shape)
    for (b, j), masses in rows.items():
        for t, m in masses.items():
            p[b, j, t] = m
    return p


# vLLM's FLy tests fix the acceptance draws (u = 0.5 or 0.9) and spell out target (and draft)
# probabilities; FLy itself has no counterpart here, but standard verification of the same
# inputs is determined: (drafts, target rows, draft rows or None, u, temperature, expected)
FLY_INPUTS = {
    # test_fly_greedy_rescues_mismatch_after_native_acceptance_window, its standard half
    "greedy_mismatch_first": ([[1, 2, 3, 4]], {(0, 0): {9: 1.0}, (0, 1): {2: 1.0},
                                               (0, 2): {3: 1.0}, (0, 3): {4: 1.0},
                                               (0, 4): {5: 1.0}}, None, 0.5, [0.0], [[9]]),
    # test_fly_target_only_sampling_uses_mapped_target_ids: p(7) = 0.4 < u = 0.5, and the
    # residual (p without 7) holds only 9
    "one_hot_rejected": ([[7, 2, 3, 4]], {(0, 0): {9: 0.6, 7: 0.4}, (0, 1): {0: 0.2, 2: 0.8},
                                          (0, 2): {0: 0.2, 3: 0.8}, (0, 3): {0: 0.2, 4: 0.8},
                                          (0, 4): {8: 1.0}}, None, 0.5, [1.0], [[9]]),
    # test_fly_probabilistic_draft_sampling_uses_probability_ratio: p/q = 0.8 < u = 0.9, and
    # max(p - q, 0) holds only token 0
    "draft_probs_rejected": ([[1, 2, 3, 4]], {(0, 0): {0: 0.6, 1: 0.4}, (0, 1): {0: 0.4, 2: 0.6},
                                              (0, 2): {0: 0.4, 3: 0.6}, (0, 3): {0: 0.4, 4: 0.6},
                                              (0, 4): {7: 1.0}},
                             {(0, 0): {0: 0.5, 1: 0.5}, (0, 1): {0: 0.5, 2: 0.5},
                              (0, 2): {0: 0.5, 3: 0.5}, (0, 3): {0: 0.5, 4: 0.5}},
                             0.9, [1.0], [[0]]),
    # test_fly_mixed_greedy_and_random_batch: a greedy row and a sampled row in one call
    "mixed_greedy_and_random": ([[1, 2, 3], [4, 5, 6]],
                                {(0, 0): {9: 0.6, 1: 0.4}, (0, 1): {2: 1.0}, (0, 2): {3: 1.0},
                                 (0, 3): {7: 1.0}, (1, 0): {0: 0.6, 4: 0.4}, (1, 1): {5: 1.0},
                                 (1, 2): {6: 1.0}, (1, 3): {8: 1.0}},
                                None, 0.5, [0.0, 1.0], [[9], [0]]),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", sorted(FLY_INPUTS))
def test_fly_inputs_under_standard_verification(case, impl):
    spec, target, draft, u, temps, want = FLY_INPUTS[case]
    drafts = padded(spec)
    B, K = drafts.shape
    V = 10
    logits = _probs_rows(target, (B, K + 1, V)).log()  # -inf where p = 0 (allowed)
    q = None if draft is None else _probs_rows(draft, (B, K + 1, V))[:, :K]
    tokens, num = run(impl, logits, drafts, q, temperature=torch.tensor(temps),
                      uniforms=torch.full((B, K), u), exponentials=torch.ones(B, V))
    assert torch.equal(tokens, expected(want, K)), tokens
    assert num.tolist() == [len(r) for r in want]


# ---------------------------------------------------------------------------- synthetic ------

def _synthetic(all_greedy: bool, rates):
    spec, target = [[1, 2], [3]], [[10, 20, 50], [30, 40]]
    drafts = padded(spec)
    logits = argmax_logits(target, 2)
    temp = None if all_greedy else torch.ones(2)
    return rejection_sample(logits, drafts, temperature=temp,
                            synthetic_rates=torch.tensor(rates))


@pytest.mark.parametrize("all_greedy", [True, False])
def test_synthetic_all_accepted(all_greedy):
    tokens, num = _synthetic(all_greedy, [1.0, 1.0])
    # vLLM mocks the bonus tokens as 50 and 40; here they come from the target's rows, which
    # peak at the same tokens (request 1's -1 draft takes the target's token at its row)
    assert torch.equal(tokens, expected([[1, 2, 50], [3, 40]], 2))
    assert num.tolist() == [3, 2]


@pytest.mark.parametrize("all_greedy", [True, False])
def test_synthetic_all_rejected(all_greedy):
    tokens, num = _synthetic(all_greedy, [0.0, 0.0])
    assert num.tolist() == [1, 1]
    for row in tokens:
        assert int(row[0]) != -1
        assert bool((row[1:] == -1).all())
    # the one token is the target's own choice at position 0
    assert tokens[:, 0].tolist() == [10, 30]


# ------------------------------------------------------------------------------- errors ------

@pytest.mark.parametrize("bad", [-2, 100])
def test_out_of_range_draft_id_is_a_value_error(bad):
    # vLLM indexes with the id (and guards -1 only); npuspec's CPU and reference paths refuse
    # an id outside [0, V) other than -1 with a ValueError that names the range
    with pytest.raises(ValueError, match=r"\[0, V=100\)") as err:
        rejection_sample(argmax_logits([[1, 2]], 1), torch.tensor([[bad]]))
    assert str(bad) in str(err.value)
