"""`extract_hidden_states`: the target's aux hidden states of every prompt token, to a file.

It drafts nothing (so the output is plain decoding's); the target's prefill and verify steps
return the residual streams entering the requested layers (vLLM's layer-id semantics,
docs/hidden_states.md), and this proposer keeps each token's row on the host. When a request
finishes, its `token_ids` [num_tokens] and `hidden_states` [num_tokens, num_layers, hidden]
go to `{shared_storage_path}/{request_id}.safetensors` (npuspec.spec_decode.extract_files: atomic
and locked), and the request's output carries the path in
`kv_transfer_params["hidden_states_path"]`.

num_tokens is the prompt; with `kv_transfer_params={"include_output_tokens": True}` in the
request's SamplingParams.extra_args, every token but the last (which never ran through the
target).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from npuspec.spec_decode.base import (CONF_MIN, BuildContext, DraftBatch, Drafts, Proposer,
                                      duplicate_request, unknown_request)
from npuspec.spec_decode.extract_config import check_with_spec, parse_kv_transfer_config
from npuspec.spec_decode.extract_files import HiddenStatesWriter

LAYER_IDS_KEY = "draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids"


def layer_ids(spec, num_layers: int) -> tuple[int, ...]:
    ids = tuple(spec.draft_model_config["hf_config"]["eagle_aux_hidden_state_layer_ids"])
    bad = [i for i in ids if not 0 <= i <= num_layers]
    if bad:
        raise ValueError(f"speculative_config.{LAYER_IDS_KEY}={list(ids)}: layer id(s) {bad} "
                         f"are outside the target's 0..{num_layers} (id i is the input of "
                         f"decoder layer i, {num_layers} the final residual); pick ids in range")
    return ids


class ExtractHiddenStatesProposer(Proposer):
    def __init__(self, spec, kv_transfer_config, target_config, dtype: torch.dtype):
        kv = parse_kv_transfer_config(kv_transfer_config)
        check_with_spec(kv, spec.method)
        self.ids = layer_ids(spec, target_config.num_layers)
        self.features = (self.ids, False)
        self.hidden = target_config.hidden_size
        self.writer = HiddenStatesWriter(kv, dtype)
        self.rows: dict[str, dict[int, torch.Tensor]] = {}  # req -> position -> [n, hidden]
        self.reqs: dict[str, object] = {}
        self.paths: dict[str, str] = {}

    # -- protocol -----------------------------------------------------------------------------
    def start_request(self, req_id: str, prompt: Sequence[int]) -> None:
        if req_id in self.rows:
            raise duplicate_request("start_request", req_id)
        self.rows[req_id] = {}

    def extend(self, req_id: str, new_tokens: Sequence[int]) -> None:
        if req_id not in self.rows:
            raise unknown_request("extend", req_id)

    def stop_request(self, req_id: str) -> None:
        rows = self.rows.pop(req_id, None)
        if rows is None:
            raise unknown_request("stop_request", req_id)
        r = self.reqs.pop(req_id, None)
        if r is None or not r.finished:
            return  # aborted (an error mid-call): nothing is written
        n = len(r.prompt_ids) if not self._include_output(r) else len(r.tokens) - 1
        missing = [p for p in range(n) if p not in rows]
        assert not missing, (req_id, missing[:8])
        hidden = torch.stack([rows[p] for p in range(n)])  # [n, layers, hidden]
        kvp = self._params(r)
        self.paths[req_id] = self.writer.submit(req_id, r.tokens[:n], hidden,
                                                path=kvp.get("hidden_states_path"))

    def propose(self, req_ids, max_tokens) -> list[list[int]]:
        return [[] for _ in req_ids]

    def draft_batch(self, batch: DraftBatch) -> Drafts:
        B, k = len(batch.reqs), batch.k
        return Drafts(np.full((B, k), -1, dtype=np.int64), None, np.full((B, k), CONF_MIN))

    # -- what the engine hands over -----------------------------------------------------------
    def on_prefill(self, rows, pre: dict) -> None:
        C = pre["input_ids"].shape[1]
        feats = pre["features"][:len(rows)].cpu()  # [n, C, layers * hidden], one copy
        for i, row in enumerate(rows):
            m = row.end - row.start
            self._keep(row.req, row.start, feats[i, C - m:])

    def on_verify(self, reqs, k: int, drafts, res, inp, feats: torch.Tensor) -> None:
        # row j of request b sits at position start_b + j; rows up to the last accepted one
        # (num_emitted of them) ran on the sequence's own tokens
        start = inp["positions"][:len(reqs), 0].cpu().tolist()
        feats = feats[:len(reqs)].cpu()  # one device->host copy for the batch
        for b, r in enumerate(reqs):
            self._keep(r, int(start[b]), feats[b, :int(res[b, k + 1])])

    def _keep(self, r, start: int, f: torch.Tensor) -> None:
        """Keep rows at positions < the file's length (the prompt, or all tokens but the
        last with include_output_tokens); a later write of a position (after a preemption's
        re-prefill) replaces the earlier one."""
        self.reqs[r.req_id] = r
        rows = self.rows.get(r.req_id)
        if rows is None:
            return
        limit = len(r.tokens) - 1 if self._include_output(r) else len(r.prompt_ids)
        f = f.reshape(f.shape[0], len(self.ids), self.hidden).clone()  # host rows, kept
        for j in range(min(f.shape[0], limit - start)):
            rows[start + j] = f[j]

    def _params(self, r) -> dict:
        extra = r.params.extra_args or {}
        return dict(extra.get("kv_transfer_params") or {})

    def _include_output(self, r) -> bool:
        return bool(self._params(r).get("include_output_tokens", False))

    def take_path(self, req_id: str):
        """The file a finished request's hidden states go to (None if it wrote none); the
        write may still be running until finish_call / writer.flush."""
        return self.paths.pop(req_id, None)

    def finish_call(self, outputs) -> None:
        """Wait for the files, and name them in outputs that do not carry their path yet."""
        self.writer.flush()
        for o in outputs:
            p = self.paths.pop(o.request_id, None)
            if p is not None:
                o.kv_transfer_params = {"hidden_states_path": p}


def build(ctx: BuildContext) -> ExtractHiddenStatesProposer:
    return ExtractHiddenStatesProposer(ctx.spec, ctx.kv_transfer_config, ctx.target.config,
                                       ctx.dtype)
