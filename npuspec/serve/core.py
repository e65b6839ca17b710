"""The engine process of `npuspec serve`: it owns the `LLM` and runs its step API; the HTTP
process talks to it over one pipe (npuspec.serve.engine).

Why a process, not a thread: a step of a small model is mostly Python, so an engine thread
and the event loop sharing one GIL serialise; streaming one client measured each step 1.5x
slower than with nothing else in the process. Here the HTTP side (parsing, detokenising, SSE)
runs on another core, as vLLM's AsyncLLM runs its EngineCore.

Messages, HTTP process -> engine (tuples, pickled by multiprocessing between two processes of
one server, never read from disk):
    ("add", req_id, prompt_ids, SamplingParams, arrival_time)   # checked on the HTTP side
    ("abort", req_id, reason)
    ("stop",)                       # finish what is in flight, then exit
engine -> HTTP process:
    ("ready", info dict) | ("failed", ErrorInfo)                 # once, after the load
    ("step", [Out...], Gauges, [(req_id, reason) aborted...], [(req_id, message) refused...])
    ("dead", message)               # a step raised: nothing after it is trusted

With `--stream-interval N` (SGLang's flag; default 1) a "step" message goes out every N engine
steps, carrying each request's tokens of those steps, and at once whenever a request gets its
first token, finishes, is aborted or refused, or the engine goes idle. Why: on a 2-vCPU VM each
message's wake-up of the HTTP process cost the engine ~10% of its one-client speed (a
constant 40-byte message per step: 0.86-0.90x an engine that sends none; every 4th step:
0.92x), so fewer, larger messages trade smooth streaming for throughput.
"""
from __future__ import annotations

import dataclasses
import logging
import signal
import traceback
from typing import NamedTuple, Optional

from npuspec.cli_util.errors import USER_ERRORS
from npuspec.serve.args import build_llm

log = logging.getLogger(__name__)


class Out(NamedTuple):
    """One request's share of a step."""
    req_id: str
    token_ids: list[int]
    finish_reason: Optional[str]          # set when it finished in this step
    kv_transfer_params: Optional[dict]    # extract_hidden_states: its file, when finished
    num_drafted: int                      # totals so far (the metrics take differences)
    num_accepted: int
    accepted_by_position: tuple


def add_message(req, arrival_time: float) -> tuple:
    """The "add" message for a request from EngineClient.new_request."""
    return ("add", req.req_id, list(req.prompt_ids), req.params, arrival_time)


class Gauges(NamedTuple):
    running: int
    waiting: int
    free_blocks: int
    preemptions: int      # since start
    steps_by_k: tuple = ()  # ((K, verify steps run with it since start), ...)
    last_k: int = -1        # K of the latest verify step (-1: none yet)


@dataclasses.dataclass
class ErrorInfo:
    """An exception from the load, as plain data: the HTTP process re-raises it as a usage
    error naming `field` (exit 2) or as a failure (exit 1)."""
    type_name: str
    message: str
    field: Optional[str]
    usage: bool           # one of cli_util.errors.USER_ERRORS: bad input, not a bug
    traceback: str


def engine_main(conn, args) -> None:
    """The process's target: load, say ready, serve until "stop" or the pipe closes."""
    # Ctrl-C in a terminal signals the whole process group; the HTTP process drains and then
    # sends "stop", so this process must not die of the signal first
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        llm = build_llm(args)
    except BaseException as e:  # noqa: B902 - every load failure goes back as a message
        conn.send(("failed", _error_info(e)))
        conn.close()
        return
    conn.send(("ready", {"max_model_len": llm.max_model_len, "model_path": llm.model_path,
                         "k_max": llm.k_max, "num_blocks": llm.runner.blocks.num_blocks,
                         "vocab_size": llm.model_config.vocab_size,
                         "eos_ids": sorted(llm.eos_ids), "max_num_seqs": llm.max_num_seqs,
                         "spec": llm.spec.method if llm.spec else "none"}))
    try:
        _loop(conn, llm, getattr(args, "stream_interval", 1))
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the HTTP process is gone: nothing to answer
    finally:
        conn.close()
        llm.shutdown()  # tensor-parallel workers


