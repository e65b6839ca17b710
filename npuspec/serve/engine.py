"""One engine loop for every connection: a thread that owns the `LLM` and runs its step API,
and an asyncio front that hands requests in and streams their tokens out.

The thread, between steps, takes what the connections sent (new requests, aborts) from a
queue, so continuous batching admits requests from all of them; after each step it posts
the step's tokens to the requests' asyncio queues with one `call_soon_threadsafe`. A
consumer that falls behind reads several steps' tokens at once (`Delta` merges them), so a
slow client never slows the loop. torch releases the GIL inside its kernels, so the HTTP side
runs while a step computes.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
from typing import AsyncIterator, Optional

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Delta:
    token_ids: list[int]
    finished: bool = False
    finish_reason: Optional[str] = None
    kv_transfer_params: Optional[dict] = None


class EngineDead(RuntimeError):
    """The engine loop stopped on an error; the server answers 503 from then on."""


class AsyncEngine:
    def __init__(self, llm, metrics=None):
        self.llm = llm
        self.metrics = metrics
        self._inbox: queue.Queue = queue.Queue()
        self._sinks: dict[str, asyncio.Queue] = {}       # engine thread only
        self._held: dict[str, list[int]] = {}            # tokens of deltas=False requests
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self.error: Optional[BaseException] = None
        self.num_aborted = 0

    # -- lifecycle (event-loop side) ----------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="npuspec-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 60.0) -> None:
        """Finish what is in flight, then stop the thread."""
        if self._thread is None:
            return
        self._inbox.put(("stop", None, None))
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self.error is None and self._thread is not None and self._thread.is_alive()

    # -- requests (event-loop side) -----------------------------------------------------------
    async def generate(self, req, deltas: bool = True) -> AsyncIterator[Delta]:
        """Add `req` (from llm.new_request) and yield its tokens as they come (with
        deltas=False: once, when it finishes; each post wakes this thread, which then holds
        the GIL the engine needs); leaving the loop early (a client gone) aborts it and frees
        its blocks."""
        if not self.alive:
            raise EngineDead(f"the engine loop stopped: {self.error!r}")
        sink: asyncio.Queue = asyncio.Queue()
        self._inbox.put(("add", (req, deltas), sink))
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
        self._inbox.put(("abort", req_id, reason))

    # -- the engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        llm, stopping = self.llm, False
        while True:
            idle = not llm.has_unfinished_requests()
            if stopping and idle:
                return
            try:
                cmds = [self._inbox.get(block=idle)]
            except queue.Empty:
                cmds = []
            while True:
                try:
                    cmds.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            for op, arg, sink in cmds:
                if op == "stop":
                    stopping = True
                elif op == "add":
                    self._add(arg, sink)
                elif op == "abort":
                    self._abort(arg, sink)
            if not llm.has_unfinished_requests():
                if self.metrics is not None:
                    self.metrics.update_queues(llm)
                continue
            try:
                outs = llm.step()
            except Exception as e:  # a bug or a device error: fail everyone, serve 503s
                log.exception("npuspec serve: the engine step failed; aborting %d request(s)",
                              len(self._sinks))
                self._fail(e)
                return
            self._publish(outs)

    def _add(self, arg, sink) -> None:
        req, deltas = arg
        try:
            self.llm.add_request(req)
        except ValueError as e:  # a duplicate id
            self._post([(sink, e)])
            return
        self._sinks[req.req_id] = sink
        if not deltas:
            self._held[req.req_id] = []
        if self.metrics is not None:
            self.metrics.on_add(len(req.prompt_ids))

    def _abort(self, req_id: str, reason: str) -> None:
        self._sinks.pop(req_id, None)
        self._held.pop(req_id, None)
        if self.llm.abort_request(req_id):
            self.num_aborted += reason == "abort"
            if self.metrics is not None:
                self.metrics.forget(req_id)
                self.metrics.finished(reason)
                self.metrics.update_queues(self.llm)

    def _publish(self, outs) -> None:
        items = []
        flush = False
        for o in outs:
            sink = self._sinks.get(o.request_id)
            held = self._held.get(o.request_id)
            if held is not None:
                held += o.new_token_ids
            if o.finished:
                self._sinks.pop(o.request_id, None)
                self._held.pop(o.request_id, None)
                flush = flush or o.request.kv_transfer_params is not None
            elif held is not None:
                continue
            if sink is not None:
                r = o.request
                toks = held if held is not None else list(o.new_token_ids)
                items.append((sink, Delta(toks, o.finished,
                                          r.finish_reason if o.finished else None,
                                          r.kv_transfer_params if o.finished else None)))
        if flush:  # extract_hidden_states: the files are complete before the client hears
            self.llm.proposer.writer.flush()
        if self.metrics is not None:
            self.metrics.on_step(outs, self.llm)
            self.metrics.set_preemptions(self.llm.num_preemptions)
        if items:
            self._post(items)

    def _fail(self, e: Exception) -> None:
        self.error = e
        items = [(sink, EngineDead(f"the engine step failed: {type(e).__name__}: {e}"))
                 for sink in self._sinks.values()]
        for rid in list(self._sinks):
            self.llm.abort_request(rid)
        self._sinks.clear()
        self._held.clear()
        self._post(items)
        while True:  # answer whatever is still queued
            try:
                op, arg, sink = self._inbox.get_nowait()
            except queue.Empty:
                return
            if op == "add":
                self._post([(sink, EngineDead("the engine loop stopped"))])

    def _post(self, items) -> None:
        def deliver():
            for sink, d in items:
                sink.put_nowait(d)
        self._loop.call_soon_threadsafe(deliver)
