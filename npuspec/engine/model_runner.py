"""`ModelRunner`: the target model on its device, its paged KV pool, and the compiled steps.

It turns a step's requests and drafts into the step's device inputs, runs the verify step and
the chunked prefill step (eager, or torch.compile(backend="npuspec") replayed from captured
graphs). Per-step metadata (slot_mapping, block_table, seq_lens, positions) is built on the
host and copied into the graph dispatcher's static buffers before each replay, so attention
reads each row's live length, never `max_model_len`. Everything above it (which requests run,
what they draft, what their tokens mean) lives in the scheduler and the LLM.
"""
from __future__ import annotations

import time

from typing import Optional

import numpy as np
import torch
from torch import nn

from npuspec.engine.block_manager import BlockManager, seat_blocks
from npuspec.engine.config import EngineConfig
from npuspec.compilation.compiled import CompiledBySignature
from npuspec.engine.request import Request
from npuspec.engine.scheduler import PrefillRow, pad_rows
from npuspec.engine.step import PrefillStep, VerifyStep, fresh_prefill_fn, fresh_step_fn
from npuspec.spec_decode.base import RunnerView

# padding values of the step inputs' padded rows: no drafts, greedy, the scratch block
# (slot 0), length 0 (attention reads nothing)
_PAD = {"draft_ids": -1, "top_p": 1.0, "uniforms": 1.0, "exponentials": 1.0}
PREFILL_CHUNK = 32  # tokens per prefill row: a prompt wastes < one row on padding


