"""Block drafters: DFlash and DSpark (npuspec.models.dflash, spec_decode/dflash_step.py).

They read the target's aux features, which its verify and prefill steps return, so a round has
no extra target pass. Per request:

    after a prefill chunk:  the chunk's context K/V (every draft layer, at the chunk's slots)
    after a verify step:    the context K/V of the step's K+1 rows (padded mode, vLLM's
                            default: every row, the rejected ones included; the block of the
                            next round overwrites those slots. `disable_padded_drafter_batch`:
                            rejected rows write the scratch block instead)
    at the next step:       one block forward per request: [anchor, MASK x (S-1)] at
                            positions n-1 .. n+S-2 (n = len(tokens), the anchor is the last
                            token), sampling in the graph

The block writes its own K/V at the positions the next verify step uses, inside the blocks the
scheduler reserved for it. Each draft is drawn from q (argmax for greedy requests) and q is
returned, so verification stays lossless. Its confidence, for the confidence budget, is DSpark's
sigmoid head, or DFlash's max softmax of the drafted slot.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from npuspec.spec_decode.base import BuildContext, Drafts
from npuspec.spec_decode.dflash_step import DFlashBlock, DFlashContext
from npuspec.spec_decode.heads import load_head
from npuspec.spec_decode.hidden import HiddenStateProposer, Pending


class BlockDraftProposer(HiddenStateProposer):
    """DFlash and DSpark: `draft` is a `DFlashDraft` or `DSparkDraft`."""

    def __init__(self, draft, num_blocks: int, block_size: int, *, padded: bool = True):
        super().__init__(draft, (tuple(draft.aux_layer_ids), False), padded=padded)
        self.cache = draft.allocate_paged_cache(num_blocks, block_size)
        self.ctx = DFlashContext(draft, self.cache)
        self.block = DFlashBlock(draft, self.cache)

    def check_k(self, k: int, key: str = "num_speculative_tokens") -> None:
        d = self.module
        most = d.drafts_per_block
        if k > most:
            rule = ("block_size (it drafts from the anchor)" if d.config.sample_from_anchor
                    else "block_size - 1 (the anchor slot drafts nothing)")
            raise ValueError(
                f"speculative_config.{key}={k}: this {d.method} draft has block_size="
                f"{d.config.block_size}, so one block gives at most {most} drafts ({rule}); "
                f"set {key} <= {most}")

    def _opts(self) -> dict:
        return self.runner.backend_options

    # -- context --------------------------------------------------------------------------------
    @torch.inference_mode()
    def _write_context(self, key, feats, positions, slots, opts) -> None:
        self._call(("ctx",) + key, self.ctx, [feats, positions, slots], opts)

    def on_prefill(self, rows, pre: dict) -> None:
        self._write_context(("prefill",), pre["features"], pre["positions"],
                            pre["slot_mapping"], self._prefill_opts())
        for row in rows:
            r = row.req
            self._req_objs[r.req_id] = r
            if row.end == len(r.tokens) - 1 and r.req_id in self.reqs:
                self.reqs[r.req_id] = Pending(row.end - 1, None, None)

    def on_verify(self, reqs, k: int, drafts: np.ndarray, res: np.ndarray, inp: dict,
                  feats: torch.Tensor) -> None:
        """After a verify step: res [rows, K+2] on the host, feats [rows, K+1, F]."""
        slots = inp["slots"]
        if not self.padded:  # rejected rows write the scratch block (slot 0), not the pool
            keep = np.zeros(slots.shape, dtype=bool)
            for b in range(len(reqs)):
                keep[b, :int(res[b, k + 1])] = True
            slots = torch.where(self._t(keep), slots, torch.zeros_like(slots))
        self._write_context(("verify", k), feats, inp["positions"], slots, self._opts())
        for r in reqs:
            self._req_objs[r.req_id] = r
            if not r.finished and r.req_id in self.reqs:
                self.reqs[r.req_id] = Pending(len(r.tokens) - 2, None, None)

    # -- drafting -------------------------------------------------------------------------------
    @torch.inference_mode()
    def draft_requests(self, reqs, k: int, temps: Optional[np.ndarray], generators,
                       want_probs: bool = True) -> Drafts:
        """K drafts per request ([B, K], -1 where a request has nothing pending): one block
        forward per request, anchored at its last token."""
        d, sel = self._no_drafts(reqs, k, want_probs)
        if not sel or k == 0:
            return d
        rs = [reqs[b] for b in sel]
        for r in rs:
            p = self.reqs[r.req_id]
            assert p.t == len(r.tokens) - 2, (r.req_id, p.t, len(r.tokens))
        args = self._block_args(rs, k)
        random = temps is not None
        if random:
            args += self._draws(np.asarray(temps, dtype=np.float64)[sel],
                                [generators[b] for b in sel], k, self.module.config.vocab_size)
        out = self._call(("block", k, random), self.block, args, self._rows_opts())
        return self._fill(d, sel, *out)

    def _block_args(self, rs, k: int) -> list:
        """[anchor, MASK...] ids, positions n-1.., their slots, block tables and lengths."""
        r = self.runner
        S = self.module.block_len(k)
        ids = np.full((len(rs), S), self.module.config.mask_token_id, dtype=np.int64)
        ids[:, 0] = [q.tokens[-1] for q in rs]
        pos = np.array([len(q.tokens) - 1 for q in rs], dtype=np.int64)[:, None] + np.arange(S)
        slots = np.stack([r.slots(q.blocks, pos[j]) for j, q in enumerate(rs)])
        return [self._t(ids), self._t(pos), self._t(slots), self._t(r.table(rs, len(rs))),
                self._t((pos[:, -1] + 1).astype(np.int32))]

    def warm_up(self, k_values, top_rows) -> None:
        """Compile and capture the context pass at every K's verify shape and the prefill
        shape, and the greedy block at every K, before the first request (pointing at the
        scratch block). Inputs are made the way the real ones are (Dynamo guards on
        inference-mode-ness): step metadata outside inference mode, features and the block's
        inputs inside it."""
        r = self.runner
        F = len(self.module.aux_layer_ids) * r.model_config.hidden_size
        z, feats = self._zeros, self._features

        for k in k_values:
            n = top_rows(k)
            self._write_context(("verify", k), feats(n, k + 1, F), z(n, k + 1), z(n, k + 1),
                                self._opts())
        C, n = r.chunk, r.max_prefill_rows
        self._write_context(("prefill",), feats(n, C, F), z(n, C), z(n, C), self._prefill_opts())
        n = r.max_num_seqs
        for k in k_values:
            if k == 0:
                continue
            S = self.module.block_len(k)
            with torch.inference_mode():
                args = [z(n, S), z(n, S), z(n, S), z(n, r.max_blocks, dtype=torch.int32),
                        z(n, dtype=torch.int32)]
                self._call(("block", k, False), self.block, args, self._rows_opts())


def build(ctx: BuildContext) -> BlockDraftProposer:
    p = BlockDraftProposer(load_head(ctx), ctx.num_blocks, ctx.block_size,
                           padded=not ctx.spec.disable_padded_drafter_batch)
    p.check_k(ctx.spec.num_speculative_tokens)
    return p
