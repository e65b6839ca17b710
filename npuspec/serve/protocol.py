"""OpenAI request bodies -> engine requests, and the OpenAI-style error body.

Every field of /v1/completions and /v1/chat/completions is either honoured, accepted at its
neutral value (a penalty of 0, `echo: false`), or refused with a 400 that names it: a client
never gets an answer computed without an option it asked for. Pure Python (no FastAPI), so
the checks are tested without a server.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import re
from typing import Any, Callable, Optional

from npuspec.engine.sampling import SamplingParams

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions
MAX_N = 64
MAX_STOP = 16


class APIError(Exception):
    """An HTTP error with an OpenAI-style body; `param` names the offending field."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 type_: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type = type_ or {400: "BadRequestError", 401: "AuthenticationError",
                              404: "NotFoundError", 503: "ServiceUnavailableError"}.get(
                                  status, "InternalServerError")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.status}}


def bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param)


@dataclasses.dataclass
class GenRequest:
    """One checked API call: its prompts (each becomes `n` engine requests) and options."""
    kind: str                       # "completion" | "chat"
    model: str
    prompts: list                   # str, or {"prompt_token_ids": [...], "prompt": text}
    params: SamplingParams          # for choice 0; choice j's seed is seed + j
    n: int
    stream: bool
    include_usage: bool
    stop: list[str]                 # stop strings, applied to the text by the server
    max_tokens_given: bool

    def choice_params(self, j: int) -> SamplingParams:
        p = self.params
        if j == 0 or p.seed is None:
            return p
        return dataclasses.replace(p, seed=(p.seed + j) % 2**64)


# field -> value at which an unsupported option changes nothing (accepted only at it)
_NEUTRAL = {"presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "echo": (False,),
            "logit_bias": ({},), "suffix": ("",), "logprobs": (False,), "top_logprobs": (0,),
            "tools": ([],), "tool_choice": ("none",), "parallel_tool_calls": (False, True),
            "response_format": ({"type": "text"},), "repetition_penalty": (1, 1.0),
            "min_p": (0, 0.0), "min_tokens": (0,)}
_WHY = {"logprobs": "the fused verify op returns token ids, not log-probabilities",
        "top_logprobs": "the fused verify op returns token ids, not log-probabilities",
        "echo": "the response carries only generated text",
        "suffix": "insertion (fill-in-the-middle) is not implemented",
        "tools": "tool calling is not implemented", "tool_choice": "tool calling is not implemented",
        "response_format": "structured output is not implemented",
        "logit_bias": "logit bias would change the target distribution the verify op samples",
        "best_of": "best_of is not implemented"}
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "n", "stream",
           "stream_options", "stop", "seed", "user", "stop_token_ids", "ignore_eos"}
COMPLETION_FIELDS = _COMMON | {"prompt", "best_of"} | {
    "presence_penalty", "frequency_penalty", "echo", "logit_bias", "suffix", "logprobs",
    "repetition_penalty", "min_p", "min_tokens"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "add_generation_prompt"} | {
    "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs",
    "tools", "tool_choice", "parallel_tool_calls", "response_format", "repetition_penalty",
    "min_p", "min_tokens"}


@dataclasses.dataclass
class ServerContext:
    """What request checks need to know about the served model."""
    served_names: list[str]
    max_model_len: int
    count_tokens: Callable[[Any], int]          # a prompt -> its token count
    # messages, add_generation_prompt -> {"prompt": text, "prompt_token_ids": ids}; None: the
    # model has no chat template
    render_chat: Optional[Callable[[list, bool], dict]] = None
    chat_missing: str = "the model has no chat template"


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_fields(body: Any, known: set, route: str) -> dict:
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got "
                            f"{type(body).__name__}; see the OpenAI {route} API")
    for k in body:
        if k in known:
            continue
        near = difflib.get_close_matches(str(k), sorted(known), n=1, cutoff=0.6)
        hint = f"did you mean {near[0]!r}?" if near else f"{route} takes {', '.join(sorted(known))}"
        raise bad(str(k), f"unknown field; {hint}")
    for k, ok in _NEUTRAL.items():
        v = body.get(k)
        if v is None or any(v == o and type(v) is type(o) for o in ok):
            continue
        why = _WHY.get(k, f"npuspec does not implement {k}")
        raise bad(k, f"{json.dumps(v)} is not supported ({why}); leave it out or send "
                     f"{json.dumps(ok[0])}")
    return body


