"""HF transformers' assisted-decoding and prompt-lookup tests, restated for npuspec.

Source: huggingface/transformers, tests/generation/test_utils.py. Ported cases:
  GenerationTesterMixin.test_prompt_lookup_decoding_matches_greedy_search,
  test_assisted_decoding_matches_greedy_search (both assistants: the model itself, where every
  candidate is accepted, and a randomly initialised one, where nearly none is),
  test_assisted_decoding_sample, test_prompt_lookup_decoding_stops_at_eos;
  UtilsFunctionsTest.test_speculative_sampling.
(tests/generation/test_candidate_generator.py covers the universal assisted generation across
vocabularies and HF's own DFlash generator: nothing in npuspec corresponds.)

HF checks its generate() modes against its own greedy search on tiny random models. Here the
embedded model ("tiny") runs both in HF (loaded with the bench's `load_hf`, the same
`AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR)` as tests/graphs/test_hf_generate.py, and
driven by the bench's `hf_runner`) and in npuspec's engine: prompt lookup maps to
`method="ngram"` (HF's `max_matching_ngram_size` default 2 = `prompt_lookup_max`, minimum 1),
assisted generation to `method="draft_model"`, and `_speculative_sampling` to
`npuspec.kernels.rejection_sample` with draft probabilities.
"""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from npuspec import LLM, SamplingParams  # noqa: E402
from npuspec.bench.e2e import encode, hf_runner, load_hf  # noqa: E402
from npuspec.kernels import rejection_sample  # noqa: E402
from npuspec.models import TINY_MODEL_DIR  # noqa: E402
from npuspec.models.config import ModelConfig  # noqa: E402
from npuspec.models.decoder import DecoderLM  # noqa: E402
from npuspec.models.loading import save_model  # noqa: E402
from npuspec.runtime import NgramProposer  # noqa: E402

EOS = 0  # the embedded model's eos_token_id
PROMPTS = ["def __init__(self", "for i in range(", "class Queue:\n    def put(self, item):\n",
           "import os\n"]  # the last one loops ("import sys" again and again): lookups hit
MAX_NEW = 12


@pytest.fixture(scope="module")
def prompt_ids():
    return encode(TINY_MODEL_DIR, PROMPTS)


@pytest.fixture(scope="module")
def hf_model():
    return load_hf(TINY_MODEL_DIR)


def hf_generate(model, prompt_ids, **gen_kwargs):
    """HF generate() one prompt at a time, each output cut after its first eos."""
    setup = hf_runner(lambda: model, prompt_ids, MAX_NEW, [EOS], **gen_kwargs)
    return setup()()["token_ids"]


@pytest.fixture(scope="module")
def hf_greedy(hf_model, prompt_ids):
    return hf_generate(hf_model, prompt_ids)


def npuspec_generate(prompt_ids, spec=None, sp=None):
    llm = LLM("tiny", enforce_eager=True, max_model_len=128, max_num_seqs=4,
              speculative_config=spec)
    sp = sp or SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    out = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], sp)
    return [o.outputs[0].token_ids for o in out], llm.metrics


@pytest.fixture(scope="module")
def random_draft_dir(tmp_path_factory):
    """A randomly initialised draft with the embedded model's vocabulary (HF's "random"
    assistant): one small layer, weights N(0, 0.1)."""
    cfg = ModelConfig(vocab_size=1024, hidden_size=32, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=16, intermediate_size=64,
                      max_position_embeddings=2048, tie_word_embeddings=True,
                      eos_token_id=EOS, bos_token_id=None)
    g = torch.Generator().manual_seed(0)
    with torch.random.fork_rng():  # the default init draws leave the global generator alone
        model = DecoderLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:  # every matrix is redrawn; the norms' ones are deterministic
                p.normal_(0, 0.1, generator=g)
    return save_model(model, str(tmp_path_factory.mktemp("random_draft")))


def test_npuspec_greedy_matches_hf_greedy(hf_greedy, prompt_ids):
    # the common ground of the tests below: both systems decode the same tokens
    ours, _ = npuspec_generate(prompt_ids)
    assert ours == hf_greedy
    assert all(len(t) > 1 for t in ours)


def test_prompt_lookup_decoding_matches_greedy_search(hf_model, hf_greedy, prompt_ids):
    # HF: prompt lookup offering 2 tokens gives greedy's output
    assert hf_generate(hf_model, prompt_ids, prompt_lookup_num_tokens=2) == hf_greedy
    # npuspec: n-gram drafting with K = 2 and HF's n range gives the same tokens
    ours, m = npuspec_generate(prompt_ids, {"method": "ngram", "num_speculative_tokens": 2,
                                            "prompt_lookup_min": 1, "prompt_lookup_max": 2})
    assert ours == hf_greedy
    assert m.num_accepted > 0


@pytest.mark.parametrize("assistant_type", ["same", "random"])
def test_assisted_decoding_matches_greedy_search(hf_model, hf_greedy, prompt_ids,
                                                 random_draft_dir, assistant_type):
    draft_dir = TINY_MODEL_DIR if assistant_type == "same" else random_draft_dir
    # HF: the assistant drafts 2 tokens per call (constant schedule)
    assistant = hf_model if assistant_type == "same" else load_hf(draft_dir)
    gc = assistant.generation_config
    saved = gc.num_assistant_tokens, gc.num_assistant_tokens_schedule
    gc.num_assistant_tokens, gc.num_assistant_tokens_schedule = 2, "constant"
    try:
        assert hf_generate(hf_model, prompt_ids, assistant_model=lambda: assistant) == hf_greedy
    finally:
        gc.num_assistant_tokens, gc.num_assistant_tokens_schedule = saved
    # npuspec: a draft model proposing K = 2
    ours, m = npuspec_generate(prompt_ids, {"method": "draft_model", "model": draft_dir,
                                            "num_speculative_tokens": 2})
    assert ours == hf_greedy
    assert m.num_drafted > 0
    if assistant_type == "same":
        assert m.num_accepted == m.num_drafted  # the model drafting for itself: all accepted
    else:
        assert m.num_accepted < m.num_drafted  # rejections happened, and changed nothing


