"""Draft-model proposer: a second, smaller checkpoint with the target's vocabulary.

It keeps its own slot KV cache (a paged pool with a fixed run of blocks per running request,
models/decoder.py) and, per step:
1. catches up on the tokens the target emitted since its last step (one batched forward over
   at most a few tokens per request, left-padded: padding tokens write the pool's scratch block
   and their outputs are dropped);
2. drafts K tokens autoregressively, one [B, 1] forward each.

Draft token i of a request is sampled from q_i = softmax(draft_logits / T) with the request's
temperature T (argmax for greedy requests), using the request's own generator, so the standard
(Leviathan) rejection path gets x_i ~ q_i and the q_i themselves: losslessness holds end to
end. Each position also reports a confidence, the max of softmax(draft_logits) (the DFlash
choice for a drafter without a confidence head), which the confidence budget turns into a
per-request draft allowance.

`propose()` (the plain protocol of spec_decode/base.py) drafts greedily; the engine's
`draft_batch()` calls `draft()` to get probabilities and confidences too.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np
import torch

from npuspec.models import load_model
from npuspec.models.packing import pack_model
from npuspec.models.tp import check_shardable, shard_model
from npuspec.spec_decode.base import (CONF_MIN, BuildContext, DraftBatch, Drafts, Proposer,
                                      duplicate_request, per_request_k, unknown_request)

_BATCHED_CATCH_UP = 16  # longer backlogs are prefilled per request


@dataclasses.dataclass
class _State:
    slot: int
    tokens: list[int]     # full context: prompt + emitted
    cached: int           # tokens whose K/V are in the draft cache


class DraftModelProposer(Proposer):
    def __init__(self, model: torch.nn.Module, num_slots: int, max_len: int, device="cpu",
                 block_size: int = 16):
        self.model = model
        self.device = torch.device(device)
        self.cache = model.allocate_cache(num_slots, max_len, block_size=block_size)
        self.free = list(range(num_slots - 1, -1, -1))
        self.reqs: dict[str, _State] = {}
        self.vocab_size = model.config.vocab_size

    # -- protocol ---------------------------------------------------------------------------
    def start_request(self, req_id: str, prompt: Sequence[int]) -> None:
        if req_id in self.reqs:
            raise duplicate_request("start_request", req_id)
        if not self.free:
            raise RuntimeError(f"DraftModelProposer: no free draft cache slot for {req_id!r}; "
                               f"raise num_slots (it must be >= max_num_seqs)")
        self.reqs[req_id] = _State(self.free.pop(), list(prompt), 0)

    def extend(self, req_id: str, new_tokens: Sequence[int]) -> None:
        st = self.reqs.get(req_id)
        if st is None:
            raise unknown_request("extend", req_id)
        st.tokens.extend(int(t) for t in new_tokens)

    def stop_request(self, req_id: str) -> None:
        st = self.reqs.pop(req_id, None)
        if st is None:
            raise unknown_request("stop_request", req_id)
        self.free.append(st.slot)

    def propose(self, req_ids: Sequence[str], max_tokens) -> list[list[int]]:
        ks = per_request_k(req_ids, max_tokens)
        k = max(ks, default=0)
        if k == 0:
            return [[] for _ in req_ids]
        d = self.draft(req_ids, k, want_probs=False)
        return [[int(t) for t in row[:kk]] for row, kk in zip(d.tokens, ks)]

    # -- batched drafting -------------------------------------------------------------------
    def draft_batch(self, batch: DraftBatch) -> Drafts:
        return self.draft(batch.req_ids, batch.k, batch.temps, batch.generators,
                          want_probs=batch.want_probs)

    @torch.inference_mode()
    def draft(self, req_ids: Sequence[str], k: int, temperature: Optional[np.ndarray] = None,
              generators: Optional[Sequence[Optional[torch.Generator]]] = None,
              want_probs: bool = True) -> Drafts:
        """K draft tokens per request. temperature [B] (0 = greedy; None = all greedy);
        generators[b] draws request b's samples (required for rows with temperature > 0)."""
        B = len(req_ids)
        states = [self.reqs[r] for r in req_ids]
        slots = torch.tensor([s.slot for s in states], dtype=torch.int64, device=self.device)
        temp = np.zeros(B) if temperature is None else np.asarray(temperature, dtype=np.float64)
        random_rows = [b for b in range(B) if temp[b] > 0]
        t = torch.tensor(np.where(temp > 0, temp, 1.0), dtype=torch.float32,
                         device=self.device)[:, None]  # [B, 1]
        logits = self._catch_up(states, slots)  # [B, V]
        xs, confs, probs = [], [], []
        pos = torch.tensor([len(s.tokens) for s in states], dtype=torch.int64, device=self.device)
        for i in range(k):
            p1 = torch.softmax(logits, dim=-1)                 # [B, V] at T = 1
            q = p1 if not random_rows else torch.softmax(logits / t, dim=-1)
            x = q.argmax(dim=-1)                               # [B]
            for b in random_rows:  # exponential race with the request's own draws
                e = torch.empty(q.shape[1], device=self.device).exponential_(
                    generator=generators[b])
                x[b] = (q[b] / e).argmax()
            xs.append(x)
            confs.append(p1.max(dim=-1).values)
            if want_probs:
                probs.append(q)
            if i + 1 < k:
                logits = self.model(x[:, None], (pos + i)[:, None], slots, self.cache)[:, 0]
        # one device->host copy for all K positions
        host = torch.stack([torch.stack(xs, 1).double(), torch.stack(confs, 1).double()]).cpu()
        toks = host[0].numpy().astype(np.int64)
        conf = np.clip(host[1].numpy(), CONF_MIN, 1.0)
        return Drafts(toks, torch.stack(probs, dim=1).float() if want_probs else None, conf)

    def _catch_up(self, states: list[_State], slots: torch.Tensor) -> torch.Tensor:
        """Feed every request's uncached tokens; return the logits after its last token [B, V].

        A request with a long backlog (a new prompt) is first prefilled on its own, so the
        batched forward stays a few tokens wide instead of padding everyone to the prompt."""
        for s in states:
            if len(s.tokens) - s.cached > _BATCHED_CATCH_UP:
                ids = torch.tensor(s.tokens[s.cached:-1], dtype=torch.int64, device=self.device)
                pos = torch.arange(s.cached, len(s.tokens) - 1, device=self.device)
                slot = torch.tensor([s.slot], dtype=torch.int64, device=self.device)
                self.model(ids[None], pos[None], slot, self.cache)
                s.cached = len(s.tokens) - 1
        new = [s.tokens[s.cached:] for s in states]
        T = max(len(n) for n in new)
        assert T >= 1, "draft() needs at least one new token per request (the last emitted one)"
        B = len(states)
        ids = np.zeros((B, T), dtype=np.int64)
        pos = np.full((B, T), -1, dtype=np.int64)  # -1: left padding, to the scratch block
        for b, (s, n) in enumerate(zip(states, new)):
            ids[b, T - len(n):] = n
            pos[b, T - len(n):] = s.cached + np.arange(len(n))
        logits = self.model(torch.from_numpy(ids).to(self.device),
                            torch.from_numpy(pos).to(self.device), slots, self.cache)  # [B, T, V]
        for s in states:
            s.cached = len(s.tokens)
        return logits[:, -1]


def build(ctx: BuildContext) -> DraftModelProposer:
    s = ctx.spec
    dcfg, dmodel = load_model(s.model, dtype=ctx.dtype, device=ctx.device)
    if dcfg.vocab_size != ctx.vocab_size:
        raise ValueError(
            f"speculative_config.model={s.model!r}: the draft model's vocab_size "
            f"({dcfg.vocab_size}) differs from the target's ({ctx.vocab_size}); "
            f"a draft model must share the target's tokenizer and vocabulary")
    if ctx.shard is not None:
        check_shardable(dcfg, ctx.shard[1], "speculative_config.draft_tensor_parallel_size")
        dmodel = shard_model(dmodel, *ctx.shard)
    pack_model(dmodel)
    return DraftModelProposer(dmodel, ctx.max_num_seqs, ctx.cache_len, device=ctx.device,
                              block_size=ctx.block_size or 16)
