"""The decode/verify step the engine compiles, and the prefill step.

A decode step is one function of static-shape tensors (docs/design.md, "One decode step, as
data", has every input and where it comes from):

    input_ids [B, K+1]  = last emitted token, then K drafts (-1 drafts fed as token 0)
    positions [B, K+1], slots [B, K+1] (the slot mapping into the paged pool),
    block_table [B, MB], seq_lens [B], draft_ids [B, K] (+ the sampling inputs)
    -> target logits [B, K+1, V] -> npuspec::rejection_sample -> [B, K+2] int32

B here is the step's rows, padding rows included. The result packs the emitted tokens (-1
padded) and, in the last column, num_emitted, so the engine does exactly one device->host
transfer per step. All random draws (uniforms, Exp(1) races) are inputs, made by the engine
from per-request generators, so the step is a pure function of its inputs: it can be captured
in a device graph and replayed, and a seeded request's result does not depend on the batch it
ran in. Attention reads only each row's live length (seq_lens).

The KV cache lives in the step module's buffers (static addresses, shared with prefill), so
the graph runners never copy it; only the per-step inputs are copied into static buffers.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

import npuspec.kernels  # noqa: F401  (registers torch.ops.npuspec.rejection_sample)
from npuspec.compilation.compiled import own_code
from npuspec.models.decoder import AttnMetadata, PagedKVCache


class VerifyStep(nn.Module):
    """model forward + fused verify over the engine's paged pool. One instance per engine;
    compiled once per input signature. `slots` is the slot mapping [B, K+1]."""

    def __init__(self, model: nn.Module, cache: PagedKVCache, *, block_verify: bool = False,
                 entropy_verify: Optional[tuple[float, float]] = None,
                 features: Optional[tuple[tuple, bool]] = None):
        super().__init__()
        self.model = model
        # (aux layer ids, final): what a hidden-state drafter reads from the target. None: the
        # step returns its tokens alone (nothing else is computed or kept)
        self.features = features
        assert isinstance(cache, PagedKVCache), type(cache)
        self.block_size = cache.block_size
        # buffers share the cache's storage: prefill and the compiled step see one cache
        self.register_buffer("k_cache", cache.k, persistent=False)
        self.register_buffer("v_cache", cache.v, persistent=False)
        self.block_verify = bool(block_verify)
        self.thr, self.alpha = (None, None) if entropy_verify is None else (
            float(entropy_verify[0]), float(entropy_verify[1]))

    def logits(self, input_ids, positions, slots, block_table=None, seq_lens=None):
        """-> logits [B, T, V], or (logits, features [B, T, F]) when the drafter needs them."""
        cache = PagedKVCache(self.k_cache, self.v_cache, self.block_size)
        meta = AttnMetadata(slots, block_table, seq_lens)
        if self.features is None:
            return self.model(input_ids, positions, meta, cache)
        aux_ids, final = self.features
        return self.model.forward_features(input_ids, positions, meta, cache, aux_ids=aux_ids,
                                           final=final)

    def forward(self, input_ids, positions, slots, draft_ids, draft_probs=None, temperature=None,
                top_k=None, top_p=None, uniforms=None, exponentials=None, synthetic_rates=None,
                block_table=None, seq_lens=None):
        # input_ids/positions [B, K+1], slots = slot_mapping [B, K+1],
        # draft_ids [B, K], draft_probs [B, K, V]
        logits = self.logits(input_ids, positions, slots, block_table, seq_lens)
        feats = None
        if self.features is not None:
            logits, feats = logits  # [B, K+1, V], [B, K+1, F]
        out, num = torch.ops.npuspec.rejection_sample(
            logits, draft_ids, draft_probs, temperature, top_k, top_p, uniforms, exponentials,
            self.block_verify, self.thr, self.alpha, synthetic_rates)  # [B, K+1], [B]
        res = torch.cat([out, num[:, None]], dim=1)  # [B, K+2] int32
        return res if feats is None else (res, feats)


class PrefillStep(nn.Module):
    """Writes prompt K/V through the paged cache: rows of `chunk` tokens, any mix of requests
    and chunks (a row's tokens right-aligned; rows of one request may share a step, since
    every row's K/V is written before any row attends). Returns the rows' last hidden
    state, [R, hidden], so the graph has an output; no logits are computed. When the
    drafter reads target features, it returns those of every token instead, [R, C, F]."""

    def __init__(self, verify: VerifyStep):
        super().__init__()
        self.verify = verify

    def forward(self, input_ids, positions, slot_mapping, block_table, seq_lens):
        v = self.verify
        cache = PagedKVCache(v.k_cache, v.v_cache, v.block_size)
        if v.features is not None:
            aux_ids, final = v.features
            return v.model.forward_features(
                input_ids, positions, AttnMetadata(slot_mapping, block_table, seq_lens), cache,
                aux_ids=aux_ids, final=final, logits=False)[1]
        h = v.model.hidden(input_ids, positions, AttnMetadata(slot_mapping, block_table, seq_lens),
                           cache)
        return h[:, -1]


def fresh_step_fn(step: VerifyStep):
    """A plain function calling `step`, with a code object of its own.

    Dynamo caches compiled graphs (and counts recompiles) per code object. Compiling the
    module's forward would share one cache between every engine in the process; a fresh code
    object per compiled signature keeps each engine's graphs, and their captured graph sets,
    separate."""
    def run(input_ids, positions, slots, draft_ids, draft_probs=None, temperature=None,
            top_k=None, top_p=None, uniforms=None, exponentials=None, synthetic_rates=None,
            block_table=None, seq_lens=None):
        return step(input_ids, positions, slots, draft_ids, draft_probs, temperature, top_k,
                    top_p, uniforms, exponentials, synthetic_rates, block_table, seq_lens)
    return own_code(run, "npuspec_step")


def fresh_prefill_fn(step: PrefillStep):
    """`fresh_step_fn` for the prefill step."""
    def run(input_ids, positions, slot_mapping, block_table, seq_lens):
        return step(input_ids, positions, slot_mapping, block_table, seq_lens)
    return own_code(run, "npuspec_prefill")
