"""The HTTP process's side of the engine: `EngineClient` starts the engine process
(npuspec.serve.core) and builds checked requests; `AsyncEngine` hands them in and streams
their tokens out on the event loop.

Requests are checked here (prompt ids, vocabulary, length, sampling fields) before anything
is sent, so a bad request is a 400 without a round trip. Seeds of unseeded random requests
are drawn here, in arrival order, from a generator seeded as `LLM(seed=...)` seeds its own,
so a server reproduces the offline engine.

The event loop reads the engine's step messages with `add_reader` (no thread); a sender
thread writes to the pipe, so the loop never blocks on a full pipe while the engine, in
turn, waits for the loop to read. A consumer that falls behind reads several steps' tokens
at once (`Delta` merges them), so a slow client never slows the engine.
"""
from __future__ import annotations

import asyncio
import atexit
import dataclasses
import logging
import multiprocessing as mp
import queue
import threading
import time
from typing import AsyncIterator, Optional

import numpy as np

from npuspec.cli_util.errors import UsageError
from npuspec.engine.request import parse_requests
from npuspec.engine.sampling import SamplingParams
from npuspec.models import load_tokenizer
from npuspec.serve import core
from npuspec.serve.args import check_engine_config

log = logging.getLogger(__name__)

LOAD_POLL_S = 0.5


@dataclasses.dataclass
class Delta:
    token_ids: list[int]
    finished: bool = False
    finish_reason: Optional[str] = None
    kv_transfer_params: Optional[dict] = None


class EngineDead(RuntimeError):
    """The engine stopped (a failed step, or its process died); the server answers 503."""


class EngineClient:
    """The engine process and what the HTTP side needs to know of its model."""

    def __init__(self, args):
        check_engine_config(args)  # the start-up checks: fail before a process starts
        ctx = mp.get_context("spawn")  # never fork a process that has imported torch
        self.conn, child = ctx.Pipe(duplex=True)
        # a daemon cannot start processes, and with --tensor-parallel-size N the engine
        # spawns its N-1 workers: then it is an ordinary child, closed before exit
        tp = getattr(args, "tensor_parallel_size", 1) > 1
        self.proc = ctx.Process(target=core.engine_main, args=(child, args),
                                name="npuspec-engine", daemon=not tp)
        self.proc.start()
        if tp:
            atexit.register(self.close)  # runs before multiprocessing joins its children
        child.close()  # else this process would never see the engine's end close
        msg = self._wait_ready()
        if msg[0] == "failed":
            self.proc.join(30)
            raise _relay(msg[1])
        info = msg[1]
        self.max_model_len: int = info["max_model_len"]
        self.model_path: str = info["model_path"]
        self.k_max: int = info["k_max"]
        self.num_blocks: int = info["num_blocks"]
        self.vocab_size: int = info["vocab_size"]
        self.eos_ids = frozenset(info["eos_ids"])
        self.max_num_seqs: int = info["max_num_seqs"]
        self.spec: str = info["spec"]
        self.tokenizer = load_tokenizer(self.model_path)
        self._rng = np.random.default_rng(args.seed)  # as LLM(seed=...) seeds its own
        self._calls = 0

    def _wait_ready(self):
        try:
            while not self.conn.poll(LOAD_POLL_S):
                if not self.proc.is_alive():
                    raise EOFError
            return self.conn.recv()
        except EOFError:
            self.proc.join(30)
            raise RuntimeError(f"the engine process exited with status {self.proc.exitcode} "
                               f"while loading the model; its stderr above says why") from None

    def new_request(self, prompt, params=None, request_id: Optional[str] = None):
        """A checked request, as LLM.new_request makes one (ValueError on a bad prompt)."""
        params = SamplingParams() if params is None else params
        if isinstance(params, SamplingParams) and not params.greedy and params.seed is None:
            params = dataclasses.replace(params, seed=int(self._rng.integers(2**62)))
        self._calls += 1
        r, = parse_requests([prompt], params, self._calls, vocab_size=self.vocab_size,
                            max_model_len=self.max_model_len, tokenizer=self.tokenizer,
                            model_path=self.model_path, eos_ids=self.eos_ids, rng=self._rng,
                            device="cpu")
        if request_id is not None:
            r.req_id = str(request_id)
        return r

    def close(self, timeout: float = 60.0) -> None:
        """Ask the engine to finish and exit; kill it if it does not."""
        if self.proc.is_alive():
            try:
                self.conn.send(("stop",))
            except OSError:
                pass
            self.proc.join(timeout)
            if self.proc.is_alive():
                log.warning("npuspec serve: the engine process did not stop in %.0f s; killing it",
                            timeout)
                self.proc.kill()
                self.proc.join(10)
        self.conn.close()


