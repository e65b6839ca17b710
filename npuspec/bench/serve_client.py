"""`npuspec bench serve`'s plumbing (npuspec/bench/serve.py is the bench): `npuspec serve` as a
subprocess (`ServerProcess`), one streaming /v1/completions request timed per SSE line, and the
HTTP clients. httpx is optional (the [serve] extra): imported where it is used."""
from __future__ import annotations

import atexit
import json
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Optional, Sequence

from npuspec.cli_util.errors import UsageError

HOST = "127.0.0.1"
URL_LINE = re.compile(r"npuspec serve: (?P<name>.+?) on (?P<url>https?://\S+)")  # stdout, first
READY_LINE = re.compile(r"npuspec serve: ready \(speculative: (?P<spec>[^,)]*)")  # stderr
STOP_GRACE_S = 60.0  # SIGTERM drains the requests in flight; after this, SIGKILL


class ServerProcess:
    """`npuspec serve ... --port 0` as a subprocess: start() returns once GET /health answers
    200; stop() sends SIGTERM, waits for the drain, then SIGKILLs. A context manager, so the
    process is stopped whatever happens in between (also KeyboardInterrupt)."""

    def __init__(self, argv: Sequence[str], label: str, timeout: float):
        self.argv, self.label, self.timeout = list(argv), label, timeout
        self.proc: Optional[subprocess.Popen] = None
        self.url = self.name = self.spec = None
        self.returncode: Optional[int] = None
        self.startup_s = 0.0
        self._lines: queue.Queue = queue.Queue()
        self._stdout: list[str] = []
        self._stderr = None
        self._stderr_text = ""  # the tail, kept when stop() closes the file

    def __enter__(self):
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc):
        self.stop()

    def start(self) -> None:
        import httpx

        t0 = time.perf_counter()
        self._stderr = tempfile.TemporaryFile()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        # own session: a terminal's Ctrl-C reaches only the bench, whose finally stops the server
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=self._stderr, env=env, start_new_session=True,
                                     text=True, encoding="utf-8", errors="replace")
        atexit.register(self._kill)
        threading.Thread(target=self._read_stdout, daemon=True, name="npuspec-bench-serve-stdout").start()
        deadline = time.monotonic() + self.timeout
        while self.url is None:
            try:
                m = URL_LINE.search(self._lines.get(timeout=0.25))
            except queue.Empty:
                m = None
                self._check(deadline, "printed its address")
            if m:
                self.url, self.name = m["url"], m["name"]
        with httpx.Client(trust_env=False, timeout=5.0) as client:
            while True:
                try:
                    if client.get(self.url + "/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                self._check(deadline, "answered GET /health")
                time.sleep(0.25)
        self.startup_s = time.perf_counter() - t0
        ready = READY_LINE.search(self.stderr_tail(lines=200, chars=100000))
        if ready:
            self.spec = ready["spec"]

    def _read_stdout(self) -> None:
        for line in self.proc.stdout:
            self._stdout.append(line.rstrip("\n"))
            self._lines.put(line)

    def stderr_tail(self, lines: int = 12, chars: int = 2000) -> str:
        if self._stderr is None:
            return self._stderr_text
        self._stderr.flush()
        self._stderr.seek(0)
        text = self._stderr.read().decode("utf-8", "replace")
        tail = "\n".join(text.strip().splitlines()[-lines:])[-chars:]
        return tail or "(nothing)"

    def _check(self, deadline: float, what: str) -> None:
        """Raise if the server died or the deadline passed before it `what`."""
        rc = self.proc.poll()
        if rc is not None:
            tail = self.stderr_tail()
            msg = (f"npuspec serve ({self.label}) exited with status {rc} before it {what}; its "
                   f"stderr ends with: {tail}")
            if rc == 2:  # the server refused a flag: a usage error, named by the server's message
                flag = re.search(r"error: (--[a-z][a-z-]*)", tail)
                raise UsageError(msg, flag[1] if flag else None)
            raise RuntimeError(msg)
        if time.monotonic() > deadline:
            raise UsageError(f"npuspec serve ({self.label}) had not {what} after {self.timeout:g} s "
                             f"(model load and compile warm-up); raise --server-timeout, or try a "
                             f"faster lowering (--compilation-config '{{\"backend\": \"eager\"}}'); "
                             f"its stderr ends with: {self.stderr_tail()}", "--server-timeout")

    def stop(self, grace: float = STOP_GRACE_S) -> Optional[int]:
        p = self.proc
        if p is None:
            return None
        if p.poll() is None:
            try:
                p.send_signal(signal.SIGTERM)
                p.wait(grace)
            except subprocess.TimeoutExpired:
                print(f"npuspec bench serve: the {self.label} server did not exit {grace:g} s after "
                      f"SIGTERM; killing it", file=sys.stderr)
                p.kill()
                p.wait(30)
            except BaseException:  # a second Ctrl-C while draining: do not leave it behind
                p.kill()
                p.wait(30)
                raise
        self.returncode = p.returncode
        atexit.unregister(self._kill)
        if p.stdout:
            p.stdout.close()
        self._stderr_text = self.stderr_tail(lines=40, chars=8000)
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None
        return self.returncode

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()


def _new_record(index: int, prompt_index: int) -> dict:
    return {"index": index, "prompt_index": prompt_index, "ok": False, "error": None,
            "ttft": None, "tpot": None, "e2e": None, "itl": [], "output_tokens": 0,
            "prompt_tokens": None, "text": "", "sent_s": None}


async def send_request(client, base: str, model: str, prompt: str, max_tokens: int,
                       index: int = -1, prompt_index: int = -1, t_ref: float = 0.0) -> dict:
    """One streaming /v1/completions request, timed on arrival of each SSE line."""
    import httpx

    rec = _new_record(index, prompt_index)
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    parts: list[str] = []
    usage = None
    done = False
    last = None
    t0 = time.perf_counter()
    rec["sent_s"] = t0 - t_ref
    try:
        async with client.stream("POST", base + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                raw = (await resp.aread()).decode("utf-8", "replace")
                rec["error"] = f"HTTP {resp.status_code}: {' '.join(raw.split())[:300]}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                obj = json.loads(data)
                if "error" in obj:
                    rec["error"] = f"error chunk: {json.dumps(obj['error'])[:300]}"
                    return rec
                if obj.get("usage"):
                    usage = obj["usage"]
                for ch in obj.get("choices") or ():
                    text = ch.get("text") or ""
                    if text:
                        now = time.perf_counter()
                        if last is None:
                            rec["ttft"] = now - t0
                        else:
                            rec["itl"].append(now - last)
                        last = now
                        parts.append(text)
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        rec["error"] = f"{type(e).__name__}: {e}"
        return rec
    rec["e2e"] = time.perf_counter() - t0
    rec["text"] = "".join(parts)
    if not done:
        rec["error"] = "the stream ended without data: [DONE]"
    elif usage is None:
        rec["error"] = "no usage chunk (stream_options.include_usage)"
    else:
        rec["ok"] = True
        rec["output_tokens"] = int(usage.get("completion_tokens") or 0)
        rec["prompt_tokens"] = usage.get("prompt_tokens")
        if rec["ttft"] is not None and rec["output_tokens"] > 1:
            rec["tpot"] = (rec["e2e"] - rec["ttft"]) / (rec["output_tokens"] - 1)
    return rec


def http_client(max_concurrency: int):
    import httpx

    n = max_concurrency + 4
    return httpx.AsyncClient(trust_env=False, limits=httpx.Limits(max_connections=n, max_keepalive_connections=n),
                             timeout=httpx.Timeout(600.0, connect=30.0, pool=None))


async def run_sequential(base: str, model: str, prompts: Sequence[str], max_tokens: int) -> dict:
    """`prompts` one at a time (concurrency 1), timed as a whole."""
    async with http_client(1) as client:
        t0 = time.perf_counter()
        records = [await send_request(client, base, model, p, max_tokens, i, i, t0)
                   for i, p in enumerate(prompts)]
        wall = time.perf_counter() - t0
    return {"records": records, "seconds": wall}
