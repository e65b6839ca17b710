"""`npuspec serve --stream-interval N`: the engine process sends each request's tokens every N
steps, and at once for a first token, an end, an abort or a refusal (npuspec.serve.core)."""
import argparse
import time

import pytest

from npuspec.serve.core import Coalescer, Out, add_message


def _out(rid, toks, fin=None):
    return Out(rid, list(toks), fin, None, 0, 0, ())


def test_coalescer_sends_firsts_and_ends_at_once_and_the_rest_every_n():
    c = Coalescer(3)
    c.add([_out("a", [1])])
    assert c.due(False)                                 # a's first token: at once
    assert c.take() == [_out("a", [1])]
    c.add([_out("a", [2]), _out("b", [])])              # b: prefill only, nothing to say
    assert not c.due(False)
    c.add([_out("a", [3, 4])])
    assert not c.due(False)
    c.add([_out("a", [5])])
    assert c.due(False)                                 # the third step
    got = {o.req_id: o.token_ids for o in c.take()}
    assert got == {"a": [2, 3, 4, 5], "b": []}
    c.add([_out("a", [6], "length")])
    assert c.due(False) and c.take() == [_out("a", [6], "length")]   # an end: at once
    c.add([_out("b", [7])])
    assert c.due(False)                                 # b's first token
    c.take()
    c.add([_out("b", [8])])
    assert not c.due(False) and c.due(True)            # forced (an abort, or idle)


def test_interval_one_sends_every_step():
    c = Coalescer(1)
    for t in range(3):
        c.add([_out("a", [t])])
        assert c.due(False)
        assert c.take()[0].token_ids == [t]


@pytest.fixture(scope="module")
def engine():
    pytest.importorskip("fastapi")
    from npuspec.serve.args import add_arguments
    from npuspec.models import TINY_MODEL_DIR
    from npuspec.serve.engine import EngineClient
    p = argparse.ArgumentParser()
    add_arguments(p)
    c = EngineClient(p.parse_args([TINY_MODEL_DIR, "--enforce-eager",
                                   "--threads", "1", "--stream-interval", "4",
                                   "--max-model-len", "256"]))
    yield c
    c.close()


def test_engine_process_streams_every_fourth_step(engine):
    """Same tokens as the offline engine; the first message holds the first token alone, the
    ones after it several tokens each."""
    import npuspec.engine
    from npuspec import LLM, SamplingParams
    from npuspec.models import TINY_MODEL_DIR

    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompt = "def check(name, value):\n    if value < 0:\n"
    r = engine.new_request(prompt, sp, "interval-1")
    engine.conn.send(add_message(r, time.perf_counter()))
    sizes, toks = [], []
    while True:
        msg = engine.conn.recv()
        assert msg[0] == "step", msg
        for o in msg[1]:
            sizes.append(len(o.token_ids))
            toks += o.token_ids
            if o.finish_reason is not None:
                break
        else:
            continue
        break
    mp = pytest.MonkeyPatch()
    mp.setattr(npuspec.engine, "DEFAULT_LOWERING", "eager")
    try:
        want = LLM(TINY_MODEL_DIR, max_model_len=256).generate([prompt], sp)[0].outputs[0].token_ids
    finally:
        mp.undo()
    assert toks == list(want)
    assert sizes[0] == 1 and max(sizes[1:]) == 4, sizes
    assert len(sizes) <= 2 + 40 // 4, sizes
