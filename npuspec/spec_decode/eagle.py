"""EAGLE, EAGLE-3 and MTP: a draft head on the target's features with its own paged K/V
(see hidden.py for the per-request flow they share with Medusa and the block drafters)."""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from npuspec.spec_decode.base import BuildContext, Drafts
from npuspec.spec_decode.draft_step import DraftFirstPass, DraftLoop
from npuspec.spec_decode.heads import load_head
from npuspec.spec_decode.hidden import HiddenStateProposer, Pending


class EagleProposer(HiddenStateProposer):
    """EAGLE, EAGLE-3 and MTP: `draft` is an `EagleDraft`, `Eagle3Draft` or `MTPDraft`."""

    defers_first_pass = True

    def __init__(self, draft, num_blocks: int, block_size: int, *, padded: bool = True):
        super().__init__(draft, (tuple(draft.aux_layer_ids), bool(draft.final_feature)),
                         padded=padded)
        self.cache = draft.allocate_paged_cache(num_blocks, block_size)
        self.first = DraftFirstPass(draft, self.cache)
        self.loop = DraftLoop(draft, self.cache)
        # deferred first passes (the hybrid drafter's suffix streaks): per request, the
        # accepted rows of each verify step not yet passed, as (ids [m], positions [m],
        # features [m, F]); `_catch_up` passes them before the head drafts again
        self.lag: dict[str, list] = {}
        self.caught_up = 0  # deferred rows passed so far (a count for tests and metrics)

    def stop_request(self, req_id: str) -> None:
        super().stop_request(req_id)
        self.lag.pop(req_id, None)

    def on_prefill(self, rows, pre: dict) -> None:
        for row in rows:  # a recompute after preemption passes those positions again
            self.lag.pop(row.req.req_id, None)
        super().on_prefill(rows, pre)

    def on_verify(self, reqs, k, drafts, res, inp, feats, defer: bool = False) -> None:
        """`defer` (the hybrid drafter, when every request of the step will take a suffix
        draft next): keep the step's accepted rows for later instead of the first pass."""
        if not defer or not self.padded:
            lagging = [r for r in reqs if r.req_id in self.lag and not r.finished]
            self._catch_up(lagging)  # the K/V before this step's rows goes first
            for r in reqs:
                self.lag.pop(r.req_id, None)  # finished ones need no K/V any more
            return super().on_verify(reqs, k, drafts, res, inp, feats)
        pos = inp["positions"].cpu().numpy()
        for b, r in enumerate(reqs):
            self._req_objs[r.req_id] = r
            if r.finished or r.req_id not in self.reqs:
                continue
            a = int(res[b, k + 1]) - 1                       # accepted drafts: rows 0..a
            ids = np.append(np.maximum(drafts[b, :a], 0), res[b, a])  # row j: token n+j+1
            self.lag.setdefault(r.req_id, []).append(
                (ids.astype(np.int64), pos[b, :a + 1].astype(np.int64), feats[b, :a + 1].clone()))

    @torch.inference_mode()
    def _catch_up(self, rs) -> None:
        """The first pass over the deferred rows of these requests, prefill-shaped (`chunk`
        tokens per row, right-aligned, up to `max_prefill_rows` requests per call, a request's
        chunks in order): their draft K/V, and each request's pending row."""
        r = self.runner
        todo = []
        for q in rs:
            parts = self.lag.pop(q.req_id, None)
            if parts:
                todo.append([q, np.concatenate([p[0] for p in parts]),
                             np.concatenate([p[1] for p in parts]),
                             torch.cat([p[2] for p in parts])])
        C = r.chunk
        while todo:
            group, todo = todo[:r.max_prefill_rows], todo[r.max_prefill_rows:]
            n = len(group)
            ids = np.zeros((n, C), dtype=np.int64)
            pos = np.zeros((n, C), dtype=np.int64)
            slots = np.zeros((n, C), dtype=np.int64)  # padding writes the scratch block
            lens = np.zeros(n, dtype=np.int32)
            feats = self._features(n, C, group[0][3].shape[-1])
            for i, (q, t, p, f) in enumerate(group):
                m = min(C, len(t))
                self.caught_up += m
                ids[i, C - m:], pos[i, C - m:] = t[:m], p[:m]
                slots[i, C - m:] = r.slots(q.blocks, p[:m])
                lens[i] = p[m - 1] + 1
                feats[i, C - m:] = f[:m]
            pre = {"positions": self._t(pos), "slot_mapping": self._t(slots),
                   "block_table": self._t(r.table([g[0] for g in group], n)),
                   "seq_lens": self._t(lens)}
            logits, hidden = self._first_pass(("prefill",), ids, feats, pre, np.full(n, C - 1),
                                              self._prefill_opts())
            for i, g in enumerate(group):
                q, t, p, f = g
                if len(t) > C:  # more to pass: back in the queue, in order
                    todo.append([q, t[C:], p[C:], f[C:]])
                else:
                    self.reqs[q.req_id] = Pending(int(p[-1]), logits[i], hidden[i])

    def _opts(self) -> dict:
        return self.runner.backend_options

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
        """K draft tokens per request ([B, K], -1 where a request has nothing pending): one
        call of the draft loop (token 0 from the pending logits, K-1 chain steps)."""
        d, sel = self._no_drafts(reqs, k, want_probs)
        if not sel or k == 0:
            return d
        Vd = self.module.draft_vocab_size  # the loop samples in the draft's vocabulary
        rs = [reqs[b] for b in sel]
        self._catch_up([q for q in rs if q.req_id in self.lag])
        pend = [self.reqs[r.req_id] for r in rs]
        for r, p in zip(rs, pend):
            assert p.t == len(r.tokens) - 2, (r.req_id, p.t, len(r.tokens))
        args = self._loop_args(rs, pend, k)
        random = temps is not None
        if random:
            args += self._draws(np.asarray(temps, dtype=np.float64)[sel],
                                [generators[b] for b in sel], k, Vd)
        opts = self._rows_opts() if k > 1 else None  # K = 1: no chain, a few ops
        out = self._call(("loop", k, random), self.loop, args, opts)
        return self._fill(d, sel, *out)

    def _loop_args(self, rs, pend, k: int) -> list:
        """The draft loop's inputs: pending logits and hidden, chain positions t+1..t+K-1 with
        their slots and lengths, the requests' block tables."""
        r = self.runner
        pos = np.array([p.t for p in pend], dtype=np.int64)[:, None] + np.arange(1, k)
        slots = np.stack([r.slots(q.blocks, pos[j]) for j, q in enumerate(rs)])
        return [torch.stack([p.logits for p in pend]), torch.stack([p.hidden for p in pend]),
                self._t(pos), self._t(slots), self._t(r.table(rs, len(rs))),
                self._t((pos + 1).astype(np.int32))]

    def warm_up(self, k_values, top_rows) -> None:
        """Compile and capture the first pass at every K and the chain step before the first
        request (inputs pointing at the scratch block: no K/V of any request is touched).
        Dynamo guards on inference-mode-ness and strides, so each input is made the way the
        real one is: step metadata outside inference mode, the target's features and all
        chain inputs inside it."""
        r = self.runner
        F = self._feature_size()
        dt = r.model.norm.weight.dtype
        z, feats = self._zeros, self._features

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
        n = r.max_num_seqs
        Vd, H = self.module.draft_vocab_size, self.module.config.hidden_size
        for k in k_values:
            if k < 2:
                continue
            with torch.inference_mode():
                args = [z(n, Vd, dtype=torch.float32), z(n, H, dtype=dt), z(n, k - 1),
                        z(n, k - 1), z(n, r.max_blocks, dtype=torch.int32),
                        z(n, k - 1, dtype=torch.int32)]
                self._call(("loop", k, False), self.loop, args, self._rows_opts())

    def _feature_size(self) -> int:
        aux, final = self.features
        return (len(aux) + final) * self.runner.model_config.hidden_size

    def bind_target(self, target: torch.nn.Module) -> bool:
        self.module.bind_target(target)
        return True


def build(ctx: BuildContext) -> EagleProposer:
    return EagleProposer(load_head(ctx), ctx.num_blocks, ctx.block_size,
                         padded=not ctx.spec.disable_padded_drafter_batch)