def _model(body: dict, ctx: ServerContext) -> str:
    m = body.get("model")
    if m is None:
        return ctx.served_names[0]
    if not isinstance(m, str):
        raise bad("model", f"{m!r} must be a string: one of {ctx.served_names}")
    if m not in ctx.served_names:
        raise APIError(404, f"The model `{m}` does not exist; this server serves "
                            f"{ctx.served_names} (see GET /v1/models)", "model")
    return m


def _stop(v: Any) -> list[str]:
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("stop", f"{v!r} must be a string or a list of strings")
    if len(stops) > MAX_STOP:
        raise bad("stop", f"{len(stops)} stop strings; send at most {MAX_STOP}")
    if any(s == "" for s in stops):
        raise bad("stop", "an empty stop string would stop at once; remove it")
    return stops


def _stream(body: dict) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad("stream", f"{stream!r} must be true or false")
    so = body.get("stream_options")
    if so is None:
        return stream, False
    if not stream:
        raise bad("stream_options", "is only allowed with stream: true")
    if not isinstance(so, dict) or set(so) - {"include_usage"}:
        raise bad("stream_options", f"{so!r}: only {{'include_usage': true|false}} is supported")
    iu = so.get("include_usage", False)
    if not isinstance(iu, bool):
        raise bad("stream_options.include_usage", f"{iu!r} must be true or false")
    return stream, iu


def _n(body: dict) -> int:
    n = body.get("n", 1)
    n = 1 if n is None else n
    if not _is_int(n) or not 1 <= n <= MAX_N:
        raise bad("n", f"{n!r} must be an integer in [1, {MAX_N}]")
    bo = body.get("best_of")
    if bo is not None and bo != n:
        raise bad("best_of", f"{bo!r} is not supported ({_WHY['best_of']}); leave it out "
                             f"or send best_of = n")
    return n


_SP_FIELD = re.compile(r"SamplingParams: (\w+)=")


def _sampling(body: dict, max_tokens: Optional[int], max_key: str) -> SamplingParams:
    kw = {}
    for key in ("temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos"):
        if body.get(key) is not None:
            kw[key] = body[key]
    if "top_k" in kw and kw["top_k"] == 0:
        kw["top_k"] = -1
    if max_tokens is not None:
        kw["max_tokens"] = max_tokens
    try:
        return SamplingParams(**kw)
    except (ValueError, TypeError, NotImplementedError) as e:
        m = _SP_FIELD.search(str(e))
        field = m.group(1) if m else None
        field = max_key if field == "max_tokens" else field
        raise APIError(400, str(e).replace("SamplingParams: ", ""), field) from None


def _max_tokens(body: dict, keys: tuple[str, ...]) -> tuple[Optional[int], str]:
    for k in keys:
        v = body.get(k)
        if v is not None:
            if not _is_int(v) or v < 1:
                raise bad(k, f"{v!r} must be an integer >= 1")
            return v, k
    return None, keys[0]


def _completion_prompts(p: Any) -> list:
    """OpenAI's four prompt shapes: a string, strings, token ids, lists of token ids."""
    def ids(x, where):
        if not x or not all(_is_int(t) for t in x):
            raise bad(where, "a token-id prompt must be a non-empty list of integers")
        return {"prompt_token_ids": list(x)}
    if isinstance(p, str):
        return [p]
    if isinstance(p, list) and p:
        if all(isinstance(x, str) for x in p):
            return list(p)
        if all(_is_int(x) for x in p):
            return [ids(p, "prompt")]
        if all(isinstance(x, list) for x in p):
            return [ids(x, f"prompt[{i}]") for i, x in enumerate(p)]
    raise bad("prompt", f"{_short(p)} must be a string, a list of strings, a list of token "
                        f"ids, or a list of lists of token ids (non-empty)")


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def _messages(v: Any) -> list[dict]:
    if not isinstance(v, list) or not v:
        raise bad("messages", f"{_short(v)} must be a non-empty list of "
                              f"{{'role': ..., 'content': ...}} objects")
    out = []
    for i, m in enumerate(v):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(where, f"{_short(m)} must be an object with a string 'role'")
        extra = set(m) - {"role", "content", "name"}
        if extra:
            raise bad(f"{where}.{sorted(extra)[0]}", "is not supported (npuspec reads role, "
                                                      "content and name)")
        c = m.get("content")
        if isinstance(c, list):  # content parts: text only
            texts = []
            for j, part in enumerate(c):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                        part.get("text"), str):
                    raise bad(f"{where}.content[{j}]", f"{_short(part)}: only "
                                                        f"{{'type': 'text', 'text': ...}} parts are supported")
                texts.append(part["text"])
            c = "".join(texts)
        elif c is None:
            c = ""
        elif not isinstance(c, str):
            raise bad(f"{where}.content", f"{_short(c)} must be a string or a list of text parts")
        out.append({**m, "content": c})
    return out


