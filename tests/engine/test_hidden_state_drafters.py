"""EAGLE, EAGLE-3, Medusa and MTP in the engine, and extract_hidden_states end to end.

Drafts come from real drafter modules (random weights, each public format's checkpoint
written by save_draft): whatever they draft, greedy output must equal plain decoding, the
captured drafter must draft exactly what the eager one drafts, and steady state must not fall
back to eager."""
import os
import shutil

import pytest
import torch

import npuspec.engine
from npuspec import LLM, SamplingParams
from npuspec._counters import counters
from npuspec.models import TINY_MODEL_DIR, load_model
from npuspec.models.draft_loading import DraftConfig, _CLASSES, save_draft

PROMPTS = ["def fib(n):\n    if n < 2:", "import os\nimport sys\n", "class Queue:\n    def",
           "for i in range(10):"]


@pytest.fixture(autouse=True)
def _eager_lowering(monkeypatch):
    monkeypatch.setattr(npuspec.engine, "DEFAULT_LOWERING", "eager")


def _random_draft(method, tmp_path, seed=0, **over):
    cfg, target = load_model("tiny")
    torch.manual_seed(seed)
    dc = DraftConfig.from_target(method, cfg, **over)
    module = _CLASSES[method](dc)
    with torch.no_grad():
        for p in module.parameters():  # sharper than nn.Linear's init: drafts vary by input
            if p.dim() == 2:
                p.normal_(0, 0.1)
        if method == "eagle3" and dc.draft_vocab_size < cfg.vocab_size:
            # a draft vocabulary of every (V/Vd)-th target id: draft id d is target id d*V/Vd
            step = cfg.vocab_size // dc.draft_vocab_size
            module.d2t.copy_(torch.arange(dc.draft_vocab_size) * (step - 1))
            module.init_buffers()
    if method == "mtp":
        out = tmp_path / "tiny-mtp"
        shutil.copytree(TINY_MODEL_DIR, out)
        save_draft(module, str(out))
        return str(out)
    out = tmp_path / method
    save_draft(module, str(out))
    return str(out)


def _spec(method, path, k):
    s = {"method": method, "num_speculative_tokens": k}
    if method != "mtp":
        s["model"] = path
    return s


def _tokens(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def plain():
    mp = pytest.MonkeyPatch()
    mp.setattr(npuspec.engine, "DEFAULT_LOWERING", "eager")
    llm = LLM("tiny", enforce_eager=True, max_model_len=256, max_num_seqs=4)
    out = _tokens(llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24)))
    mp.undo()
    return out


# (method, K, draft config overrides, modes): eagle3 also runs eagerly, as the oracle of the
# captured drafter (the others share its code path)
# EAGLE-3 with a draft vocabulary (d2t) of a quarter of the target's: the loop samples in it
CASES = [("eagle", 3, {}, (False,)), ("eagle3", 3, {"draft_vocab_size": 256}, (True, False)),
         ("medusa", 3, {"medusa_num_heads": 3}, (False,)), ("mtp", 2, {}, (False,))]


@pytest.mark.parametrize("method,k,over,modes", CASES, ids=[c[0] for c in CASES])
def test_greedy_identical_and_captured_equals_eager(method, k, over, modes, tmp_path, plain):
    path = _random_draft(method, tmp_path, **over)
    model = path if method == "mtp" else "tiny"
    sp = SamplingParams(temperature=0, max_tokens=24)
    runs = {}
    for eager in modes:
        llm = LLM(model, speculative_config=_spec(method, path, k), enforce_eager=eager,
                  max_model_len=256, max_num_seqs=4)
        before = counters.get("eager_fallbacks", 0)
        out = _tokens(llm.generate(PROMPTS, sp))
        assert out == plain, (method, eager)
        if not eager:  # the drafter's first pass and chain replay captured graphs
            assert counters.get("eager_fallbacks", 0) == before
        m = llm.metrics
        runs[eager] = (m.num_drafted, m.num_accepted, m.num_steps)
    assert len(set(runs.values())) == 1, runs  # captured drafts == eager drafts
    assert runs[False][0] > 0


def test_draft_vocabulary_loop_drafts_what_the_target_vocabulary_loop_does(tmp_path, plain,
                                                                           monkeypatch):
    """The draft loop samples in EAGLE-3's draft vocabulary and maps ids out; the reference
    scatters each step's logits to the target's vocabulary first (-inf off the draft
    vocabulary) and samples there: the same drafts, step for step."""
    from npuspec.models.eagle import Eagle3Draft, PagedDraft
    path = _random_draft("eagle3", tmp_path, draft_vocab_size=256)
    sp = SamplingParams(temperature=0, max_tokens=24)
    runs = []
    for reference in (False, True):
        if reference:
            for name in ("draft_logits", "draft_to_target_ids", "draft_to_target_probs"):
                monkeypatch.setattr(Eagle3Draft, name, getattr(PagedDraft, name))
            monkeypatch.setattr(Eagle3Draft, "draft_vocab_size",
                                property(lambda self: self.config.vocab_size))
        llm = LLM("tiny", speculative_config=_spec("eagle3", path, 3), enforce_eager=True,
                  max_model_len=256, max_num_seqs=4)
        assert llm.proposer.module.draft_vocab_size == (1024 if reference else 256)
        drafts, real = [], llm.proposer.draft_batch

        def record(batch):
            d = real(batch)
            drafts.append(d.tokens.tolist())
            return d
        monkeypatch.setattr(llm.proposer, "draft_batch", record)
        assert _tokens(llm.generate(PROMPTS, sp)) == plain
        runs.append(drafts)
    assert runs[0] == runs[1]  # every step's drafts, token for token
    ids = {t for step in runs[0] for row in step for t in row if t >= 0}
    assert ids and all(t % 4 == 0 for t in ids), ids  # target ids of the draft vocabulary


