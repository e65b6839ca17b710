"""One request's state, the prompts -> requests checks, and the results `generate()` returns.

A `Request` holds its prompt, its output so far, its stop rules and its generator. The
bookkeeping after a verify step (`Request.append`) applies the stop rules: stop/eos tokens
(kept in the output, like vLLM), `max_tokens` and `max_model_len`.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import torch

from npuspec.engine.metrics import RequestMetrics
from npuspec.engine.sampling import ArgTypeError, SamplingParams, a_type


@dataclasses.dataclass
class Request:
    index: int                      # position in the generate() call's prompt list
    req_id: str
    prompt: Optional[str]
    prompt_ids: list[int]
    params: SamplingParams
    stop_ids: frozenset             # eos (unless ignore_eos) | stop_token_ids
    max_len: int                    # max_model_len: prompt + output never exceed it
    generator: Optional[torch.Generator] = None
    blocks: list[int] = dataclasses.field(default_factory=list)   # KV block table (owned blocks)
    num_cached: int = 0             # leading tokens whose K/V is in the cache
    started: bool = False           # the proposer knows this request (survives preemption)
    tokens: list[int] = dataclasses.field(default_factory=list)   # prompt + output
    output: list[int] = dataclasses.field(default_factory=list)
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort"
    stats: Optional[RequestMetrics] = None
    arrival_time: float = 0.0       # perf_counter() when it was added to the engine
    kv_transfer_params: Optional[dict] = None   # extract_hidden_states: its file
    seed: Optional[int] = None      # its generator's seed (a tensor-parallel worker's copy)

    def __post_init__(self):
        self.tokens = list(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_to_prefill(self) -> int:
        """Tokens to write before decoding: all but the last, which feeds the next step."""
        return len(self.tokens) - 1 - self.num_cached

    @property
    def max_new(self) -> int:
        """Tokens this request may still emit."""
        return min(self.params.max_tokens - len(self.output), self.max_len - len(self.tokens))

    def append(self, toks: list[int]) -> list[int]:
        """Add the tokens a verify step emitted, cut at a stop token or the length limit.
        Returns the tokens actually kept."""
        keep = toks[:self.max_new]
        for i, t in enumerate(keep):
            if t in self.stop_ids:
                keep = keep[:i + 1]
                self.finish_reason = "stop"
                break
        self.output += keep
        self.tokens += keep
        if self.finish_reason is None and self.max_new <= 0:
            self.finish_reason = "length"
        return keep


@dataclasses.dataclass
class StepOutput:
    """What one engine iteration (`LLM.step()`) gave one request."""
    request: Request
    new_token_ids: list[int]        # emitted this iteration (after the stop rules)
    finished: bool

    @property
    def request_id(self) -> str:
        return self.request.req_id


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: Optional[str]
    token_ids: list[int]
    finish_reason: Optional[str] = None   # "stop" | "length"


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: RequestMetrics
    finished: bool = True
    # extract_hidden_states: {"hidden_states_path": file of this request's hidden states}
    kv_transfer_params: Optional[dict] = None


PROMPTS_FIX = ("pass a string, a {'prompt_token_ids': [...]} dict, or a list of them")
PROMPT_KEYS = ("prompt_token_ids", "prompt")  # vLLM's TokensPrompt / TextPrompt keys we read


def parse_requests(prompts, params, call: int, *, vocab_size: int, max_model_len: int,
                   tokenizer, model_path: str, eos_ids: frozenset, rng: np.random.Generator,
                   device) -> list[Request]:
    """generate()'s prompts and sampling params -> requests, every check before any work."""
    prompts = _prompt_list(prompts)
    if params is None:
        params = SamplingParams()
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    if not isinstance(params, (list, tuple)):
        raise ArgTypeError(f"LLM.generate: sampling_params={params!r} is a "
                           f"{type(params).__name__}; pass npuspec.SamplingParams(...), a list "
                           f"of them (one per prompt), or None for the defaults")
    params = list(params)
    if len(params) != len(prompts):
        raise ValueError(f"LLM.generate: {len(params)} sampling_params for {len(prompts)} "
                         f"prompts; pass one SamplingParams or one per prompt")
    V = vocab_size
    reqs = []
    for i, (p, sp) in enumerate(zip(prompts, params)):
        if not isinstance(sp, SamplingParams):
            raise ValueError(f"LLM.generate: sampling_params[{i}] is {a_type(sp)}; "
                             f"pass npuspec.SamplingParams(...)")
        sp.check()  # its fields may have been reassigned since construction
        text, ids = prompt_ids(i, p, tokenizer, model_path)
        if not ids:
            raise ValueError(f"LLM.generate: prompt {i} is empty; give at least one token")
        for j, t in enumerate(ids):
            if not 0 <= t < V:
                raise ValueError(f"LLM.generate: prompt {i} has token id {t!r} at index {j}, "
                                 f"outside the model's vocabulary [0, {V}); use ids from this "
                                 f"model's tokenizer")
        if len(ids) >= max_model_len:
            raise ValueError(f"LLM.generate: prompt {i} has {len(ids)} tokens but "
                             f"max_model_len={max_model_len} leaves no room to generate; "
                             f"shorten the prompt or raise max_model_len")
        reqs.append(new_request(call, i, text, ids, sp, eos_ids=eos_ids,
                                max_model_len=max_model_len, rng=rng, device=device))
    return reqs


