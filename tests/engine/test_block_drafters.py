"""DFlash and DSpark in the engine, and the confidence budget they drive.

Drafts come from real block drafters (random weights, written by save_draft in their public
formats): whatever they draft, greedy output must equal plain decoding, the captured drafter
must draft exactly what the eager one drafts, and nothing may fall back to eager. The
confidence budget cuts drafts without changing any output and without leaving the captured
verify graphs."""
import pytest
import torch

import npuspec.engine
from npuspec import LLM, SamplingParams
from npuspec._counters import counters
from npuspec.models import load_model
from npuspec.models.draft_loading import DraftConfig, _CLASSES, save_draft

PROMPTS = ["def fib(n):\n    if n < 2:", "import os\nimport sys\n", "class Queue:\n    def",
           "for i in range(10):"]
SP = SamplingParams(temperature=0, max_tokens=24)


@pytest.fixture(autouse=True)
def _eager_lowering(monkeypatch):
    monkeypatch.setattr(npuspec.engine, "DEFAULT_LOWERING", "eager")


def _random_draft(method, tmp_path, seed=0, **over):
    cfg, _ = load_model("tiny")
    torch.manual_seed(seed)
    over = {"num_layers": 1, "aux_layer_ids": (1, 3), "block_size": 5, **over}
    module = _CLASSES[method](DraftConfig.from_target(method, cfg, **over))
    with torch.no_grad():
        for p in module.parameters():  # sharper than nn.Linear's init: drafts vary by input
            if p.dim() == 2:
                p.normal_(0, 0.1)
    out = tmp_path / method
    save_draft(module, str(out))
    return str(out)


def _llm(path, method, k, eager=False, **spec):
    return LLM("tiny", speculative_config={"method": method, "model": path,
                                           "num_speculative_tokens": k, **spec},
               enforce_eager=eager, max_model_len=256, max_num_seqs=4)


def _tokens(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def plain():
    mp = pytest.MonkeyPatch()
    mp.setattr(npuspec.engine, "DEFAULT_LOWERING", "eager")
    out = _tokens(LLM("tiny", enforce_eager=True, max_model_len=256,
                      max_num_seqs=4).generate(PROMPTS, SP))
    mp.undo()
    return out


@pytest.mark.parametrize("method,k", [("dflash", 4), ("dspark", 5)])
def test_greedy_identical_and_captured_equals_eager(method, k, tmp_path, plain):
    path = _random_draft(method, tmp_path)
    runs = {}
    for eager in (True, False):
        llm = _llm(path, method, k, eager)
        before = counters.get("eager_fallbacks", 0)
        assert _tokens(llm.generate(PROMPTS, SP)) == plain, (method, eager)
        if not eager:  # the context pass and the block replay captured graphs
            assert counters.get("eager_fallbacks", 0) == before
        m = llm.metrics
        runs[eager] = (m.num_drafted, m.num_accepted, m.num_steps)
        assert not llm.proposer.reqs
    assert len(set(runs.values())) == 1, runs  # captured drafts == eager drafts
    assert runs[False][0] > 0


@pytest.mark.parametrize("method,k,match", [
    ("dflash", 5, r"num_speculative_tokens=5: this dflash draft has block_size=5, so one block "
                  r"gives at most 4 drafts .*set num_speculative_tokens <= 4"),
    ("dspark", 6, r"num_speculative_tokens=6: this dspark draft has block_size=5, so one block "
                  r"gives at most 5 drafts .*set num_speculative_tokens <= 5"),
])
def test_k_bounded_by_block_size(method, k, match, tmp_path):
    path = _random_draft(method, tmp_path)
    with pytest.raises(ValueError, match=match):
        _llm(path, method, k, eager=True)


def test_unpadded_drafter_batch_same_drafts(tmp_path, plain):
    path = _random_draft("dflash", tmp_path)
    res = []
    for unpadded in (False, True):
        llm = _llm(path, "dflash", 4, eager=True, disable_padded_drafter_batch=unpadded)
        assert _tokens(llm.generate(PROMPTS, SP)) == plain
        res.append((llm.metrics.num_drafted, llm.metrics.num_accepted))
    assert res[0] == res[1]


def test_batch_size_k_table(tmp_path, plain):
    path = _random_draft("dspark", tmp_path)
    llm = _llm(path, "dspark", 4, num_speculative_tokens_per_batch_size=[[1, 2, 4], [3, 16, 2]])
    assert _tokens(llm.generate(PROMPTS, SP)) == plain


def _budget(method, **params):
    return {"dynamic_spec_config": {"method": method, "method_params": params}}


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_confidence_budget_cuts_drafts_not_outputs(method, tmp_path, plain):
    path = _random_draft(method, tmp_path)
    # the uncut baseline runs eagerly: captured drafts equal eager ones (test above), and only
    # its draft count is compared
    full = _llm(path, method, 4, eager=True)
    assert _tokens(full.generate(PROMPTS, SP)) == plain
    # threshold 1.0: no survival reaches it, so after the first update every request verifies
    # min_verify_tokens = 1 draft (the budget rounds 0 up to 1)
    cut = LLM("tiny", speculative_config={"method": method, "model": path,
                                          "num_speculative_tokens": 4},
              additional_config=_budget(method, initial_verify_budget_per_req=4,
                                        budget_update_interval=1, budget_threshold=1.0),
              max_model_len=256, max_num_seqs=4)
    before = counters.get("eager_fallbacks", 0)
    assert _tokens(cut.generate(PROMPTS, SP)) == plain
    assert counters.get("eager_fallbacks", 0) == before  # the verify graph stays captured
    mf, mc = full.metrics, cut.metrics
    # step 1: up to 4 drafts for each of 4 requests; then at most one per request and step
    assert mc.num_drafted <= 4 * 4 + mc.num_steps  # num_steps counts request-steps
    assert 2 * mc.num_drafted < mf.num_drafted
    assert cut.budget.budget == 1


def test_confidence_head_feeds_the_budget(tmp_path):
    """DSpark's drafts carry the sigmoid head's value, DFlash's the max softmax."""
    for method in ("dflash", "dspark"):
        llm = _llm(_random_draft(method, tmp_path), method, 4, eager=True)
        seen = []
        orig = llm.proposer.draft_requests

        def spy(*a, **kw):
            d = orig(*a, **kw)
            seen.append(d)
            return d
        llm.proposer.draft_requests = spy
        llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=6))
        d = next(x for x in seen if (x.tokens >= 0).any())
        conf = d.conf[d.tokens >= 0]
        assert ((conf > 0) & (conf <= 1)).all()
        if method == "dspark":  # a sigmoid of random weights, nowhere near a peaked softmax
            assert (conf < 0.99).all()


def test_sampled_requests_reproduce(tmp_path):
    path = _random_draft("dspark", tmp_path)
    llm = _llm(path, "dspark", 4, eager=True)
    sp = SamplingParams(temperature=0.8, max_tokens=16, seed=3)
    a = _tokens(llm.generate(PROMPTS, sp))
    assert _tokens(llm.generate(PROMPTS, sp)) == a
    assert llm.metrics.num_drafted > 0
    assert not llm.proposer.reqs


def test_enable_adaptive_verification_uses_the_budget(tmp_path, plain):
    path = _random_draft("dspark", tmp_path)
    llm = _llm(path, "dspark", 4, eager=True, enable_adaptive_verification=True)
    assert llm.budget is not None and llm.budget.cfg.method == "dspark"
    assert _tokens(llm.generate(PROMPTS, SP)) == plain
