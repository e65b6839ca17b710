"""NgramProposer and SuffixProposer: edge cases, and equality with brute-force references.

The suffix tests run on both implementations: the public (compiled) SuffixProposer and the
Python SuffixProposerReference; those that read the trees' internals run on the reference
(tests/runtime/test_suffix_native.py checks that the two agree exactly)."""
from __future__ import annotations

import json
import os

import pytest
from hypothesis import given, settings, strategies as st

from npuspec.runtime import NgramProposer, Proposer, SuffixProposer
from npuspec.spec_decode.ngram_reference import NgramProposerReference
from npuspec.spec_decode import suffix_tree as suffix_mod
from npuspec.spec_decode.suffix_reference import SuffixProposerReference

SUFFIX = [SuffixProposer, SuffixProposerReference]

SETTINGS = settings(max_examples=120, deadline=None, derandomize=True)


# -- brute-force references ---------------------------------------------------------------
def ngram_reference(toks, nmin, nmax, k):
    """Scan: longest n in [nmin, nmax] whose suffix n-gram occurred earlier; copy after its
    earliest occurrence, continuing periodically past the end of the context."""
    T = len(toks)
    if k == 0:
        return []
    for n in range(nmax, nmin - 1, -1):
        if n >= T:
            continue
        suf = toks[T - n:]
        for e in range(n - 1, T - 1):  # earliest first
            if toks[e - n + 1:e + 1] == suf:
                start = e + 1
                return [toks[start + j % (T - start)] for j in range(k)]
    return []


def suffix_tree_reference(seqs, ctx, K, D, f, pmin, own=None, off=0.0):
    """(tokens, probs, score) of one tree by scanning every sequence for every match length.

    seqs are in time order; `own` (one of them) ends with the context, and that tail is not an
    occurrence; ties between equally frequent next tokens go to the token that reached that
    count first; a match of m tokens drafts up to min(K, int(m * f + off), D - m) tokens
    (Arctic's budget), short matches included."""
    best = ([], [], 0.0)
    for m in range(1, min(len(ctx), D)):
        s = ctx[-m:]
        occ = [(q, e) for q in seqs for e in range(m - 1, len(q)) if q[e - m + 1:e + 1] == s
               and not (q is own and e == len(q) - 1)]
        if not occ:
            break
        n_max = min(K, int(m * f + off + 1e-6), D - m)
        toks, probs, cur = [], [], occ
        for j in range(1, n_max + 1):
            counts, t, c = {}, None, 0
            for q, e in cur:
                if e + j < len(q):
                    x = q[e + j]
                    counts[x] = counts.get(x, 0) + 1
                    if counts[x] > c:
                        t, c = x, counts[x]
            if not c or c / len(occ) < pmin:
                break
            toks.append(t)
            probs.append(c / len(occ))
            cur = [(q, e) for q, e in cur if e + j < len(q) and q[e + j] == t]
        score = sum(probs)
        if toks and score >= best[2]:
            best = (toks, probs, score)
    return best


def suffix_reference(local, responses, ctx, K, D, f, pmin):
    lt, lp, ls = suffix_tree_reference([local], ctx, K, D, f, pmin, own=local)
    if responses is None:
        return lt, lp
    gt, gp, gs = suffix_tree_reference(responses, ctx, K, D, f, pmin, own=responses[-1])
    return (gt, gp) if gs > ls else (lt, lp)


# -- shared API behaviour -----------------------------------------------------------------
@pytest.mark.parametrize("make", [NgramProposer, *SUFFIX])
def test_protocol_and_lifecycle_errors(make):
    p = make()
    assert isinstance(p, Proposer)
    with pytest.raises(KeyError, match="'nope'.*start_request"):
        p.propose(["nope"], 3)
    with pytest.raises(KeyError, match="'nope'"):
        p.extend("nope", [1])
    with pytest.raises(KeyError, match="'nope'"):
        p.stop_request("nope")
    p.start_request("a", [1, 2, 3])
    with pytest.raises(ValueError, match="'a' is already active"):
        p.start_request("a", [1])
    with pytest.raises(ValueError, match="2 entries but req_ids has 1"):
        p.propose(["a"], [1, 2])
    with pytest.raises(ValueError, match="-1"):
        p.propose(["a"], -1)
    p.stop_request("a")
    with pytest.raises(KeyError):
        p.extend("a", [1])
    p.start_request("a", [4])  # an id may be reused after stop_request


