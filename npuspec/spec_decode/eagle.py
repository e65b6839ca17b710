"""EAGLE, EAGLE-3 and MTP: a draft head on the target's features with its own paged K/V
(see hidden.py for the per-request flow they share with Medusa and the block drafters)."""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from npuspec.spec_decode.base import BuildContext, Drafts
from npuspec.spec_decode.draft_step import DraftFirstPass, DraftLoop
from npuspec.spec_decode.heads import load_head
from npuspec.spec_decode.hidden import HiddenStateProposer


class EagleProposer(HiddenStateProposer):
    """EAGLE, EAGLE-3 and MTP: `draft` is an `EagleDraft`, `Eagle3Draft` or `MTPDraft`."""

    def __init__(self, draft, num_blocks: int, block_size: int, *, padded: bool = True):
        super().__init__(draft, (tuple(draft.aux_layer_ids), bool(draft.final_feature)),
                         padded=padded)
        self.cache = draft.allocate_paged_cache(num_blocks, block_size)
        self.first = DraftFirstPass(draft, self.cache)
        self.loop = DraftLoop(draft, self.cache)

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
