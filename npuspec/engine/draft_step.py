"""The hidden-state drafter's compiled steps (EAGLE, EAGLE-3, MTP; Medusa's heads).

A KV-carrying drafter runs two kinds of forward, each compiled with
torch.compile(backend="npuspec") and replayed from captured graphs like the target's step:

    first pass  [R, T]: the target's tokens of a step shifted by one (row t carries token
                x_{t+1} and the target's feature h_t), at the target's own positions and
                slots; T = K+1 after a verify step (captured at multiples of K+1), T = the
                prefill chunk after a prefill step. It writes the draft's K/V of every row
                and returns, for row `last[r]` of each request, the logits of the token after
                the next one and the hidden state the chain continues from.
    chain step  [B, 1]: one draft token per request on the draft's own hidden state.

The draft's KV pool has the target pool's geometry, so the target's block tables and slot
mappings address it (vLLM keeps the draft layers in the same KV manager). Its buffers are
the module's, so the captured graphs never copy the pool.
"""
from __future__ import annotations

import types

from torch import nn

from npuspec.models.decoder import AttnMetadata, PagedKVCache


class _DraftModule(nn.Module):
    def __init__(self, draft: nn.Module, cache: PagedKVCache):
        super().__init__()
        self.draft = draft
        self.block_size = cache.block_size
        self.register_buffer("k_cache", cache.k, persistent=False)
        self.register_buffer("v_cache", cache.v, persistent=False)

    def _forward(self, input_ids, hidden, positions, slot_mapping, block_table, seq_lens):
        cache = PagedKVCache(self.k_cache, self.v_cache, self.block_size)
        meta = AttnMetadata(slot_mapping, block_table, seq_lens)
        return self.draft(input_ids, hidden, positions, meta, cache)  # 2 x [R, T, H]


class DraftFirstPass(_DraftModule):
    def forward(self, input_ids, feats, positions, slot_mapping, block_table, seq_lens, last):
        # input_ids/positions/slot_mapping [R, T], feats [R, T, F], last [R] int64
        lh, nh = self._forward(input_ids, self.draft.first_hidden(feats), positions,
                               slot_mapping, block_table, seq_lens)  # [R, T, H] each
        idx = last[:, None, None].expand(-1, 1, lh.shape[-1])     # [R, 1, H]
        lh, nh = lh.gather(1, idx), nh.gather(1, idx)              # [R, 1, H]
        return self.draft.logits(lh)[:, 0], nh[:, 0]               # [R, V], [R, H]


class DraftChainStep(_DraftModule):
    def forward(self, input_ids, hidden, positions, slot_mapping, block_table, seq_lens):
        # input_ids/positions/slot_mapping [B, 1], hidden [B, H]
        lh, nh = self._forward(input_ids, hidden[:, None], positions, slot_mapping,
                               block_table, seq_lens)              # [B, 1, H] each
        return self.draft.logits(lh)[:, 0], nh[:, 0]               # [B, V], [B, H]


class MedusaStep(nn.Module):
    """Medusa's heads on the target's final hidden state at one row per request."""

    def __init__(self, heads: nn.Module):
        super().__init__()
        self.heads = heads

    def forward(self, feats, last):
        # feats [R, T, H] (the target's post-norm hidden), last [R] int64
        idx = last[:, None, None].expand(-1, 1, feats.shape[-1])
        return self.heads(feats.gather(1, idx)[:, 0])               # [R, heads, V]


def fresh_fn(module: nn.Module, name: str):
    """A plain function calling `module`, with a code object of its own, so Dynamo's cache
    and recompile count are per drafter and per variant (as `fresh_step_fn` for the target)."""
    def run(*args):
        return module(*args)
    return types.FunctionType(run.__code__.replace(), run.__globals__, name, run.__defaults__,
                              run.__closure__)
