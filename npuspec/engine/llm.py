"""`LLM`: the offline engine's API, built from the scheduler, drafter and model runner.

One `generate()` call runs every request to completion with continuous batching: a request
holds KV blocks while it runs, and a waiting request is admitted when seats and blocks free
up. Each iteration is
    admit + prefill (chunks of the prompts' K/V within the token budget, compiled)
    draft (ngram / suffix / draft model; dynamic K picks K from the batch size, the
           confidence budget cuts low-confidence drafts)
    verify step (model forward + npuspec::rejection_sample, compiled with
           torch.compile(backend="npuspec") and replayed from captured graphs; one
           device->host transfer of (tokens, num_emitted))
    bookkeeping (stop rules, proposer updates, metrics).
See docs/engine.md.
"""
from __future__ import annotations

import itertools
import time
import weakref
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch

from npuspec.engine import args
from npuspec.engine import tp as tp_mod
from npuspec.engine.args import DEFAULT_MAX_NUM_SEQS, arg_error, pos_int
from npuspec.engine.drafting import HIDDEN_STATE_METHODS, draft, make_proposer
from npuspec.engine.metrics import EngineMetrics, record_prefill, record_step
from npuspec.engine.model_runner import ModelRunner
from npuspec.engine.request import (Request, RequestOutput, StepOutput, parse_requests,
                                    request_output, request_spec)
from npuspec.engine.sampling import SamplingParams
from npuspec.engine.scheduler import Scheduler
from npuspec.runtime import dynamic_k


