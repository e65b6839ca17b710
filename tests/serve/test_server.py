"""One real server (embedded model with a chat template, ngram, an API key) and the real
`openai` client: completions and chat, streamed and not, 32 concurrent streams equal to the
offline engine, a dropped client, the error bodies, the metrics."""
import asyncio
import json
import signal
import time

import pytest

from npuspec import LLM, SamplingParams
from serve_helpers import EAGER, NGRAM, Server, metric, render_chatml

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

KEY = "sk-npuspec-test"
NAME = "tiny-chat"
MAX_LEN = 384
SEQS = 8


@pytest.fixture(scope="module")
def server(chat_model):
    s = Server([chat_model, "--served-model-name", NAME, "--api-key", KEY,
                "--speculative-config", json.dumps(NGRAM), "--max-model-len", str(MAX_LEN),
                "--max-num-seqs", str(SEQS), "--compilation-config", EAGER, "--threads", "1"])
    yield s
    s.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def offline(chat_model):
    """The offline engine with the server's settings, uncompiled: greedy tokens do not depend
    on compilation (tests/engine/test_compiled.py), and the server runs the compiled step."""
    return LLM(chat_model, speculative_config=NGRAM, max_model_len=MAX_LEN, max_num_seqs=SEQS,
               enforce_eager=True)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def prompts(n):
    base = ["def __init__(self, x, y):\n    self.x = x\n", "for i in range(10):\n",
            "import os\nimport sys\n", "class Point:\n    def __repr__(self):\n",
            "def check(name, value):\n    if value < 0:\n"]
    return [f"# case {i}\n" + base[i % len(base)] for i in range(n)]


def greedy(offline, ps, max_tokens):
    return [o.outputs[0].text for o in
            offline.generate(ps, SamplingParams(temperature=0, max_tokens=max_tokens))]


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [NAME]
    assert httpx.get(server.url + "/health").status_code == 200  # no key needed


def test_completion_equals_offline(client, offline):
    ps = prompts(3)
    r = client.completions.create(model=NAME, prompt=ps, max_tokens=40, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == greedy(offline, ps, 40)
    assert all(c.finish_reason == "length" for c in r.choices)
    ids = [offline.tokenizer.encode(p).ids for p in ps]
    assert r.usage.prompt_tokens == sum(map(len, ids)) and r.usage.completion_tokens == 120


def test_completion_stream_equals_offline(client, offline):
    p = prompts(1)[0]
    chunks = list(client.completions.create(model=NAME, prompt=p, max_tokens=48, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == greedy(offline, [p], 48)[0]
    assert len([c for c in chunks if c.choices]) > 1  # streamed, not one block
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 48


def test_chat_equals_offline_on_the_rendered_template(client, offline):
    msgs = [{"role": "system", "content": "You write Python."},
            {"role": "user", "content": "def add(a, b):"}]
    ids = offline.tokenizer.encode(render_chatml(msgs), add_special_tokens=False).ids
    want = offline.generate([{"prompt_token_ids": ids}],
                            SamplingParams(temperature=0, max_tokens=32))[0].outputs[0].text
    r = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=32, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want
    assert r.usage.prompt_tokens == len(ids)
    stream = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=32,
                                            temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length"


def test_32_concurrent_streams_equal_offline(server, offline):
    ps = prompts(32)
    want = greedy(offline, ps, 40)

    async def one(client, p):
        s = await client.completions.create(model=NAME, prompt=p, max_tokens=40, temperature=0,
                                            stream=True)
        return "".join([c.choices[0].text async for c in s if c.choices])

    async def main():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0,
                                    timeout=300)
        return await asyncio.wait_for(asyncio.gather(*(one(client, p) for p in ps)), 300)
    got = asyncio.run(main())
    assert got == want


def test_dropped_client_is_aborted_and_frees_its_blocks(server, client):
    before = server.metrics()
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", server.url + "/v1/completions",
                      headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": NAME, "prompt": prompts(1)[0], "max_tokens": 300,
                            "temperature": 0, "stream": True, "ignore_eos": True}) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(g.startswith("data: {") for g in got)
        # the connection is closed mid-stream; the others finish
        rest = client.completions.create(model=NAME, prompt=prompts(2), max_tokens=24,
                                         temperature=0)
        assert [c.finish_reason for c in rest.choices] == ["length", "length"]
    for _ in range(50):
        m = server.metrics()
        if metric(m, "npuspec:request_success_total", finished_reason="abort") > metric(
                before, "npuspec:request_success_total", finished_reason="abort"):
            break
        time.sleep(0.1)
    assert metric(m, "npuspec:request_success_total", finished_reason="abort") == metric(
        before, "npuspec:request_success_total", finished_reason="abort") + 1
    assert metric(m, "npuspec:num_requests_running") == 0
    assert metric(m, "npuspec:kv_cache_usage_perc") == 0  # every block back in the pool


