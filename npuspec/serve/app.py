"""The FastAPI app of `npuspec serve`: OpenAI's /v1/completions, /v1/chat/completions and
/v1/models, plus /health and Prometheus /metrics.

Bodies are parsed by npuspec.serve.protocol (not pydantic models), so every refusal is an
OpenAI-style error body naming the field. Each choice of each prompt is one engine request;
a stream interleaves the choices' chunks as their tokens come.
"""
# no `from __future__ import annotations`: FastAPI reads the routes' `Request` annotations,
# which must be the class itself (it is imported inside build_app)
import asyncio
import contextlib
import hmac
import json
import time
import uuid
from typing import Optional

from npuspec.cli_util.errors import MissingExtra
from npuspec.serve import protocol
from npuspec.serve.engine import AsyncEngine, EngineDead
from npuspec.serve.protocol import APIError, GenRequest, ServerContext
from npuspec.serve.text import TextStream


def build_app(llm, served_names: list[str], api_key: Optional[str] = None, metrics=None,
              chat_template=None, chat_missing: str = ""):
    try:  # the [serve] extra
        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse, Response, StreamingResponse
    except ImportError:
        raise MissingExtra("fastapi", "serve", "npuspec serve") from None

    engine = AsyncEngine(llm, metrics)
    ctx = ServerContext(served_names, llm.max_model_len, _token_counter(llm),
                        _chat_renderer(llm, chat_template) if chat_template else None,
                        chat_missing or "the model has no chat template")
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        engine.shutdown()  # uvicorn has drained the connections by now

    app = FastAPI(title="npuspec", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine = engine

    def error(e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    if api_key is not None:
        app.add_middleware(_APIKey, api_key=api_key, refusal=error(APIError(
            401, "invalid or missing API key: send the header 'Authorization: Bearer <key>' "
                 "with the key the server was started with (--api-key)")))

    @app.get("/health")
    async def health():
        if not engine.alive:
            return error(APIError(503, f"the engine stopped: {engine.error or 'its process exited'}"))
        return Response(status_code=200)

    @app.get("/metrics")
    async def prom():
        if metrics is None:
            return error(APIError(404, "metrics are off"))
        body, ctype = metrics.exposition()
        return Response(body, media_type=ctype)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [
            {"id": n, "object": "model", "created": created, "owned_by": "npuspec",
             "root": llm.model_path, "max_model_len": llm.max_model_len} for n in served_names]}

    async def body_of(request: Request):
        raw = await request.body()
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON ({e}); send a JSON object "
                                f"with Content-Type: application/json") from None

    async def serve(request: Request, parse, kind: str, rid: str):
        try:
            g = parse(await body_of(request), ctx)
            reqs = [[llm.new_request(p, g.choice_params(j), f"{rid}-{i}-{j}")
                     for j in range(g.n)] for i, p in enumerate(g.prompts)]
            if not engine.alive:
                raise APIError(503, f"the engine stopped: {engine.error or 'its process exited'}")
        except APIError as e:
            return error(e)
        except ValueError as e:  # the engine's prompt checks (vocabulary, length)
            return error(APIError(400, str(e).replace("LLM.generate: ", ""),
                                  "messages" if kind == "chat" else "prompt"))
        choices = [(i * g.n + j, r) for i, row in enumerate(reqs) for j, r in enumerate(row)]
        if g.stream:
            return StreamingResponse(_stream(engine, llm, g, rid, choices, kind),
                                     media_type="text/event-stream")
        try:
            return await _complete(engine, llm, g, rid, choices, kind, request)
        except EngineDead as e:
            return error(APIError(503, str(e)))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serve(request, protocol.parse_completion, "completion",
                           f"cmpl-{uuid.uuid4().hex}")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await serve(request, protocol.parse_chat, "chat", f"chatcmpl-{uuid.uuid4().hex}")

    return app


