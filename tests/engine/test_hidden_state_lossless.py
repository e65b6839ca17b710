"""Sampling with a hidden-state drafter stays lossless: chi-square of the engine's sampled
tokens against exact target sampling, on a 16-token vocabulary. The draft probabilities are
real: softmax of a real drafter's logits at T = 1 (EAGLE-3; DFlash; DSpark, whose Markov walk
makes each slot's q depend on the slot drafted before it, with the confidence budget cutting
drafts)."""
import itertools
import os
import sys

import pytest
import torch

import npuspec.engine
from npuspec import LLM, SamplingParams
from npuspec.models.config import ModelConfig
from npuspec.models.decoder import DecoderLM
from npuspec.models.draft_loading import DraftConfig, _CLASSES, save_draft
from npuspec.models.loading import save_model

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "kernels"))
from verify_lossless import chi_square_pvalue  # noqa: E402

V, PROMPT, N = 16, [3, 1, 4, 1, 5], 4000
ALPHA = 1e-3


# eagle3-vocab: a draft vocabulary of 12 of the 16 ids (d2t), so q is 0 on the other 4
HEADS = {"eagle3": {}, "eagle3-vocab": {"draft_vocab_size": 12},
         "dflash": {"block_size": 3, "aux_layer_ids": (1, 3)},
         "dspark": {"block_size": 2, "aux_layer_ids": (1, 3), "markov_rank": 8}}


def _target(tmp_path, method="eagle3"):
    cfg = ModelConfig(vocab_size=V, hidden_size=32, num_layers=4, num_heads=2, num_kv_heads=1,
                      head_dim=16, intermediate_size=64, max_position_embeddings=64,
                      tie_word_embeddings=True, eos_token_id=None, bos_token_id=None)
    torch.manual_seed(0)
    model = DecoderLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)  # peaked enough that drafts are sometimes right
    d = tmp_path / "target"
    save_model(model, str(d))
    kind, method = method, method.split("-")[0]
    head = _CLASSES[method](DraftConfig.from_target(method, cfg, **HEADS[kind]))
    with torch.no_grad():  # a flat-ish q: drafts are accepted often, and rejected often
        for p in head.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.05)
        if kind == "eagle3-vocab":  # target ids 0..15 without 2, 5, 9, 14
            used = torch.tensor([i for i in range(V) if i not in (2, 5, 9, 14)])
            head.d2t.copy_(used - torch.arange(len(used)))
            head.init_buffers()
    save_draft(head, str(tmp_path / "head"))
    return str(d), str(tmp_path / "head"), model


def _exact(model):
    """P(y1, y2) [V*V] and P(y3) [V] of plain sampling at T = 1."""
    with torch.no_grad():
        seqs = torch.tensor([PROMPT + [a, b] for a, b in itertools.product(range(V), repeat=2)])
        p = torch.softmax(model.forward_causal(seqs).double(), -1)  # [V*V, T, V]
    n = len(PROMPT)
    p1 = p[0, n - 1]                                   # [V]
    p2 = p[:, n].reshape(V, V, V)[:, 0]                # [y1, y2]: seq (y1, 0) gives P(.|y1)
    joint = p1[:, None] * p2                           # [y1, y2]
    p3 = (joint.reshape(-1, 1) * p[:, n + 1]).sum(0)   # [V]
    return joint.reshape(-1), p3


def _assert_exact_sampling(llm, model):
    """N requests of PROMPT, 3 tokens at T = 1: drafts both accepted and rejected, and the
    tokens' joint distribution the target's own (chi-square)."""
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * N,
                        SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True))
    y = torch.tensor([list(o.outputs[0].token_ids) for o in outs])  # [N, 3]
    m = llm.metrics
    assert 0.05 < m.num_accepted / m.num_drafted < 0.95, (m.num_accepted, m.num_drafted)
    joint, p3 = _exact(model)
    pv12 = chi_square_pvalue(torch.bincount(y[:, 0] * V + y[:, 1], minlength=V * V), joint)[0]
    pv3 = chi_square_pvalue(torch.bincount(y[:, 2], minlength=V), p3)[0]
    assert pv12 > ALPHA and pv3 > ALPHA, (pv12, pv3)


# min 0 and a budget of 1 of K = 2: the B verify slots go to the highest survival values over
# all rows, so rows keep 0, 1 or 2 drafts, each a prefix
BUDGET = {"dynamic_spec_config": {"method": "dspark", "method_params": {
    "initial_verify_budget_per_req": 1, "budget_update_interval": 1, "budget_threshold": 0.4,
    "min_verify_tokens": 0}}}


def test_online_k_sampling_is_lossless(tmp_path, monkeypatch):
    """The online K controller cuts the head's drafts and their q after drafting, and changes
    K between steps: still the target's distribution."""
    monkeypatch.setattr(npuspec.engine, "DEFAULT_LOWERING", "eager")
    target_dir, head_dir, model = _target(tmp_path, "eagle3")
    llm = LLM(target_dir, speculative_config={"method": "eagle3", "model": head_dir,
                                              "num_speculative_tokens": 2,
                                              "k_controller": "online"},
              enforce_eager=True, max_model_len=16, max_num_seqs=16, seed=1)
    _assert_exact_sampling(llm, model)
    assert len(llm.metrics.steps_by_k) >= 2, llm.metrics.steps_by_k


@pytest.mark.parametrize("method", list(HEADS))
def test_sampling_is_lossless(method, tmp_path, monkeypatch):
    monkeypatch.setattr(npuspec.engine, "DEFAULT_LOWERING", "eager")
    target_dir, head_dir, model = _target(tmp_path, method)
    method = method.split("-")[0]
    llm = LLM(target_dir, speculative_config={"method": method, "model": head_dir,
                                              "num_speculative_tokens": 2},
              additional_config=BUDGET if method == "dspark" else None,
              enforce_eager=True, max_model_len=16, max_num_seqs=16, seed=1)
    _assert_exact_sampling(llm, model)


def test_hybrid_sampling_is_lossless(tmp_path, monkeypatch):
    """Suffix decoding in front of the EAGLE-3 head (suffix_min_score 0: a suffix draft is taken
    whenever the tree has one): one-hot q on suffix rows, the head's q on the others, mixed
    within each step's batch."""
    monkeypatch.setattr(npuspec.engine, "DEFAULT_LOWERING", "eager")
    target_dir, head_dir, model = _target(tmp_path, "eagle3")
    llm = LLM(target_dir, speculative_config={"method": "eagle3", "model": head_dir,
                                              "num_speculative_tokens": 2,
                                              "enable_suffix_decoding": True,
                                              "suffix_min_score": 0.0},
              enforce_eager=True, max_model_len=16, max_num_seqs=16, seed=1)
    _assert_exact_sampling(llm, model)
    picks = llm.proposer.picks
    assert min(picks["suffix"], picks["model"]) > N // 10, picks  # both drafted often
