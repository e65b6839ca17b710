"""The compiled SuffixProposer equals SuffixProposerReference exactly.

Drafts and probabilities (bitwise-equal floats), errors, `active_requests` and
`cached_requests`, for random call sequences under every parameter combination, for the
pathological contexts the search windows exist for, under FIFO eviction with compaction, and
on the shipped traces replayed as `npuspec.bench.propose` replays them; plus the batch calls
and the logged, counted fallback to the reference.
"""
from __future__ import annotations

import functools
import itertools
import logging
import operator
import os
import random
from array import array

import numpy as np
import pytest

from npuspec import counters
from npuspec.bench.make_traces import TRACE_FILES, TRACES_DIR
from npuspec.bench.propose import load_traces
from npuspec.kernels import cpp_build, suffix_cpu
from npuspec.runtime import SuffixProposer
from npuspec.spec_decode import suffix as suffix_native
from npuspec.spec_decode import suffix_tree as suffix_mod
from npuspec.spec_decode.suffix_reference import SuffixProposerReference


@pytest.fixture(autouse=True)
def _native():
    if not suffix_cpu.available():
        if cpp_build.toolchain_present():
            pytest.fail("a C++ compiler is here but the suffix library did not build (see log)")
        pytest.skip("no C++ toolchain: SuffixProposer runs the reference")


def _outcome(fn, args):
    try:
        return ("ok", fn(*args))
    except (KeyError, ValueError, TypeError) as e:
        return ("error", type(e), str(e))


class Pair:
    """The compiled proposer and the reference driven by the same calls; every call's result
    (or error) and the request lists must be equal."""

    def __init__(self, *args, **kw):
        self.a = SuffixProposer(*args, **kw)
        self.b = SuffixProposerReference(*args, **kw)
        assert self.a.native
        self.calls = 0

    def __getattr__(self, name):
        fa, fb = getattr(self.a, name), getattr(self.b, name)

        def call(*args):
            ra, rb = _outcome(fa, args), _outcome(fb, args)
            assert ra == rb, (name, args, ra, rb)
            assert self.a.active_requests == self.b.active_requests
            assert self.a.cached_requests == self.b.cached_requests
            self.calls += 1
            return rb
        return call


def _drive(pair: Pair, rng: random.Random, V: int, ops: int, sizes=(0, 1, 2, 3, 4, 8, 20),
           prompts=(0, 1, 5, 20, 60, 200)) -> None:
    """Random interleaved requests from a pool of 5 ids (so ids are reused), random extend
    sizes, K in 0..16, singles and batches, stops, evictions, and calls that must fail."""
    ids = [f"r{i}" for i in range(5)]
    active: list[str] = []
    toks = lambda n: [rng.randrange(V) for _ in range(n)]  # noqa: E731
    for _ in range(ops):
        x = rng.random()
        if x < 0.1 or not active:
            rid = rng.choice(ids)
            pair.start_request(rid, toks(rng.choice(prompts)))  # may be a duplicate: an error
            if rid not in active:
                active.append(rid)
        elif x < 0.45:
            pair.extend(rng.choice(active), toks(rng.choice(sizes)))
        elif x < 0.7:
            pair.propose_with_probs(rng.choice(active), rng.randrange(17))
        elif x < 0.82:
            rs = [rng.choice(active) for _ in range(rng.randrange(1, 6))]
            ks = [rng.randrange(17) for _ in rs] if rng.random() < 0.5 else rng.randrange(17)
            pair.propose(rs, ks)
            pair.propose_batch_with_probs(rs, ks)
        elif x < 0.92:
            rid = active.pop(rng.randrange(len(active)))
            pair.stop_request(rid)
        elif x < 0.97:
            pair.evict_cached_response(rng.choice(ids))  # an error when it has none
        else:
            pair.extend(rng.choice(ids + ["nope"]), [1])  # errors for unknown ids


