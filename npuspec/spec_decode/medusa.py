"""Medusa: K heads on the target's final hidden state at the pending row; head k drafts token
k, and there is no draft K/V (hidden.py has the flow it shares with EAGLE)."""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from npuspec.spec_decode.base import BuildContext, Drafts
from npuspec.spec_decode.draft_step import MedusaStep, sample_drafts
from npuspec.spec_decode.heads import load_head
from npuspec.spec_decode.hidden import HiddenStateProposer


class MedusaProposer(HiddenStateProposer):
    """Medusa: `heads` is a `MedusaHeads`; K must equal its number of heads."""

    def __init__(self, heads):
        super().__init__(heads, ((), True))
        self.step = MedusaStep(heads)

    def _opts(self) -> dict:
        return self.runner.backend_options

    @torch.inference_mode()
    def _first_pass(self, key, ids, feats, inp, last, opts):
        # the heads read one row per request: no draft K/V, so `ids` is not needed
        logits = self._call(("medusa",) + key, self.step,
                            [feats, self._t(np.asarray(last, dtype=np.int64))], opts)
        return logits.clone(), None  # [R, heads, V]

    @torch.inference_mode()
    def draft_requests(self, reqs, k: int, temps: Optional[np.ndarray], generators,
                       want_probs: bool = True) -> Drafts:
        d, sel = self._no_drafts(reqs, k, want_probs)
        if not sel or k == 0:
            return d
        V = self.module.config.vocab_size
        logits = torch.stack([self.reqs[reqs[b].req_id].logits for b in sel])[:, :k]  # [B', K, V]
        draws = [] if temps is None else self._draws(
            np.asarray(temps, dtype=np.float64)[sel], [generators[b] for b in sel], k, V)
        return self._fill(d, sel, *sample_drafts(logits, *draws))

    @torch.inference_mode()  # its only inputs, the target's features, are inference tensors
    def warm_up(self, k_values, top_rows) -> None:
        r = self.runner
        H = r.model_config.hidden_size
        dt = r.model.norm.weight.dtype
        for k in k_values:
            n = top_rows(k)
            self._first_pass(("verify", k), None, torch.zeros(n, k + 1, H, dtype=dt,
                                                              device=r.device), None,
                             np.zeros(n), self._opts())
        n = r.max_prefill_rows
        self._first_pass(("prefill",), None, torch.zeros(n, r.chunk, H, dtype=dt,
                                                         device=r.device), None, np.zeros(n),
                         self._prefill_opts())

    def bind_target(self, target: torch.nn.Module) -> bool:
        self.module.bind_target(target)
        return True


def build(ctx: BuildContext) -> MedusaProposer:
    heads = load_head(ctx)
    heads.check_k(ctx.spec.num_speculative_tokens)
    return MedusaProposer(heads)
