"""The embedded demo model: shipped files, loadable by npuspec and HF transformers alike,
and trained (it predicts unseen Python far better than chance and continues code)."""
import json
import math
import os

import pytest
import torch

from npuspec.models import TINY_MODEL_DIR, load_model, load_tokenizer

CODE = '''class LRUCache:
    """A small least-recently-used cache."""

    def __init__(self, maxsize=128):
        self.maxsize = maxsize
        self.data = {}

    def get(self, key, default=None):
        if key not in self.data:
            return default
        value = self.data.pop(key)
        self.data[key] = value
        return value
'''


@pytest.fixture(scope="module")
def tiny():
    cfg, model = load_model("tiny")
    return cfg, model, load_tokenizer("tiny")


def greedy(model, ids, n):
    cache = model.allocate_cache(num_slots=2, max_len=len(ids) + n)
    slot = torch.tensor([1])
    logits = model(torch.tensor([ids]), torch.arange(len(ids))[None], slot, cache)
    out = []
    for _ in range(n):
        out.append(int(logits[0, -1].argmax()))
        logits = model(torch.tensor([[out[-1]]]), torch.tensor([[len(ids) + len(out) - 1]]), slot, cache)
    return out


def test_shipped_files():
    names = sorted(os.listdir(TINY_MODEL_DIR))
    for need in ("config.json", "model.safetensors", "tokenizer.json"):
        assert need in names
    total = sum(os.path.getsize(os.path.join(TINY_MODEL_DIR, n)) for n in names)
    assert total < 10 * 2**20, total
    with open(os.path.join(TINY_MODEL_DIR, "config.json")) as f:
        assert json.load(f)["model_type"] == "llama"


def test_tokenizer_roundtrip(tiny):
    cfg, _, tok = tiny
    assert tok is not None and tok.get_vocab_size() == cfg.vocab_size
    ids = tok.encode(CODE).ids
    assert tok.decode(ids) == CODE
    assert len(ids) < len(CODE) / 2  # BPE merges: well under one token per 2 characters
    assert cfg.eos_token_id == tok.token_to_id("<|endoftext|>")


def test_predicts_unseen_code(tiny):
    _, model, tok = tiny
    ids = torch.tensor([tok.encode(CODE).ids])
    logits = model.forward_causal(ids)
    nll = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]).item()
    assert nll < 0.5 * math.log(tok.get_vocab_size()), nll  # chance is log(V) = 6.9 nats


@pytest.mark.parametrize("prompt", ["def __init__(self", "    def __repr__(self):\n        return"])
def test_greedy_continuation_is_code_like(tiny, prompt):
    _, model, tok = tiny
    text = tok.decode(greedy(model, tok.encode(prompt).ids, 32))
    # attribute access on self, and a new statement on an indented line
    assert "self." in text or "self._" in text, text
    assert "\n    " in text, text


def test_transformers_loads_it_and_agrees(tiny):
    transformers = pytest.importorskip("transformers")
    cfg, model, tok = tiny
    hf = transformers.AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR, dtype=torch.float32).eval()
    ids = tok.encode(CODE).ids[:96]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits
        ours = model(torch.tensor([ids]), torch.arange(len(ids))[None], torch.tensor([0]), model.allocate_cache(1, 128))
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
        # greedy decoding through the KV cache gives HF generate's tokens
        prompt = tok.encode("import os\n").ids
        hf_out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=24,
                             pad_token_id=cfg.eos_token_id)[0, len(prompt):].tolist()
    assert len(hf_out) > 0 and greedy(model, prompt, 24)[:len(hf_out)] == hf_out  # HF stops at eos