@pytest.mark.parametrize("make", [NgramProposer, *SUFFIX])
def test_empty_context_and_k_zero(make):
    p = make(1, 1) if make is NgramProposer else make()
    p.start_request("e", [])
    assert p.propose(["e"], 4) == [[]]
    p.extend("e", [])
    p.extend("e", [7])
    assert p.propose(["e"], 4) == [[]]
    rep = [1, 2, 3, 4, 5, 6] * 3
    p.start_request("r", rep)
    # per-request K from a dynamic-K table: 0 means no draft, others still draft
    out = p.propose(["r", "e", "r"], [0, 3, 2])
    assert out[0] == [] and out[1] == [] and out[2] == [1, 2]
    assert p.propose(["r"], 0) == [[]]


def test_constructor_errors_name_the_value():
    with pytest.raises(ValueError, match="prompt_lookup_min=0"):
        NgramProposer(prompt_lookup_min=0)
    with pytest.raises(ValueError, match="prompt_lookup_min=4 > prompt_lookup_max=2"):
        NgramProposer(4, 2)
    for make in SUFFIX:
        with pytest.raises(ValueError, match="max_tree_depth=0"):
            make(max_tree_depth=0)
        with pytest.raises(ValueError, match="max_cached_requests=-1"):
            make(max_cached_requests=-1)
        with pytest.raises(ValueError, match="max_spec_factor=0"):
            make(max_spec_factor=0)
        with pytest.raises(ValueError, match="max_spec_factor=inf must be a finite"):
            make(max_spec_factor=float("inf"))
        with pytest.raises(ValueError, match="max_spec_offset=-inf must be a finite"):
            make(max_spec_offset=float("-inf"))
        with pytest.raises(ValueError, match="min_token_prob=1.5"):
            make(min_token_prob=1.5)
        p = make()
        with pytest.raises(ValueError, match="token id -3"):
            p.start_request("a", [1, -3])
        p.start_request("a", [1])
        with pytest.raises(ValueError, match=r"token id 4294967296 is outside \[0, 2\*\*32\)"):
            p.extend("a", [2 ** 32])


# -- ngram --------------------------------------------------------------------------------
def test_ngram_longer_than_context_and_fallback_to_shorter_n():
    p = NgramProposer(prompt_lookup_min=2, prompt_lookup_max=6)
    p.start_request("a", [5, 6])  # shorter than any usable n-gram + 1
    assert p.propose(["a"], 3) == [[]]
    p.extend("a", [5, 6])  # now "5 6" occurred before: n = 2 matches
    assert p.propose(["a"], 3) == [[5, 6, 5]]  # periodic copy: period 2
    q = NgramProposer(prompt_lookup_min=3, prompt_lookup_max=3)
    q.start_request("b", [1, 2, 3, 9, 1, 2])
    assert q.propose(["b"], 2) == [[]]  # only a 2-gram repeats


def test_ngram_longest_first_then_earliest():
    p = NgramProposer(prompt_lookup_min=1, prompt_lookup_max=3)
    #                 "7 8" -> 1 (old)   "9 7 8" -> 2    "7 8" -> 3 (recent)
    p.start_request("a", [7, 8, 1, 0, 9, 7, 8, 2, 0, 7, 8, 3, 0, 9, 7, 8])
    assert p.propose(["a"], 1) == [[2]]  # the 3-gram "9 7 8" beats the shorter "7 8"
    q = NgramProposer(prompt_lookup_min=2, prompt_lookup_max=2)
    q.start_request("b", [7, 8, 1, 0])
    q.extend("b", [7, 8, 3, 0, 7, 8])  # the index is built by start_request and by extend
    assert q.propose(["b"], 2) == [[1, 0]]  # tie on n: the earliest occurrence


