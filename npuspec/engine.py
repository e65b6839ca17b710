"""The offline engine: `npuspec.LLM` and `npuspec.SamplingParams` (DESIGN.md §3.7).

Shaped like vLLM's offline API, so that the vLLM Ascend speculative decoding guide's examples
port directly:

    llm = LLM(model="tiny", speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    out = llm.generate(["def fib(n):"], SamplingParams(temperature=0, max_tokens=64))
    out[0].outputs[0].text, out[0].metrics.mean_acceptance_length

One `generate()` call runs every request to completion with continuous batching: a request
holds a KV-cache slot while it runs, and a waiting request takes a freed slot at the next
step. Each iteration is
    admit + prefill (its own step: the prompts' K/V, eager)
    draft (ngram / suffix / draft model; dynamic K picks K from the batch size, the
           confidence budget cuts low-confidence drafts)
    verify step (model forward + npuspec::rejection_sample, compiled with
           torch.compile(backend="npuspec") and replayed from captured graphs; one
           device->host transfer of (tokens, num_emitted))
    bookkeeping (stop rules, proposer updates, metrics).
See docs/engine.md.
"""
from __future__ import annotations

import dataclasses
import difflib
import itertools
import logging
import time
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch

from npuspec.config import SpeculativeConfig, merge_additional_config
from npuspec.runtime import dynamic_k
from npuspec.runtime.scheduler import Request, Scheduler, fill_drafts, pad_rows
from npuspec.runtime.step import VerifyStep, fresh_step_fn, prefill

log = logging.getLogger("npuspec.engine")

ENGINE_METHODS = ("ngram", "suffix", "draft_model")
CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
COMPILATION_KEYS = ("cudagraph_capture_sizes", "cudagraph_mode", "backend")
DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16, "half": torch.float16}
DEFAULT_MAX_NUM_SEQS = 16
# padding values of the step inputs' padded rows (slots: filled in per engine, the scratch slot)
_PAD = {"draft_ids": -1, "top_p": 1.0, "uniforms": 1.0, "exponentials": 1.0}
DEFAULT_MAX_MODEL_LEN = 2048
DEFAULT_LOWERING: Optional[str] = None  # None: the backend's platform default (Inductor on CPU)


# ----------------------------------------------------------------------------------------------
# Public data classes

