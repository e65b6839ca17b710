"""The hybrid drafter: suffix decoding and a model head, chosen per request and per step.

Arctic Inference pairs suffix decoding with a trained speculator: where the output repeats
something seen (the prompt, an earlier answer), the suffix tree drafts long and for free;
elsewhere the model head drafts. Here, every step and for every request:

    suffix draft s_1..s_L (L <= the request's cap) with the tree's path probabilities
    p_1 >= .. >= p_L; its score sum(p) is the tree's own estimate of the drafts accepted
    take it when score >= the threshold, else the model head's draft

The threshold is `suffix_min_score` when set; by default it is what the model head has been
getting: the mean accepted drafts per step of the requests it drafted (an exponential average
over request-steps, starting at `DEFAULT_MODEL_ACCEPTED`), and the head's loop must also pay
for its measured cost (`_model_pays`). The model's draft loop runs only for the requests that
take its drafts (none: no loop this step). Its first pass after a verify step runs as in the
plain method, except after a step where every request will take a suffix draft next (EAGLE,
EAGLE-3, MTP): then the step's accepted rows wait, and the rows of all the steps waiting are
passed in one prefill-shaped call when the head drafts for the request again, so a suffix
streak costs the head nothing and its K/V ends up as the plain method's.

Lossless: suffix rows go to the verify op as one-hot q (the suffix draft is a deterministic
function of the context), model rows with the head's q; both are exact under rejection
sampling, whoever drafted. With `suffix_min_score` set the choice reads scores only (runs are
reproducible); the default reads timings too.
"""
from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from npuspec.spec_decode import suffix
from npuspec.spec_decode.base import CONF_MIN, DraftBatch, Drafts, Proposer, per_request_k