def _relay(info) -> Exception:
    """The load's exception, raised again here: a usage error keeps its field (exit 2)."""
    if info.usage:
        e = UsageError(info.message)
        e.field = info.field
        return e
    return RuntimeError(f"the engine process failed to load the model: {info.type_name}: "
                        f"{info.message}\n{info.traceback}")


class AsyncEngine:
    def __init__(self, client: EngineClient, metrics=None):
        self.client = client
        self.metrics = metrics
        self._sinks: dict[str, tuple[asyncio.Queue, Optional[list]]] = {}  # loop thread only
        self._outbox: queue.Queue = queue.Queue()
        self._sender: Optional[threading.Thread] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self.error: Optional[EngineDead] = None

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._sender = threading.Thread(target=self._send_loop, name="npuspec-engine-send",
                                        daemon=True)
        self._sender.start()
        self._loop.add_reader(self.client.conn.fileno(), self._on_readable)

    def shutdown(self, timeout: float = 60.0) -> None:
        """Stop the engine process once what is in flight is done (uvicorn drained first)."""
        if self._loop is not None and not self.client.conn.closed:
            self._loop.remove_reader(self.client.conn.fileno())
        self._outbox.put(None)
        if self._sender is not None:
            self._sender.join(timeout)
        self.client.close(timeout)

    @property
    def alive(self) -> bool:
        return self.error is None and self.client.proc.is_alive()

    # -- requests --------------------------------------------------------------------------------
    async def generate(self, req, deltas: bool = True) -> AsyncIterator[Delta]:
        """Add `req` (from client.new_request) and yield its tokens as they come (deltas=False:
        once, when it finishes). Leaving early (a client gone) aborts it and frees its blocks."""
        if not self.alive:
            raise EngineDead(f"the engine stopped: {self.error or 'its process exited'}")
        sink: asyncio.Queue = asyncio.Queue()
        if req.req_id in self._sinks:
            raise RuntimeError(f"request id {req.req_id!r} is already running")
        self._sinks[req.req_id] = (sink, None if deltas else [])
        now = time.perf_counter()
        if self.metrics is not None:
            self.metrics.on_add(req.req_id, len(req.prompt_ids), now)
        self._outbox.put(core.add_message(req, now))
        done = False
        try:
            while not done:
                d = await sink.get()
                while not sink.empty() and isinstance(d, Delta) and not d.finished:
                    nxt = sink.get_nowait()
                    if not isinstance(nxt, Delta):
                        d = nxt
                        break
                    d = Delta(d.token_ids + nxt.token_ids, nxt.finished, nxt.finish_reason,
                              nxt.kv_transfer_params)
                if isinstance(d, BaseException):
                    raise d
                done = d.finished
                yield d
        finally:
            if not done:
                self.abort(req.req_id)

    def abort(self, req_id: str, reason: str = "abort") -> None:
        """Stop a request early (`reason` "stop": a stop string ended it)."""
        if self._sinks.pop(req_id, None) is not None:
            self._outbox.put(("abort", req_id, reason))

    # -- the pipe --------------------------------------------------------------------------------
    def _send_loop(self) -> None:
        conn = self.client.conn
        while True:
            msg = self._outbox.get()
            if msg is None:
                return
            try:
                conn.send(msg)
            except OSError:  # the engine is gone; the reader reports it
                return

    def _on_readable(self) -> None:
        conn = self.client.conn
        try:
            while conn.poll():
                msg = conn.recv()
                if msg[0] == "step":
                    self._on_step(*msg[1:])
                elif msg[0] == "dead":
                    self._fail(msg[1])
                    return
        except (EOFError, OSError):
            self._fail(f"the engine process exited (status {self.client.proc.exitcode})")

    def _on_step(self, outs, gauges, aborted, refused) -> None:
        for o in outs:
            entry = self._sinks.get(o.req_id)
            if entry is None:  # aborted here already
                continue
            sink, held = entry
            if o.finish_reason is not None:
                del self._sinks[o.req_id]
            if held is not None:
                held += o.token_ids
                if o.finish_reason is None:
                    continue
            toks = held if held is not None else o.token_ids
            sink.put_nowait(Delta(toks, o.finish_reason is not None, o.finish_reason,
                                  o.kv_transfer_params))
        for rid, message in refused:
            entry = self._sinks.pop(rid, None)
            if entry is not None:
                entry[0].put_nowait(RuntimeError(message))
        if self.metrics is not None:
            self.metrics.on_step(outs, gauges, aborted, time.perf_counter())

    def _fail(self, message: str) -> None:
        if self.error is not None:
            return
        log.error("npuspec serve: %s; failing %d request(s)", message, len(self._sinks))
        self.error = EngineDead(message)
        self._loop.remove_reader(self.client.conn.fileno())
        for sink, _ in self._sinks.values():
            sink.put_nowait(EngineDead(message))
        self._sinks.clear()
