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
    at the next step:       draft token 0 from the pending logits, then K-1 chain steps
                            ([B, 1] forwards on the draft's own hidden state)

The pending row is at position t = len(tokens) - 2, so the chain writes draft K/V at
positions t+1 .. t+K-1, inside the blocks the scheduler reserved for the next verify step.
A draft token is sampled from q = softmax(logits / T) with the request's generator (argmax for
greedy requests), and q is returned, so verification stays lossless; its confidence is the
max of softmax(logits) at T = 1, for the confidence budget.

Medusa has no draft KV: its heads read the target's final hidden state at the pending row, and
head k drafts token k.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Optional, Sequence

import numpy as np
import torch

from npuspec.engine.draft_step import DraftChainStep, DraftFirstPass, MedusaStep, fresh_fn
from npuspec.runtime.draft_model import CONF_MIN, Drafts
from npuspec.runtime.proposer import duplicate_request, per_request_k, unknown_request

log = logging.getLogger("npuspec.engine")


@dataclasses.dataclass
class _Pending:
    t: int                          # position of the row the draft continues from
    logits: torch.Tensor            # [V] (Medusa: [heads, V]) logits of the next draft token(s)
    hidden: Optional[torch.Tensor]  # [H] the draft hidden state the chain starts from


def sample(logits: torch.Tensor, temps: Optional[np.ndarray], generators, want_probs: bool):
    """-> (tokens [B], confidence [B], q [B, V] or None). Greedy rows take the argmax of the
    logits; a row with temperature T > 0 races q = softmax(logits / T) against Exp(1) draws of
    its own generator (so x ~ q exactly)."""
    p1 = torch.softmax(logits, dim=-1)  # [B, V]
    conf = p1.max(dim=-1).values
    rand = [] if temps is None else [b for b in range(len(temps)) if temps[b] > 0]
    if not rand:
        return logits.argmax(dim=-1), conf, p1 if want_probs else None
    t = torch.tensor(np.where(temps > 0, temps, 1.0), dtype=torch.float32,
                     device=logits.device)[:, None]
    q = torch.softmax(logits / t, dim=-1)
    x = logits.argmax(dim=-1)
    for b in rand:
        e = torch.empty(q.shape[1], device=q.device).exponential_(generator=generators[b])
        x[b] = (q[b] / e).argmax()
    return x, conf, q if want_probs else None


