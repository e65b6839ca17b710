"""Hidden-state drafters: EAGLE, EAGLE-3 and MTP (one class), and Medusa.

They read the target's features, which the target's verify and prefill steps return
(`ModelRunner(features=...)`), so a round has no extra target pass. Per request:

    after a prefill chunk:  first pass over the chunk (row t: token x_{t+1}, feature h_t);
                            the chunk that ends the prompt leaves the logits of x_P pending
    after a verify step:    first pass over the step's K+1 rows (shift by one; row a, the
                            last accepted one, carries the bonus token); its row a leaves
                            the logits of the next token and the draft hidden pending
                            (padded mode, vLLM's default: every row runs, rejected rows'
                            draft K/V is overwritten later; `disable_padded_drafter_batch`:
                            only the accepted rows run, ragged, eagerly)
    at the next step:       one call of the draft loop: token 0 from the pending logits,
                            then K-1 chain steps ([B, 1] forwards on the draft's own hidden
                            state), sampling inside the graph

The pending row is at position t = len(tokens) - 2, so the chain writes draft K/V at
positions t+1 .. t+K-1, inside the blocks the scheduler reserved for the next verify step.
A draft token is drawn from q = softmax(logits / T) by an exponential race against Exp(1) draws
of the request's own generator (argmax for greedy requests), and q is returned, so
verification stays lossless; its confidence is the
max of softmax(logits) at T = 1, for the confidence budget.

Medusa has no draft KV: its heads read the target's final hidden state at the pending row, and
head k drafts token k.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np
import torch

from npuspec.compilation.compiled import CompiledBySignature
from npuspec.graphs import mark_token_dim
from npuspec.spec_decode.base import (CONF_MIN, DraftBatch, Drafts, Proposer, RunnerView,
                                      duplicate_request, per_request_k, unknown_request)
from npuspec.spec_decode.draft_step import fresh_fn

@dataclasses.dataclass
class Pending:
    t: int                          # position of the row the draft continues from
    logits: torch.Tensor            # [Vd] (the draft vocabulary; Medusa: [heads, V]) logits of
                                    # the next draft token(s)
    hidden: Optional[torch.Tensor]  # [H] the draft hidden state the chain starts from


class HiddenStateProposer(Proposer):
    """What EAGLE-family and Medusa proposers share: request bookkeeping and compiled calls."""

    def __init__(self, module, features: tuple[tuple, bool], *, padded: bool = True):
        self.module = module
        self.features = features  # (aux layer ids, final): ModelRunner(features=...)
        self.padded = padded
        self.runner = None
        self.reqs: dict[str, Optional[Pending]] = {}
        self._req_objs: dict[str, object] = {}
        self._fns: dict[tuple, object] = {}

    # -- protocol -----------------------------------------------------------------------------
    def start_request(self, req_id: str, prompt: Sequence[int]) -> None:
        if req_id in self.reqs:
            raise duplicate_request("start_request", req_id)
        self.reqs[req_id] = None

    def extend(self, req_id: str, new_tokens: Sequence[int]) -> None:
        if req_id not in self.reqs:
            raise unknown_request("extend", req_id)

    def stop_request(self, req_id: str) -> None:
        if req_id not in self.reqs:
            raise unknown_request("stop_request", req_id)
        del self.reqs[req_id]
        self._req_objs.pop(req_id, None)

    def propose(self, req_ids: Sequence[str], max_tokens) -> list[list[int]]:
        """The plain protocol (greedy): drafts of the requests the engine last ran."""
        ks = per_request_k(req_ids, max_tokens)
        k = max(ks, default=0)
        if k == 0:
            return [[] for _ in req_ids]
        d = self.draft_requests([self._req_objs[r] for r in req_ids], k, None, None, False)
        return [[int(t) for t in row[:kk] if t >= 0] for row, kk in zip(d.tokens, ks)]

    def attach(self, runner: RunnerView) -> None:
        """Bind to the target's runner: its device, block tables and compile options."""
        self.runner = runner

    def draft_batch(self, batch: DraftBatch) -> Drafts:
        return self.draft_requests(batch.reqs, batch.k, batch.temps, batch.generators,
                                   want_probs=batch.want_probs)

    # -- compiled calls -----------------------------------------------------------------------
    def _call(self, key: tuple, module, args: list, opts: Optional[dict]):
        r = self.runner
        if r.enforce_eager or opts is None:
            return module(*args)
        fn = self._fns.get(key)
        if fn is None:
            fn = CompiledBySignature(fresh_fn(module, f"npuspec_{key[0]}"), opts)
            self._fns[key] = fn
        for a in args:
            mark_token_dim(a, 0, pad=0)
        return fn(*args)

    def _prefill_opts(self) -> dict:
        r = self.runner
        return r.options(speculative_config=None, max_num_seqs=r.max_prefill_rows,
                    capture_sizes=r.prefill_sizes)

    def _rows_opts(self) -> dict:
        return self.runner.options(speculative_config=None, capture_sizes=None)

    # -- hooks the engine calls ---------------------------------------------------------------
    def on_prefill(self, rows, pre: dict) -> None:
        """After a prefill step: `pre` holds its device inputs and "features" [n, C, F]."""
        n, C = pre["input_ids"].shape
        ids = np.zeros((n, C), dtype=np.int64)
        for i, row in enumerate(rows):
            m = row.end - row.start
            ids[i, C - m:] = row.req.tokens[row.start + 1:row.end + 1]  # shift by one
        last = np.full(n, C - 1, dtype=np.int64)
        logits, hidden = self._first_pass(("prefill",), ids, pre["features"], pre, last,
                                          self._prefill_opts())
        for i, row in enumerate(rows):
            r = row.req
            self._req_objs[r.req_id] = r
            if row.end == len(r.tokens) - 1 and r.req_id in self.reqs:
                self.reqs[r.req_id] = Pending(row.end - 1, logits[i],
                                               None if hidden is None else hidden[i])

    def on_verify(self, reqs, k: int, drafts: np.ndarray, res: np.ndarray, inp: dict,
                  feats: torch.Tensor) -> None:
        """After a verify step: res [rows, K+2] on the host, feats [rows, K+1, F]."""
        rows = feats.shape[0]
        acc = np.zeros(rows, dtype=np.int64)           # accepted drafts per row
        ids = np.zeros((rows, k + 1), dtype=np.int64)  # row j: token at position n + j
        for b, r in enumerate(reqs):
            a = int(res[b, k + 1]) - 1
            acc[b] = a
            ids[b, :k] = np.maximum(drafts[b], 0)
            ids[b, a] = res[b, a]  # the bonus (the target's own token)
        if self.padded or k == 0:
            logits, hidden = self._first_pass(("verify", k), ids, feats, inp, acc, self._opts())
        else:
            logits, hidden = self._unpadded(reqs, k, ids, acc, inp, feats)
        for b, r in enumerate(reqs):
            self._req_objs[r.req_id] = r
            if r.finished or r.req_id not in self.reqs:
                continue
            self.reqs[r.req_id] = Pending(len(r.tokens) - 2, logits[b],
                                           None if hidden is None else hidden[b])

    def _unpadded(self, reqs, k, ids, acc, inp, feats):
        """vLLM's `disable_padded_drafter_batch`: only the accepted rows go through the draft
        (right-aligned, ragged, so this runs eagerly); same results at the pending row."""
        rows = feats.shape[0]
        T = int(acc[:len(reqs)].max()) + 1 if reqs else 1
        lens = inp["seq_lens"].cpu().numpy().astype(np.int64)
        pos0 = inp["positions"][:, :1].cpu().numpy()
        sl = inp["slots"].cpu().numpy()
        u_ids = np.zeros((rows, T), dtype=np.int64)
        u_pos = np.zeros((rows, T), dtype=np.int64)
        u_slots = np.zeros((rows, T), dtype=np.int64)
        u_lens = np.zeros(rows, dtype=np.int32)
        sel = np.zeros((rows, T), dtype=np.int64)
        for b in range(len(reqs)):
            m = int(acc[b]) + 1
            u_ids[b, T - m:] = ids[b, :m]
            u_pos[b, T - m:] = pos0[b, 0] + np.arange(m)
            u_slots[b, T - m:] = sl[b, :m]
            u_lens[b] = lens[b] - k + acc[b]
            sel[b, T - m:] = np.arange(m)
        f = feats.gather(1, self._t(sel)[:, :, None].expand(-1, -1, feats.shape[-1]))
        meta = {"positions": self._t(u_pos), "slots": self._t(u_slots),
                "block_table": inp["block_table"], "seq_lens": self._t(u_lens)}
        return self._first_pass(("unpadded",), u_ids, f, meta, np.full(rows, T - 1), None)

    def _no_drafts(self, reqs, k: int, want_probs: bool):
        """-> (Drafts of all -1, the rows of requests with something pending)."""
        B, V = len(reqs), self.module.config.vocab_size
        probs = torch.zeros(B, k, V, device=self.runner.device) if want_probs else None
        d = Drafts(np.full((B, k), -1, dtype=np.int64), probs, np.full((B, k), CONF_MIN))
        return d, [b for b, r in enumerate(reqs) if self.reqs.get(r.req_id) is not None]

    @staticmethod
    def _fill(d: Drafts, sel: list, x, c, q=None) -> Drafts:
        """Rows `sel` of d from tokens x [B', K], confidences c and q [B', K, V]."""
        host = torch.stack([x.double(), c.double()]).cpu()  # one device->host copy
        d.tokens[sel] = host[0].numpy().astype(np.int64)
        d.conf[sel] = np.clip(host[1].numpy(), CONF_MIN, 1.0)
        if d.probs is not None:
            d.probs[sel] = q
        return d

    def _t(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(self.runner.device)

    # warm-up inputs (step metadata is made outside inference mode, features inside it)
    def _zeros(self, *shape, dtype=torch.int64) -> torch.Tensor:
        return torch.zeros(*shape, dtype=dtype, device=self.runner.device)

    def _features(self, *shape) -> torch.Tensor:
        with torch.inference_mode():
            return self._zeros(*shape, dtype=self.runner.model.norm.weight.dtype)

    def _draws(self, temps: np.ndarray, gens, k: int, V: int) -> list:
        """temperature [B] and each sampled request's own Exp(1) draws [B, K, V]."""
        dev = self.runner.device
        e = torch.ones(len(temps), k, V, device=dev)
        for j, g in enumerate(gens):
            if temps[j] > 0:
                e[j].exponential_(generator=g)
        return [torch.tensor(temps, dtype=torch.float32, device=dev), e]