@dataclasses.dataclass
class SamplingParams:
    """vLLM's SamplingParams subset. temperature 0 = greedy; top_k -1 or 0 = off."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    seed: Optional[int] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False

    def __post_init__(self):
        def bad(key, fix):
            return ValueError(f"SamplingParams: {key}={getattr(self, key)!r}: {fix}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) \
                or self.max_tokens <= 0:
            raise bad("max_tokens", "must be an integer >= 1 (the number of tokens to generate)")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not self.temperature >= 0 or self.temperature == float("inf"):
            raise bad("temperature", "must be a finite number >= 0 (0 = greedy)")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) \
                or not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1] (1 = off)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", "must be an integer >= 1, or -1 / 0 for off")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise bad("seed", "must be an integer or None")
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                    isinstance(t, int) and not isinstance(t, bool) and t >= 0
                    for t in self.stop_token_ids):
                raise bad("stop_token_ids", "must be a list of token ids (integers >= 0)")
            self.stop_token_ids = list(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclasses.dataclass
class RequestMetrics:
    """Counts and times for one request (times in seconds; a step's time is charged to every
    request that ran in it)."""
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_steps: int = 0              # verify steps this request took part in
    num_drafted: int = 0            # draft tokens verified (after cuts; -1 not counted)
    num_accepted: int = 0
    drafted_by_position: list[int] = dataclasses.field(default_factory=list)
    accepted_by_position: list[int] = dataclasses.field(default_factory=list)
    prefill_s: float = 0.0
    draft_s: float = 0.0
    step_s: float = 0.0
    bookkeeping_s: float = 0.0
    total_s: float = 0.0            # from the start of generate() to this request's last token

    def _grow(self, k: int) -> None:
        while len(self.accepted_by_position) < k:
            self.accepted_by_position.append(0)
            self.drafted_by_position.append(0)

    @property
    def mean_acceptance_length(self) -> Optional[float]:
        """Tokens emitted per verify step: 1 + accepted drafts per step."""
        return (self.num_steps + self.num_accepted) / self.num_steps if self.num_steps else None

    @property
    def acceptance_rate(self) -> Optional[float]:
        return self.num_accepted / self.num_drafted if self.num_drafted else None

    @property
    def acceptance_by_position(self) -> list[Optional[float]]:
        """P(draft i accepted | a draft was verified at i)."""
        return [a / d if d else None
                for a, d in zip(self.accepted_by_position, self.drafted_by_position)]

    @property
    def tokens_per_s(self) -> Optional[float]:
        return self.num_output_tokens / self.total_s if self.total_s > 0 else None


@dataclasses.dataclass
class EngineMetrics(RequestMetrics):
    """Totals over one generate() call; times are wall-clock (not summed over requests).
    `num_steps` counts request-steps (a step of B requests counts B), so
    `mean_acceptance_length` is per request; `num_engine_steps` counts batched steps."""
    num_requests: int = 0
    num_engine_steps: int = 0
    steps_by_k: dict = dataclasses.field(default_factory=dict)  # K -> verify steps run with it
    padded_rows: int = 0            # rows added to reach captured sizes


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


# ----------------------------------------------------------------------------------------------
# Argument parsing

def _err(key: str, value: Any, fix: str) -> ValueError:
    return ValueError(f"LLM: {key}={value!r}: {fix}")


def _pos_int(key: str, v: Any, lo: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise _err(key, v, f"must be an integer >= {lo}")
    return v


def _parse_dtype(dtype: Any) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.float32
    if dtype not in DTYPES:
        raise _err("dtype", dtype, f"use one of {', '.join(DTYPES)} or 'auto'")
    return DTYPES[dtype]


def _parse_compilation(cc: Any, enforce_eager: bool) -> tuple[Any, Optional[list], Optional[str]]:
    """-> (capture: True | False, capture sizes in tokens or None, lowering or None)."""
    if cc is None:
        cc = {}
    if not isinstance(cc, dict):
        raise _err("compilation_config", cc, "must be a dict such as "
                   "{'cudagraph_capture_sizes': [4, 8, 16], 'cudagraph_mode': 'FULL'}")
    for k in cc:
        if k not in COMPILATION_KEYS:
            near = difflib.get_close_matches(str(k), COMPILATION_KEYS, n=1, cutoff=0.5)
            hint = f"did you mean {near[0]!r}?" if near else f"valid keys: {', '.join(COMPILATION_KEYS)}"
            raise ValueError(f"LLM: compilation_config has unknown key {k!r}; {hint}")
    sizes = cc.get("cudagraph_capture_sizes")
    if sizes is not None:
        if not isinstance(sizes, (list, tuple)) or not sizes or not all(
                isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in sizes):
            raise _err("compilation_config.cudagraph_capture_sizes", sizes,
                       "must be a non-empty list of positive token counts, e.g. [4, 8, 16]")
        sizes = sorted(set(sizes))
    mode = cc.get("cudagraph_mode", "FULL_DECODE_ONLY")
    if isinstance(mode, str):
        mode = mode.upper()
    if mode not in CUDAGRAPH_MODES:
        raise _err("compilation_config.cudagraph_mode", cc.get("cudagraph_mode"),
                   f"must be one of {', '.join(CUDAGRAPH_MODES)}")
    lowering = cc.get("backend", DEFAULT_LOWERING)
    if lowering is not None and lowering not in ("inductor", "eager"):
        raise _err("compilation_config.backend", lowering, "must be 'inductor' or 'eager'")
    if mode in ("PIECEWISE", "FULL_AND_PIECEWISE"):
        log.info("npuspec captures the whole decode step (FULL); cudagraph_mode=%s behaves "
                 "as FULL_DECODE_ONLY", mode)
    capture = not enforce_eager and mode != "NONE"
    return capture, sizes, lowering


def _parse_spec(spec: Any, additional: Any, tp: int) -> Optional[SpeculativeConfig]:
    if spec is None:
        if additional:
            keys = [k for k in ("rejection_sampler_config", "dynamic_spec_config")
                    if isinstance(additional, dict) and k in additional]
            if keys:
                raise ValueError(f"LLM: additional_config.{keys[0]} needs a speculative_config; "
                                 f"pass speculative_config={{'method': ..., ...}} or drop it")
        return None
    from npuspec.platform import current_platform
    d = merge_additional_config(spec, additional)
    cfg = SpeculativeConfig.from_dict(d, tensor_parallel_size=tp,
                                      device=current_platform().device)
    if cfg.method not in ENGINE_METHODS:
        raise NotImplementedError(
            f"speculative_config.method={cfg.method!r} is not implemented yet in npuspec's "
            f"engine; use one of {', '.join(ENGINE_METHODS)} (or drop speculative_config)")
    return cfg


# ----------------------------------------------------------------------------------------------
# The engine

class LLM:
    def __init__(self, model: str = "tiny", speculative_config: Union[dict, str, None] = None,
                 max_model_len: Optional[int] = None, max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
                 enforce_eager: bool = False, compilation_config: Optional[dict] = None,
                 additional_config: Optional[dict] = None, tensor_parallel_size: int = 1,
                 seed: int = 0, dtype: Any = "auto", device: Optional[str] = None):
        from npuspec.models import load_model, load_tokenizer
        from npuspec.platform import current_platform

        if tensor_parallel_size != 1:
            raise NotImplementedError(
                f"LLM: tensor_parallel_size={tensor_parallel_size!r} is not supported yet; "
                f"npuspec's engine runs on one device: use tensor_parallel_size=1")
        self.max_num_seqs = _pos_int("max_num_seqs", max_num_seqs)
        if not isinstance(enforce_eager, bool):
            raise _err("enforce_eager", enforce_eager, "must be True or False")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise _err("seed", seed, "must be an integer")
        self.spec = _parse_spec(speculative_config, additional_config, tensor_parallel_size)
        self.capture, self.capture_sizes, lowering = _parse_compilation(compilation_config,
                                                                        enforce_eager)
        self.enforce_eager = enforce_eager
        self.device = torch.device(device or current_platform().device)
        torch_dtype = _parse_dtype(dtype)

        self.model_path = model
        self.model_config, self.model = load_model(model, dtype=torch_dtype, device=self.device)
        self.tokenizer = load_tokenizer(model)
        cfg = self.model_config
        limit = min(cfg.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
        if max_model_len is None:
            max_model_len = limit
        self.max_model_len = _pos_int("max_model_len", max_model_len, lo=2)
        if max_model_len > cfg.max_position_embeddings:
            raise _err("max_model_len", max_model_len,
                       f"exceeds the model's max_position_embeddings "
                       f"({cfg.max_position_embeddings}); use a value <= that")
        self.eos_ids = frozenset(cfg.eos_token_ids)

        self.k_max = self.spec.num_speculative_tokens if self.spec else 0
        self.k_values = self.spec.k_values() if self.spec else (0,)
        rs = self.spec.rejection_sampler_config if self.spec else None
        rates = self.spec.synthetic_rates() if self.spec else None
        self._rates = None if rates is None else torch.tensor(rates, dtype=torch.float32,
                                                              device=self.device)
        cache_len = self.max_model_len + self.k_max + 1  # draft positions run K past the end
        self.cache = self.model.allocate_cache(self.max_num_seqs + 1, cache_len)
        self.step_module = VerifyStep(
            self.model, self.cache, block_verify=bool(rs and rs.enable_block_verify),
            entropy_verify=rs.entropy_verify if rs else None)
        self.proposer = self._make_proposer(torch_dtype, cache_len)
        dsc = self.spec.dynamic_spec_config if self.spec else None
        self.budget = dynamic_k.ConfidenceBudget(dsc, self.k_max) if dsc else None

        self._plans = self._plan_sizes()
        # Compiled steps run at least 2 rows (one padding row at batch 1): Dynamo specialises
        # a dim of size 1, so a 1-row call would compile and capture a second graph per K and
        # variant, doubling start-up time. With max_num_seqs=1 the 1-row graph is the only one.
        self._min_rows = 1 if enforce_eager or self.max_num_seqs == 1 else 2
        self._options = self._backend_options(lowering)
        self._compiled: dict[tuple, Any] = {}  # step variant -> torch.compile'd step
        self._rng = np.random.default_rng(seed)
        self._calls = itertools.count()
        self.metrics: Optional[EngineMetrics] = None   # of the last generate() call
        self._random = self._top_k = self._top_p = False  # what the current call's batch needs
        if self.capture:
            self._warm_up()

    # -- construction helpers ---------------------------------------------------------------
    def _make_proposer(self, dtype, cache_len: int):
        s = self.spec
        if s is None:
            return None
        if s.method == "ngram":
            from npuspec.runtime.ngram import NgramProposer
            return NgramProposer(prompt_lookup_min=s.prompt_lookup_min,
                                 prompt_lookup_max=s.prompt_lookup_max)
        if s.method == "suffix":
            from npuspec.runtime.suffix import SuffixProposer
            return SuffixProposer(max_tree_depth=s.suffix_decoding_max_tree_depth,
                                  max_cached_requests=s.suffix_decoding_max_cached_requests,
                                  max_spec_factor=s.suffix_decoding_max_spec_factor,
                                  min_token_prob=s.suffix_decoding_min_token_prob)
        from npuspec.models import load_model
        from npuspec.runtime.draft_model import DraftModelProposer
        dcfg, dmodel = load_model(s.model, dtype=dtype, device=self.device)
        if dcfg.vocab_size != self.model_config.vocab_size:
            raise ValueError(
                f"speculative_config.model={s.model!r}: the draft model's vocab_size "
                f"({dcfg.vocab_size}) differs from the target's ({self.model_config.vocab_size}); "
                f"a draft model must share the target's tokenizer and vocabulary")
        return DraftModelProposer(dmodel, self.max_num_seqs, cache_len, device=self.device)

    def _plan_sizes(self) -> dict[int, Optional[list[int]]]:
        """Capture sizes (tokens) per K; None when nothing is captured (no padding then)."""
        if not self.capture:
            return {k: None for k in self.k_values}
        from npuspec.graphs import plan_capture_sizes
        return {k: list(plan_capture_sizes(k, self.max_num_seqs, sizes=self.capture_sizes))
                for k in self.k_values}

    def _backend_options(self, lowering: Optional[str]) -> dict:
        opts = {"speculative_config": self.spec, "max_num_seqs": self.max_num_seqs,
                "capture": self.capture}
        if self.capture_sizes is not None:
            opts["capture_sizes"] = list(self.capture_sizes)
        if lowering is not None:
            opts["lowering"] = lowering
        return opts

    def _warm_up(self) -> None:
        """Compile and capture the greedy variant of every K before the first request, so a
        K swap never compiles or captures: one call per K at the largest captured size (the
        dynamic-batch graph, whose set captures every planned size)."""
        for k in self.k_values:
            sizes = self._plans.get(k)
            top = sizes[-1] // (k + 1) if sizes else self._min_rows
            self._run_step(self._inputs(k, [], max(top, self._min_rows), None, None))

    # -- input validation -------------------------------------------------------------------
    def _requests(self, prompts, params, call: int) -> list[Request]:
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
        V = self.model_config.vocab_size
        reqs = []
        for i, (p, sp) in enumerate(zip(prompts, params)):
            if not isinstance(sp, SamplingParams):
                raise ValueError(f"LLM.generate: sampling_params[{i}] is a {type(sp).__name__}; "
                                 f"pass npuspec.SamplingParams(...)")
            text, ids = self._prompt_ids(i, p)
            if not ids:
                raise ValueError(f"LLM.generate: prompt {i} is empty; give at least one token")
            for j, t in enumerate(ids):
                if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < V:
                    raise ValueError(f"LLM.generate: prompt {i} has token id {t!r} at index {j}, "
                                     f"outside the model's vocabulary [0, {V}); use ids from this "
                                     f"model's tokenizer")
            if len(ids) >= self.max_model_len:
                raise ValueError(f"LLM.generate: prompt {i} has {len(ids)} tokens but "
                                 f"max_model_len={self.max_model_len} leaves no room to generate; "
                                 f"shorten the prompt or raise max_model_len")
            reqs.append(self._new_request(call, i, text, [int(t) for t in ids], sp))
        return reqs

    def _prompt_ids(self, i: int, p) -> tuple[Optional[str], list]:
        if isinstance(p, str):
            if self.tokenizer is None:
                raise ValueError(f"LLM.generate: prompt {i} is a string but the checkpoint "
                                 f"{self.model_path!r} has no tokenizer.json; pass "
                                 f"{{'prompt_token_ids': [...]}} instead")
            return p, (self.tokenizer.encode(p).ids if p else [])
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

    def _new_request(self, call: int, i: int, text, ids: list[int], sp: SamplingParams) -> Request:
        stop = set(sp.stop_token_ids or ())
        if not sp.ignore_eos:
            stop |= self.eos_ids
        gen = None
        if not sp.greedy:
            # every random request draws from its own generator: seeded ones reproduce
            # whatever else is in the batch; the others follow LLM(seed=...)
            seed = sp.seed if sp.seed is not None else int(self._rng.integers(2**62))
            gen = torch.Generator(device=self.device).manual_seed(seed)
        r = Request(i, f"{call}-{i}", text, ids, sp, frozenset(stop), self.max_model_len, gen)
        r.stats = RequestMetrics(num_prompt_tokens=len(ids))
        return r

    # -- generation ---------------------------------------------------------------------------
    def generate(self, prompts, sampling_params: Union[SamplingParams, Sequence[SamplingParams],
                                                      None] = None, use_tqdm: bool = False
                 ) -> list[RequestOutput]:
        """Run every prompt to completion; results come back in prompt order. (`use_tqdm` is
        accepted for vLLM compatibility and ignored.)"""
        reqs = self._requests(prompts, sampling_params, next(self._calls))  # all checks first
        sched = Scheduler(self.max_num_seqs)
        for r in reqs:
            sched.add(r)
        m = EngineMetrics(num_requests=len(reqs), num_prompt_tokens=sum(len(r.prompt_ids) for r in reqs))
        self._random = any(not r.params.greedy for r in reqs)
        self._top_k = any(r.params.top_k > 0 for r in reqs)
        self._top_p = any(r.params.top_p < 1 for r in reqs)
        t_start = time.perf_counter()
        try:
            while sched.has_work():
                new = sched.admit()
                if new:
                    self._prefill(new, m)
                self._decode_step(sched.running, m)
                for r in sched.retire():
                    r.stats.total_s = time.perf_counter() - t_start
                    if self.proposer is not None:
                        self.proposer.stop_request(r.req_id)
        finally:  # an error mid-call must not leave proposer state (draft cache slots) behind
            if self.proposer is not None:
                for r in sched.running:
                    try:
                        self.proposer.stop_request(r.req_id)
                    except KeyError:  # failed before its start_request
                        pass
        m.total_s = time.perf_counter() - t_start
        m.num_output_tokens = sum(len(r.output) for r in reqs)
        self.metrics = m
        return [self._output(r) for r in reqs]

    def _output(self, r: Request) -> RequestOutput:
        r.stats.num_output_tokens = len(r.output)
        text = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(r.output, skip_special_tokens=True)
        return RequestOutput(r.req_id, r.prompt, list(r.prompt_ids),
                             [CompletionOutput(0, text, list(r.output), r.finish_reason)], r.stats)

    def _prefill(self, new: list[Request], m: EngineMetrics) -> None:
        t0 = time.perf_counter()
        prefill(self.model, self.cache, [r.prompt_ids for r in new], [r.slot for r in new],
                self.device)
        if self.proposer is not None:
            for r in new:
                self.proposer.start_request(r.req_id, r.prompt_ids)
        dt = time.perf_counter() - t0
        m.prefill_s += dt
        for r in new:
            r.stats.prefill_s += dt

    def _k_for(self, batch: int) -> int:
        return dynamic_k.k_for_step(self.spec, batch)

    def _decode_step(self, reqs: list[Request], m: EngineMetrics) -> None:
        t0 = time.perf_counter()
        B = len(reqs)
        k = self._k_for(B)
        caps = [min(k, max(r.max_new - 1, 0)) for r in reqs]  # never draft past the end
        drafts, probs = self._draft(reqs, k, caps)               # [B, K] int64, [B, K, V] | None
        t1 = time.perf_counter()
        sizes = self._plans.get(k)
        rows = pad_rows(max(B, self._min_rows), sizes, k)
        inputs = self._inputs(k, reqs, rows, drafts, probs)
        t2 = time.perf_counter()
        res = self._run_step(inputs).cpu().numpy()               # the one device->host copy
        t3 = time.perf_counter()
        drafted = drafts >= 0                                    # [B, K]
        for b, r in enumerate(reqs):
            n = int(res[b, k + 1])
            kept = r.append(res[b, :n].tolist())
            st = r.stats
            st.num_steps += 1
            if k:
                st._grow(k)
                nd = int(drafted[b].sum())
                acc = min(n - 1, nd)
                st.num_drafted += nd
                st.num_accepted += acc
                for i in range(nd):
                    st.drafted_by_position[i] += 1
                for i in range(acc):
                    st.accepted_by_position[i] += 1
            if not r.finished and self.proposer is not None:
                self.proposer.extend(r.req_id, kept)
        t4 = time.perf_counter()
        draft_s, step_s, book_s = t1 - t0, t3 - t2, (t2 - t1) + (t4 - t3)
        for r in reqs:
            r.stats.draft_s += draft_s
            r.stats.step_s += step_s
            r.stats.bookkeeping_s += book_s
        m.draft_s += draft_s
        m.step_s += step_s
        m.bookkeeping_s += book_s
        m.num_engine_steps += 1
        m.num_steps += B  # request-steps: mean_acceptance_length is per request
        m.padded_rows += rows - B
        m.steps_by_k[k] = m.steps_by_k.get(k, 0) + 1
        if k:
            m._grow(k)
            nd = drafted.sum(0)
            m.num_drafted += int(nd.sum())
            acc = np.array([min(int(res[b, k + 1]) - 1, int(drafted[b].sum())) for b in range(B)])
            m.num_accepted += int(acc.sum())
            for i in range(k):
                m.drafted_by_position[i] += int(nd[i])
                m.accepted_by_position[i] += int((acc > i).sum())

    def _draft(self, reqs: list[Request], k: int, caps: list[int]):
        B = len(reqs)
        if k == 0:
            return np.full((B, 0), -1, dtype=np.int64), None
        ids = [r.req_id for r in reqs]
        if not hasattr(self.proposer, "draft"):  # token-only drafters (ngram, suffix)
            return fill_drafts(self.proposer.propose(ids, caps), B, k), None
        # model drafters: tokens [B, K], draft probs and per-position confidences
        temps = np.array([r.params.temperature for r in reqs], dtype=np.float64)
        d = self.proposer.draft(ids, k, temps if self._random else None,
                                [r.generator for r in reqs], want_probs=self._random)
        allow = np.asarray(caps, dtype=np.int64)
        if self.budget is not None:
            allow = np.minimum(allow, self.budget(d.conf))
        return dynamic_k.cut_drafts(d.tokens, allow), d.probs

    def _inputs(self, k: int, reqs: list[Request], rows: int, drafts, probs) -> dict:
        """Host-side step inputs for `rows` rows (the first len(reqs) real, the rest padding
        that writes only into the scratch slot and is never read back)."""
        B = len(reqs)
        dev = self.device
        draft = np.full((rows, k), -1, dtype=np.int64)
        ids = np.zeros((rows, k + 1), dtype=np.int64)
        pos = np.broadcast_to(np.arange(k + 1, dtype=np.int64), (rows, k + 1)).copy()
        slots = np.full(rows, self.max_num_seqs, dtype=np.int64)  # scratch slot
        if B:
            draft[:B] = drafts
            ids[:B, 0] = [r.tokens[-1] for r in reqs]
            ids[:B, 1:] = np.maximum(drafts, 0)  # a -1 draft still needs a valid embedding row
            pos[:B] += np.array([len(r.tokens) - 1 for r in reqs], dtype=np.int64)[:, None]
            slots[:B] = [r.slot for r in reqs]
        t = lambda a: torch.from_numpy(a).to(dev)  # noqa: E731
        inp = {"input_ids": t(ids), "positions": t(pos), "slots": t(slots), "draft_ids": t(draft)}
        if self._rates is not None:
            inp["synthetic_rates"] = self._rates[:k]
        random = B > 0 and self._random
        if not random:
            return inp
        V = self.model_config.vocab_size
        temp = np.zeros(rows, dtype=np.float32)
        temp[:B] = [r.params.temperature for r in reqs]
        inp["temperature"] = t(temp)
        if self._top_k:
            tk = np.zeros(rows, dtype=np.int64)
            tk[:B] = [max(r.params.top_k, 0) for r in reqs]
            inp["top_k"] = t(tk)
        if self._top_p:
            tp = np.ones(rows, dtype=np.float32)
            tp[:B] = [r.params.top_p for r in reqs]
            inp["top_p"] = t(tp)
        if probs is not None:
            q = torch.zeros(rows, k, V, dtype=torch.float32, device=dev)
            q[:B] = probs
            inp["draft_probs"] = q
        # draws: per request from its own generator (uniforms first, then the Exp(1) vector),
        # so a seeded request's draws do not depend on the batch; greedy and padding rows
        # ignore theirs
        u = torch.ones(rows, k, dtype=torch.float32, device=dev)
        e = torch.ones(rows, V, dtype=torch.float32, device=dev)
        for b, r in enumerate(reqs):
            if r.generator is not None:
                u[b] = torch.rand(k, dtype=torch.float64, generator=r.generator,
                                  device=dev).float()
                e[b].exponential_(generator=r.generator)
        inp["uniforms"], inp["exponentials"] = u, e
        return inp

    def _step_fn(self, inp: dict):
        """The compiled step for this input variant (which optional inputs are present).

        Each variant gets its own code object (`fresh_step_fn`), so Dynamo's per-code cache
        and recompile limit are per engine and per variant: graphs of one LLM never evict or
        count against another's, and within a variant only K and the batch-size-1 graph vary.
        """
        key = tuple(sorted(inp))
        fn = self._compiled.get(key)
        if fn is None:
            fn = torch.compile(fresh_step_fn(self.step_module), backend="npuspec",
                               options=self._options, dynamic=None)
            self._compiled[key] = fn
        return fn

    @torch.inference_mode()
    def _run_step(self, inp: dict) -> torch.Tensor:
        if self.enforce_eager:
            return self.step_module(**inp)
        from npuspec.graphs import mark_token_dim
        # dim 0 of every per-request input is the token/batch dim: dynamic for Dynamo (one
        # graph per K serves every batch size) and padded by the graph dispatcher with
        # inert rows: scratch slot, no drafts, greedy.
        for name, t in inp.items():
            if name != "synthetic_rates":
                pad = self.max_num_seqs if name == "slots" else _PAD.get(name, 0)
                mark_token_dim(t, 0, pad=pad)
        return self._step_fn(inp)(**inp)