@SETTINGS
@given(st.data())
def test_ngram_matches_brute_force(data):
    V = data.draw(st.integers(2, 5))
    nmin = data.draw(st.integers(1, 4))
    nmax = data.draw(st.integers(nmin, 6))
    toks = data.draw(st.lists(st.integers(0, V - 1), max_size=25))
    p = NgramProposer(nmin, nmax)
    p.start_request("a", toks)
    toks = list(toks)
    for _ in range(6):
        k = data.draw(st.integers(0, 8))
        assert p.propose(["a"], k) == [ngram_reference(toks, nmin, nmax, k)]
        new = data.draw(st.lists(st.integers(0, V - 1), max_size=4))
        p.extend("a", new)
        toks += new
    assert p.context("a") == toks


# -- suffix -------------------------------------------------------------------------------
@pytest.mark.parametrize("make", SUFFIX)
@SETTINGS
@given(st.data())
def test_suffix_matches_brute_force(make, data):
    V = data.draw(st.integers(2, 5))
    D = data.draw(st.sampled_from([2, 3, 5, 9, 24]))
    f = data.draw(st.sampled_from([0.5, 1.0, 2.0]))
    pmin = data.draw(st.sampled_from([0.0, 0.1, 0.4]))
    use_global = data.draw(st.booleans())
    p = make(max_tree_depth=D, max_cached_requests=100 if use_global else 0,
             max_spec_factor=f, min_token_prob=pmin)
    responses = [] if use_global else None
    for r in range(data.draw(st.integers(1, 3))):  # requests run one after another
        rid = f"r{r}"
        prompt = data.draw(st.lists(st.integers(0, V - 1), max_size=20))
        p.start_request(rid, prompt)
        ctx, resp = list(prompt), []
        if responses is not None:
            responses.append(resp)
        for _ in range(data.draw(st.integers(1, 6))):
            new = data.draw(st.lists(st.integers(0, V - 1), min_size=1, max_size=4))
            p.extend(rid, new)
            ctx += new
            resp += new
            K = data.draw(st.integers(0, 12))
            got = p.propose_with_probs(rid, K)
            want = suffix_reference(ctx, responses, ctx, K, D, f, pmin) if K else ([], [])
            assert got[0] == want[0], (ctx, responses, K)
            assert got[1] == pytest.approx(want[1])
            assert p.propose([rid], K) == [got[0]]
        p.stop_request(rid)


@pytest.mark.parametrize("make", SUFFIX)
def test_suffix_counts_and_adaptive_length(make):
    p = make(max_cached_requests=0, min_token_prob=0.4)
    # "1 2" occurred 3 times before the context's own tail (which is not counted): followed by
    # 3, 3 and 4; no longer suffix ("7 1 2", ...) occurred before, so m = 2 with a budget of
    # min(K, 2 * factor) = 2 tokens; the second, "1 2 3" -> 9 or 8, has 1/3 < 0.4
    p.start_request("a", [1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 4, 7, 1, 2])
    toks, probs = p.propose_with_probs("a", 8)
    assert toks == [3] and probs == [pytest.approx(2 / 3)]
    p.extend("a", [3])  # "1 2 3": 9 and 8 tie at 1/2 and 9 reached the count first; a budget
    assert p.propose_with_probs("a", 8) == ([9, 1, 2], [0.5] * 3)  # of 3 tokens for m = 3
    q = make(max_cached_requests=0, min_token_prob=0.0, max_spec_factor=0.5)
    q.start_request("b", list(range(10)) + list(range(6)))
    toks, _ = q.propose_with_probs("b", 16)  # match of 6 tokens: budget 6 * 0.5 = 3
    assert toks == [6, 7, 8]


@pytest.mark.parametrize("make", SUFFIX)
def test_suffix_max_tree_depth_caps_match_plus_draft(make):
    seq = list(range(30)) * 3
    for D in (1, 2, 4, 24):
        p = make(max_tree_depth=D, max_cached_requests=0, max_spec_factor=100.0)
        p.start_request("a", seq[:45])
        toks = p.propose(["a"], 40)[0]
        assert len(toks) <= max(0, D - 1)  # a match has >= 1 token; match + draft <= depth
        assert toks == seq[45:45 + len(toks)]
        if D == 24:  # a 1-token match drafts 23 (= depth - 1) past the count table's depth
            assert len(toks) == 23
    p = make(max_tree_depth=24, max_cached_requests=0, max_spec_factor=1.0)
    p.start_request("a", seq[:45])
    assert p.propose(["a"], 40) == [seq[45:57]]  # m = 12: budget 12 * factor = depth left


