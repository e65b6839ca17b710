"""Benchmarks answer their prompts as new requests: `forget_responses()` drops suffix
decoding's cached responses (native and reference trees alike), and the bench runner calls it
before every pass, so a repeated pass does not copy its earlier, identical answers."""
import pytest

from npuspec.bench.common import npuspec_runner
from npuspec.runtime import SuffixProposer
from npuspec.spec_decode.suffix_reference import SuffixProposerReference


@pytest.mark.parametrize("cls", [SuffixProposer, SuffixProposerReference])
def test_forget_responses_empties_the_response_cache(cls):
    p = cls()
    answer = [5, 6, 7, 8, 9, 10]
    p.start_request("a", [1, 2, 3])
    p.extend("a", answer)
    p.stop_request("a")
    p.start_request("b", [1, 2, 3])
    p.extend("b", [5, 6, 7])
    assert p.propose(["b"], 3) == [[8, 9, 10]]  # copied from a's cached response
    p.stop_request("b")
    p.forget_responses()
    assert p.cached_requests == []
    p.start_request("c", [1, 2, 3])
    p.extend("c", [5, 6, 7])
    assert p.propose(["c"], 3) == [[]]  # nothing left to copy from
    p.stop_request("c")


def test_bench_passes_draft_the_same_each_time():
    spec = {"method": "suffix", "num_speculative_tokens": 4}
    run = npuspec_runner("tiny", spec, ["def add(a, b):\n"], 24, enforce_eager=True)()
    first, second = run(), run()
    assert first["token_ids"] == second["token_ids"]
    # the same drafts and acceptances: the second pass did not copy the first's answer
    assert first["metrics"]["drafted"] == second["metrics"]["drafted"]
    assert first["metrics"]["accepted"] == second["metrics"]["accepted"]
