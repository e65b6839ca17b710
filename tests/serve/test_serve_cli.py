"""`npuspec serve` start-up errors (a clear exit, naming the flag) and the SIGTERM drain."""
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from serve_helpers import NGRAM

httpx = pytest.importorskip("httpx")


def serve(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "npuspec.cli", "serve", *args], text=True,
                          capture_output=True, timeout=timeout)


@pytest.mark.parametrize("args, flag, words", [
    (["--speculative-config", '{"method": "ngramm", "num_speculative_tokens": 4}'],
     "--speculative-config", "ngram"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4,'],
     "--speculative-config", "not valid JSON"),
    (["--compilation-config", '{"backend": "tvm"}'], "--compilation-config", "inductor"),
    (["--additional-config", "[1]"], "--additional-config", "JSON object"),
    (["--max-num-seqs", "0"], "--max-num-seqs", ">= 1"),
    (["--tensor-parallel-size", "3"], "tensor_parallel_size", "not divisible"),
    (["--port", "70000"], "--port", "65535"),
])
def test_bad_start_up_config_exits_2_naming_the_flag(args, flag, words):
    r = serve("tiny", "--port", "0", *args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    err = r.stderr.strip().splitlines()[-1]
    assert flag in err and words in err, err
    assert "Traceback" not in r.stderr


def test_port_in_use_exits_2():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        r = serve("tiny", "--port", str(s.getsockname()[1]))
    assert r.returncode == 2 and "--port" in r.stderr and "cannot listen" in r.stderr, r.stderr


def test_sigterm_drains_in_flight_streams_then_exits(start_server):
    s = start_server("tiny", "--enforce-eager", "--max-model-len", "256",
                     "--threads", "1")
    results, started = {}, threading.Semaphore(0)

    def stream(i):
        body = {"model": "tiny", "prompt": f"def f{i}(x):\n", "max_tokens": 60,
                "temperature": 0, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        chunks = []
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
                    if len(chunks) == 1:
                        started.release()
                elif line == "data: [DONE]":
                    chunks.append("DONE")
        results[i] = chunks

    engine = _children(s.proc.pid)
    assert len(engine) == 1, engine  # the engine process
    threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for _ in threads:
        assert started.acquire(timeout=120)
    s.proc.send_signal(signal.SIGTERM)   # every stream is mid-flight
    for t in threads:
        t.join(120)
    assert s.proc.wait(60) == 0
    for i in range(3):
        chunks = results[i]
        assert chunks[-1] == "DONE", chunks[-3:]
        assert chunks[-2]["usage"]["completion_tokens"] == 60
        assert chunks[-3]["choices"][0]["finish_reason"] == "length"
    with pytest.raises(httpx.ConnectError):  # and it is gone
        httpx.get(s.url + "/health", timeout=5)
    assert _alive_children(engine) == [], "the engine process outlived the server"


def _children(pid: int) -> list[int]:
    """Live engine processes of `pid` (Linux /proc): the server's engine process (spawned)
    or a tensor-parallel worker (`python -m npuspec.engine.tp_worker`), not the resource
    tracker that spawn also starts."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    cmd = f.read()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z" and (b"spawn_main" in cmd
                                                           or b"npuspec.engine.tp_worker" in cmd):
                out.append(int(d))
    return out


def _alive_children(pids: list[int]) -> list[int]:
    alive = []
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    alive.append(p)
        except OSError:
            pass
    return alive


def _kill_mid_stream(s, pid: int, max_tokens: int):
    """SIGKILL `pid` after a stream's third line -> (the request body, its 503 error)."""
    body = {"model": "tiny", "prompt": "def f(x):\n", "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True}
    lines = []
    with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            lines.append(line)
            if len(lines) == 3:
                os.kill(pid, signal.SIGKILL)  # mid-stream
    errors = [json.loads(x[6:]) for x in lines if x.startswith("data: {\"error\"")]
    assert errors and errors[0]["error"]["code"] == 503, lines[-3:]
    return body, errors[0]["error"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_dead_engine_process_fails_requests_with_503_not_a_hang(start_server):
    s = start_server("tiny", "--enforce-eager", "--max-model-len", "256",
                     "--threads", "1")
    engine, = _children(s.proc.pid)
    body, error = _kill_mid_stream(s, engine, 200)
    assert "engine process exited" in error["message"]
    assert httpx.get(s.url + "/health", timeout=10).status_code == 503
    r = httpx.post(s.url + "/v1/completions", json={**body, "stream": False}, timeout=10)
    assert r.status_code == 503 and "engine" in r.json()["error"]["message"]
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(60) == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_tensor_parallel_server_matches_one_device_then_a_dead_worker_fails_requests(start_server):
    """`--tensor-parallel-size 2`: the engine process spawns its rank-1 worker; greedy
    completions equal the one-device engine's. Then SIGKILL the worker mid-stream: the stream
    ends in a 503 naming rank 1, /health turns 503, and SIGTERM still exits 0 leaving neither
    process behind. (One server for both: a TP server start costs three processes.)"""
    from npuspec import LLM, SamplingParams
    s = start_server("tiny", "--enforce-eager", "--max-model-len", "512",
                     "--tensor-parallel-size", "2",
                     "--speculative-config", json.dumps(NGRAM))
    engine, = _children(s.proc.pid)
    worker, = _children(engine)
    prompts = ["def fib(n):", "The quick brown fox"]
    got = []
    for p in prompts:
        r = httpx.post(s.url + "/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": p, "max_tokens": 20, "temperature": 0})
        assert r.status_code == 200, r.text
        got.append(r.json()["choices"][0]["text"])
    llm = LLM("tiny", max_model_len=512, speculative_config=NGRAM, enforce_eager=True)
    ref = [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(max_tokens=20,
                                                                           temperature=0))]
    assert got == ref

    _, error = _kill_mid_stream(s, worker, 400)
    assert "worker rank 1" in error["message"], error
    assert httpx.get(s.url + "/health", timeout=10).status_code == 503
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(60) == 0
    time.sleep(0.5)
    assert _alive_children([engine, worker]) == [], "a process outlived the server"
