"""`npuspec bench serve` (npuspec/bench/serve.py): the whole client side against a stub server
(a stdlib HTTP script speaking npuspec serve's stdout line, /health, SSE /v1/completions and
/metrics, started as the real one is: a subprocess, stopped with SIGTERM), bad input, the
statistics, and one run on the embedded model with real servers (two servers start)."""
import json
import math
import os
import sys

import pytest

from npuspec.bench import serve
from npuspec.cli_util.errors import UsageError

STUB = r'''
import argparse, json, os, signal, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

p = argparse.ArgumentParser()
p.add_argument("model")
p.add_argument("--host"); p.add_argument("--port", type=int)
p.add_argument("--served-model-name"); p.add_argument("--speculative-config")
args, _ = p.parse_known_args()
mode = os.environ.get("STUB_MODE", "ok")
spec = json.loads(args.speculative_config) if args.speculative_config else None
with open(os.environ["STUB_PIDS"], "a") as f:
    f.write(f"{os.getpid()}\n")
if mode == "die":
    print("npuspec serve: error: the stub fell over on purpose", file=sys.stderr, flush=True)
    sys.exit(1)
state = {"ready": mode != "hang", "drafts": 0, "draft_tokens": 0, "accepted": 0, "gen": 0}
lock = threading.Lock()

class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_GET(self):
        if self.path == "/health":
            self.send_response(200 if state["ready"] else 503); self.end_headers(); return
        if self.path == "/metrics":
            with lock:
                body = "".join(
                    f"# TYPE npuspec:{n} counter\nnpuspec:{n}_total{{model_name=\"m\"}} {float(state[k])}\n"
                    for n, k in (("spec_decode_num_drafts", "drafts"),
                                 ("spec_decode_num_draft_tokens", "draft_tokens"),
                                 ("spec_decode_num_accepted_tokens", "accepted"),
                                 ("generation_tokens", "gen")))
            self.send_response(200); self.end_headers(); self.wfile.write(body.encode()); return
        self.send_response(404); self.end_headers()

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert req["stream"] and req["ignore_eos"] and req["temperature"] == 0, req
        assert req["model"] == args.served_model_name, req
        n, prompt = req["max_tokens"], req["prompt"]
        pieces = [f" {prompt[:3]}{i}" for i in range(n)]
        if mode == "mismatch" and spec and prompt == "beta":
            pieces[-1] = " DIFFERENT"
        step = 2 if spec else 1  # a speculative step delivers several tokens in one chunk
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream"); self.end_headers()
        for i in range(0, n, step):
            time.sleep(0.002)
            chunk = {"choices": [{"index": 0, "text": "".join(pieces[i:i + step]), "finish_reason": None}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode()); self.wfile.flush()
        # counted before [DONE], as the real server counts a step before it streams it: a
        # client that reads /metrics right after [DONE] must see this request
        with lock:
            state["gen"] += n
            if spec:
                steps = (n + 1) // 2
                state["drafts"] += steps; state["draft_tokens"] += 4 * steps; state["accepted"] += steps
        usage = {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}
        self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())

srv = ThreadingHTTPServer((args.host, args.port), H)
srv.daemon_threads = True
print(f"npuspec serve: {args.served_model_name} on http://{args.host}:{srv.server_address[1]}", flush=True)
print(f"npuspec serve: ready (speculative: {spec['method'] if spec else 'none'}, max_model_len 64)",
      file=sys.stderr, flush=True)
signal.signal(signal.SIGTERM, lambda s, f: threading.Thread(target=srv.shutdown).start())
srv.serve_forever()
'''


@pytest.fixture
def stub(tmp_path, monkeypatch):
    """Point the bench at the stub server; returns a function giving the pids it started."""
    path = tmp_path / "stub_server.py"
    path.write_text(STUB)
    pids = tmp_path / "pids"
    monkeypatch.setenv("STUB_PIDS", str(pids))
    real = serve.server_argv

    def argv(*a, **kw):
        full = real(*a, **kw)
        assert full[1:4] == ["-m", "npuspec.cli", "serve"], full
        return [sys.executable, str(path)] + full[4:]
    monkeypatch.setattr(serve, "server_argv", argv)
    return lambda: [int(x) for x in pids.read_text().split()] if pids.exists() else []


