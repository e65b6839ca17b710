"""The compiled n-gram proposer (kernels/ngram_cpu.py) against its Python reference: the same
drafts for random call sequences (requests that start, grow, draft at every K and n range,
stop and have their slots reused), the same errors, and nothing changed by a call that
raises."""
import numpy as np
import pytest

from npuspec import counters
from npuspec.kernels import ngram_cpu
from npuspec.spec_decode import ngram
from npuspec.spec_decode.base import DraftBatch
from npuspec.spec_decode.ngram import NgramProposer
from npuspec.spec_decode.ngram_reference import NgramProposerReference

pytestmark = pytest.mark.skipif(not ngram_cpu.available(),
                                reason="no C++ toolchain: NgramProposer runs its reference")


class _Req:
    def __init__(self, rid):
        self.req_id = rid


def _as(rng, toks):
    """The same tokens as a list, a tuple or a numpy array."""
    return [list(toks), tuple(toks), np.array(toks, dtype=np.int64)][int(rng.integers(0, 3))]


@pytest.mark.parametrize("nmin,nmax", [(1, 1), (2, 2), (5, 5), (1, 4), (2, 6), (3, 8)])
def test_random_call_sequences_draft_what_the_reference_drafts(nmin, nmax):
    rng = np.random.default_rng(nmin * 10 + nmax)
    nat, ref = NgramProposer(nmin, nmax), NgramProposerReference(nmin, nmax)
    assert nat.native
    live, drafted, serial = [], 0, 0
    V = 3 if nmin >= 3 else 5  # an alphabet small enough for long n-grams to recur
    for step in range(400):
        if len(live) < 6 and rng.random() < 0.3:  # a new request
            rid, serial = f"r{serial}", serial + 1
            prompt = rng.integers(0, V, int(rng.integers(0, 40))).tolist()
            p = _as(rng, prompt)
            nat.start_request(rid, p)
            ref.start_request(rid, prompt)
            live.append(rid)
        if live and rng.random() < 0.05:  # one stops; its slot is reused by the next
            rid = live.pop(int(rng.integers(0, len(live))))
            nat.stop_request(rid)
            ref.stop_request(rid)
        if not live:
            continue
        k = int(rng.integers(0, 7))
        caps = [int(rng.integers(0, k + 1)) for _ in live]
        d = nat.draft_batch(DraftBatch([_Req(r) for r in live], k, caps, None)).tokens
        want = ref.draft_batch(DraftBatch([_Req(r) for r in live], k, caps, None)).tokens
        assert d.dtype == np.int64 and d.shape == (len(live), k)
        assert np.array_equal(d, want), step
        assert nat.propose(live, caps) == ref.propose(live, caps), step
        drafted += int((d >= 0).sum())
        new = [rng.integers(0, V, int(rng.integers(0, 4))).tolist() for _ in live]
        nat.extend_batch(live, [_as(rng, t) for t in new])
        ref.extend_batch(live, new)
    assert drafted > 200, drafted  # the drafts compared were mostly not empty
    for rid in live:
        assert nat.context(rid) == ref.context(rid)
    assert sorted(nat.active_requests) == sorted(ref.active_requests)


def test_errors_are_the_references_and_change_nothing():
    p = NgramProposer(1, 2)
    p.start_request("a", [1, 2, 1])
    with pytest.raises(ValueError, match="already active"):
        p.start_request("a", [3])
    with pytest.raises(KeyError, match="'nope'"):  # 'a' is not extended either
        p.extend_batch(["a", "nope"], [[2], [1]])
    assert p.context("a") == [1, 2, 1]
    with pytest.raises(KeyError, match="'gone'"):
        p.draft_batch(DraftBatch([_Req("a"), _Req("gone")], 2, [2, 2], None))
    with pytest.raises(ValueError, match="max_tokens"):
        p.draft_batch(DraftBatch([_Req("a")], 2, [3], None))
    with pytest.raises(ValueError, match="max_tokens"):
        p.propose(["a"], -1)
    for call in (lambda: p.propose(["b"], 2), lambda: p.context("b"),
                 lambda: p.stop_request("b")):
        with pytest.raises(KeyError, match="'b'"):
            call()
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(0, 2)
    p.stop_request("a")
    assert p.active_requests == []


def test_without_the_library_the_reference_runs(monkeypatch):
    monkeypatch.setattr(ngram_cpu, "library", lambda: None)
    before = counters.get("ngram_native_fallback", 0)
    p = ngram.NgramProposer(1, 2)
    assert not p.native and counters.get("ngram_native_fallback", 0) == before + 1
    p.start_request("a", [1, 2, 3, 1, 2])
    assert p.propose(["a"], 3) == [[3, 1, 2]]
    assert p.draft_batch(DraftBatch([_Req("a")], 4, [4], None)).tokens.tolist() == \
        [[3, 1, 2, 3]]
    assert p.active_requests == ["a"]