class _HiddenStateProposer:
    """What EAGLE-family and Medusa proposers share: request bookkeeping and compiled calls."""

    def __init__(self, module, features: tuple[tuple, bool], *, padded: bool = True):
        self.module = module
        self.features = features  # (aux layer ids, final): ModelRunner(features=...)
        self.padded = padded
        self.runner = None
        self.reqs: dict[str, Optional[_Pending]] = {}
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

    def attach(self, runner) -> None:
        """Bind to the target's runner: its device, block tables and compile options."""
        self.runner = runner

    # -- compiled calls -----------------------------------------------------------------------
    def _call(self, key: tuple, module, args: list, opts: Optional[dict]):
        r = self.runner
        if r.enforce_eager or opts is None:
            return module(*args)
        fn = self._fns.get(key)
        if fn is None:
            fn = torch.compile(fresh_fn(module, f"npuspec_{key[0]}"), backend="npuspec",
                               options=opts, dynamic=None)
            self._fns[key] = fn
        from npuspec.graphs import mark_token_dim
        for a in args:
            mark_token_dim(a, 0, pad=0)
        return fn(*args)

    def _prefill_opts(self) -> dict:
        r = self.runner
        return dict(r._options, speculative_config=None, max_num_seqs=r.max_prefill_rows,
                    capture_sizes=r.prefill_sizes)

    def _rows_opts(self) -> dict:
        return dict(self.runner._options, speculative_config=None, capture_sizes=None)

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
                self.reqs[r.req_id] = _Pending(row.end - 1, logits[i],
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
            self.reqs[r.req_id] = _Pending(len(r.tokens) - 2, logits[b],
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

    def _t(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(self.runner.device)


class EagleProposer(_HiddenStateProposer):
    """EAGLE, EAGLE-3 and MTP: `draft` is an `EagleDraft`, `Eagle3Draft` or `MTPDraft`."""

    def __init__(self, draft, num_blocks: int, block_size: int, *, padded: bool = True):
        super().__init__(draft, (tuple(draft.aux_layer_ids), bool(draft.final_feature)),
                         padded=padded)
        self.cache = draft.allocate_paged_cache(num_blocks, block_size)
        self.first = DraftFirstPass(draft, self.cache)
        self.chain = DraftChainStep(draft, self.cache)

    def _opts(self) -> dict:
        return self.runner._options

    @torch.inference_mode()
    def _first_pass(self, key, ids, feats, inp, last, opts):
        args = [self._t(ids), feats, inp["positions"],
                inp["slot_mapping"] if "slot_mapping" in inp else inp["slots"],
                inp["block_table"], inp["seq_lens"], self._t(np.asarray(last, dtype=np.int64))]
        logits, hidden = self._call(("first",) + key, self.first, args, opts)
        return logits.clone(), hidden.clone()

    @torch.inference_mode()
    def draft_requests(self, reqs, k: int, temps: Optional[np.ndarray], generators,
                       want_probs: bool = True) -> Drafts:
        """K draft tokens per request ([B, K], -1 where a request has nothing pending)."""
        B = len(reqs)
        V = self.module.config.vocab_size
        toks = np.full((B, k), -1, dtype=np.int64)
        conf = np.full((B, k), CONF_MIN)
        probs = torch.zeros(B, k, V, device=self.runner.device) if want_probs else None
        sel = [b for b, r in enumerate(reqs) if self.reqs.get(r.req_id) is not None]
        if not sel or k == 0:
            return Drafts(toks, probs, conf)
        pend = [self.reqs[reqs[b].req_id] for b in sel]
        for b, p in zip(sel, pend):
            assert p.t == len(reqs[b].tokens) - 2, (reqs[b].req_id, p.t, len(reqs[b].tokens))
        tm = None if temps is None else np.asarray(temps, dtype=np.float64)[sel]
        gens = None if generators is None else [generators[b] for b in sel]
        logits = torch.stack([p.logits for p in pend])   # [B', V]
        hidden = torch.stack([p.hidden for p in pend])   # [B', H]
        t0 = np.array([p.t for p in pend], dtype=np.int64)
        table = self._t(self.runner._table([reqs[b] for b in sel], len(sel)))
        xs, cs, qs = [], [], []
        for i in range(k):
            x, c, q = sample(logits, tm, gens, want_probs)
            xs.append(x)
            cs.append(c)
            qs.append(q)
            if i + 1 < k:
                logits, hidden = self._chain_step(x, hidden, t0 + i + 1, [reqs[b] for b in sel],
                                                  table)
        host = torch.stack([torch.stack(xs, 1).double(), torch.stack(cs, 1).double()]).cpu()
        toks[sel] = host[0].numpy().astype(np.int64)
        conf[sel] = np.clip(host[1].numpy(), CONF_MIN, 1.0)
        if want_probs:
            probs[sel] = torch.stack(qs, dim=1).float()
        return Drafts(toks, probs, conf)

    def _chain_step(self, x, hidden, pos: np.ndarray, reqs, table):
        r = self.runner
        slots = np.stack([r._slots(q.blocks, pos[j:j + 1]) for j, q in enumerate(reqs)])
        args = [x[:, None].long(), hidden, self._t(pos).view(-1, 1),
                self._t(slots), table, self._t((pos + 1).astype(np.int32))]
        logits, hidden = self._call(("chain",), self.chain, args, self._rows_opts())
        return logits, hidden

    def warm_up(self, k_values, top_rows) -> None:
        """Compile and capture the first pass at every K and the chain step before the first
        request (inputs pointing at the scratch block: no K/V of any request is touched).
        Dynamo guards on inference-mode-ness and strides, so each input is made the way the
        real one is: step metadata outside inference mode, the target's features and all
        chain inputs inside it."""
        r = self.runner
        F = self._feature_size()
        dt = r.model.norm.weight.dtype

        def z(*shape, dtype=torch.int64):
            return torch.zeros(*shape, dtype=dtype, device=r.device)

        def feats(*shape):
            with torch.inference_mode():
                return z(*shape, dtype=dt)

        for k in k_values:
            n = top_rows(k)
            inp = {"positions": z(n, k + 1), "slots": z(n, k + 1),
                   "block_table": z(n, r.max_blocks, dtype=torch.int32),
                   "seq_lens": z(n, dtype=torch.int32)}
            self._first_pass(("verify", k), np.zeros((n, k + 1), np.int64), feats(n, k + 1, F),
                             inp, np.zeros(n), self._opts())
        C, n = r.chunk, r.max_prefill_rows
        pre = {"positions": z(n, C), "slot_mapping": z(n, C),
               "block_table": z(n, r.max_blocks, dtype=torch.int32),
               "seq_lens": z(n, dtype=torch.int32)}
        self._first_pass(("prefill",), np.zeros((n, C), np.int64), feats(n, C, F), pre,
                         np.zeros(n), self._prefill_opts())
        if max(k_values) > 1:
            n = r.max_num_seqs
            with torch.inference_mode():
                args = [z(n, 1), z(n, self.module.config.hidden_size, dtype=dt), z(n, 1),
                        z(n, 1), z(n, r.max_blocks, dtype=torch.int32),
                        z(n, dtype=torch.int32)]
                self._call(("chain",), self.chain, args, self._rows_opts())

    def _feature_size(self) -> int:
        aux, final = self.features
        return (len(aux) + final) * self.runner.model_config.hidden_size


class MedusaProposer(_HiddenStateProposer):
    """Medusa: `heads` is a `MedusaHeads`; K must equal its number of heads."""

    def __init__(self, heads):
        super().__init__(heads, ((), True))
        self.step = MedusaStep(heads)

    def _opts(self) -> dict:
        return self.runner._options

    @torch.inference_mode()
    def _first_pass(self, key, ids, feats, inp, last, opts):
        # the heads read one row per request: no draft K/V, so `ids` is not needed
        logits = self._call(("medusa",) + key, self.step,
                            [feats, self._t(np.asarray(last, dtype=np.int64))], opts)
        return logits.clone(), None  # [R, heads, V]

    @torch.inference_mode()
    def draft_requests(self, reqs, k: int, temps: Optional[np.ndarray], generators,
                       want_probs: bool = True) -> Drafts:
        B = len(reqs)
        V = self.module.config.vocab_size
        toks = np.full((B, k), -1, dtype=np.int64)
        conf = np.full((B, k), CONF_MIN)
        probs = torch.zeros(B, k, V, device=self.runner.device) if want_probs else None
        sel = [b for b, r in enumerate(reqs) if self.reqs.get(r.req_id) is not None]
        if not sel or k == 0:
            return Drafts(toks, probs, conf)
        tm = None if temps is None else np.asarray(temps, dtype=np.float64)[sel]
        gens = None if generators is None else [generators[b] for b in sel]
        logits = torch.stack([self.reqs[reqs[b].req_id].logits for b in sel])  # [B', heads, V]
        xs, cs, qs = zip(*(sample(logits[:, i], tm, gens, want_probs) for i in range(k)))
        host = torch.stack([torch.stack(xs, 1).double(), torch.stack(cs, 1).double()]).cpu()
        toks[sel] = host[0].numpy().astype(np.int64)
        conf[sel] = np.clip(host[1].numpy(), CONF_MIN, 1.0)
        if want_probs:
            probs[sel] = torch.stack(qs, dim=1).float()
        return Drafts(toks, probs, conf)

    @torch.inference_mode()  # its only inputs, the target's features, are inference tensors
    def warm_up(self, k_values, top_rows) -> None:
        r = self.runner
        H = r.model_config.hidden_size
        dt = r.model.norm.weight.dtype
        for k in k_values:
            n = top_rows(k)
            self._first_pass(("verify", k), None, torch.zeros(n, k + 1, H, dtype=dt,
                                                              device=r.device), None,
                             np.zeros(n), self._opts())
        n = r.max_prefill_rows
        self._first_pass(("prefill",), None, torch.zeros(n, r.chunk, H, dtype=dt,
                                                         device=r.device), None, np.zeros(n),
                         self._prefill_opts())