def _token_counter(llm):
    def count(p) -> int:
        if isinstance(p, dict):
            return len(p["prompt_token_ids"])
        if llm.tokenizer is None:
            raise APIError(400, f"prompt: the model {llm.model_path} has no tokenizer, so a "
                                f"text prompt cannot be encoded; send token ids instead",
                           "prompt")
        return len(llm.tokenizer.encode(p).ids)
    return count


def _chat_renderer(llm, template):
    def render(messages, add_generation_prompt):
        text = template.render(messages, add_generation_prompt)
        # the template writes BOS itself when it wants one: no special tokens added here
        ids = llm.tokenizer.encode(text, add_special_tokens=False).ids
        return {"prompt": text, "prompt_token_ids": ids}
    return render


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _chunk(kind: str, rid: str, model: str, created: int, choices: list, usage=None) -> str:
    obj = {"id": rid, "object": "text_completion" if kind == "completion"
           else "chat.completion.chunk", "created": created, "model": model, "choices": choices}
    if usage is not None:
        obj["usage"] = usage
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _choice_delta(kind: str, index: int, text: Optional[str], finish: Optional[str],
                  role: bool = False) -> dict:
    if kind == "completion":
        return {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}
    delta = {"role": "assistant", "content": ""} if role else (
        {"content": text} if text else {})
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}


async def _run_choice_iter(engine: AsyncEngine, llm, g: GenRequest, req, on_text):
    """Drive one engine request to its end, calling on_text(text, finish_reason or None) per
    delta; yields the completion tokens so far after each delta, last the final count."""
    ts = TextStream(llm.tokenizer, g.stop)
    # a stream, or stop strings to watch, needs every step's tokens; else only the last
    gen = engine.generate(req, deltas=g.stream or bool(g.stop))
    try:
        async for d in gen:
            text = ts.add(d.token_ids, final=d.finished)
            if ts.stopped:
                engine.abort(req.req_id, "stop")  # the engine need not go on
                await on_text(text, "stop")
                yield ts.num_tokens
                return
            if d.finished:
                req.kv_transfer_params = d.kv_transfer_params
                await on_text(text, d.finish_reason)
                yield ts.num_tokens
                return
            if text:
                await on_text(text, None)
            yield ts.num_tokens
    finally:
        await gen.aclose()


async def _run_choice(engine: AsyncEngine, llm, g: GenRequest, req, on_text):
    """-> (completion tokens, finish reason, kv_transfer_params)."""
    ntok, finish = 0, []

    async def note(text, why):
        if why is not None:
            finish.append(why)
        await on_text(text, why)
    async for ntok in _run_choice_iter(engine, llm, g, req, note):
        pass
    return ntok, finish[-1] if finish else None, req.kv_transfer_params


class _Chunks:
    """SSE lines of one response. A text delta is the common case (one per engine step and
    choice), so its JSON is written around the escaped text from a prefix and suffix made
    once, not dumped from a dict each time."""

    def __init__(self, kind: str, rid: str, model: str):
        self.kind, self.rid, self.model, self.created = kind, rid, model, int(time.time())
        self._text: dict[int, tuple[str, str]] = {}

    def text(self, index: int, text: str) -> str:
        pre_post = self._text.get(index)
        if pre_post is None:
            mark = "\u0000MARK\u0000"
            line = _chunk(self.kind, self.rid, self.model, self.created,
                          [_choice_delta(self.kind, index, mark, None)])
            pre, post = line.split(json.dumps(mark, ensure_ascii=False))
            pre_post = self._text[index] = (pre, post)
        return f"{pre_post[0]}{json.dumps(text, ensure_ascii=False)}{pre_post[1]}"

    def delta(self, index: int, text: Optional[str], finish: Optional[str],
              role: bool = False) -> str:
        if text and finish is None and not role:
            return self.text(index, text)
        return _chunk(self.kind, self.rid, self.model, self.created,
                      [_choice_delta(self.kind, index, text, finish, role)])

    def usage(self, usage: dict) -> str:
        return _chunk(self.kind, self.rid, self.model, self.created, [], usage)