class LLM:
    def __init__(self, model: str = "tiny", speculative_config: Union[dict, str, None] = None,
                 max_model_len: Optional[int] = None, max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
                 enforce_eager: bool = False, compilation_config: Optional[dict] = None,
                 additional_config: Optional[dict] = None, tensor_parallel_size: int = 1,
                 seed: int = 0, dtype: Any = "auto", device: Optional[str] = None,
                 block_size: Optional[int] = None, num_kv_blocks: Optional[int] = None,
                 max_num_batched_tokens: Optional[int] = None,
                 kv_transfer_config: Union[dict, str, None] = None,
                 distributed_executor_backend: Optional[str] = None):
        call_args = {k: v for k, v in locals().items() if k != "self"}  # tensor-parallel workers
        from npuspec import envs
        from npuspec.models import load_tokenizer, read_model_config
        from npuspec.platform import parse_device

        # every argument is checked before any work (issue 16): bad NPUSPEC_* values first,
        # so they fail here rather than inside a compile
        envs.check_all()
        world, launcher = args.parse_tp(tensor_parallel_size, distributed_executor_backend)
        self.max_num_seqs = pos_int("max_num_seqs", max_num_seqs)
        if not isinstance(enforce_eager, bool):
            raise arg_error("enforce_eager", enforce_eager, "must be True or False")
        args.parse_seed(seed)
        self.spec = args.parse_spec(speculative_config, additional_config, tensor_parallel_size)
        from npuspec.engine import hidden_states
        hidden_states.check_with_spec(hidden_states.parse_kv_transfer_config(kv_transfer_config),
                                      self.spec.method if self.spec else None)
        self.capture, self.capture_sizes, lowering = args.parse_compilation(compilation_config,
                                                                            enforce_eager)
        self.enforce_eager = enforce_eager
        self.device = parse_device(device)
        torch_dtype = args.parse_dtype(dtype)
        self.model_path = model = args.parse_model(model)
        cfg = read_model_config(model)  # config.json only: the pool is sized before any load
        drafts_sharded = False
        if world > 1:
            from npuspec.models.tp import check_shardable, local_config
            check_shardable(cfg, world)
            drafts_sharded = args.parse_draft_tp(self.spec, world)
            cfg = local_config(cfg, world)  # this rank's share of the KV pool
        self.max_model_len = args.parse_max_model_len(max_model_len, cfg)
        self.k_max = self.spec.num_speculative_tokens if self.spec else 0
        cache_len = self.max_model_len + self.k_max + 1  # draft positions run K past the end
        self.block_size, num_blocks = args.parse_kv_pool(
            block_size, num_kv_blocks, self.max_num_seqs, self.max_model_len, self.k_max,
            self.device.type)
        self.max_num_batched_tokens = args.parse_batched_tokens(
            max_num_batched_tokens, self.max_num_seqs, self.k_max)
        args.check_kv_memory(cfg, self.spec, model, num_blocks=num_blocks,
                             block_size=self.block_size, max_num_seqs=self.max_num_seqs,
                             max_model_len=self.max_model_len, k_max=self.k_max,
                             dtype=torch_dtype, device=self.device, num_kv_blocks=num_kv_blocks)

        self.tokenizer = load_tokenizer(model)  # a corrupt tokenizer.json: before the weights
        self.tp: Optional[tp_mod.TP] = None
        if world > 1:  # every check passed: launch (or join) the ranks
            # the workers lower as this rank does (the default is read here, in this process)
            call_args["compilation_config"] = dict(compilation_config or {}, backend=lowering)
            self.tp = tp_mod.start(world, launcher, self.device, call_args)
            weakref.finalize(self, self.tp.shutdown)
            self.device = self.tp.device
            self.tp.drafts_from_rank0 = self.spec is not None and not drafts_sharded
        try:
            self._build(model, torch_dtype, num_blocks, cache_len, kv_transfer_config,
                        lowering, enforce_eager, seed)
        except BaseException as e:
            if self.tp is not None:
                try:
                    self.tp.failed(e)
                finally:
                    self.tp.shutdown()
            raise

    def _build(self, model, torch_dtype, num_blocks, cache_len, kv_transfer_config, lowering,
               enforce_eager, seed) -> None:
        """Load the target (this rank's shard of it) and the drafter, and build the runner."""
        from npuspec.models import load_model
        from npuspec.models.packing import pack_model
        if self.device.type == "cpu":
            from npuspec.kernels import prebuild_cpu_kernels
            prebuild_cpu_kernels()  # their g++ runs while the model loads and Dynamo traces
        self.model_config, self.model = load_model(model, dtype=torch_dtype, device=self.device)
        cfg = self.model_config
        self.eos_ids = frozenset(cfg.eos_token_ids)
        tp = self.tp
        self.proposer = None
        if tp is None or tp.rank == 0 or not tp.drafts_from_rank0:
            self.proposer = make_proposer(
                self.spec, torch_dtype, self.device, cfg.vocab_size, self.max_num_seqs,
                cache_len, target=self.model, target_path=model, num_blocks=num_blocks,
                block_size=self.block_size, kv_transfer_config=kv_transfer_config,
                shard=None if tp is None or tp.drafts_from_rank0 else (tp.rank, tp.world))
        features = getattr(self.proposer, "features", None)
        if tp is not None:
            from npuspec.models.tp import shard_model
            whole, self.model = self.model, shard_model(self.model, tp.rank, tp.world)
            if tp.drafts_from_rank0:  # the ranks' steps return what rank 0's drafter reads
                features = tp.broadcast_object(features)
            module = getattr(self.proposer, "module", None)
            if not tp.drafts_from_rank0 and hasattr(module, "bind_target"):
                module.bind_target(self.model)  # every rank drafts: the shared pieces' shards
            elif self.proposer is not None and self.spec.method in HIDDEN_STATE_METHODS:
                # a drafter on rank 0 alone shares the target's embedding, norm and head:
                # those stay whole there (the sharded ones need every rank); the layers go
                whole.layers = torch.nn.ModuleList()
                pack_model(whole)
        pack_model(self.model)  # CPU: weights in the layout the step reads at streaming speed
        dsc = args.confidence_budget_config(self.spec)
        self.budget = dynamic_k.ConfidenceBudget(dsc, self.k_max) if dsc else None
        self.runner = ModelRunner(
            self.model, cfg, self.spec, max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len, block_size=self.block_size, num_blocks=num_blocks,
            max_num_batched_tokens=self.max_num_batched_tokens, device=self.device,
            capture=self.capture, capture_sizes=self.capture_sizes, lowering=lowering,
            enforce_eager=enforce_eager, features=features)
        if hasattr(self.proposer, "attach"):  # hidden-state drafters read the runner's tables
            self.proposer.attach(self.runner)
        self.k_values = self.runner.k_values
        self._rng = np.random.default_rng(seed)
        self._calls = itertools.count()
        self.metrics: Optional[EngineMetrics] = None   # of the last generate() call
        self.totals = EngineMetrics()   # of step() calls made without their own metrics
        self._sched = Scheduler(self.max_num_seqs, self.runner.blocks, lookahead=self.k_max,
                                chunk=self.runner.chunk,
                                max_num_batched_tokens=self.max_num_batched_tokens)
        self._live: dict[str, Request] = {}  # request id -> added and not finished
        if self.capture:
            self.runner.warm_up()
            if hasattr(self.proposer, "warm_up"):
                self.proposer.warm_up(self.k_values, self.runner.top_rows)
        if self.tp is not None and self.tp.mirrors:
            self.tp.wait_ready()

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

    # the runner's state under the names it had on LLM before the split (tests and
    # npuspec.bench.tune reach some of them)
    @property
    def cache(self):
        return self.runner.cache

    @property
    def step_module(self):
        return self.runner.step_module

    @property
    def _plans(self) -> dict[int, Optional[list[int]]]:
        return self.runner.plans

    def _inputs(self, k: int, reqs: list[Request], rows: int, drafts, probs) -> dict:
        return self.runner.step_inputs(k, reqs, rows, drafts, probs)

    def _run_step(self, inp: dict) -> torch.Tensor:
        return self.runner.run_step(inp)

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
        if hasattr(self.proposer, "finish_call"):  # extract_hidden_states: wait for the files
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
        m = self.totals if m is None else m
        sched = self._sched
        sched.admit()
        k = dynamic_k.k_for_step(self.spec, len(sched.running))
        self._prefill(sched, len(sched.running) * (k + 1), m)
        outs = []
        if sched.running:
            sched.reserve(self.k_max)
            batch = list(sched.running)
            before = [len(r.output) for r in batch]
            self._decode_step(batch, m)
            now = time.perf_counter()
            for r, n in zip(batch, before):
                if n == 0 and r.output:
                    r.stats.first_token_s = now - r.arrival_time
                outs.append(StepOutput(r, r.output[n:], r.finished))
        for r in sched.retire():
            r.stats.total_s = time.perf_counter() - r.arrival_time
            r.stats.num_output_tokens = len(r.output)
            self._live.pop(r.req_id, None)
            if self.proposer is not None:
                self.proposer.stop_request(r.req_id)
                if hasattr(self.proposer, "take_path"):
                    path = self.proposer.take_path(r.req_id)
                    if path is not None:
                        r.kv_transfer_params = {"hidden_states_path": path}
        return outs

    def _prefill(self, sched: Scheduler, decode_tokens: int, m: EngineMetrics) -> None:
        rows = sched.prefill_rows(decode_tokens, self.runner.prefill_sizes
                                  if self.capture else None)
        if not rows and not sched.prefilling:
            return
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
        record_prefill(m, reqs, time.perf_counter() - t0)

    def _decode_step(self, reqs: list[Request], m: EngineMetrics) -> None:
        t0 = time.perf_counter()
        B = len(reqs)
        k = dynamic_k.k_for_step(self.spec, B)
        caps = [min(k, max(r.max_new - 1, 0)) for r in reqs]  # never draft past the end
        tp = self.tp
        drafts = probs = None
        if tp is None or tp.rank == 0 or not tp.drafts_from_rank0:
            drafts, probs = draft(self.proposer, self.budget, reqs, k, caps,  # [B, K], [B, K, V]
                                  self.runner.random)
        if tp is not None and tp.drafts_from_rank0 and k > 0:
            drafts = tp.sync_drafts(drafts, B, k)
        elif drafts is None:
            drafts = np.full((B, 0), -1, dtype=np.int64)
        t1 = time.perf_counter()
        rows = self.runner.rows_for(B, k)
        inputs = self.runner.step_inputs(k, reqs, rows, drafts, probs)
        t2 = time.perf_counter()
        res = self.runner.run_step(inputs).cpu().numpy()         # the one device->host copy
        if tp is not None:  # rank 0's tokens: its draws and draft probabilities decide
            res = tp.sync_result(res)
        t3 = time.perf_counter()
        for b, r in enumerate(reqs):
            kept = r.append(res[b, :int(res[b, k + 1])].tolist())
            if self.proposer is not None:  # a finishing step too: the suffix cache keeps it
                self.proposer.extend(r.req_id, kept)
        if self.runner.features is not None and self.proposer is not None:
            # the drafter's first pass on the step's rows
            self.proposer.on_verify(reqs, k, drafts, res, inputs, self.runner.last_features)
        t4 = time.perf_counter()
        record_step(m, reqs, k, res, drafts, rows, draft_s=t1 - t0, step_s=t3 - t2,
                    book_s=(t2 - t1) + (t4 - t3))