@pytest.mark.parametrize("make", SUFFIX)
def test_suffix_global_tree_fifo_eviction_and_disable(make):
    resp = {r: [100 + 10 * r + i for i in range(8)] for r in range(3)}
    p = make(max_cached_requests=2, min_token_prob=0.0)
    for r in range(3):
        p.start_request(f"r{r}", [1, 2])
        p.extend(f"r{r}", resp[r])
        p.stop_request(f"r{r}")
    assert p.cached_requests == ["r1", "r2"]  # FIFO: r0 evicted
    p.start_request("q", resp[0][:4] + [5] + resp[1][:4])
    assert p.cached_requests == ["r2", "q"]  # starting q evicts r1 (the new one never)
    assert p.propose(["q"], 4) == [[]]  # r0 and r1 are gone from the global tree
    p.extend("q", resp[2][:4])
    assert p.propose(["q"], 4) == [resp[2][4:8]]  # r2 is still cached
    if make is SuffixProposerReference:
        # eviction undoes the counts exactly: the count table equals one built from the
        # survivors
        fresh = suffix_mod._Tree(evictable=True)
        for sid in sorted(p._global.seqs):
            fresh.add_seq(sid, list(p._global.seqs[sid]))
        assert p._global.cnt == fresh.cnt
        assert {k: sorted(v) for k, v in p._global.kids.items()} == \
            {k: sorted(v) for k, v in fresh.kids.items()}
    off = make(max_cached_requests=0)
    off.start_request("a", [1])
    off.extend("a", resp[0])
    off.stop_request("a")
    off.start_request("b", resp[0][:5])
    assert off.propose(["b"], 4) == [[]] and off.cached_requests == []


def test_suffix_eviction_compacts_the_index():
    p = SuffixProposerReference(max_cached_requests=3, min_token_prob=0.0)
    for r in range(40):
        p.start_request(f"r{r}", [1])
        p.extend(f"r{r}", [(r * 7 + i) % 50 for i in range(300)])
        p.stop_request(f"r{r}")
    g = p._global
    assert len(g.seqs) == 3 and g.live == 900
    refs = sum(len(v) for v in g.index.values())
    assert refs <= 2 * len(suffix_mod._LEVELS) * (g.live + max(g.live, 4096))
    for key, lst in g.index.items():
        n = (key.bit_length() - 1) // suffix_mod._B  # tokens in the packed key
        for ref in lst:
            sid, e = ref >> 32, ref & 0xFFFFFFFF
            if sid in g.seqs:
                assert suffix_mod._key(g.seqs[sid][e - n + 1:e + 1]) == key


def test_suffix_counts_match_scans():
    p = SuffixProposerReference(max_cached_requests=0)
    seq = [1, 2, 1, 2, 3, 1, 2, 1, 3, 3, 2, 1]
    p.start_request("a", seq)
    tree = p._local["a"]
    key = suffix_mod._key
    for s in [(1,), (1, 2), (2, 1, 3), (3, 3, 2, 1), (2, 3, 1, 2)]:
        assert tree.cnt[key(s)] == tree.count(s)
    # best next token of "1": 2 follows it 3 times, 3 once; of "1 2": 1 and 3 tie, 1 was first
    assert tree.best[key((1,))] == 2 and tree.best[key((1, 2))] == 1