def _error_event(e: Exception) -> str:
    return f"data: {json.dumps(APIError(503, str(e)).body())}\n\n"


async def _stream(engine, llm, g: GenRequest, rid: str, choices, kind: str):
    ch = _Chunks(kind, rid, g.model)
    if kind == "chat":  # the role comes first, as OpenAI sends it
        for index, _ in choices:
            yield ch.delta(index, None, None, role=True)
    if len(choices) == 1:  # the common case: no fan-in queue, no extra task
        index, req = choices[0]
        lines: list[str] = []

        async def on_text(text, finish):
            lines.append(ch.delta(index, text, finish))
        gen = _run_choice_iter(engine, llm, g, req, on_text)
        ntok = 0
        try:
            async for ntok in gen:
                while lines:
                    yield lines.pop(0)
        except EngineDead as e:
            yield _error_event(e)
            return
        finally:
            await gen.aclose()  # a client gone: closing the generator aborts the request
        while lines:
            yield lines.pop(0)
        totals = [ntok]
    else:
        out: asyncio.Queue = asyncio.Queue()
        done, counts = 0, {}

        def task(index, req):
            async def on_text(text, finish):
                await out.put(ch.delta(index, text, finish))

            async def run():
                try:
                    counts[index] = (await _run_choice(engine, llm, g, req, on_text))[0]
                except EngineDead as e:
                    await out.put(_error_event(e))
                finally:
                    await out.put(None)
            return asyncio.ensure_future(run())
        tasks = [task(index, req) for index, req in choices]
        try:
            while done < len(tasks):
                item = await out.get()
                if item is None:
                    done += 1
                    continue
                yield item
        finally:  # a client gone mid-stream: cancelling a choice aborts its engine request
            for t in tasks:
                t.cancel()
        totals = list(counts.values())
    if g.include_usage:
        pt = sum(len(r.prompt_ids) for _, r in choices)
        yield ch.usage(_usage(pt, sum(totals)))
    yield "data: [DONE]\n\n"


async def _complete(engine, llm, g: GenRequest, rid: str, choices, kind: str, request):
    texts = {index: [] for index, _ in choices}

    def collector(index):
        async def on_text(text, finish):
            if text:
                texts[index].append(text)
        return on_text

    tasks = [asyncio.ensure_future(_run_choice(engine, llm, g, req, collector(index)))
             for index, req in choices]
    watch = asyncio.ensure_future(_watch_disconnect(request, tasks))
    try:
        results = await asyncio.gather(*tasks)
    finally:
        watch.cancel()
        for t in tasks:
            t.cancel()
    out = []
    for (index, req), (ntok, finish, kvp) in zip(choices, results):
        text = "".join(texts[index])
        if kind == "completion":
            c = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
        else:
            c = {"index": index, "message": {"role": "assistant", "content": text},
                 "logprobs": None, "finish_reason": finish}
        if kvp is not None:
            c["kv_transfer_params"] = kvp
        out.append(c)
    pt = sum(len(r.prompt_ids) for _, r in choices)
    ct = sum(r[0] for r in results)
    return {"id": rid, "object": "text_completion" if kind == "completion" else "chat.completion",
            "created": int(time.time()), "model": g.model, "choices": out, "usage": _usage(pt, ct)}


class _APIKey:
    """Pure ASGI: refuses /v1 requests without the key. Starlette's @app.middleware("http")
    would wrap every streamed chunk in an extra task and memory stream."""

    def __init__(self, app, api_key: str, refusal):
        self.app, self.refusal = app, refusal
        self.want = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.want):
                return await self.refusal(scope, receive, send)
        await self.app(scope, receive, send)


async def _watch_disconnect(request, tasks, every: float = 0.25) -> None:
    """A non-streaming client that hangs up has its requests aborted (their tasks cancelled)."""
    while True:
        await asyncio.sleep(every)
        if await request.is_disconnected():
            for t in tasks:
                t.cancel()
            return