DEFAULT_MODEL_ACCEPTED = 1.0  # before the head has drafted: a suffix draft must expect one token
EMA = 0.05                    # weight of one request-step in the model's running acceptance
TIME_EMA = 0.1                # weight of one round in the running round and loop times
GAP_MAX = 5.0                 # a gap over this many rounds is idle time, not a round
EXPLORE_EVERY = 16            # run the head at least every this many steps it was declined


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
        # request-steps drafted by each ("none": the head was not worth its cost and suffix
        # had nothing)
        self.picks = {"suffix": 0, "model": 0, "none": 0}
        self._source: dict[str, str] = {}             # request -> who drafted its last step
        self.clock = time.perf_counter
        self.t_round: Optional[float] = None  # seconds per round without the head's loop
        self.t_loop: Optional[float] = None   # seconds per call of the head's loop
        self._last: Optional[float] = None
        self._last_loop = 0.0
        self._asked = 0
        # tensor parallelism with the head sharded: every rank drafts, and the one decision made
        # from wall-clock times (does the head's loop pay this step?) must be rank 0's on every
        # rank (agree_with: the engine passes TP.broadcast_object)
        self.agree: Callable[[bool], bool] = lambda pays: pays

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
        use = self._takes_suffix(s)[1]
        rest = [r for r, u in zip(req_ids, use) if not u]
        m = iter(self.model.propose(rest, [k for k, u in zip(ks, use) if not u]) if rest else [])
        return [list(t) if u else next(m) for (t, _), u in zip(s, use)]

    # -- per step -----------------------------------------------------------------------------
    def threshold(self) -> float:
        return self.model_accepted if self.min_score is None else self.min_score

    def _takes_suffix(self, s: list) -> tuple[np.ndarray, np.ndarray]:
        """Suffix drafts [(tokens, path probs)] -> (scores [B], which take the suffix [B])."""
        scores = np.array([sum(p) for _, p in s], dtype=np.float64)
        has = np.array([bool(t) for t, _ in s], dtype=bool)
        return scores, has & (scores >= self.threshold())

    def _tick(self) -> None:
        """Time the round that ended: from the last draft_batch to this one, less the model
        loop it ran (an exponential average; a gap over GAP_MAX rounds is idle time)."""
        now = self.clock()
        if self._last is not None:
            gap = now - self._last - self._last_loop
            if self.t_round is None:
                self.t_round = gap
            elif gap < GAP_MAX * self.t_round:
                self.t_round += TIME_EMA * (gap - self.t_round)
        self._last, self._last_loop = now, 0.0

    def _model_pays(self, scores: np.ndarray, prefer: np.ndarray) -> bool:
        """Adaptive mode: run the head's loop this step only if the tokens it adds (the head's
        running acceptance instead of the suffix score, on the rows that prefer it) beat its
        measured cost: with * t_round > without * (t_round + t_loop). Every EXPLORE_EVERY-th
        such step it runs anyway, so its acceptance and cost stay measured."""
        if self.min_score is not None or self.t_loop is None or self.t_round is None:
            return True
        self._asked += 1
        if self._asked % EXPLORE_EVERY == 0:
            return True
        with_m = float(np.where(prefer, 1 + self.model_accepted, 1 + scores).sum())
        without = float((1 + scores).sum())
        return with_m * self.t_round > without * (self.t_round + self.t_loop)

    def _run_model(self, sub: DraftBatch) -> Drafts:
        t0 = self.clock()
        md = self.model.draft_batch(sub)  # [B', K], [B', K, V] | None, [B', K]
        dt = self.clock() - t0
        self.t_loop = dt if self.t_loop is None else self.t_loop + TIME_EMA * (dt - self.t_loop)
        self._last_loop = dt
        return md

    def draft_batch(self, batch: DraftBatch) -> Drafts:
        B, K = len(batch.reqs), batch.k
        self._tick()
        s = self.suffix.propose_batch_with_probs(batch.req_ids, batch.caps)
        scores, use = self._takes_suffix(s)  # [B] each
        if not use.all() and not self.agree(self._model_pays(scores, ~use)):
            use = np.array([bool(t) for t, _ in s], dtype=bool)  # any suffix draft, no loop
            rest = np.zeros(0, dtype=np.int64)
        else:
            rest = np.flatnonzero(~use)
        tokens = np.full((B, K), -1, dtype=np.int64)
        conf = np.full((B, K), CONF_MIN)
        for b in np.flatnonzero(use):
            t, p = s[b][0], np.asarray(s[b][1], dtype=np.float64)
            tokens[b, :len(t)] = t
            # per-position confidence: the tree's conditional probability p_j / p_{j-1}
            conf[b, :len(p)] = np.clip(p / np.concatenate([[1.0], p[:-1]]), CONF_MIN, 1.0)
        md = None
        if len(rest):
            sub = DraftBatch([batch.reqs[b] for b in rest], K, [batch.caps[b] for b in rest],
                             None if batch.temps is None else batch.temps[rest])
            md = self._run_model(sub)
            tokens[rest] = md.tokens
            conf[rest] = CONF_MIN if md.conf is None else md.conf
        probs = self._probs(batch, tokens, use, rest, md)
        source = np.where(use, "suffix", "none").astype(object)
        source[rest] = "model"
        for r, src in zip(batch.reqs, source):
            self._source[r.req_id] = src
            self.picks[src] += 1
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

    def agree_with(self, agree) -> None:
        self.agree = agree

    # -- the model drafter's hooks ------------------------------------------------------------
    def on_prefill(self, rows: list, pre: dict) -> None:
        self.model.on_prefill(rows, pre)

    def on_verify(self, reqs, k, drafts, res, inp, feats) -> None:
        if self.model.defers_first_pass and self._next_all_suffix(reqs, k):
            self.model.on_verify(reqs, k, drafts, res, inp, feats, defer=True)
        else:
            self.model.on_verify(reqs, k, drafts, res, inp, feats)

    def _next_all_suffix(self, reqs, k: int) -> bool:
        """Will every live request of this step take a suffix draft at the next one (by the
        score rule, on the tree as this step left it)? Then the head's first pass can wait:
        its rows are passed when the head drafts again (EagleProposer._catch_up)."""
        live = [r for r in reqs if not r.finished]
        if not live or k == 0:  # K = 0 drafts nothing to predict from: wait until one drafts
            return bool(live)
        caps = [min(k, max(r.max_new - 1, 0)) for r in live]
        return bool(self._takes_suffix(
            self.suffix.propose_batch_with_probs([r.req_id for r in live], caps))[1].all())

    def attach(self, runner) -> None:
        self.model.attach(runner)

    def warm_up(self, k_values, top_rows) -> None:
        self.model.warm_up(k_values, top_rows)

    def bind_target(self, target: torch.nn.Module) -> bool:
        return self.model.bind_target(target)

    def take_path(self, req_id: str) -> Optional[str]:
        return self.model.take_path(req_id)

    def finish_call(self, outputs: list) -> None:
        self._last = None  # the time until the next call's first step is not a round
        self.model.finish_call(outputs)

    def forget_responses(self) -> None:
        self.suffix.forget_responses()
        self.model.forget_responses()


def wrap(model: Proposer, ctx) -> Proposer:
    """`enable_suffix_decoding`: the model drafter behind suffix decoding (ctx: BuildContext)."""
    return HybridProposer(model, suffix.build(ctx), ctx.vocab_size, ctx.device,
                          ctx.spec.suffix_min_score)
