"""The engine's step API (new_request / add_request / step / abort_request), which npuspec serve's
engine loop drives and generate() runs on."""
import pytest

import npuspec.engine
from npuspec import LLM, SamplingParams

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3}
PROMPTS = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i)\n",
           "class Queue:\n    def __init__(self):\n        self.items = []\n"]


@pytest.fixture(scope="module")
def llm(ckpt):
    mp = pytest.MonkeyPatch()
    mp.setattr(npuspec.engine, "DEFAULT_LOWERING", "eager")
    try:
        yield LLM(ckpt, speculative_config=SPEC, max_model_len=256, max_num_seqs=2)
    finally:
        mp.undo()


def _run(llm, reqs, got=None):
    """Step until nothing is live; -> {req_id: tokens streamed}, finish flags seen."""
    got = got or {r.req_id: [] for r in reqs}
    finished = set()
    while llm.has_unfinished_requests():
        for o in llm.step():
            assert o.request_id not in finished, o.request_id
            got[o.request_id] += o.new_token_ids
            if o.finished:
                finished.add(o.request_id)
    return got, finished


def test_streamed_tokens_equal_generate(llm):
    sp = SamplingParams(temperature=0, max_tokens=24)
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp)]
    # added one at a time, the third while two run (max_num_seqs=2: it waits for a seat)
    reqs = [llm.new_request(p, sp, f"r{i}") for i, p in enumerate(PROMPTS)]
    llm.add_request(reqs[0])
    first = llm.step()  # prefill and the first verify step of r0
    assert [o.request_id for o in first] == ["r0"] and first[0].new_token_ids
    llm.add_request(reqs[1])
    llm.add_request(reqs[2])
    assert llm.num_requests() == (1, 2)
    got, finished = _run(llm, reqs, {"r0": list(first[0].new_token_ids), "r1": [], "r2": []})
    assert finished == {"r0", "r1", "r2"}
    assert [got[f"r{i}"] for i in range(3)] == want
    assert all(r.finish_reason == "length" and r.stats.first_token_s > 0 for r in reqs)
    assert llm.runner.blocks.num_free == llm.runner.blocks.num_blocks - 1  # all blocks back


def test_abort_frees_blocks_and_others_finish(llm):
    sp = SamplingParams(temperature=0, max_tokens=40)
    free0 = llm.runner.blocks.num_free
    reqs = [llm.new_request(p, sp, f"a{i}") for i, p in enumerate(PROMPTS)]
    for r in reqs:
        llm.add_request(r)
    llm.step()
    llm.step()
    assert llm.runner.blocks.num_free < free0
    assert llm.abort_request("a0")           # running
    assert llm.abort_request("a2")           # still waiting for a seat
    assert not llm.abort_request("a0")       # already gone
    assert not llm.abort_request("nope")
    assert reqs[0].finish_reason == "abort" and reqs[2].finish_reason == "abort"
    got, finished = _run(llm, reqs)
    assert finished == {"a1"} and len(reqs[1].output) == 40
    assert llm.runner.blocks.num_free == free0
    # the aborted request's proposer state is gone: its id can be used again
    r = llm.new_request(PROMPTS[0], sp, "a0")
    llm.add_request(r)
    _run(llm, [r])
    assert len(r.output) == 40


def test_duplicate_id_and_generate_while_live(llm):
    sp = SamplingParams(temperature=0, max_tokens=4)
    r = llm.new_request(PROMPTS[0], sp, "dup")
    llm.add_request(r)
    with pytest.raises(ValueError, match="request_id 'dup' is already running"):
        llm.add_request(llm.new_request(PROMPTS[1], sp, "dup"))
    with pytest.raises(RuntimeError, match="still running"):
        llm.generate(PROMPTS[:1], sp)
    llm.abort_request("dup")
    assert not llm.has_unfinished_requests()
    assert len(llm.generate(PROMPTS[:1], sp)[0].outputs[0].token_ids) == 4


def test_new_request_checks_like_generate(llm):
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        llm.new_request({"prompt_token_ids": [1, 10**6]})
    with pytest.raises(ValueError, match="max_model_len=256 leaves no room"):
        llm.new_request({"prompt_token_ids": [1] * 256})
    assert not llm.has_unfinished_requests()