PARAMS = list(itertools.product(
    [2, 5, 24],                                       # max_tree_depth
    [0, 2, 10000],                                    # max_cached_requests
    [(1.0, 0.0), (0.5, 1.5), (2.0, 0.0), (1.0, -1.0)],  # max_spec_factor, max_spec_offset
    [0.0, 0.1, 0.4]))                                 # min_token_prob


@pytest.mark.parametrize("D,C,fo,pmin", PARAMS)
def test_random_streams_equal_reference(D, C, fo, pmin):
    seed = PARAMS.index((D, C, fo, pmin))
    rng = random.Random(seed)
    pair = Pair(max_tree_depth=D, max_cached_requests=C, max_spec_factor=fo[0],
                min_token_prob=pmin, max_spec_offset=fo[1])
    _drive(pair, rng, V=(2, 3, 5, 40)[seed % 4], ops=250)
    assert pair.calls > 200


@pytest.mark.parametrize("D", [1, 3, 4, 9, 40])
def test_random_streams_other_depths(D):
    rng = random.Random(D)
    pair = Pair(max_tree_depth=D, max_cached_requests=3, max_spec_factor=3.7,
                min_token_prob=0.0, max_spec_offset=4.0)
    _drive(pair, rng, V=3, ops=300)


def test_fifo_eviction_and_compaction_equal_reference(monkeypatch):
    """Long responses through a 1..3-response cache: every eviction re-picks best tokens and
    the global tree compacts several times; 3-gram windows read evicted references."""
    compactions = []
    compact = suffix_mod._Tree._compact
    monkeypatch.setattr(suffix_mod._Tree, "_compact",
                        lambda self: (compactions.append(1), compact(self)))
    for seed in range(4):
        rng = random.Random(seed)
        pair = Pair(24 if seed % 2 else 5, 1 + seed % 3, (1.0, 2.0)[seed % 2],
                    (0.0, 0.1)[seed // 2], (0.0, 1.5)[seed // 2])
        V = (2, 3, 4, 30)[seed]
        running: list[str] = []
        for i in range(30):
            rid = next(p for p in "xyzw" if p not in running)
            pair.start_request(rid, [rng.randrange(V) for _ in range(rng.choice([10, 50]))])
            running.append(rid)
            for _ in range(rng.choice([80, 160])):
                r = rng.choice(running)
                pair.extend(r, [rng.randrange(V) for _ in range(rng.choice([1, 3, 4]))])
                pair.propose_with_probs(r, rng.choice([4, 8, 16]))
            if len(running) > 1 or rng.random() < 0.3:
                pair.stop_request(running.pop(0))
            if rng.random() < 0.1 and pair.b.cached_requests:
                pair.evict_cached_response(rng.choice(pair.b.cached_requests))
    assert len(compactions) >= 4


def test_compaction_timing_equal_reference(monkeypatch):
    """Evicted references newer than a live cached response push its references out of the
    3-gram windows until the compaction drops them, so the drafts depend on exactly when it
    runs (a threshold of 2048 or 5000 instead of 4096 changes 2-4% of them here); with a
    6000-token cached response the live tokens set the threshold instead."""
    compactions = []
    compact = suffix_mod._Tree._compact
    monkeypatch.setattr(suffix_mod._Tree, "_compact",
                        lambda self: (compactions.append(1), compact(self)))
    for seed, old in ((0, 300), (1, 300), (2, 6000)):
        rng = random.Random(seed)
        tok = lambda: 0 if rng.random() < 0.8 else rng.randrange(1, 3)  # noqa: E731
        pair = Pair(max_cached_requests=3, min_token_prob=0.0)
        pair.start_request("x", [tok() for _ in range(20)])
        pair.extend("x", [tok() for _ in range(old)])  # an old response that stays cached
        pair.stop_request("x")
        for _ in range(20 if old < 4096 else 40):
            pair.start_request("r", [tok() for _ in range(20)])  # evicts the previous "r"
            for _ in range(120):
                pair.extend("r", [tok() for _ in range(3)])
                pair.propose_with_probs("r", 8)
            pair.stop_request("r")
    assert len(compactions) >= 3


@pytest.mark.parametrize("D,C", [(24, 0), (24, 3), (40, 10000)])
def test_pathological_contexts_equal_reference(D, C):
    """Runs of one token and short periods: n-grams seen far more often than the search
    windows read, and the work budget cutting the search short."""
    pair = Pair(max_tree_depth=D, max_cached_requests=C, min_token_prob=0.0,
                max_spec_factor=2.0)
    run = [7] * 700
    pair.start_request("a", run)
    pair.start_request("b", [1, 2, 3] * 200 + [1, 2])
    for step in range(40):
        for rid, new in (("a", [7] * (step % 3 + 1)), ("b", [3, 1, 2][:step % 3 + 1])):
            pair.extend(rid, new)
            for k in (1, 8, 16):
                pair.propose_with_probs(rid, k)
    tree = pair.b._local["a"]
    assert len(tree.index[tree.state[0][8]]) > dict(suffix_mod._SEARCH)[8]
    pair.stop_request("a")
    pair.start_request("c", [7] * 30)  # the global tree holds the long run now (when cached)
    pair.propose_with_probs("c", 16)


def test_large_token_ids_and_input_types():
    pair = Pair(max_cached_requests=4, min_token_prob=0.0)
    big = [2 ** 32 - 1, 2 ** 32 - 2, 0, 2 ** 31]
    pair.start_request("a", np.array(big * 5, dtype=np.int64))
    pair.extend("a", tuple(big[:2]))
    pair.extend("a", np.array(big[2:], dtype=np.uint32))
    # m = 8 wins: its 4 earlier occurrences all continue for 4 tokens, 3 of them for 8
    assert pair.propose_with_probs("a", 8) == ("ok", (big * 2, [1.0] * 4 + [0.75] * 4))
    torch = pytest.importorskip("torch")
    pair.start_request("t", torch.tensor(big * 3))
    pair.extend("t", torch.tensor(big[:1]))
    pair.propose(["t", "a"], [5, 3])


def test_errors_equal_reference():
    pair = Pair(max_cached_requests=2)
    pair.start_request("a", [1, 2, 3, 1, 2])
    for call, args in [("start_request", ("a", [1])),           # duplicate
                       ("start_request", ("b", [1, -3])),       # negative id
                       ("start_request", ("b", [2 ** 32])),
                       ("extend", ("a", [5, -1])),
                       ("extend", ("a", [2 ** 40])),
                       ("extend", ("zz", [1])),
                       ("stop_request", ("zz",)),
                       ("evict_cached_response", ("zz",)),
                       ("propose_with_probs", ("zz", 3)),
                       ("propose", (["a", "zz", "yy"], 3)),   # names the first unknown
                       ("propose", (["a"], -1)),
                       ("propose", (["a"], True)),
                       ("propose", (["a"], [1, 2])),
                       ("propose", (["a", "zz"], [1, -2])),   # K is checked first
                       ("propose_batch_with_probs", (["zz"], 2))]:
        outcome = getattr(pair, call)(*args)
        assert outcome[0] == "error", (call, args)
    assert pair.propose([], 3) == ("ok", [])
    pair.extend("a", [3])
    assert pair.propose(["a"], 4) == ("ok", [[1, 2, 3]])  # nothing was applied by the errors


def test_batch_equals_per_request():
    rng = random.Random(5)
    p = SuffixProposer(max_cached_requests=100)
    ids = [f"q{i}" for i in range(40)]
    for rid in ids:
        p.start_request(rid, [rng.randrange(6) for _ in range(rng.randrange(0, 300))])
    for rid in ids[:20]:
        p.stop_request(rid)  # their responses stay cached for the others
    live = ids[20:] * 2  # each twice
    for _ in range(5):
        for rid in ids[20:]:
            p.extend(rid, [rng.randrange(6) for _ in range(3)])
        ks = [rng.randrange(0, 25) for _ in live]
        singles = [p.propose_with_probs(r, k) for r, k in zip(live, ks)]
        assert p.propose(live, ks) == [t for t, _ in singles]
        assert p.propose_batch_with_probs(live, ks) == singles
        assert p.propose(live, 8) == [p.propose_with_probs(r, 8)[0] for r in live]
        assert any(t for t, _ in singles)
    assert p.propose(live[:1], 10 ** 9) == [p.propose_with_probs(live[0], 10 ** 9)[0]]


def _neumaier_sum(xs, start=0):
    """CPython >= 3.12's sum() of floats (Neumaier's compensated summation), in Python."""
    xs = list(xs)
    if not xs:
        return start
    s, c = start + xs[0], 0.0
    for x in xs[1:]:
        t = s + x
        c += (s - t) + x if abs(s) >= abs(x) else (x - t) + s
        s = t
    return s + c if c else s


def test_scores_sum_as_python_does():
    """The library's score sum is Python's left-to-right float addition, or CPython >= 3.12's
    compensated sum() when that is what this interpreter's sum() does."""
    lib = suffix_cpu.library()
    rng = random.Random(0)
    differ = 0
    for _ in range(3000):
        den = rng.randrange(1, 300)
        xs = sorted((rng.randrange(1, den + 1) / den for _ in range(rng.randrange(17))),
                    reverse=True)
        buf = array("d", xs)
        plain = functools.reduce(operator.add, xs, 0.0)
        assert lib.npuspec_suffix_sum(buf.buffer_info()[0], len(xs), 0) == plain
        assert lib.npuspec_suffix_sum(buf.buffer_info()[0], len(xs), 1) == _neumaier_sum(xs)
        assert sum(xs) == (_neumaier_sum(xs) if suffix_native._NEUMAIER else plain)
        differ += plain != _neumaier_sum(xs)
    assert differ > 100


def test_neumaier_summation_matches_a_reference_that_sums_so(monkeypatch):
    """Python 3.12 changed sum() of floats; the library sums as this interpreter does. Here
    the reference is made to sum as 3.12 does and the library told to do the same."""
    monkeypatch.setattr(suffix_mod, "sum", _neumaier_sum, raising=False)
    monkeypatch.setattr(suffix_native, "_NEUMAIER", True)
    pair = Pair(max_tree_depth=24, max_cached_requests=10000, min_token_prob=0.0,
                max_spec_factor=2.0)
    rng = random.Random(3)
    differ = 0
    for i in range(6):
        pair.start_request(f"n{i}", [rng.randrange(3) for _ in range(300)])
        for _ in range(40):
            pair.extend(f"n{i}", [rng.randrange(3)])
            _, (_, probs) = pair.propose_with_probs(f"n{i}", 16)
            differ += _neumaier_sum(probs) != sum(probs)
    assert differ  # the two summations do differ on these drafts' probabilities


def test_shipped_traces_equal_reference():
    """Replayed as bench/propose.py replays them (one instance per file, K = 8, the config's
    defaults): every draft and probability equal; and so tokens per step."""
    for name in TRACE_FILES:
        pair = Pair()
        for i, tr in enumerate(load_traces(os.path.join(TRACES_DIR, name))):
            rid, resp, pos = f"r{i}", tr["response"], 0
            pair.start_request(rid, tr["prompt"])
            while pos < len(resp):
                _, (draft, _) = pair.propose_with_probs(rid, 8)
                a = 0
                while a < len(draft) and pos + a < len(resp) and draft[a] == resp[pos + a]:
                    a += 1
                n = min(a + 1, len(resp) - pos)
                pair.extend(rid, resp[pos:pos + n])
                pos += n
            pair.stop_request(rid)


def test_fallback_is_logged_once_counted_and_equal(monkeypatch, caplog):
    class NoCompiler:
        @staticmethod
        def load(source):
            raise RuntimeError("no C++ compiler here (test)")

    monkeypatch.setattr(cpp_build, "_code_cache", lambda: NoCompiler)
    suffix_cpu.library.cache_clear()
    try:
        before = counters.snapshot()
        with caplog.at_level(logging.WARNING, logger="npuspec.kernels.cpp_build"):
            p, q = SuffixProposer(max_cached_requests=3), SuffixProposer()
        warnings = [r for r in caplog.records if "compiled suffix proposer" in r.getMessage()]
        assert len(warnings) == 1 and "no C++ compiler here" in warnings[0].getMessage()
        assert counters.delta(before) == {"suffix_native_fallback": 2}
        assert not p.native and not q.native
        ref = SuffixProposerReference(max_cached_requests=3)
        rng = random.Random(1)
        for who in (p, ref):
            rng.seed(1)
            for i in range(6):
                who.start_request(f"f{i}", [rng.randrange(4) for _ in range(50)])
                who.extend(f"f{i}", [rng.randrange(4) for _ in range(20)])
                who.stop_request(f"f{i}")
            who.start_request("g", [rng.randrange(4) for _ in range(30)])
        assert p.propose_with_probs("g", 8) == ref.propose_with_probs("g", 8)
        assert p.propose(["g"], 5) == ref.propose(["g"], 5)
        assert p.cached_requests == ref.cached_requests and p.active_requests == ["g"]
    finally:
        monkeypatch.undo()
        suffix_cpu.library.cache_clear()
    assert SuffixProposer().native


def test_extend_batch_equals_one_extend_per_request():
    """The engine's one call per step (`extend_batch`) leaves the proposer as `extend` per
    request in batch order does: the same drafts and probabilities afterwards, shared
    responses included; an unknown id raises as `extend` does, before anything is added."""
    rng = random.Random(11)
    a, b = SuffixProposer(max_cached_requests=50), SuffixProposer(max_cached_requests=50)
    ids = [f"q{i}" for i in range(12)]
    for rid in ids:
        prompt = [rng.randrange(5) for _ in range(rng.randrange(1, 120))]
        a.start_request(rid, prompt)
        b.start_request(rid, list(prompt))
    for step in range(30):
        toks = [[rng.randrange(5) for _ in range(rng.randrange(0, 6))] for _ in ids]
        a.extend_batch(ids, toks)
        for rid, t in zip(ids, toks):
            b.extend(rid, t)
        assert a.propose_batch_with_probs(ids, 12) == b.propose_batch_with_probs(ids, 12), step
    assert any(a.propose(ids, 12))
    with pytest.raises(KeyError, match="nope") as e:
        a.extend_batch(ids[:2] + ["nope"], [[1], [2], [3]])
    with pytest.raises(KeyError) as want:
        b.extend("nope", [3])
    assert str(e.value) == str(want.value)
    assert a.propose(ids, 12) == b.propose(ids, 12)   # nothing was added by the failed call


def test_batch_probabilities_land_in_the_buffer_read_back():
    """A first batch larger than the output buffers grows them before the native call; the
    call must write into the new ones (it wrote into the freed old ones: a heap corruption,
    and probabilities read back as zeros)."""
    rng = random.Random(3)
    prompts = {f"r{i}": [rng.randrange(3) for _ in range(200)] for i in range(16)}
    a, b = SuffixProposer(), SuffixProposer()
    for rid, p in prompts.items():
        a.start_request(rid, p)
        b.start_request(rid, list(p))
    ids = list(prompts)
    got = a.propose_batch_with_probs(ids, 16)             # up to 256 tokens: the buffers grow
    assert sum(len(t) for t, _ in got) > 64
    assert got == [b.propose_with_probs(r, 16) for r in ids]
    assert all(p > 0 for _, ps in got for p in ps)
