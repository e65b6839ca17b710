import json
import os

import pytest

from npuspec.models.config import ModelConfig


def write_config(path, vocab_size=512, **kw) -> str:
    """A checkpoint directory holding only config.json (enough for the CLI's pre-flight checks,
    which run before any weights are read)."""
    os.makedirs(path, exist_ok=True)
    cfg = ModelConfig(vocab_size=vocab_size, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                      head_dim=16, intermediate_size=64, eos_token_id=0, **kw)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg.to_hf_dict(), f)
    return str(path)


@pytest.fixture
def config_dir(tmp_path):
    return lambda name, **kw: write_config(tmp_path / name, **kw)


@pytest.fixture
def tiny_available():
    from npuspec.models import TINY_MODEL_DIR
    if not os.path.isfile(os.path.join(TINY_MODEL_DIR, "model.safetensors")):
        pytest.skip("the embedded tiny model has not been trained into npuspec/models/tiny yet")
    return TINY_MODEL_DIR


_TEXT = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i)\n",
         "class Queue:\n    def __init__(self):\n        self.items = []\n",
         "import os\nimport sys\n\nprint(os.getcwd(), sys.argv)\n"] * 4


def _save_random(out_dir, tok, *, vocab_size=300, hidden=64, layers=2, heads=4, kv_heads=2, seed=0):
    """A random-initialised HF checkpoint (config.json, model.safetensors, tokenizer.json)."""
    import torch

    from npuspec.models.decoder import DecoderLM
    from npuspec.models.loading import save_model

    cfg = ModelConfig(vocab_size=vocab_size, hidden_size=hidden, num_layers=layers, num_heads=heads,
                      num_kv_heads=kv_heads, head_dim=hidden // heads, intermediate_size=2 * hidden,
                      max_position_embeddings=512, tie_word_embeddings=True, eos_token_id=0)
    torch.manual_seed(seed)
    model = DecoderLM(cfg)
    with torch.no_grad():  # peaky logits: greedy falls into loops that ngram drafting catches
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    return save_model(model, out_dir, tok)


@pytest.fixture(scope="session")
def rand_ckpts(tmp_path_factory):
    """(target, draft): small random checkpoints sharing one 300-token BPE tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_TEXT, trainer=trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    root = tmp_path_factory.mktemp("cli_ckpt")
    return (_save_random(root / "target", tok),
            _save_random(root / "draft", tok, hidden=32, layers=1, heads=2, kv_heads=1, seed=1))


def _gguf_writer():
    """tests/models/test_gguf.py's write_llama_gguf (a tiny random Llama GGUF with a byte-level
    BPE vocabulary), loaded by path: the test directories are not packages."""
    import importlib.util

    pytest.importorskip("gguf")
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "test_gguf.py")
    spec = importlib.util.spec_from_file_location("_npuspec_tests_gguf_writer", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.write_llama_gguf


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """A tiny random Llama as a .gguf file (context 128, 321-token vocabulary)."""
    path = tmp_path_factory.mktemp("cli_gguf") / "tiny-llama.Q8_0.gguf"
    _gguf_writer()(path)
    return str(path)