@pytest.fixture
def prompts(tmp_path):
    f = tmp_path / "prompts.json"
    f.write_text(json.dumps(["alpha", "beta", "gamma"]))
    return str(f)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _check_dist(d: dict, n: int) -> None:
    assert d["n"] == n
    assert 0 < d["median"] <= d["p90"] <= d["p99"], d
    assert d["mean"] > 0


def test_server_argv_passes_the_engine_flags():
    args = serve.build_parser().parse_args(["--compilation-config", '{"backend": "eager"}',
                                            "--enforce-eager", "--threads", "2"])
    argv = serve.server_argv("m", {"method": "ngram"}, args, 64)
    assert argv[argv.index("--compilation-config") + 1] == '{"backend": "eager"}'
    assert "--enforce-eager" in argv and argv[argv.index("--threads") + 1] == "2"
    assert argv[argv.index("--max-model-len") + 1] == "64"
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == {"method": "ngram"}


def test_stub_server_run(stub, prompts, tmp_path, capsys):
    out = tmp_path / "serve.json"
    rc = serve.main(["--prompts", prompts, "--num-prompts", "7", "--max-tokens", "6",
                     "--max-concurrency", "3", "--max-model-len", "64", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "== bench serve: tiny, 7 requests x 6 tokens" in text and "== latencies (ms) ==" in text
    assert "greedy texts: ngram identical to none on 7/7 requests" in text
    doc = json.loads(out.read_text())
    assert doc["schema"] == serve.SCHEMA and doc["methods"] == ["none", "ngram"]
    assert doc["request_rate"] is None and doc["max_model_len"] == 64
    for row in doc["rows"]:
        assert row["completed"] == 7 and row["failed"] == 0 and row["output_tokens"] == 42
        assert row["output_tokens_per_s"] > 0 and row["request_throughput"] > 0
        assert row["server_exit_status"] == 0
        for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
            _check_dist(row[key], 7)
        assert row["ttft_ms"]["p99"] <= row["e2e_ms"]["p99"]
    none, ngram = doc["rows"]
    assert none["itl_ms"]["n"] == 7 * 5 and ngram["itl_ms"]["n"] == 7 * 2  # 6 chunks vs 3
    assert none["spec"]["mean_acceptance_length"] is None
    # the stub's counters: 1 accepted of 4 drafted per step; the warm-up is not counted
    assert ngram["spec"]["mean_acceptance_length"] == pytest.approx(2.0)
    assert ngram["spec"]["acceptance_rate"] == pytest.approx(0.25)
    assert ngram["spec"]["generation_tokens"] == 42
    # /metrics read through the run: its intervals' tokens add up to the run's
    for row in doc["rows"]:
        tl = row["timeline"]
        assert tl and all(p["mean_k"] is None for p in tl)  # the stub reports no K per step
        assert [p["t"] for p in tl] == sorted(p["t"] for p in tl)
    assert doc["identity"]["ngram"] == {"compared": 7, "identical": 7, "mismatches": 0,
                                        "first_mismatch": None}
    reqs = doc["requests"]
    assert [r["prompt_index"] for r in reqs["none"]] == [0, 1, 2, 0, 1, 2, 0]
    assert reqs["none"][1]["text"] == " bet0 bet1 bet2 bet3 bet4 bet5"
    pids = stub()
    assert len(pids) == 2 and all(_gone(p) for p in pids)


def test_stub_mismatch_is_reported(stub, prompts, monkeypatch, capsys):
    monkeypatch.setenv("STUB_MODE", "mismatch")
    rc = serve.main(["--prompts", prompts, "--num-prompts", "6", "--max-tokens", "4",
                     "--request-rate", "200", "--seed", "3"])
    text = capsys.readouterr().out
    assert rc == 1, text
    assert "!! GREEDY TEXT MISMATCH: ngram differs from none on 2/6 requests" in text
    assert "prompt 1" in text and "DIFFERENT" in text
    assert all(_gone(p) for p in stub())


def test_server_dies_at_start(stub, prompts, monkeypatch, capsys):
    monkeypatch.setenv("STUB_MODE", "die")
    assert serve.main(["--prompts", prompts, "--methods", "none", "--num-prompts", "2"]) == 1
    err = capsys.readouterr().err
    assert "exited with status 1 before it" in err and "fell over on purpose" in err


def test_server_timeout_kills_it(stub, prompts, monkeypatch, capsys):
    monkeypatch.setenv("STUB_MODE", "hang")  # /health answers 503 for ever
    assert serve.main(["--prompts", prompts, "--methods", "none", "--server-timeout", "3"]) == 2
    err = capsys.readouterr().err
    assert "--server-timeout" in err and "had not answered GET /health after 3 s" in err
    pids = stub()
    assert len(pids) == 1 and _gone(pids[0])


def test_interrupt_stops_the_server(stub, prompts, monkeypatch, capsys):
    async def interrupted(*a, **kw):
        raise KeyboardInterrupt
    monkeypatch.setattr(serve, "run_load", interrupted)
    assert serve.main(["--prompts", prompts, "--methods", "none"]) == 130
    pids = stub()
    assert len(pids) == 1 and _gone(pids[0])


@pytest.mark.parametrize("argv, flag", [
    (["--methods", "bogus"], "--methods"),
    (["--methods", "none,none"], "--methods"),
    (["--methods", ""], "--methods"),
    (["--request-rate", "-1"], "--request-rate"),
    (["--request-rate", "nan"], "--request-rate"),
    (["--server-timeout", "0"], "--server-timeout"),
    (["--compilation-config", "{backend: eager}"], "--compilation-config"),
    (["--speculative-config", '{"method": "bogus"}'], "--speculative-config"),
    (["--model", "/no/such/model"], "--model"),
    (["--json", "/no/such/dir/out.json"], "--json"),
])
def test_bad_input(argv, flag, capsys):
    """Refused with a UsageError naming the flag, before any server starts (exit 2 via main)."""
    with pytest.raises(UsageError) as e:
        serve.run(serve.build_parser().parse_args(argv))
    assert e.value.field == flag
    assert serve.main(argv) == 2
    err = capsys.readouterr().err
    assert f"npuspec bench serve: error: {flag}:" in err and "Traceback" not in err


def test_statistics():
    assert serve.percentile([3, 1, 2, 4], 50) == 2.5
    assert serve.percentile([5], 99) == 5
    assert serve.percentile(range(101), 90) == pytest.approx(90)
    d = serve.dist_ms([0.001, 0.002, 0.003])
    assert d["mean"] == pytest.approx(2.0) and d["median"] == pytest.approx(2.0) and d["n"] == 3
    assert serve.dist_ms([])["p99"] is None
    a = serve.arrival_offsets(2000, 50.0, seed=1)
    assert a == serve.arrival_offsets(2000, 50.0, seed=1) and a[0] == 0
    gaps = [y - x for x, y in zip(a, a[1:])]
    assert min(gaps) > 0 and sum(gaps) / len(gaps) == pytest.approx(1 / 50, rel=0.1)
    assert serve.arrival_offsets(4, math.inf, seed=0) == [0.0] * 4


def test_parse_metrics():
    text = ('# TYPE npuspec:spec_decode_num_drafts counter\n'
            'npuspec:spec_decode_num_drafts_total{model_name="m"} 10.0\n'
            '# TYPE npuspec:spec_decode_num_draft_tokens counter\n'
            'npuspec:spec_decode_num_draft_tokens_total{model_name="m"} 40.0\n'
            '# TYPE npuspec:spec_decode_num_accepted_tokens counter\n'
            'npuspec:spec_decode_num_accepted_tokens_total{model_name="m"} 13.0\n'
            '# TYPE npuspec:spec_decode_num_accepted_tokens_per_pos counter\n'
            'npuspec:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 8.0\n'
            'npuspec:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 5.0\n')
    before = {"npuspec:spec_decode_num_drafts_total": 2.0,
              "npuspec:spec_decode_num_accepted_tokens_total": 1.0,
              "npuspec:spec_decode_num_accepted_tokens_per_pos_total{position=0}": 1.0}
    m = serve.spec_metrics(before, serve.parse_metrics(text))
    assert m["num_drafts"] == 8 and m["num_accepted_tokens"] == 12
    assert m["mean_acceptance_length"] == pytest.approx(1 + 12 / 8)
    assert m["acceptance_rate"] == pytest.approx(12 / 40)
    assert m["acceptance_by_position"] == pytest.approx([7 / 8, 5 / 8])


def test_embedded_model_two_servers(tiny_available, tmp_path, capsys):
    """Real `npuspec serve` subprocesses on the embedded model: every request completes, the
    percentiles are ordered, ngram's greedy texts equal no speculation's, and both servers are
    gone afterwards. The servers run uncompiled (--enforce-eager): serving is the subject."""
    out = tmp_path / "serve.json"
    started = []
    real = serve.ServerProcess.start

    def start(self):
        started.append(self)
        return real(self)
    mp = pytest.MonkeyPatch()
    mp.setattr(serve.ServerProcess, "start", start)
    try:
        rc = serve.main(["--enforce-eager",
                         "--methods", "none,ngram", "--num-prompts", "6", "--max-tokens", "16",
                         "--max-num-seqs", "4", "--max-concurrency", "4", "--server-timeout", "300",
                         "--json", str(out)])
    finally:
        mp.undo()
    text = capsys.readouterr().out
    assert rc == 0, text
    doc = json.loads(out.read_text())
    for row in doc["rows"]:
        assert row["completed"] == 6 and row["failed"] == 0 and row["short_outputs"] == 0
        assert row["output_tokens"] == 6 * 16 and row["output_tokens_per_s"] > 0
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            d = row[key]
            assert d["median"] <= d["p99"], (key, d)
        assert row["server_exit_status"] == 0
    ngram = doc["rows"][1]["spec"]
    assert ngram["num_draft_tokens"] > 0 and ngram["mean_acceptance_length"] >= 1.0
    assert doc["identity"]["ngram"]["mismatches"] == 0
    assert doc["identity"]["ngram"]["identical"] == 6
    texts = [[r["text"] for r in doc["requests"][m]] for m in ("none", "ngram")]
    assert texts[0] == texts[1] and all(texts[0])
    assert len(started) == 2 and all(s.proc.poll() is not None for s in started)
    assert all("--enforce-eager" in s.argv for s in started) and doc["enforce_eager"]


def test_offline_regime_three_sides(tiny_available, tmp_path, capsys):
    """--offline on the embedded model: server at concurrency 1, offline LLM and the engine
    process alone alternate; all three give the same greedy texts and every side is timed."""
    out = tmp_path / "serve.json"
    rc = serve.main(["--enforce-eager", "--methods", "none",
                     "--num-prompts", "2", "--max-concurrency", "1", "--max-tokens", "8",
                     "--offline", "--offline-prompts", "2", "--rounds", "2",
                     "--server-timeout", "300", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "engine process / offline" in text
    o, = json.loads(out.read_text())["offline"]
    assert o["rounds"] == 2 and o["failed"] == 0 and o["requests"] == 2
    for side in ("server", "offline", "engine_process"):
        assert len(o[f"{side}_rounds"]) == 2 and all(x > 0 for x in o[f"{side}_rounds"]), side
    assert o["same_text"] == 2 and o["engine_process_same_text"] == 2
    assert o["server_texts"] == o["offline_texts"] and all(o["offline_texts"])
    assert o["server_over_offline"] > 0 and o["engine_process_over_offline"] > 0


def test_timeline_from_metrics_samples():
    """Tokens/s and the mean K per interval between /metrics reads (the per-K step counter)."""
    k = "npuspec:spec_decode_num_steps_by_k_total{k=%d}"
    gen = "npuspec:generation_tokens_total"
    samples = [(0.0, {gen: 0.0}),
               (0.5, {gen: 50.0, k % 4: 10.0, k % 1: 0.0}),
               (1.0, {gen: 70.0, k % 4: 10.0, k % 1: 10.0}),
               (1.0, {gen: 70.0, k % 4: 10.0, k % 1: 10.0}),   # zero-length: skipped
               (2.0, {gen: 80.0, k % 4: 10.0, k % 1: 10.0})]
    tl = serve.timeline(samples)
    assert [p["t"] for p in tl] == [0.25, 0.75, 1.5]
    assert [p["tokens_per_s"] for p in tl] == [100.0, 40.0, 10.0]
    assert [p["mean_k"] for p in tl] == [4.0, 1.0, None]
    assert serve.timeline(samples[:1]) == []