def _error_info(e: BaseException) -> ErrorInfo:
    return ErrorInfo(type(e).__name__, str(e), getattr(e, "field", None),
                     isinstance(e, USER_ERRORS), traceback.format_exc())


class Coalescer:
    """Each request's outputs since the last message, and whether one is due (module doc)."""

    def __init__(self, interval: int):
        assert interval >= 1, interval
        self.interval = interval
        self.pending: dict[str, Out] = {}
        self.steps = 0
        self.urgent = False
        self.sent: set[str] = set()   # requests that have had a token sent

    def add(self, outs: list[Out]) -> None:
        self.steps += 1
        for o in outs:
            prev = self.pending.get(o.req_id)
            if prev is not None:
                o = o._replace(token_ids=prev.token_ids + o.token_ids)
            self.pending[o.req_id] = o
            if o.finish_reason is not None or (o.token_ids and o.req_id not in self.sent):
                self.urgent = True

    def due(self, force: bool) -> bool:
        return force or self.urgent or self.steps >= self.interval

    def take(self) -> list[Out]:
        outs = list(self.pending.values())
        for o in outs:
            if o.finish_reason is not None:
                self.sent.discard(o.req_id)
            elif o.token_ids:  # a prefill-only share sends nothing the client sees
                self.sent.add(o.req_id)
        self.pending, self.steps, self.urgent = {}, 0, False
        return outs

    def drop(self, req_id: str) -> None:
        """An aborted request: the HTTP side has dropped its sink."""
        self.pending.pop(req_id, None)
        self.sent.discard(req_id)


def _loop(conn, llm, interval: int = 1) -> None:
    stopping = False
    aborted: list[tuple[str, str]] = []
    refused: list[tuple[str, str]] = []
    batch = Coalescer(interval)
    while True:
        idle = not llm.has_unfinished_requests()
        if stopping and idle:
            return
        # block only when there is nothing to step
        while (idle and not stopping and not aborted and not refused) or conn.poll():
            msg = conn.recv()
            op = msg[0]
            if op == "add":
                _, rid, ids, params, arrival = msg
                try:
                    req = llm.new_request({"prompt_token_ids": ids}, params, rid)
                    llm.add_request(req, arrival_time=arrival)
                except ValueError as e:  # a duplicate id; the HTTP side checked the rest
                    refused.append((rid, str(e)))
            elif op == "abort":
                if llm.abort_request(msg[1]):
                    aborted.append((msg[1], msg[2]))
                batch.drop(msg[1])
            elif op == "stop":
                stopping = True
            idle = not llm.has_unfinished_requests()
        outs = []
        if llm.has_unfinished_requests():
            try:
                outs = llm.step()
            except Exception as e:  # a bug or a device error: fail everyone, serve 503s
                log.exception("npuspec serve: the engine step failed")
                conn.send(("dead", f"the engine step failed: {type(e).__name__}: {e}"))
                return
        batch.add(_outs(llm, outs))
        if batch.due(bool(aborted or refused) or not llm.has_unfinished_requests()):
            conn.send(("step", batch.take(), _gauges(llm), aborted, refused))
            aborted, refused = [], []


def _outs(llm, outs) -> list[Out]:
    res, flush = [], False
    for o in outs:
        r, st = o.request, o.request.stats
        fin = r.finish_reason if o.finished else None
        kvp = r.kv_transfer_params if o.finished else None
        flush = flush or kvp is not None
        res.append(Out(r.req_id, list(o.new_token_ids), fin, kvp, st.num_drafted,
                       st.num_accepted, tuple(st.accepted_by_position)))
    if flush:  # extract_hidden_states: the files are complete before the client hears
        llm.proposer.writer.flush()
    return res


def _gauges(llm) -> Gauges:
    running, waiting = llm.num_requests()
    tot = llm.totals
    return Gauges(running, waiting, llm.runner.blocks.num_free, llm.num_preemptions,
                  tuple(sorted(tot.steps_by_k.items())),
                  tot.k_trace[-1][1] if tot.k_trace else -1)
