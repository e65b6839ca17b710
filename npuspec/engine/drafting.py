"""The engine's drafter: which proposer a speculative config builds, and one step's drafts.

Token-only proposers (ngram, suffix) return ragged lists; model drafters (draft_model) return
[B, K] tokens with draft probabilities and per-position confidences, which the confidence
budget (dynamic K) may cut.
"""
from __future__ import annotations

import os
from typing import Optional

import numpy as np
import torch

from npuspec.config import SpeculativeConfig
from npuspec.engine.request import Request
from npuspec.engine.scheduler import fill_drafts
from npuspec.runtime import dynamic_k


HIDDEN_STATE_METHODS = ("eagle", "eagle3", "mtp", "medusa", "dflash", "dspark")


def make_proposer(spec: Optional[SpeculativeConfig], dtype: torch.dtype, device, vocab_size: int,
                  max_num_seqs: int, cache_len: int, *, target=None, target_path=None,
                  num_blocks: int = 0, block_size: int = 0, kv_transfer_config=None,
                  shard: Optional[tuple[int, int]] = None):
    """The step's proposer. `shard`: (rank, world) when a draft model is sharded with the
    target (draft_tensor_parallel_size = tensor_parallel_size)."""
    s = spec
    if s is None:
        return None
    if s.method in HIDDEN_STATE_METHODS:
        return _hidden_state_proposer(s, dtype, device, target, target_path, num_blocks,
                                      block_size, shard)
    if s.method == "extract_hidden_states":
        from npuspec.runtime.extract import ExtractHiddenStatesProposer
        return ExtractHiddenStatesProposer(s, kv_transfer_config, target.config, dtype)
    if s.method == "ngram":
        from npuspec.runtime.ngram import NgramProposer
        return NgramProposer(prompt_lookup_min=s.prompt_lookup_min,
                             prompt_lookup_max=s.prompt_lookup_max)
    if s.method == "suffix":
        from npuspec.runtime.suffix import SuffixProposer
        return SuffixProposer(max_tree_depth=s.suffix_decoding_max_tree_depth,
                              max_cached_requests=s.suffix_decoding_max_cached_requests,
                              max_spec_factor=s.suffix_decoding_max_spec_factor,
                              min_token_prob=s.suffix_decoding_min_token_prob)
    from npuspec.models import load_model
    from npuspec.runtime.draft_model import DraftModelProposer
    from npuspec.models.packing import pack_model
    dcfg, dmodel = load_model(s.model, dtype=dtype, device=device)
    if dcfg.vocab_size != vocab_size:
        raise ValueError(
            f"speculative_config.model={s.model!r}: the draft model's vocab_size "
            f"({dcfg.vocab_size}) differs from the target's ({vocab_size}); "
            f"a draft model must share the target's tokenizer and vocabulary")
    if shard is not None:
        from npuspec.models.tp import check_shardable, shard_model
        check_shardable(dcfg, shard[1], "speculative_config.draft_tensor_parallel_size")
        dmodel = shard_model(dmodel, *shard)
    pack_model(dmodel)
    return DraftModelProposer(dmodel, max_num_seqs, cache_len, device=device)


# heads for the embedded model, trained by `npuspec train-draft` (their train_recipe.json
# records how), shipped in npuspec/models/tiny_drafts/
TINY_DRAFTS = {"tiny-eagle": "eagle", "tiny-eagle3": "eagle3", "tiny-medusa": "medusa",
               "tiny-dflash": "dflash", "tiny-dspark": "dspark"}


def resolve_draft(name: str) -> str:
    """speculative_config.model -> a checkpoint directory ("tiny-eagle3" etc. -> the package's)."""
    if name not in TINY_DRAFTS:
        return name
    import npuspec.models
    d = os.path.join(os.path.dirname(npuspec.models.__file__), "tiny_drafts", TINY_DRAFTS[name])
    if not os.path.isfile(os.path.join(d, "config.json")):
        raise FileNotFoundError(f"speculative_config.model={name!r}: the embedded head is missing "
                                f"from this install ({d}); reinstall npuspec, or train one with "
                                f"`npuspec train-draft --target tiny --method "
                                f"{TINY_DRAFTS[name]} --out DIR` and pass model=DIR")
    return d


def _hidden_state_proposer(s: SpeculativeConfig, dtype, device, target, target_path,
                           num_blocks: int, block_size: int, shard=None):
    from npuspec.models.draft_loading import load_draft
    from npuspec.models.packing import pack_draft
    from npuspec.runtime.eagle import EagleProposer, MedusaProposer
    path = target_path if s.method == "mtp" else resolve_draft(s.model)
    module = load_draft(s.method, path, target.config, target, dtype=dtype, device=device,
                        draft_model_config=s.draft_model_config)
    if shard is not None:  # its layers sharded like the target's (rebound to its shard later)
        from npuspec.models.tp import shard_draft
        shard_draft(module, *shard)
    pack_draft(module)  # CPU: fused, packed projections (one kernel call each for q|k|v, gate|up)
    if s.method == "medusa":
        module.check_k(s.num_speculative_tokens)
        return MedusaProposer(module)
    if s.method in ("dflash", "dspark"):
        from npuspec.runtime.dflash import BlockDraftProposer
        p = BlockDraftProposer(module, num_blocks, block_size,
                               padded=not s.disable_padded_drafter_batch)
        p.check_k(s.num_speculative_tokens)
        return p
    return EagleProposer(module, num_blocks, block_size,
                         padded=not s.disable_padded_drafter_batch)


def draft(proposer, budget: Optional[dynamic_k.ConfidenceBudget], reqs: list[Request], k: int,
          caps: list[int], random: bool):
    """-> (drafts int64 [B, K], -1 = none; draft probs [B, K, V] or None). `caps` bounds each
    request's drafts; `random`: the call has sampled requests (model drafters then sample
    with each request's temperature and return their probabilities)."""
    B = len(reqs)
    if k == 0:
        return np.full((B, 0), -1, dtype=np.int64), None
    ids = [r.req_id for r in reqs]
    if not hasattr(proposer, "draft") and not hasattr(proposer, "draft_requests"):
        # token-only drafters (ngram, suffix)
        return fill_drafts(proposer.propose(ids, caps), B, k), None
    # model drafters: tokens [B, K], draft probs and per-position confidences
    temps = np.array([r.params.temperature for r in reqs], dtype=np.float64)
    gens = [r.generator for r in reqs]
    if hasattr(proposer, "draft_requests"):  # hidden-state drafters read the requests' tables
        d = proposer.draft_requests(reqs, k, temps if random else None, gens, want_probs=random)
    else:
        d = proposer.draft(ids, k, temps if random else None, gens, want_probs=random)
    allow = np.asarray(caps, dtype=np.int64)
    if budget is not None:
        allow = np.minimum(allow, budget(d.conf))
    return dynamic_k.cut_drafts(d.tokens, allow), d.probs
