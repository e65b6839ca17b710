"""DFlash's and DSpark's compiled steps (npuspec.models.dflash).

    context [R, T]: the target's features of a step's rows (a verify step's K+1 rows, or a
                    prefill chunk) -> every draft layer's context K/V at those rows' slots.
    block   [B, S]: one forward over [anchor, MASK x (S-1)] per request, then the drafts,
                    sampled inside the graph: DFlash samples each slot from its own logits;
                    DSpark walks the slots in order, adding the Markov bias of the token drafted
                    before (the anchor for the first) and reading the confidence head.

Both are compiled with torch.compile(backend="npuspec") and replayed from captured graphs, like
the EAGLE steps (spec_decode/draft_step.py). The block graph is keyed by K, so dynamic K and the
confidence budget never recapture it.
"""
from __future__ import annotations

import torch

from npuspec.spec_decode.draft_step import _DraftModule, sample_drafts
from npuspec.models.decoder import AttnMetadata, PagedKVCache


class DFlashContext(_DraftModule):
    def forward(self, feats, positions, slot_mapping):
        # feats [R, T, F], positions/slot_mapping [R, T] -> c [R, T, H] (returned so the graph
        # has an output; the K/V writes are what matters)
        cache = PagedKVCache(self.k_cache, self.v_cache, self.block_size)
        c = self.draft.context(feats)
        self.draft.write_context(c, positions, AttnMetadata(slot_mapping, None, None), cache)
        return c[:, -1:, :1]


class DFlashBlock(_DraftModule):
    def forward(self, input_ids, positions, slot_mapping, block_table, seq_lens,
                temperature=None, exponentials=None):
        # input_ids/positions/slot_mapping [B, S]; seq_lens [B] (the block's last position + 1);
        # temperature [B], exponentials [B, K, V] -> tokens [B, K], conf [B, K] (, q [B, K, V])
        cache = PagedKVCache(self.k_cache, self.v_cache, self.block_size)
        meta = AttnMetadata(slot_mapping, block_table, seq_lens)
        d = self.draft
        h = d(input_ids, positions, meta, cache)                    # [B, S, H]
        S = input_ids.shape[1]
        K = S if d.config.sample_from_anchor else S - 1
        h = h[:, S - K:]                                            # [B, K, H] the drafting slots
        if d.method == "dflash":
            return _out(*sample_drafts(d.logits(h), temperature, exponentials))
        prev = input_ids[:, 0]                                      # the anchor seeds the walk
        ld = d.draft_logits(h)                  # [B, K, Vd]: the LM head read once per block
        toks, confs, qs = [], [], []
        for j in range(K):
            e = None if exponentials is None else exponentials[:, j]
            x, _, q = sample_drafts(d.biased_logits(ld[:, j], prev), temperature, e)  # [B], [B, V]
            confs.append(d.confidence(h[:, j], prev))               # [B] fp32
            toks.append(x)
            qs.append(q)
            prev = x
        return _out(torch.stack(toks, 1), torch.stack(confs, 1),
                    None if temperature is None else torch.stack(qs, 1))


def _out(x, conf, q):
    return (x, conf) if q is None else (x, conf, q)