@settings(max_examples=30, deadline=None, derandomize=True)
@given(st.lists(st.integers(0, 3), max_size=40), st.lists(st.integers(1, 12), min_size=1))
def test_suffix_tree_same_for_any_extend_chunking(toks, sizes):
    """append's unrolled steady-state path (>= _LONG tokens before) and its general path give
    the same counts, best next tokens, occurrence indexes and tail keys, however the tokens
    arrive; the counts equal scans and the tail keys pack the last j tokens."""
    whole = suffix_mod._Tree(evictable=True)
    whole.add_seq(0, list(toks))
    parts = suffix_mod._Tree(evictable=True)
    parts.add_seq(0, [])
    i = 0
    while i < len(toks):
        n = sizes[i % len(sizes)]
        parts.append(0, parts.seqs[0], toks[i:i + n])
        i += n
    for t in (whole, parts):
        assert t.seqs[0] == toks
        for key, c in t.cnt.items():
            n = (key.bit_length() - 1) // suffix_mod._B
            s = [(key >> (suffix_mod._B * (n - 1 - j))) & suffix_mod._MASK for j in range(n)]
            assert c == t.count(s)
        assert t.state[0] == [suffix_mod._key(toks[len(toks) - j:] if j else [])
                              if j <= len(toks) else 0 for j in range(suffix_mod._LONG + 1)]
    assert parts.cnt == whole.cnt and parts.best == whole.best and parts.kids == whole.kids
    assert parts.index == whole.index
    whole.add_seq(1, list(toks))  # eviction undoes a steady-state append's counts exactly
    whole.remove_seq(1)  # (`best` is re-picked by first-seen order on ties, so not compared)
    assert whole.cnt == parts.cnt and whole.kids == parts.kids


# -- traces and the replay bench ----------------------------------------------------------
def test_trace_builder_is_deterministic_and_lossless(tmp_path):
    from npuspec.bench import make_traces as mt
    a = mt.build(seed=3, out_dir=str(tmp_path / "a"), n_edit=1, n_extract=1, n_groups=1,
                 samples=2)
    b = mt.build(seed=3, out_dir=str(tmp_path / "b"), n_edit=1, n_extract=1, n_groups=1,
                 samples=2)
    assert a == b
    for name in a:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    v = mt.Vocab()
    text = 'def f(x):\n    return x + 1  # ok\n\n\tß "q"\n'
    assert v.decode(v.encode(text)) == text


def test_shipped_traces_load_and_decode():
    from npuspec.bench import make_traces as mt
    from npuspec.bench.propose import load_traces
    vocab = mt.load_vocab()
    total = 0
    for name in mt.TRACE_FILES:
        path = os.path.join(mt.TRACES_DIR, name)
        total += os.path.getsize(path)
        rows = load_traces(path)
        assert rows and all(r["prompt"] and r["response"] for r in rows)
        assert isinstance(vocab.decode(rows[0]["response"]), str)
    assert total < 2 * 1024 * 1024