def _prompt_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (bytes, bytearray)):
        raise ArgTypeError(f"LLM.generate: prompts={prompts[:40]!r} is bytes; decode it to a "
                           f"string first (prompts.decode('utf-8'))")
    if prompts is None or isinstance(prompts, (int, float)) or not hasattr(prompts, "__iter__"):
        raise ArgTypeError(f"LLM.generate: prompts={prompts!r} is {a_type(prompts)}; "
                           f"{PROMPTS_FIX}")
    prompts = list(prompts)
    if not prompts:
        raise ValueError(f"LLM.generate: prompts is empty; {PROMPTS_FIX}")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        raise ArgTypeError(f"LLM.generate: prompts={_short(prompts)} is a list of ints; token "
                           f"ids go in a dict: {{'prompt_token_ids': {_short(prompts)}}}")
    return prompts


def _short(xs: list) -> str:
    return repr(xs) if len(xs) <= 8 else repr(xs[:8])[:-1] + ", ...]"


def prompt_ids(i: int, p, tokenizer, model_path: str) -> tuple[Optional[str], list[int]]:
    """One prompt (a string, {'prompt_token_ids': [...]} or {'prompt': text}) -> (its text or
    None, its ids as Python ints)."""
    if isinstance(p, str):
        return p, _encode(i, p, tokenizer, model_path)
    if isinstance(p, dict):
        extra = sorted(str(k) for k in p if k not in PROMPT_KEYS)
        if extra:  # e.g. vLLM's multi_modal_data: refused, not ignored
            raise ValueError(f"LLM.generate: prompt {i} has keys {extra} npuspec does not read; "
                             f"use {{'prompt_token_ids': [...]}} or {{'prompt': text}}")
        text = p.get("prompt")
        if text is not None and not isinstance(text, str):
            raise ArgTypeError(f"LLM.generate: prompt {i}: 'prompt'={text!r} is a "
                               f"{type(text).__name__}; it must be the prompt's text (a string)")
        if "prompt_token_ids" not in p:
            if text is None:
                raise ValueError(f"LLM.generate: prompt {i} is a dict without "
                                 f"'prompt_token_ids' or 'prompt'; use "
                                 f"{{'prompt_token_ids': [...]}} or {{'prompt': text}}")
            return text, _encode(i, text, tokenizer, model_path)
        return text, token_ids(f"prompt {i}: prompt_token_ids", p["prompt_token_ids"])
    if isinstance(p, (list, tuple)) or hasattr(p, "tolist"):
        raise ArgTypeError(f"LLM.generate: prompt {i} is {a_type(p)}; token ids go "
                           f"in a dict: {{'prompt_token_ids': [...]}}")
    raise ArgTypeError(f"LLM.generate: prompt {i} is {a_type(p)}; pass a string or "
                       f"{{'prompt_token_ids': [...]}}")


