"""`LLM`: the offline engine's API, built from the scheduler, drafter and model runner.

One `generate()` call runs every request to completion with continuous batching: a request
holds KV blocks while it runs, and a waiting request is admitted when seats and blocks free
up. Each iteration is `_schedule -> _draft -> _verify -> _postprocess`, then `_retire`:
    schedule (admit, prefill chunks of the prompts' K/V within the token budget, compiled;
           reserve blocks; dynamic K picks K from the size of the batch that verifies)
    draft (the configured method's proposer, npuspec/methods.py; the confidence budget
           cuts low-confidence drafts)
    verify step (model forward + npuspec::rejection_sample, compiled with
           torch.compile(backend="npuspec") and replayed from captured graphs; one
           device->host transfer of (tokens, num_emitted))
    postprocess (stop rules, proposer updates, metrics), a hidden-state drafter's first pass
           on the step's features (timed as drafting), then retire finished requests.
See docs/design.md ("One decode step, as data") and docs/engine.md.
"""
from __future__ import annotations

import itertools
import math
import time
import weakref
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch

from npuspec._counters import counters
from npuspec.engine import args
from npuspec.engine import tp as tp_mod
from npuspec.engine.args import DEFAULT_MAX_NUM_SEQS
from npuspec.engine.config import EngineConfig, create_engine_config
from npuspec.engine.drafting import draft, make_proposer
from npuspec.engine.k_online import OnlineK
from npuspec.engine.metrics import EngineMetrics, record_prefill, record_step
from npuspec.engine.model_runner import ModelRunner
from npuspec.engine.request import (Request, RequestOutput, StepOutput, parse_requests,
                                    request_output, request_spec)
from npuspec.engine.sampling import SamplingParams
from npuspec.engine.scheduler import Scheduler
from npuspec.kernels import native_cpu, prebuild_cpu_kernels
from npuspec.methods import METHODS
from npuspec.models import load_model, load_tokenizer
from npuspec.models.packing import pack_model
from npuspec.models.tp import shard_model
from npuspec.spec_decode import dynamic_k
from npuspec.spec_decode.base import BuildContext, Proposer