def test_replay_bench_runs_and_counts_steps(tmp_path, capsys):
    from npuspec.bench import propose as bench
    path = tmp_path / "t.jsonl"
    rows = [{"prompt": [1, 2, 3, 4, 5, 6, 7], "response": [1, 2, 3, 4, 5, 6, 7, 8]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    traces = bench.load_traces(str(path))
    r = bench.replay(bench.Ours(NgramProposer(2, 2)), traces, 4)
    # steps: [] -> 1 token; then "1 2 .." is found: 4 accepted + 1, then the rest
    assert r["steps"] * r["tokens/step"] == pytest.approx(8)
    assert r["tokens/step"] > 1
    bench.main([str(path), "-k", "2,4", "--only", "ngram,suffix", "--no-targets"])
    out = capsys.readouterr().out
    assert "K=2" in out and "K=4" in out and "suffix" in out
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": [1]}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        bench.load_traces(str(bad))


@pytest.mark.parametrize("make", SUFFIX)
def test_suffix_short_match_gets_arctic_budget(make):
    """Issue 34, item 6: a 2-token match at max_spec_factor 2 drafts floor(2 * 2) = 4 tokens,
    as Arctic does (the count table's depth had capped it at 2)."""
    p = make(max_spec_factor=2.0, max_cached_requests=0)
    p.start_request("a", [1, 2, 3, 4, 5, 6, 7, 9, 1, 2])  # [9, 1, 2] never occurred before
    assert p.propose(["a"], 8) == [[3, 4, 5, 6]]
    q = make(max_spec_factor=2.0, max_cached_requests=0)
    q.start_request("b", [7, 3, 4, 5, 6, 8, 3])  # a 1-token match: floor(1 * 2) = 2 tokens
    assert q.propose(["b"], 8) == [[4, 5]]


@pytest.mark.parametrize("factor", [1.0, 2.0])
def test_suffix_not_worse_than_arctic_on_shipped_traces(factor):
    """The issue's bar: mean acceptance length over the shipped traces >= Arctic Inference's
    SuffixDecodingCache with the same parameters (a peer, only when installed); factor 2.0
    is vLLM's recommended value, where short matches draft past the count table."""
    pytest.importorskip("arctic_inference.suffix_decoding")
    import argparse
    from npuspec.bench import propose as bench
    from npuspec.bench.make_traces import TRACE_FILES, TRACES_DIR
    a = argparse.Namespace(max_tree_depth=24, max_cached_requests=10000,
                           max_spec_factor=factor, min_token_prob=0.1)
    emitted = {"ours": 0.0, "arctic": 0.0}
    steps = {"ours": 0, "arctic": 0}
    for name in TRACE_FILES:
        traces = bench.load_traces(os.path.join(TRACES_DIR, name))
        for who, adapter in (("ours", bench.Ours(SuffixProposer(max_spec_factor=factor))),
                             ("arctic", bench.ArcticSuffix(a))):
            r = bench.replay(adapter, traces, 8)
            emitted[who] += r["tokens/step"] * r["steps"]
            steps[who] += r["steps"]
    assert emitted["ours"] / steps["ours"] >= emitted["arctic"] / steps["arctic"]


@SETTINGS
@given(st.lists(st.lists(st.integers(0, 4), max_size=30), min_size=1, max_size=4),
       st.lists(st.lists(st.integers(0, 4), max_size=3), max_size=20),
       st.integers(1, 3), st.integers(0, 2))
def test_ngram_extend_batch_equals_the_reference_per_request(prompts, steps, nmin, extra):
    """A step's tokens for every request in one `extend_batch` (as lists, tuples or numpy,
    possibly none for a request) give each request the drafts the scan reference gives on its
    whole context; a request the drafter does not know is named."""
    import numpy as np
    nmax = nmin + extra
    p = NgramProposer(prompt_lookup_min=nmin, prompt_lookup_max=nmax)
    ids = [f"r{i}" for i in range(len(prompts))]
    ctx = {rid: list(pr) for rid, pr in zip(ids, prompts)}
    for rid in ids:
        p.start_request(rid, ctx[rid])
    for s, new in enumerate(steps):
        given_as = [new, tuple(new), np.array(new, dtype=np.int64)][s % 3]
        p.extend_batch(ids, [given_as if i % 2 == 0 else [] for i in range(len(ids))])
        for i, rid in enumerate(ids):
            ctx[rid] += new if i % 2 == 0 else []
    for rid in ids:
        assert p.context(rid) == ctx[rid]
        assert p.propose([rid], 3)[0] == ngram_reference(ctx[rid], nmin, nmax, 3)
    with pytest.raises(KeyError, match="nope"):
        p.extend_batch(["nope"], [[1]])


def test_draft_batch_pads_each_row_with_minus_one_to_k():
    import numpy as np
    from npuspec.spec_decode.base import DraftBatch

    class _R:
        def __init__(self, rid):
            self.req_id = rid
    p = NgramProposer(prompt_lookup_min=1, prompt_lookup_max=2)
    p.start_request("a", [1, 2, 3, 1, 2])        # "1 2" recurs: drafts 3 1 2 ...
    p.start_request("b", [7, 8, 9])              # nothing recurs: no drafts
    d = p.draft_batch(DraftBatch([_R("a"), _R("b")], 4, [2, 4], None))
    assert d.tokens.dtype == np.int64
    assert d.tokens.tolist() == [[3, 1, -1, -1], [-1, -1, -1, -1]]

    # a drafter breaking propose's contract is not padded over by the default draft_batch
    # (the reference's; the compiled NgramProposer drafts in one native call)
    class _TooLong(NgramProposerReference):
        def propose(self, req_ids, caps):
            return [[1, 2, 3]] * len(req_ids)
    with pytest.raises(AssertionError):
        _TooLong().draft_batch(DraftBatch([_R("a")], 2, [2], None))
