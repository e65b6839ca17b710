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
from npuspec.engine.sampling import SamplingParams


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
    slot: int = -1                  # unused by the paged engine; kept for callers of the old API
    blocks: list[int] = dataclasses.field(default_factory=list)   # KV block table (owned blocks)
    num_cached: int = 0             # leading tokens whose K/V is in the cache
    started: bool = False           # the proposer knows this request (survives preemption)
    tokens: list[int] = dataclasses.field(default_factory=list)   # prompt + output
    output: list[int] = dataclasses.field(default_factory=list)
    finish_reason: Optional[str] = None
    stats: Optional[RequestMetrics] = None

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


def parse_requests(prompts, params, call: int, *, vocab_size: int, max_model_len: int,
                   tokenizer, model_path: str, eos_ids: frozenset, rng: np.random.Generator,
                   device) -> list[Request]:
    """generate()'s prompts and sampling params -> requests, every check before any work."""
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    prompts = list(prompts)
    if not prompts:
        raise ValueError("LLM.generate: prompts is empty; pass a string, a "
                         "{'prompt_token_ids': [...]} dict, or a list of them")
    if params is None:
        params = SamplingParams()
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    params = list(params)
    if len(params) != len(prompts):
        raise ValueError(f"LLM.generate: {len(params)} sampling_params for {len(prompts)} "
                         f"prompts; pass one SamplingParams or one per prompt")
    V = vocab_size
    reqs = []
    for i, (p, sp) in enumerate(zip(prompts, params)):
        if not isinstance(sp, SamplingParams):
            raise ValueError(f"LLM.generate: sampling_params[{i}] is a {type(sp).__name__}; "
                             f"pass npuspec.SamplingParams(...)")
        text, ids = prompt_ids(i, p, tokenizer, model_path)
        if not ids:
            raise ValueError(f"LLM.generate: prompt {i} is empty; give at least one token")
        for j, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < V:
                raise ValueError(f"LLM.generate: prompt {i} has token id {t!r} at index {j}, "
                                 f"outside the model's vocabulary [0, {V}); use ids from this "
                                 f"model's tokenizer")
        if len(ids) >= max_model_len:
            raise ValueError(f"LLM.generate: prompt {i} has {len(ids)} tokens but "
                             f"max_model_len={max_model_len} leaves no room to generate; "
                             f"shorten the prompt or raise max_model_len")
        reqs.append(new_request(call, i, text, [int(t) for t in ids], sp, eos_ids=eos_ids,
                                max_model_len=max_model_len, rng=rng, device=device))
    return reqs


def prompt_ids(i: int, p, tokenizer, model_path: str) -> tuple[Optional[str], list]:
    """One prompt (a string or {'prompt_token_ids': [...]}) -> (its text or None, its ids)."""
    if isinstance(p, str):
        if tokenizer is None:
            raise ValueError(f"LLM.generate: prompt {i} is a string but the checkpoint "
                             f"{model_path!r} has no tokenizer.json; pass "
                             f"{{'prompt_token_ids': [...]}} instead")
        return p, (tokenizer.encode(p).ids if p else [])
    if isinstance(p, dict):
        if "prompt_token_ids" not in p:
            raise ValueError(f"LLM.generate: prompt {i} is a dict without 'prompt_token_ids' "
                             f"(keys: {sorted(p)}); use {{'prompt_token_ids': [...]}}")
        ids = p["prompt_token_ids"]
        if not isinstance(ids, (list, tuple)):
            ids = list(ids) if hasattr(ids, "__iter__") else ids
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"LLM.generate: prompt {i}: prompt_token_ids={ids!r} must be a "
                             f"list of token ids")
        return p.get("prompt"), list(ids)
    raise ValueError(f"LLM.generate: prompt {i} is a {type(p).__name__}; pass a string or "
                     f"{{'prompt_token_ids': [...]}}")


def new_request(call: int, i: int, text, ids: list[int], sp: SamplingParams, *,
                eos_ids: frozenset, max_model_len: int, rng: np.random.Generator,
                device) -> Request:
    stop = set(sp.stop_token_ids or ())
    if not sp.ignore_eos:
        stop |= eos_ids
    gen = None
    if not sp.greedy:
        # every random request draws from its own generator: seeded ones reproduce
        # whatever else is in the batch; the others follow LLM(seed=...)
        seed = sp.seed if sp.seed is not None else int(rng.integers(2**62))
        gen = torch.Generator(device=device).manual_seed(seed)
    r = Request(i, f"{call}-{i}", text, ids, sp, frozenset(stop), max_model_len, gen)
    r.stats = RequestMetrics(num_prompt_tokens=len(ids))
    return r


def request_output(r: Request, tokenizer) -> RequestOutput:
    r.stats.num_output_tokens = len(r.output)
    text = None
    if tokenizer is not None:
        text = tokenizer.decode(r.output, skip_special_tokens=True)
    return RequestOutput(r.req_id, r.prompt, list(r.prompt_ids),
                         [CompletionOutput(0, text, list(r.output), r.finish_reason)], r.stats)
