"""The hybrid drafter: suffix decoding and a model head, chosen per request and per step.

Arctic Inference pairs suffix decoding with a trained speculator: where the output repeats
something seen (the prompt, an earlier answer), the suffix tree drafts long and for free;
elsewhere the model head drafts. Here, every step and for every request:

    suffix draft s_1..s_L (L <= the request's cap) with the tree's path probabilities
    p_1 >= .. >= p_L; its score sum(p) is the tree's own estimate of the drafts accepted
    take it when score >= the threshold, else the model head's draft

The threshold is `suffix_min_score` when set; by default it is what the model head has been
getting: the mean accepted drafts per step of the requests it drafted (an exponential average
over request-steps, starting at `DEFAULT_MODEL_ACCEPTED`). The model's draft loop runs only for
the requests that take its drafts (none: no loop this step); its first pass after each verify
step runs for every request, so its K/V and pending state stay those of the plain method.

Lossless: suffix rows go to the verify op as one-hot q (the suffix draft is a deterministic
function of the context), model rows with the head's q; both are exact under rejection
sampling. Every decision depends only on tokens and counts, never on timings, so a run is
reproducible.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from npuspec.spec_decode import suffix
from npuspec.spec_decode.base import CONF_MIN, DraftBatch, Drafts, Proposer, per_request_k

DEFAULT_MODEL_ACCEPTED = 1.0  # before the head has drafted: a suffix draft must expect one token
EMA = 0.05                    # weight of one request-step in the model's running acceptance


class HybridProposer(Proposer):
    """Suffix decoding (`suffix`, a SuffixProposer) in front of a model drafter (`model`)."""

    def __init__(self, model: Proposer, suffix, vocab_size: int, device: torch.device,
                 min_score: Optional[float] = None):
        self.model = model
        self.suffix = suffix
        self.vocab_size = vocab_size
        self.device = device
        self.min_score = min_score
        self.features = model.features
        self.module = model.module
        self.model_accepted = DEFAULT_MODEL_ACCEPTED  # running mean accepted per model step
        self.picks = {"suffix": 0, "model": 0}        # request-steps drafted by each
        self._source: dict[str, str] = {}             # request -> who drafted its last step

    # -- per request --------------------------------------------------------------------------
    def start_request(self, req_id: str, prompt: Sequence[int]) -> None:
        self.suffix.start_request(req_id, prompt)
        self.model.start_request(req_id, prompt)

    def extend(self, req_id: str, new_tokens: Sequence[int]) -> None:
        src = self._source.pop(req_id, None)
        if src == "model" and len(new_tokens):  # accepted drafts = emitted - the bonus token
            self.model_accepted += EMA * ((len(new_tokens) - 1) - self.model_accepted)
        self.suffix.extend(req_id, new_tokens)
        self.model.extend(req_id, new_tokens)

    def stop_request(self, req_id: str) -> None:
        self._source.pop(req_id, None)
        self.suffix.stop_request(req_id)
        self.model.stop_request(req_id)

    def propose(self, req_ids: Sequence[str], max_tokens) -> list[list[int]]:
        """The plain protocol (greedy): each request's chosen draft."""
        ks = per_request_k(req_ids, max_tokens)
        s = self.suffix.propose_batch_with_probs(list(req_ids), ks)
        use = [self._takes_suffix(p) for _, p in s]
        rest = [r for r, u in zip(req_ids, use) if not u]
        m = iter(self.model.propose(rest, [k for k, u in zip(ks, use) if not u]) if rest else [])
        return [list(t) if u else next(m) for (t, _), u in zip(s, use)]

    # -- per step -----------------------------------------------------------------------------
    def threshold(self) -> float:
        return self.model_accepted if self.min_score is None else self.min_score

    def _takes_suffix(self, probs: Sequence[float]) -> bool:
        return bool(probs) and sum(probs) >= self.threshold()

    def draft_batch(self, batch: DraftBatch) -> Drafts:
        B, K = len(batch.reqs), batch.k
        s = self.suffix.propose_batch_with_probs(batch.req_ids, batch.caps)
        use = np.array([self._takes_suffix(p) for _, p in s], dtype=bool)  # [B]
        tokens = np.full((B, K), -1, dtype=np.int64)
        conf = np.full((B, K), CONF_MIN)
        for b in np.flatnonzero(use):
            t, p = s[b][0], np.asarray(s[b][1], dtype=np.float64)
            tokens[b, :len(t)] = t
            # per-position confidence: the tree's conditional probability p_j / p_{j-1}
            conf[b, :len(p)] = np.clip(p / np.concatenate([[1.0], p[:-1]]), CONF_MIN, 1.0)
        rest = np.flatnonzero(~use)
        md = None
        if len(rest):
            sub = DraftBatch([batch.reqs[b] for b in rest], K, [batch.caps[b] for b in rest],
                             None if batch.temps is None else batch.temps[rest])
            md = self.model.draft_batch(sub)  # [B', K], [B', K, V] | None, [B', K]
            tokens[rest] = md.tokens
            conf[rest] = CONF_MIN if md.conf is None else md.conf
        probs = self._probs(batch, tokens, use, rest, md)
        for b, r in enumerate(batch.reqs):
            self._source[r.req_id] = "suffix" if use[b] else "model"
        self.picks["suffix"] += int(use.sum())
        self.picks["model"] += int(len(rest))
        return Drafts(tokens, probs, conf)

    def _probs(self, batch: DraftBatch, tokens: np.ndarray, use: np.ndarray, rest: np.ndarray,
               md: Optional[Drafts]) -> Optional[torch.Tensor]:
        """q [B, K, V] for a sampled step: one-hot at each suffix draft, the head's q elsewhere."""
        if not batch.want_probs:
            return None
        dev = self.device if md is None or md.probs is None else md.probs.device
        q = torch.zeros(len(batch.reqs), batch.k, self.vocab_size, device=dev)
        if len(rest) and md is not None and md.probs is not None:
            q[torch.as_tensor(rest, device=dev)] = md.probs
        hot = np.argwhere(use[:, None] & (tokens >= 0))  # [n, 2] (row, position)
        if len(hot):
            rows, pos = (torch.as_tensor(hot[:, i], device=dev) for i in (0, 1))
            q[rows, pos, torch.as_tensor(tokens[hot[:, 0], hot[:, 1]], device=dev)] = 1.0
        return q

    # -- the model drafter's hooks ------------------------------------------------------------
    def on_prefill(self, rows: list, pre: dict) -> None:
        self.model.on_prefill(rows, pre)

    def on_verify(self, reqs, k, drafts, res, inp, feats) -> None:
        self.model.on_verify(reqs, k, drafts, res, inp, feats)

    def attach(self, runner) -> None:
        self.model.attach(runner)

    def warm_up(self, k_values, top_rows) -> None:
        self.model.warm_up(k_values, top_rows)

    def bind_target(self, target: torch.nn.Module) -> bool:
        return self.model.bind_target(target)

    def take_path(self, req_id: str) -> Optional[str]:
        return self.model.take_path(req_id)

    def finish_call(self, outputs: list) -> None:
        self.model.finish_call(outputs)

    def forget_responses(self) -> None:
        self.suffix.forget_responses()
        self.model.forget_responses()


def wrap(model: Proposer, ctx) -> Proposer:
    """`enable_suffix_decoding`: the model drafter behind suffix decoding (ctx: BuildContext)."""
    return HybridProposer(model, suffix.build(ctx), ctx.vocab_size, ctx.device,
                          ctx.spec.suffix_min_score)