def test_unpadded_drafter_batch_same_drafts(tmp_path, plain):
    path = _random_draft("eagle3", tmp_path)
    sp = SamplingParams(temperature=0, max_tokens=24)
    res = []
    for unpadded in (False, True):
        spec = dict(_spec("eagle3", path, 3), disable_padded_drafter_batch=unpadded)
        llm = LLM("tiny", speculative_config=spec, enforce_eager=True, max_model_len=256,
                  max_num_seqs=4)
        assert _tokens(llm.generate(PROMPTS, sp)) == plain
        res.append((llm.metrics.num_drafted, llm.metrics.num_accepted))
    assert res[0] == res[1]


def test_batch_size_k_table(tmp_path, plain):
    path = _random_draft("eagle3", tmp_path)
    spec = dict(_spec("eagle3", path, 3),
                num_speculative_tokens_per_batch_size=[[1, 2, 3], [3, 16, 1]])
    llm = LLM("tiny", speculative_config=spec, max_model_len=256, max_num_seqs=4)
    assert _tokens(llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24))) == plain


def test_medusa_k_must_equal_heads(tmp_path):
    path = _random_draft("medusa", tmp_path, medusa_num_heads=3)
    with pytest.raises(ValueError, match="num_speculative_tokens=2.*3 heads.*=3"):
        LLM("tiny", speculative_config=_spec("medusa", path, 2), enforce_eager=True)


def test_sampled_requests_get_draft_probs(tmp_path):
    path = _random_draft("eagle3", tmp_path)
    llm = LLM("tiny", speculative_config=_spec("eagle3", path, 3), enforce_eager=True,
              max_model_len=256, max_num_seqs=4)
    sp = SamplingParams(temperature=0.8, max_tokens=16, seed=3)
    a = _tokens(llm.generate(PROMPTS, sp))
    assert _tokens(llm.generate(PROMPTS, sp)) == a  # seeded requests reproduce
    assert llm.metrics.num_drafted > 0
    assert not llm.proposer.reqs  # every request was stopped


def test_extract_hidden_states_equal_targets_own(tmp_path):
    from npuspec.spec_decode.extract_files import load_hidden_states
    ids = [1, 2, 4]
    llm = LLM("tiny", speculative_config={
        "method": "extract_hidden_states", "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": ids}}},
        kv_transfer_config={"kv_connector": "ExampleHiddenStatesConnector",
                            "kv_role": "kv_producer",
                            "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}},
        max_model_len=256, max_num_seqs=4)
    prompts = [PROMPTS[0] * 6, PROMPTS[1], "x"]  # one prompt spans several prefill chunks
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1))
    cfg, target = load_model("tiny")
    for o in outs:
        path = o.kv_transfer_params["hidden_states_path"]
        assert os.path.dirname(path) == str(tmp_path)
        t = load_hidden_states(path)
        assert t["token_ids"].tolist() == o.prompt_token_ids
        with torch.no_grad():
            _, f = target.forward_causal(torch.tensor([o.prompt_token_ids]), aux_ids=tuple(ids))
        ref = f[0].reshape(len(o.prompt_token_ids), len(ids), cfg.hidden_size)
        assert t["hidden_states"].shape == ref.shape
        torch.testing.assert_close(t["hidden_states"], ref, atol=1e-4, rtol=1e-4)
    sp = SamplingParams(temperature=0, max_tokens=5,
                        extra_args={"kv_transfer_params": {"include_output_tokens": True}})
    for o in llm.generate(prompts, sp):
        t = load_hidden_states(o.kv_transfer_params["hidden_states_path"])
        assert t["token_ids"].tolist() == (o.prompt_token_ids + list(o.outputs[0].token_ids))[:-1]


@pytest.mark.parametrize("kw,match", [
    ({"kv_transfer_config": {"kv_connector": "Nope", "kv_role": "kv_producer"}},
     "ExampleHiddenStatesConnector"),
    ({"kv_transfer_config": {"kv_connector": "ExampleHiddenStatesConnector",
                             "kv_role": "kv_consumer"}}, "kv_producer"),
    ({}, "kv_transfer_config"),
])
def test_extract_bad_input(kw, match):
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [1]}}}
    with pytest.raises(ValueError, match=match):
        LLM("tiny", speculative_config=spec, enforce_eager=True, **kw)


def test_extract_layer_id_out_of_range(tmp_path):
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [1, 9]}}}
    kv = {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
          "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}}
    with pytest.raises(ValueError, match=r"eagle_aux_hidden_state_layer_ids.*\[9\].*0\.\.4"):
        LLM("tiny", speculative_config=spec, kv_transfer_config=kv, enforce_eager=True)
