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

import torch
from torch import nn

from npuspec.compilation.compiled import own_code
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
        return self.draft.draft_logits(lh)[:, 0], nh[:, 0]         # [R, Vd], [R, H]


class DraftChainStep(_DraftModule):
    def forward(self, input_ids, hidden, positions, slot_mapping, block_table, seq_lens):
        # input_ids/positions/slot_mapping [B, 1], hidden [B, H]
        lh, nh = self._forward(input_ids, hidden[:, None], positions, slot_mapping,
                               block_table, seq_lens)              # [B, 1, H] each
        return self.draft.logits(lh)[:, 0], nh[:, 0]               # [B, V], [B, H]


def sample_drafts(logits, temperature=None, exponentials=None):
    """logits [B, ..., V] -> (tokens [B, ...], confidence [B, ...], q [B, ..., V] or None).

    Without `temperature`: the argmax, confidence max softmax(logits), no q. With temperature
    [B] (0 = greedy row) and the row's Exp(1) draws `exponentials` [B, ..., V]: a row with T > 0
    takes argmax(q / e) with q = softmax(logits / T), i.e. a draw x ~ q (the exponential race),
    a greedy row the argmax; q is returned for the verify op (greedy rows: softmax(logits))."""
    p1 = torch.softmax(logits.float(), dim=-1)
    conf = p1.amax(dim=-1)
    greedy = logits.argmax(dim=-1)
    if temperature is None:
        return greedy, conf, None
    t = temperature.reshape(-1, *([1] * (logits.dim() - 1)))   # [B, 1.., 1]
    hot = t > 0
    q = torch.softmax(logits.float() / torch.where(hot, t, torch.ones_like(t)), dim=-1)
    x = torch.where(hot[..., 0], (q / exponentials).argmax(dim=-1), greedy)
    return x, conf, q


class DraftLoop(_DraftModule):
    """Draft tokens 0..K-1 of every request in one graph: token 0 from the pending logits, then
    K-1 chain steps ([B, 1] forwards on the draft's own hidden state), sampling in the graph
    (vLLM Ascend merges the K-step loop into one graph the same way). Logits, sampling and q
    stay in the draft's vocabulary (Vd, EAGLE-3's d2t; else V); ids and q are mapped to the
    target's vocabulary on the way out."""

    def forward(self, logits, hidden, positions, slot_mapping, block_table, seq_lens,
                temperature=None, exponentials=None):
        # logits [B, Vd], hidden [B, H]; positions/slot_mapping/seq_lens [B, K-1] (chain
        # step i at column i); temperature [B], exponentials [B, K, Vd]
        d = self.draft
        toks, confs, qs = [], [], []
        K = positions.shape[1] + 1
        for i in range(K):
            e = None if exponentials is None else exponentials[:, i]
            x, c, q = sample_drafts(logits, temperature, e)         # [B], [B], [B, Vd]
            x = d.draft_to_target_ids(x)                            # [B] target ids
            toks.append(x)
            confs.append(c)
            qs.append(q)
            if i + 1 < K:
                lh, nh = self._forward(x[:, None], hidden[:, None], positions[:, i:i + 1],
                                       slot_mapping[:, i:i + 1], block_table, seq_lens[:, i])
                logits, hidden = d.draft_logits(lh)[:, 0], nh[:, 0]
        out = (torch.stack(toks, 1), torch.stack(confs, 1))        # [B, K] each
        if temperature is None:
            return out
        return out + (d.draft_to_target_probs(torch.stack(qs, 1)),)  # q [B, K, V]


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
    return own_code(run, name)