def _check_room(ctx: ServerContext, prompts: list, max_tokens: Optional[int], max_key: str,
                prompt_key: str) -> Optional[int]:
    """Reject a prompt that leaves no room, and max_tokens past max_model_len (as vLLM does);
    returns the room left for the shortest-room prompt when max_tokens is not given."""
    room = None
    for i, p in enumerate(prompts):
        n = ctx.count_tokens(p)
        where = prompt_key if len(prompts) == 1 else f"{prompt_key}[{i}]"
        if n >= ctx.max_model_len:
            raise bad(where, f"{n} tokens, but this server's max_model_len is "
                             f"{ctx.max_model_len}, which leaves no room to generate; shorten "
                             f"it (or start the server with a larger --max-model-len)")
        if max_tokens is not None and n + max_tokens > ctx.max_model_len:
            raise bad(max_key, f"{max_tokens} plus the prompt's {n} tokens exceeds this "
                               f"server's max_model_len of {ctx.max_model_len}; ask for at most "
                               f"{ctx.max_model_len - n} tokens")
        left = ctx.max_model_len - n
        room = left if room is None else min(room, left)
    return room


def parse_completion(body: Any, ctx: ServerContext) -> GenRequest:
    body = _check_fields(body, COMPLETION_FIELDS, "/v1/completions")
    model = _model(body, ctx)
    if "prompt" not in body:
        raise bad("prompt", "is required")
    prompts = _completion_prompts(body["prompt"])
    stream, usage = _stream(body)
    mt, key = _max_tokens(body, ("max_tokens",))
    given = mt is not None
    n = _n(body)
    stop = _stop(body.get("stop"))
    mt = mt if given else DEFAULT_COMPLETION_MAX_TOKENS
    _check_room(ctx, prompts, mt if given else None, key, "prompt")
    return GenRequest("completion", model, prompts, _sampling(body, mt, key), n, stream,
                      usage, stop, given)


def parse_chat(body: Any, ctx: ServerContext) -> GenRequest:
    body = _check_fields(body, CHAT_FIELDS, "/v1/chat/completions")
    model = _model(body, ctx)
    if ctx.render_chat is None:
        raise APIError(400, f"messages: {ctx.chat_missing}, so chat requests cannot be "
                            f"formatted; use /v1/completions with the formatted prompt, or "
                            f"serve a checkpoint whose tokenizer has a chat template", "messages")
    if "messages" not in body:
        raise bad("messages", "is required")
    msgs = _messages(body["messages"])
    agp = body.get("add_generation_prompt", True)
    if not isinstance(agp, bool):
        raise bad("add_generation_prompt", f"{agp!r} must be true or false")
    try:
        prompts = [ctx.render_chat(msgs, agp)]
    except Exception as e:  # the template's raise_exception(), or a template bug
        raise bad("messages", f"the chat template refused these messages: {e}") from None
    stream, usage = _stream(body)
    mt, key = _max_tokens(body, ("max_completion_tokens", "max_tokens"))
    given = mt is not None
    n = _n(body)
    stop = _stop(body.get("stop"))
    room = _check_room(ctx, prompts, mt, key, "messages")
    return GenRequest("chat", model, prompts, _sampling(body, mt if given else room, key), n,
                      stream, usage, stop, given)
