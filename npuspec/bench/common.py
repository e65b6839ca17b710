"""What several benches (and `npuspec demo`, `generate`, `tune`) share: building npuspec as a
benchmark row (`make_llm`, `npuspec_runner`), timing rows round-robin (`Runner`,
`run_interleaved`), the engine's acceptance metrics summed over requests, and the prompts as
token ids."""
from __future__ import annotations

import json
import statistics
import time
from typing import Callable, Sequence

from npuspec._counters import counters
from npuspec.cli_util import common
from npuspec.cli_util.errors import UsageError
from npuspec.engine import LLM, SamplingParams
from npuspec.models.loading import load_tokenizer


def cut_at_eos(ids: Sequence[int], eos: Sequence[int]) -> list[int]:
    """Tokens up to and including the first EOS (HF pads after it; engines stop there)."""
    out = []
    for t in ids:
        out.append(int(t))
        if t in eos:
            break
    return out


def encode(model_dir: str, prompts: Sequence[str], hf_tokenizer=None) -> list[list[int]]:
    """Token ids of text prompts: with `hf_tokenizer` (chat-templated text, which carries its own
    special tokens) transformers' encoding without added special tokens, else npuspec's tokenizer."""
    if hf_tokenizer is not None:
        ids = [list(hf_tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts]
        if any(not x for x in ids):
            raise UsageError("a prompt encodes to no tokens; remove empty prompts", "--prompts")
        return ids
    tok = load_tokenizer(model_dir)
    if tok is None:
        raise UsageError(f"{model_dir} has no tokenizer.json, so the text prompts cannot be encoded; "
                         f"use a checkpoint directory that has one", "--model")
    ids = [tok.encode(p).ids for p in prompts]
    if any(not x for x in ids):
        raise UsageError("a prompt encodes to no tokens; remove empty prompts", "--prompts")
    return ids


class Runner:
    """One row of the benchmark: `setup()` builds the system (load, compile, capture), then each
    `run()` generates every prompt and returns {"token_ids", "tokens", "metrics"}."""

    def __init__(self, system: str, method: str, k: int, setup: Callable[[], Callable[[], dict]]):
        self.system, self.method, self.k, self._setup = system, method, k, setup
        self.times: list[float] = []
        self.result: dict = {}
        self.warmup_seconds = 0.0

    def warm_up(self) -> None:
        t0 = time.perf_counter()
        self._run = self._setup()
        self.result = self._run()
        self.warmup_seconds = time.perf_counter() - t0

    def timed(self) -> None:
        t0 = time.perf_counter()
        self.result = self._run()
        self.times.append(time.perf_counter() - t0)

    @property
    def seconds(self) -> float:
        return statistics.median(self.times)


def run_interleaved(runners: Sequence[Runner], repeats: int, progress=None,
                    rotate: bool = False) -> None:
    """Warm every row up, then time them round-robin `repeats` times, so a change in machine
    load hits every row alike (medians are taken per row). `rotate`: round i starts at row i
    (mod the row count), so no row always runs right after the same one."""
    for r in runners:
        r.warm_up()
        if progress:
            progress.update()
    for i in range(repeats):
        j = i % len(runners) if rotate and runners else 0
        for r in list(runners[j:]) + list(runners[:j]):
            r.timed()
            if progress:
                progress.update()


def aggregate_metrics(results, engine=None) -> dict:
    """Counts summed over the requests (in request-steps), times from the engine's wall clock
    (`llm.metrics`) when given. acceptance_by_position[i] = fraction of request-steps whose
    draft i+1 was accepted (unconditional), so mean acceptance length = 1 + their sum."""
    steps = drafted = accepted = 0
    by_pos: list[int] = []
    for r in results:
        m = r.metrics
        steps += m.num_steps
        drafted += m.num_drafted
        accepted += m.num_accepted
        for i, a in enumerate(m.accepted_by_position):
            if i >= len(by_pos):
                by_pos.append(0)
            by_pos[i] += a
    src = engine
    return {"request_steps": steps, "drafted": drafted, "accepted": accepted,
            "accepted_by_position": by_pos,
            "acceptance_by_position": [a / steps for a in by_pos] if steps else [],
            "mean_acceptance_length": (steps + accepted) / steps if steps else None,
            "draft_s": src.draft_s if src else sum(r.metrics.draft_s for r in results),
            "step_s": src.step_s if src else sum(r.metrics.step_s for r in results),
            "bookkeeping_s": src.bookkeeping_s if src else sum(r.metrics.bookkeeping_s for r in results),
            "engine_steps": src.num_engine_steps if src else None,
            "k_over_time": k_over_time(src) if src else []}


def k_over_time(m) -> list[list]:
    """[[seconds since the call's first verify step, batch, K, tokens emitted], ...] per verify
    step of an EngineMetrics (bounded like its k_trace)."""
    if not m.step_trace:
        return []
    t0 = m.step_trace[0][0]
    return [[t - t0, b, k, n] for (b, k), (t, n) in zip(m.k_trace, m.step_trace)]


def make_llm(model: str, spec: dict | None, max_num_seqs: int, max_model_len: int,
             enforce_eager: bool = False, dtype: str = "auto", quantization: str | None = None):
    return LLM(model=model, speculative_config=spec, max_num_seqs=max_num_seqs,
               max_model_len=max_model_len, enforce_eager=enforce_eager, dtype=dtype,
               quantization=quantization)


def npuspec_runner(model: str, spec: dict | None, prompts, max_tokens: int, max_num_seqs: int = 1,
                   enforce_eager: bool = False, eos=(), max_model_len: int | str | None = "fit",
                   dtype: str = "auto", engines: dict | None = None,
                   quantization: str | None = None) -> Callable[[], Callable[[], dict]]:
    """setup for a Runner: LLM.generate over all prompts (strings, or lists of token ids).
    max_model_len: a number, None (the engine's default) or "fit" (the prompts plus max_tokens).
    engines: a dict the rows share, so rows with the same engine settings (one method over
    several prompt sets) build, compile and capture it once."""
    def setup():
        inputs = [p if isinstance(p, str) else {"prompt_token_ids": list(p)} for p in prompts]
        mml = common.fit_max_model_len(model, prompts, max_tokens) if max_model_len == "fit" else max_model_len
        key = (json.dumps(spec, sort_keys=True), max_num_seqs, mml, enforce_eager, dtype, quantization)
        if engines is not None and key in engines:
            llm = engines[key]
        else:
            llm = make_llm(model, spec, max_num_seqs, mml, enforce_eager, dtype, quantization)
            if engines is not None:
                engines[key] = llm
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)

        def run():
            # every pass answers the prompts as new requests: suffix decoding would otherwise
            # copy the earlier passes' (identical, greedy) answers from its response cache
            if llm.proposer is not None:
                llm.proposer.forget_responses()
            before = counters.snapshot()
            picks0 = dict(getattr(llm.proposer, "picks", None) or {})  # the hybrid's choices
            res = llm.generate(inputs, sp)
            # steps that ran uncaptured in this pass (the target's or a drafter's)
            fallbacks = counters.delta(before).get("eager_fallbacks", 0)
            picks = {k: v - picks0.get(k, 0)
                     for k, v in (getattr(llm.proposer, "picks", None) or {}).items()}
            return {"token_ids": [cut_at_eos(r.outputs[0].token_ids, eos) for r in res],
                    "texts": [r.outputs[0].text for r in res],
                    "tokens": sum(len(r.outputs[0].token_ids) for r in res),
                    "metrics": aggregate_metrics(res, llm.metrics),
                    "eager_fallbacks": fallbacks, "picks": picks}
        return run
    return setup


def run_npuspec(model: str, spec: dict | None, prompts, max_tokens: int, max_num_seqs: int = 1,
                repeats: int = 1, enforce_eager: bool = False, eos=()) -> dict:
    """One npuspec row on its own (used by `npuspec tune`): result of the last timed pass."""
    r = Runner("npuspec", "", 0, npuspec_runner(model, spec, prompts, max_tokens, max_num_seqs,
                                                 enforce_eager, eos))
    run_interleaved([r], repeats)
    return dict(r.result, seconds=r.seconds, warmup_seconds=r.warmup_seconds)


def spec_from_flag(value, field: str = "--speculative-config") -> dict | None:
    """--speculative-config as a dict (common.spec_dict: inline JSON or a .json path); a file
    `npuspec tune --json` wrote is unwrapped to its "speculative_config" object."""
    d = common.spec_dict(value, field)
    if isinstance(d, dict) and "method" not in d and isinstance(d.get("speculative_config"), dict):
        d = d["speculative_config"]
    return d