class ModelRunner:
    def __init__(self, model: nn.Module, model_config, cfg: EngineConfig, device: torch.device,
                 features: Optional[tuple[tuple, bool]] = None):
        """`model`: this rank's shard; `model_config`: the whole model's (vocabulary, hidden
        size); `device`: this rank's."""
        spec = cfg.spec
        self.model = model
        self.model_config = model_config
        self.spec = spec
        self.max_num_seqs = cfg.max_num_seqs
        self.device = device
        self.capture = cfg.capture
        self.capture_sizes = cfg.capture_sizes
        self.enforce_eager = cfg.enforce_eager
        self.k_values = spec.k_values() if spec else (0,)
        rs = spec.rejection_sampler_config if spec else None
        rates = spec.synthetic_rates() if spec else None
        self._rates = None if rates is None else torch.tensor(rates, dtype=torch.float32,
                                                              device=device)
        self.block_size = cfg.block_size
        # a block table covers max_model_len plus the K draft positions a verify step writes
        self.max_blocks = seat_blocks(cfg.max_model_len, cfg.k_max, cfg.block_size)
        self.blocks = BlockManager(cfg.num_blocks, cfg.block_size)
        self.cache = model.allocate_paged_cache(cfg.num_blocks, cfg.block_size)
        self.step_module = VerifyStep(
            model, self.cache, block_verify=bool(rs and rs.enable_block_verify),
            entropy_verify=rs.entropy_verify if rs else None, features=features)
        self.features = features
        self.last_features: Optional[torch.Tensor] = None  # [rows, K+1, F] of the last step
        self.prefill_module = PrefillStep(self.step_module)
        self.chunk = PREFILL_CHUNK
        self.max_prefill_rows = max(1, cfg.max_num_batched_tokens // self.chunk)
        # prefill row counts captured: powers of two up to the budget (the scheduler cuts a
        # prefill batch down to one of these, so no row is padding but a lone remainder's)
        self.prefill_sizes = sorted({min(1 << i, self.max_prefill_rows)
                                     for i in range(self.max_prefill_rows.bit_length() + 1)})
        self.plans = self._plan_sizes()
        # a lone request runs one row: the graphs layer marks the row dim unbacked, so one
        # Dynamo graph (and its 1-row captured size) serves batch 1 too
        self.min_rows = 1
        self.backend_options = self._backend_options(cfg.lowering)
        # the one lookup of a compiled step: CompiledBySignature keys each call by its input
        # signature (which inputs are present, their dtypes and shapes past the token dim, so
        # K and the sampling variant), and inside the graph it picks, the backend's dispatcher
        # pads the row count to the next captured size and replays that graph
        self._step_fn = CompiledBySignature(fresh_step_fn(self.step_module),
                                            self.backend_options)
        self._prefill_fn = None
        self.random = self.top_k = self.top_p = False  # what the current call's batch needs

    def _plan_sizes(self) -> dict[int, Optional[list[int]]]:
        """Capture sizes (tokens) per K; None when nothing is captured (no padding then)."""
        if not self.capture:
            return {k: None for k in self.k_values}
        from npuspec.graphs import plan_capture_sizes  # heavy (torch._dynamo): compiled only
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

    def view(self) -> RunnerView:
        """What a drafter may read of this runner."""
        return RunnerView(self.device, self.enforce_eager, dict(self.backend_options),
                          self.max_num_seqs, self.max_prefill_rows, list(self.prefill_sizes),
                          self.chunk, self.max_blocks, self.model, self.model_config,
                          self.slots, self.table)

    def top_rows(self, k: int) -> int:
        """Rows of K's largest captured size (the size warm-up captures the set at)."""
        sizes = self.plans.get(k)
        return max(sizes[-1] // (k + 1) if sizes else self.min_rows, self.min_rows)

    def warm_up(self) -> None:
        """Compile and capture the greedy variant of every K before the first request, so a
        K swap never compiles or captures: one call per K at the largest captured size (the
        dynamic-batch graph, whose set captures every planned size); and compile the prefill
        step."""
        for k in self.k_values:
            self.run_step(self.step_inputs(k, [], self.top_rows(k), None, None))
        self.prefill([])

    def time_steps(self, repeats: int = 2) -> dict[tuple[int, int], float]:
        """{(rows, K): seconds} of one greedy step at every captured size (the online K
        controller's first costs; the best of `repeats` replays after one untimed pass, so a
        graph's first replay, which may still allocate, is not its cost)."""
        steps = [(size // (k + 1), k) for k in self.k_values for size in self.plans.get(k) or ()
                 if size // (k + 1) >= self.min_rows]
        inputs = {rk: self.step_inputs(rk[1], [], rk[0], None, None) for rk in steps}
        out = {rk: float("inf") for rk in steps}
        for rep in range(repeats + 1):
            for rk in steps:
                t0 = time.perf_counter()
                self.run_step(inputs[rk]).cpu()
                if rep:
                    out[rk] = min(out[rk], time.perf_counter() - t0)
        return out

    def start_call(self, reqs: list[Request]) -> None:
        """Note which optional step inputs this generate() call's batches carry."""
        self.random = any(not r.params.greedy for r in reqs)
        self.top_k = any(r.params.top_k > 0 for r in reqs)
        self.top_p = any(r.params.top_p < 1 for r in reqs)

    # -- metadata ------------------------------------------------------------------------------
    def table(self, reqs: list[Request], rows: int) -> np.ndarray:
        bt = np.zeros((rows, self.max_blocks), dtype=np.int32)  # 0: the scratch block
        for b, r in enumerate(reqs):
            bt[b, :len(r.blocks)] = r.blocks
        return bt

    def slots(self, blocks: list[int], pos: np.ndarray) -> np.ndarray:
        bs = self.block_size
        return np.asarray(blocks, dtype=np.int64)[pos // bs] * bs + pos % bs

    def _tensor(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(self.device)

    # -- prefill -------------------------------------------------------------------------------
    def prefill(self, rows: list[PrefillRow]) -> Optional[dict]:
        """Write the K/V of these context chunks (one row each, right-aligned in the row).
        With target features on, -> the step's device inputs plus "features" [n, C, F]
        (rows past len(rows) are padding), for the drafter; else None."""
        C = self.chunk
        n = max(len(rows), self.min_rows)
        ids = np.zeros((n, C), dtype=np.int64)
        pos = np.zeros((n, C), dtype=np.int64)
        slots = np.zeros((n, C), dtype=np.int64)  # padding tokens write the scratch block
        lens = np.zeros(n, dtype=np.int32)
        for i, r in enumerate(rows):
            m = r.end - r.start
            p = np.arange(r.start, r.end, dtype=np.int64)
            ids[i, C - m:] = r.req.tokens[r.start:r.end]
            pos[i, C - m:] = p
            slots[i, C - m:] = self.slots(r.req.blocks, p)
            lens[i] = r.end
        inp = {"input_ids": ids, "positions": pos, "slot_mapping": slots,
               "block_table": self.table([r.req for r in rows], n), "seq_lens": lens}
        inp = {k: self._tensor(v) for k, v in inp.items()}
        with torch.inference_mode():
            if self.enforce_eager:
                out = self.prefill_module(**inp)
            else:
                from npuspec.graphs import mark_token_dim  # heavy (torch._dynamo)
                for t in inp.values():
                    mark_token_dim(t, 0, pad=0)
                out = self._prefill_compiled()(**inp)
        if self.features is None:
            return None
        return dict(inp, features=out)

    def _prefill_compiled(self):
        if self._prefill_fn is None:
            opts = dict(self.backend_options, speculative_config=None,
                        max_num_seqs=self.max_prefill_rows, capture_sizes=self.prefill_sizes)
            self._prefill_fn = CompiledBySignature(fresh_prefill_fn(self.prefill_module), opts)
        return self._prefill_fn

    # -- verify --------------------------------------------------------------------------------
    def rows_for(self, batch: int, k: int) -> int:
        """Rows a step of `batch` requests runs: padded up to K's next captured size."""
        return pad_rows(max(batch, self.min_rows), self.plans.get(k), k)

    def step_inputs(self, k: int, reqs: list[Request], rows: int, drafts, probs) -> dict:
        """Host-side step inputs for `rows` rows (the first len(reqs) real, the rest padding
        that writes only into the scratch block and attends to nothing)."""
        B = len(reqs)
        dev = self.device
        draft = np.full((rows, k), -1, dtype=np.int64)
        ids = np.zeros((rows, k + 1), dtype=np.int64)
        pos = np.zeros((rows, k + 1), dtype=np.int64)
        slots = np.zeros((rows, k + 1), dtype=np.int64)
        lens = np.zeros(rows, dtype=np.int32)
        table = self.table(reqs, rows)                                   # [rows, max_blocks]
        if B:  # whole-batch numpy: per-request calls cost ~10 µs each at 64 requests
            n = np.fromiter((len(r.tokens) for r in reqs), dtype=np.int64, count=B)   # [B]
            pos[:B] = (n - 1)[:, None] + np.arange(k + 1)                # [B, K+1]
            blk = pos[:B] // self.block_size
            assert (blk < np.fromiter((len(r.blocks) for r in reqs), dtype=np.int64,
                                      count=B)[:, None]).all(), "verify rows past the reserved blocks"
            slots[:B] = (table[np.arange(B)[:, None], blk].astype(np.int64) * self.block_size
                         + pos[:B] % self.block_size)
            lens[:B] = n + k
            ids[:B, 0] = [r.tokens[-1] for r in reqs]
            draft[:B] = drafts
            ids[:B, 1:] = np.maximum(drafts, 0)  # a -1 draft still needs a valid embedding row
        t = self._tensor
        inp = {"input_ids": t(ids), "positions": t(pos), "slots": t(slots), "draft_ids": t(draft),
               "block_table": t(table), "seq_lens": t(lens)}
        if self._rates is not None:
            inp["synthetic_rates"] = self._rates[:k]
        random = B > 0 and self.random
        if not random:
            return inp
        V = self.model_config.vocab_size
        temp = np.zeros(rows, dtype=np.float32)
        temp[:B] = [r.params.temperature for r in reqs]
        inp["temperature"] = t(temp)
        if self.top_k:
            tk = np.zeros(rows, dtype=np.int64)
            tk[:B] = [max(r.params.top_k, 0) for r in reqs]
            inp["top_k"] = t(tk)
        if self.top_p:
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

    @torch.inference_mode()
    def run_step(self, inp: dict) -> torch.Tensor:
        """-> [rows, K+2] int32 on the device: emitted tokens (-1 padded), then num_emitted.
        With target features on, the step's features [rows, K+1, F] land in last_features."""
        out = self._run_step(inp)
        if self.features is None:
            return out
        out, self.last_features = out
        return out

    def _run_step(self, inp: dict):
        if self.enforce_eager:
            return self.step_module(**inp)
        from npuspec.graphs import mark_token_dim  # heavy (torch._dynamo): compiled only
        # dim 0 of every per-request input is the token/batch dim: dynamic for Dynamo (one
        # graph per K serves every batch size) and padded by the graph dispatcher with
        # inert rows: scratch block, length 0, no drafts, greedy.
        for name, t in inp.items():
            if name != "synthetic_rates":
                mark_token_dim(t, 0, pad=_PAD.get(name, 0))
        return self._step_fn(**inp)