class LLM:
    def __init__(self, model: str = "tiny", speculative_config: Union[dict, str, None] = None,
                 max_model_len: Optional[int] = None, max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
                 enforce_eager: bool = False, compilation_config: Optional[dict] = None,
                 additional_config: Optional[dict] = None, tensor_parallel_size: int = 1,
                 seed: int = 0, dtype: Any = "auto", device: Optional[str] = None,
                 block_size: Optional[int] = None, num_kv_blocks: Optional[int] = None,
                 max_num_batched_tokens: Optional[int] = None,
                 kv_transfer_config: Union[dict, str, None] = None,
                 distributed_executor_backend: Optional[str] = None,
                 quantization: Optional[str] = None):
        call_args = {k: v for k, v in locals().items() if k != "self"}  # tensor-parallel workers
        # every argument is checked before any work
        self._start(create_engine_config(**call_args), call_args)

    @classmethod
    def for_worker(cls, call_args: dict, rank: int, init_method: str) -> "LLM":
        """A tensor-parallel worker's engine (engine/tp_worker.py): rank 0's arguments, this
        rank and the group's rendezvous."""
        self = cls.__new__(cls)
        self._start(create_engine_config(**call_args, worker=(rank, init_method)), call_args)
        return self

    def _start(self, cfg: EngineConfig, call_args: dict) -> None:
        self.config = cfg
        self.spec, self.device, self.model_path = cfg.spec, cfg.device, cfg.model
        self.max_num_seqs, self.max_model_len, self.k_max = (cfg.max_num_seqs, cfg.max_model_len,
                                                             cfg.k_max)
        self.capture, self.capture_sizes, self.enforce_eager = (cfg.capture, cfg.capture_sizes,
                                                                cfg.enforce_eager)
        self.block_size, self.max_num_batched_tokens = cfg.block_size, cfg.max_num_batched_tokens
        self.tokenizer = load_tokenizer(cfg.model)  # a corrupt tokenizer.json: before the weights
        self.tp: Optional[tp_mod.TP] = None
        if cfg.parallel.world > 1:  # every check passed: launch (or join) the ranks
            # the workers lower as this rank does (the default is read here, in this process)
            call_args["compilation_config"] = dict(call_args["compilation_config"] or {},
                                                   backend=cfg.lowering)
            self.tp = tp_mod.start(cfg.parallel, cfg.device, call_args)
            weakref.finalize(self, self.tp.shutdown)
            self.device = self.tp.device
            self.tp.drafts_from_rank0 = cfg.spec is not None and not cfg.parallel.drafts_sharded
        try:
            self._build(cfg)
        except BaseException as e:
            if self.tp is not None:
                try:
                    self.tp.failed(e)
                finally:
                    self.tp.shutdown()
            raise

    def _build(self, cfg: EngineConfig) -> None:
        """Load the target (this rank's shard of it) and the drafter, and build the runner."""
        if self.device.type == "cpu":
            prebuild_cpu_kernels()  # their g++ runs while the model loads and Dynamo traces
        self.model_config, self.model = load_model(cfg.model, dtype=cfg.dtype, device=self.device,
                                                   quantization=cfg.quantization)
        self.eos_ids = frozenset(self.model_config.eos_token_ids)
        self.proposer = self._make_proposer(cfg)
        features = self._shard(self.proposer.features if self.proposer is not None else None)
        pack_model(self.model)  # CPU: weights in the layout the step reads at streaming speed
        dsc = args.confidence_budget_config(self.spec)
        self.budget = dynamic_k.ConfidenceBudget(dsc, self.k_max) if dsc else None
        self.runner = ModelRunner(self.model, self.model_config, cfg, self.device,
                                  features=features)
        if self.proposer is not None:  # hidden-state drafters read the runner's tables
            self.proposer.attach(self.runner.view())
        if getattr(self.model, "fused_norm", False):  # the CPU kernels: dispatched in C++
            native_cpu.install()  # (built in the background since prebuild_cpu_kernels)
        self.k_values = self.runner.k_values
        self._rng = np.random.default_rng(cfg.seed)
        self._calls = itertools.count()
        self.metrics: Optional[EngineMetrics] = None   # of the last generate() call
        self.totals = EngineMetrics()   # of step() calls made without their own metrics
        self._sched = Scheduler(self.max_num_seqs, self.runner.blocks, lookahead=self.k_max,
                                chunk=self.runner.chunk,
                                max_num_batched_tokens=self.max_num_batched_tokens)
        self._live: dict[str, Request] = {}  # request id -> added and not finished
        self.online: Optional[OnlineK] = None
        self._prefill_tok_s = math.nan  # the last prefill's seconds per token (_prefill)
        if self.spec is not None and self.spec.online_k:
            table = self.spec.num_speculative_tokens_per_batch_size
            cheap = not (METHODS[self.spec.method].needs_model
                         or self.spec.enable_suffix_decoding)
            rs = self.spec.rejection_sampler_config
            token_by_token = not (rs and (rs.enable_block_verify or rs.enable_entropy_verify))
            self.online = OnlineK(self.k_values, self.runner.rows_for, cheap_drafter=cheap,
                                  prior=self.spec.k_for_batch_size if table else None,
                                  probes=cheap and token_by_token)
            if self.tp is not None:  # every rank's controller is fed rank 0's times
                self.online.agree_with(self.tp.broadcast_floats, self.tp.broadcast_object)
        if self.capture:
            self.runner.warm_up()
            if self.proposer is not None:
                self.proposer.warm_up(self.k_values, self.runner.top_rows)
            if self.online is not None:  # every captured (rows, K) step's time, once
                self.online.seed_times(self.runner.time_steps())
        if self.tp is not None and self.tp.mirrors:
            self.tp.wait_ready()

    def _make_proposer(self, cfg: EngineConfig) -> Optional[Proposer]:
        """The drafter, on the ranks that draft: all, when it is sharded with the target."""
        tp = self.tp
        if tp is not None and tp.rank != 0 and tp.drafts_from_rank0:
            return None
        return make_proposer(BuildContext(
            cfg.spec, cfg.dtype, self.device, self.model_config.vocab_size, cfg.max_num_seqs,
            cfg.cache_len, target=self.model, target_path=cfg.model, num_blocks=cfg.num_blocks,
            block_size=cfg.block_size, kv_transfer_config=cfg.kv_transfer,
            shard=None if tp is None or tp.drafts_from_rank0 else (tp.rank, tp.world)))

    def _shard(self, features):
        """Tensor parallelism: this rank's shard of the target, with the drafter bound to it.
        -> the features the target's steps return (rank 0's drafter decides them)."""
        tp = self.tp
        if tp is None:
            return features
        whole, self.model = self.model, shard_model(self.model, tp.rank, tp.world)
        if tp.drafts_from_rank0:  # the ranks' steps return what rank 0's drafter reads
            features = tp.broadcast_object(features)
        # every rank drafting: a head rebinds the pieces it shares to the target's shards
        bound = (self.proposer is not None and not tp.drafts_from_rank0
                 and self.proposer.bind_target(self.model))
        if self.proposer is not None and not tp.drafts_from_rank0:
            self.proposer.agree_with(tp.broadcast_object)  # timed decisions: rank 0's
        if not bound and self.proposer is not None and METHODS[self.spec.method].hidden_states:
            # otherwise a head shares the target's embedding, norm and LM head whole (the
            # sharded ones need every rank); the whole model's layers go
            whole.layers = torch.nn.ModuleList()
            pack_model(whole)
        return features

    # -- tensor parallelism: shutdown ---------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and leave the process group (a no-op on one
        device). The LLM cannot run after this."""
        if self.tp is not None:
            self.tp.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # -- generation ---------------------------------------------------------------------------
    def generate(self, prompts, sampling_params: Union[SamplingParams, Sequence[SamplingParams],
                                                      None] = None, use_tqdm: bool = False
                 ) -> list[RequestOutput]:
        """Run every prompt to completion; results come back in prompt order. (`use_tqdm` is
        accepted for vLLM compatibility and ignored.)"""
        if self._live:
            raise RuntimeError(f"LLM.generate: {len(self._live)} request(s) added with "
                               f"add_request() are still running; finish them with step() "
                               f"or abort_request() first")
        reqs = parse_requests(  # all checks first
            prompts, sampling_params, next(self._calls), vocab_size=self.model_config.vocab_size,
            max_model_len=self.max_model_len, tokenizer=self.tokenizer,
            model_path=self.model_path, eos_ids=self.eos_ids, rng=self._rng, device=self.device)
        m = EngineMetrics(num_requests=len(reqs), num_prompt_tokens=sum(len(r.prompt_ids) for r in reqs))
        preempted = self._sched.num_preemptions
        t_start = time.perf_counter()
        for r in reqs:
            self.add_request(r, arrival_time=t_start)
        try:
            while self._sched.has_work():
                self.step(m)
        finally:  # an error mid-call must not leave proposer state or blocks behind
            for rid in list(self._live):
                self.abort_request(rid)
        m.total_s = time.perf_counter() - t_start
        m.num_output_tokens = sum(len(r.output) for r in reqs)
        m.num_preemptions = self._sched.num_preemptions - preempted
        self.metrics = m
        outs = [request_output(r, self.tokenizer) for r in reqs]
        if self.proposer is not None:  # extract_hidden_states: waits for its files
            self.proposer.finish_call(outs)
        return outs

    # -- the step API: npuspec serve's engine loop drives it; generate() runs on it ------------
    def new_request(self, prompt, params: Optional[SamplingParams] = None,
                    request_id: Optional[str] = None) -> Request:
        """A checked request for add_request(): `prompt` as generate() takes one. Touches no
        engine state but the seed generator, so a server thread may build requests while
        another runs step()."""
        r, = parse_requests(
            [prompt], params, next(self._calls), vocab_size=self.model_config.vocab_size,
            max_model_len=self.max_model_len, tokenizer=self.tokenizer,
            model_path=self.model_path, eos_ids=self.eos_ids, rng=self._rng, device=self.device)
        if request_id is not None:
            r.req_id = str(request_id)
        return r

    def add_request(self, req: Request, arrival_time: Optional[float] = None) -> None:
        """Queue a request from new_request(); the next step() may admit it."""
        if req.req_id in self._live:
            raise ValueError(f"LLM.add_request: request_id {req.req_id!r} is already running; "
                             f"give each request a unique id")
        assert not req.output and not req.blocks, req.req_id
        if self.tp is not None:
            self.tp.mirror(("add", request_spec(req), arrival_time))
        req.arrival_time = time.perf_counter() if arrival_time is None else arrival_time
        self._live[req.req_id] = req
        self._sched.add(req)
        # the optional step inputs (temperature, top-k, top-p) the live batch needs
        self.runner.start_call(list(self._live.values()))

    def abort_request(self, request_id: str) -> bool:
        """Drop an unfinished request: its blocks and proposer state are freed at once.
        False when no such request is live (finished, aborted or unknown)."""
        if self.tp is not None and not self.tp.dead:
            self.tp.mirror(("abort", request_id))
        r = self._live.pop(request_id, None)
        if r is None:
            return False
        self._sched.remove(r)
        if self.online is not None:
            self.online.forget(r.req_id)
        if self.proposer is not None and r.started:
            self.proposer.stop_request(r.req_id)
        r.finish_reason = r.finish_reason or "abort"
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._live)

    @property
    def num_preemptions(self) -> int:
        """Requests preempted (recomputed) for lack of KV blocks since construction."""
        return self._sched.num_preemptions

    def num_requests(self) -> tuple[int, int]:
        """(running, waiting): running counts prefilling requests too."""
        s = self._sched
        return len(s.running) + len(s.prefilling), len(s.waiting)

    def step(self, m: Optional[EngineMetrics] = None) -> list[StepOutput]:
        """One engine iteration: admit, prefill within the token budget, one verify step of
        the running batch, retire. Returns the requests that got tokens or finished. Charges
        `m` (default: `self.totals`, the step API's running totals)."""
        if self.tp is None:
            return self._step(m)
        self.tp.mirror(("step",))
        try:
            return self._step(m)
        except Exception as e:
            self.tp.failed(e)  # a collective with a dead worker: WorkerDied naming its rank
            raise

    def _step(self, m: Optional[EngineMetrics]) -> list[StepOutput]:
        """schedule -> draft -> verify -> postprocess (nano-vllm's loop, with a draft phase)."""
        m = self.totals if m is None else m
        batch, k = self._schedule(m)
        outs: list[StepOutput] = []
        if batch:
            t0 = time.perf_counter()
            if self.online is not None:  # K from measured costs and acceptance
                drafts, probs, k = self.online.draft(batch, self._draft)
            else:
                drafts, probs = self._draft(batch, k)                 # [B, K], [B, K, V] | None
            t1 = time.perf_counter()
            rows, inputs, res, t_run = self._verify(batch, k, drafts, probs)  # [rows, K+2]
            t2 = time.perf_counter()
            outs = self._postprocess(batch, k, drafts, res, inputs)
            t3 = time.perf_counter()
            self._draft_first_pass(batch, k, drafts, res, inputs)
            # the drafter's share: its loop before the step and its first pass after it;
            # bookkeeping: building the step's inputs, and the postprocess
            book = (t2 - t1 - t_run) + (t3 - t2)
            if self.online is not None:
                self.online.verified(rows, k, res, t_run, book, self._prefill_tok_s)
            record_step(m, batch, k, res, drafts, rows,
                        draft_s=(t1 - t0) + (time.perf_counter() - t3), step_s=t_run,
                        book_s=book)
        self._retire()
        return outs

    def _schedule(self, m: EngineMetrics) -> tuple[list[Request], int]:
        """Admit waiting requests, prefill chunks within the token budget, and reserve the
        verify step's blocks. -> (the requests that verify this step, its K). The prefill's
        token budget leaves K + 1 tokens to each running request, K the one its verify step
        is expected to run (the online controller's last, else the config's for this many
        requests); K is then chosen once, from the batch that verifies (requests whose prompt
        completed this step included)."""
        sched = self._sched
        sched.admit()
        k_next = (self.online.ctl.last_k if self.online is not None
                  else dynamic_k.k_for_step(self.spec, len(sched.running)))
        self._prefill(sched, len(sched.running) * (k_next + 1), m)
        if self.online is not None:  # prompts left for later steps: speculation delays them
            self.online.prefill_pending(bool(sched.prefilling))
        if not sched.running:
            return [], 0
        sched.reserve(self.k_max)
        return list(sched.running), dynamic_k.k_for_step(self.spec, len(sched.running))

    def _draft(self, batch: list[Request], k: int):
        """-> (drafts int64 [B, K], -1 = none; draft probs [B, K, V] or None), every rank's."""
        B, tp = len(batch), self.tp
        drafts = probs = None
        if self.proposer is not None and k > 0:
            caps = [min(k, max(r.max_new - 1, 0)) for r in batch]  # never draft past the end
            drafts, probs = draft(self.proposer, self.budget, batch, k, caps, self.runner.random)
        if tp is not None and tp.drafts_from_rank0 and k > 0:
            drafts = tp.sync_drafts(drafts, B, k)
        elif drafts is None:  # no speculation (K = 0)
            drafts = np.full((B, 0), -1, dtype=np.int64)
        return drafts, probs

    def _verify(self, batch: list[Request], k: int, drafts, probs):
        """One verify step of the batch. -> (rows run, its inputs, res [rows, K+2] on the host:
        emitted tokens -1 padded, then num_emitted; seconds the step itself took)."""
        rows = self.runner.rows_for(len(batch), k)
        inputs = self.runner.step_inputs(k, batch, rows, drafts, probs)
        t0 = time.perf_counter()
        res = self.runner.run_step(inputs).cpu().numpy()         # the one device->host copy
        if self.tp is not None:  # rank 0's tokens: its draws and draft probabilities decide
            res = self.tp.sync_result(res)
        return rows, inputs, res, time.perf_counter() - t0

    def _postprocess(self, batch: list[Request], k: int, drafts, res, inputs) -> list[StepOutput]:
        """Append each request's tokens (stop rules), hand them to the drafter, and report."""
        now = time.perf_counter()
        outs = []
        rows = res[:len(batch)].tolist()  # one conversion, not two numpy reads per request
        kept = []
        for r, row in zip(batch, rows):
            n = len(r.output)
            kept.append(r.append(row[:row[k + 1]]))
            if n == 0 and r.output:
                r.stats.first_token_s = now - r.arrival_time
            outs.append(StepOutput(r, r.output[n:], r.finished))
        if self.proposer is not None:  # a finishing step too: the suffix cache keeps it
            self.proposer.extend_batch([r.req_id for r in batch], kept)
        return outs

    def _draft_first_pass(self, batch: list[Request], k: int, drafts, res, inputs) -> None:
        """A hidden-state drafter's first pass over the step's rows (its K/V and the next
        round's pending logits), on the target's features."""
        if self.runner.features is not None and self.proposer is not None:
            self.proposer.on_verify(batch, k, drafts, res, inputs, self.runner.last_features)

    def _retire(self) -> None:
        """Free the finished requests' blocks and drafter state."""
        for r in self._sched.retire():
            r.stats.total_s = time.perf_counter() - r.arrival_time
            r.stats.num_output_tokens = len(r.output)
            self._live.pop(r.req_id, None)
            if self.online is not None:
                self.online.forget(r.req_id)
            if self.proposer is not None:
                self.proposer.stop_request(r.req_id)
                path = self.proposer.take_path(r.req_id)
                if path is not None:
                    r.kv_transfer_params = {"hidden_states_path": path}

    def _prefill(self, sched: Scheduler, decode_tokens: int, m: EngineMetrics) -> None:
        rows = sched.prefill_rows(decode_tokens, self.runner.prefill_sizes
                                  if self.capture else None)
        self._prefill_tok_s = math.nan  # seconds per prefill token, for the K controller
        if not rows and not sched.prefilling:
            return
        snap = counters.disturbed
        t0 = time.perf_counter()
        pre = None
        if rows:
            pre = self.runner.prefill(rows)
            m.num_prefill_steps += 1
        reqs = list({id(row.req): row.req for row in rows}.values())
        done = sched.prefilled(rows)
        if self.proposer is not None:
            # requests with rows this step, and one-token prompts (no rows, done at once)
            for r in reqs + done:
                if not r.started:
                    self.proposer.start_request(r.req_id, r.prompt_ids)
                    r.started = True
            if pre is not None:  # hidden-state drafters: their pass over the chunks
                self.proposer.on_prefill(rows, pre)
        dt = time.perf_counter() - t0
        record_prefill(m, reqs, dt)
        tokens = sum(row.end - row.start for row in rows)
        if tokens and snap == counters.disturbed:  # not across a compile or a fallback
            self._prefill_tok_s = dt / tokens