def test_assisted_decoding_sample(prompt_ids):
    # HF only checks the output's shape: sampling with an assistant does not reproduce plain
    # sampling's draws. Here: the length, the vocabulary, and that a seed repeats the tokens.
    sp = SamplingParams(temperature=1.0, max_tokens=MAX_NEW, seed=3, ignore_eos=True)
    spec = {"method": "draft_model", "model": TINY_MODEL_DIR, "num_speculative_tokens": 2}
    first, m = npuspec_generate(prompt_ids, spec, sp)
    again, _ = npuspec_generate(prompt_ids, spec, sp)
    assert first == again
    assert all(len(t) == MAX_NEW and all(0 <= x < 1024 for x in t) for t in first)
    assert m.num_drafted > 0


def _stops_at_eos_context():
    """HF's input: 10 ids from [1, 50), the unmatched id 51 at position 3 and at the end, and the
    eos right after the first 51, so a 1-gram lookup of the final 51 lands on the eos."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 50, (10,), generator=g)
    ids[3], ids[-1], ids[4] = 51, 51, EOS
    return ids.tolist()


def test_prompt_lookup_decoding_stops_at_eos():
    ctx = _stops_at_eos_context()
    # HF's candidate generator refuses a candidate run that contains the eos: no new tokens
    hf_gen = transformers.generation.candidate_generator.PromptLookupCandidateGenerator(
        eos_token_id=torch.tensor([EOS]), num_output_tokens=4, max_matching_ngram_size=1)
    candidates, _ = hf_gen.get_candidates(torch.tensor([ctx]))
    assert candidates.shape[-1] == len(ctx)
    # npuspec's proposer knows no eos and copies what followed the match, eos included
    # (docs/proposers.md, "Differences from vLLM's / HF's tests"); the engine's stop rule is
    # what ends the output there (next test)
    p = NgramProposer(prompt_lookup_min=1, prompt_lookup_max=1)
    p.start_request("r", ctx)
    assert p.propose(["r"], 4) == [[EOS] + ctx[5:8]]


def test_stop_token_inside_an_accepted_draft_ends_the_output():
    # HF's concern end to end: when drafts that run past a stop token are accepted, the user
    # must get the output up to that token and nothing after it
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3}
    llm = LLM("tiny", enforce_eager=True, max_model_len=128, max_num_seqs=2,
              speculative_config=spec)
    prompt = "import sys\nimport os\nimport re\nimport sys\nimport os\nimport re\nimport"
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm.add_request(llm.new_request(prompt, sp, request_id="free"))
    steps = []
    while llm.has_unfinished_requests():
        steps += [o.new_token_ids for o in llm.step()]
    output = [t for s in steps for t in s]
    # a token that first appears before the end of a multi-token step: drafts after it were
    # accepted in the same verify step
    seen, stop = set(), None
    for s in steps:
        for i, t in enumerate(s):
            if stop is None and t not in seen and i < len(s) - 1:
                stop = t
            seen.add(t)
    assert stop is not None, steps
    want = output[:output.index(stop) + 1]
    stopped = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                             stop_token_ids=[stop])
    got = llm.generate([prompt], stopped)[0].outputs[0]
    assert got.token_ids == want
    assert got.finish_reason == "stop"
    plain = LLM("tiny", enforce_eager=True, max_model_len=128, max_num_seqs=2)
    assert plain.generate([prompt], stopped)[0].outputs[0].token_ids == want


def test_speculative_sampling():
    # HF's case: V = 10, three candidates 1, 4, 5 drafted with near-certainty; the target
    # agrees on 1 and 4, gives 5 no mass at all (-inf except 8), and its last row is unused
    cand_logits = torch.full((1, 3, 10), -10.0)
    cand_logits[0, 0, 1] = cand_logits[0, 1, 4] = cand_logits[0, 2, 5] = 10.0
    new_logits = torch.full((1, 4, 10), -10.0)
    new_logits[0, 0, 1] = new_logits[0, 1, 4] = 10.0
    new_logits[0, 2] = float("-inf")
    new_logits[0, 2, 8] = 10.0
    drafts = torch.tensor([[1, 4, 5]])
    tokens, num = rejection_sample(new_logits, drafts, torch.softmax(cand_logits, -1),
                                   temperature=torch.ones(1))
    # two matches, then 8 (the residual's only token)
    assert tokens.tolist() == [[1, 4, 8, -1]]
    assert num.tolist() == [3]
    # HF's own function on the same inputs agrees
    from transformers.generation.utils import _speculative_sampling
    cand_ids = torch.tensor([[8, 0, 3, 9, 8, 1, 4, 5]])  # a 5-token prompt + the candidates
    valid, n_matches = _speculative_sampling(cand_ids, cand_logits, 3, new_logits)
    assert int(n_matches) == 2
    assert valid[0].tolist() == tokens[0, :3].tolist()