def test_speculative_metrics_move(server, client):
    before = server.metrics()
    p = "x = [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3"  # a pattern ngram drafts from
    client.completions.create(model=NAME, prompt=p, max_tokens=40, temperature=0)
    m = server.metrics()

    def d(name, **lab):
        return metric(m, name, **lab) - metric(before, name, **lab)
    assert d("npuspec:spec_decode_num_draft_tokens_total") > 0
    assert 0 < d("npuspec:spec_decode_num_accepted_tokens_total") <= d(
        "npuspec:spec_decode_num_draft_tokens_total")
    assert d("npuspec:spec_decode_num_accepted_tokens_per_pos_total", position="0") > 0
    assert d("npuspec:generation_tokens_total") == 40
    assert d("npuspec:time_to_first_token_seconds_count") == 1
    assert d("npuspec:request_success_total", finished_reason="length") == 1
    assert metric(m, "npuspec:spec_decode_mean_acceptance_length") > 1
    # K per step (a fixed K here; the online controller's choices under k_controller online)
    k = NGRAM["num_speculative_tokens"]
    assert d("npuspec:spec_decode_num_steps_by_k_total", k=str(k)) >= 40 / (k + 1)
    assert metric(m, "npuspec:spec_decode_k") == k


def test_stop_strings_n_and_seed(client, offline):
    p = prompts(1)[0]
    full = greedy(offline, [p], 40)[0]
    stop = full[10:14]
    r = client.completions.create(model=NAME, prompt=p, max_tokens=40, temperature=0, stop=stop)
    assert r.choices[0].text == full[:full.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    s = client.completions.create(model=NAME, prompt=p, max_tokens=40, temperature=0,
                                  stop=[stop], stream=True)
    assert "".join(c.choices[0].text for c in s if c.choices) == full[:full.index(stop)]
    kw = dict(model=NAME, prompt=p, max_tokens=24, temperature=0.9, n=2, seed=7)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert len(a.choices) == 2


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "max_tokens": 4, "frobnicate": 1}, "frobnicate"),
    ({"prompt": "x", "max_tokens": 4, "logprobs": 2}, "logprobs"),
    ({"prompt": "x", "max_tokens": 4, "temperature": -1}, "temperature"),
    ({"prompt": "x", "max_tokens": MAX_LEN}, "max_tokens"),
    ({"prompt": "word " * 600, "max_tokens": 4}, "prompt"),
    ({"prompt": "x", "max_tokens": 4, "stream_options": {"include_usage": True}},
     "stream_options"),
    ({"prompt": [], "max_tokens": 4}, "prompt"),
])
def test_bad_requests_are_400_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, **body) if "frobnicate" not in body else \
            client.completions.create(model=NAME, prompt="x", max_tokens=4,
                                      extra_body={"frobnicate": 1})
    err = e.value.body
    assert e.value.status_code == 400
    assert err["param"] == param and param in err["message"], err


def test_malformed_json_unknown_model_and_chat_fields(server, client):
    h = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "x",', headers=h)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", content=b'[1, 2]', headers=h)
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=4)
    assert e.value.body["param"] == "model" and "tiny-chat" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}],
                                       tools=[{"type": "function", "function": {"name": "f"}}])
    assert e.value.body["param"] == "tools"


def test_api_key(server):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.completions.create(model=NAME, prompt="x", max_tokens=4)
    assert e.value.status_code == 401 and "--api-key" in e.value.body["message"]
    assert httpx.get(server.url + "/v1/models").status_code == 401  # no key at all
    assert httpx.get(server.url + "/metrics").status_code == 200    # not under /v1