def _encode(i: int, text: str, tokenizer, model_path: str) -> list[int]:
    if tokenizer is None:
        raise ValueError(f"LLM.generate: prompt {i} is text but the checkpoint {model_path!r} "
                         f"has no tokenizer.json; pass {{'prompt_token_ids': [...]}} instead")
    return tokenizer.encode(text).ids if text else []


def token_ids(key: str, ids) -> list[int]:
    """A list/tuple of ints, or a 1-D integer tensor / ndarray -> a list of Python ints."""
    fix = "pass a list of integer token ids, e.g. [1, 2, 3]"
    if hasattr(ids, "tolist") and hasattr(ids, "dtype"):  # torch.Tensor, np.ndarray
        kind = str(ids.dtype)
        if "int" not in kind or kind.startswith("torch.q"):  # float, bool, complex, quantised
            raise ArgTypeError(f"LLM.generate: {key} is {a_type(ids)} of dtype "
                               f"{kind}; token ids are integers: convert it (.long()) or {fix}")
        if len(ids.shape) != 1:
            raise ArgTypeError(f"LLM.generate: {key} has shape {tuple(ids.shape)}; one prompt's "
                               f"ids are 1-D: pass one prompt per dict (ids[0] for a batch of "
                               f"one) or {fix}")
        return ids.tolist()
    if not isinstance(ids, (list, tuple)):
        raise ArgTypeError(f"LLM.generate: {key}={ids!r} is {a_type(ids)}; {fix}"
                           + (" (text goes in a string prompt)" if isinstance(ids, str) else ""))
    out = []
    for j, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
            raise ArgTypeError(f"LLM.generate: {key}[{j}]={t!r} is {a_type(t)}; {fix}")
        out.append(int(t))
    return out


def new_request(call: int, i: int, text, ids: list[int], sp: SamplingParams, *,
                eos_ids: frozenset, max_model_len: int, rng: np.random.Generator,
                device) -> Request:
    stop = set(sp.stop_token_ids or ())
    if not sp.ignore_eos:
        stop |= eos_ids
    gen = seed = None
    if not sp.greedy:
        # every random request draws from its own generator: seeded ones reproduce
        # whatever else is in the batch; the others follow LLM(seed=...)
        seed = sp.seed if sp.seed is not None else int(rng.integers(2**62))
        gen = torch.Generator(device=device).manual_seed(seed)
    r = Request(i, f"{call}-{i}", text, ids, sp, frozenset(stop), max_model_len, gen, seed=seed)
    r.stats = RequestMetrics(num_prompt_tokens=len(ids))
    return r


def request_spec(r: Request) -> tuple:
    """What another process needs to rebuild a fresh `r` (its generator from its seed):
    the tensor-parallel workers' copy of each request rank 0 adds."""
    assert not r.output and not r.blocks, r.req_id
    return (r.index, r.req_id, r.prompt_ids, r.params, r.stop_ids, r.max_len, r.seed)


def rebuild_request(spec: tuple, device) -> Request:
    index, req_id, ids, sp, stop, max_len, seed = spec
    gen = None if seed is None else torch.Generator(device=device).manual_seed(seed)
    r = Request(index, req_id, None, list(ids), sp, stop, max_len, gen, seed=seed)
    r.stats = RequestMetrics(num_prompt_tokens=len(ids))
    return r


def request_output(r: Request, tokenizer) -> RequestOutput:
    r.stats.num_output_tokens = len(r.output)
    text = None
    if tokenizer is not None:
        text = tokenizer.decode(r.output, skip_special_tokens=True)
    return RequestOutput(r.req_id, r.prompt, list(r.prompt_ids),
                         [CompletionOutput(0, text, list(r.output), r.finish_reason)], r.stats,
                         kv_transfer_params=r.kv_transfer_params)
