"""Small random-initialised checkpoints (HF format, with a BPE tokenizer) for engine tests.

Random weights make greedy decoding fall into repetitive loops quickly, which is exactly what
n-gram and suffix drafting feed on, so acceptance is non-trivial even without training.
"""

import pytest
import torch

from npuspec.models.config import ModelConfig
from npuspec.models.decoder import DecoderLM
from npuspec.models.loading import save_model

TEXT = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i)\n",
        "class Queue:\n    def __init__(self):\n        self.items = []\n",
        "import os\nimport sys\n\nprint(os.getcwd(), sys.argv)\n"] * 4


def make_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXT, trainer=trainer)
    return tok


def save_checkpoint(out_dir, *, vocab_size=300, hidden=64, layers=2, heads=4, kv_heads=2,
                    seed=0, eos=None, tokenizer=None, max_pos=512):

    cfg = ModelConfig(vocab_size=vocab_size, hidden_size=hidden, num_layers=layers,
                      num_heads=heads, num_kv_heads=kv_heads, head_dim=hidden // heads,
                      intermediate_size=2 * hidden, max_position_embeddings=max_pos,
                      tie_word_embeddings=True, eos_token_id=eos, bos_token_id=None)
    torch.manual_seed(seed)
    model = DecoderLM(cfg)
    with torch.no_grad():  # std 0.1: repetitive greedy loops (good for n-gram drafting), clear argmax margins
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.1)
    return save_model(model, out_dir, tokenizer)


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory):
    """Target: 2 layers, vocab 300, no eos (never stops early), with a tokenizer."""
    tok = make_tokenizer(300)
    assert tok.get_vocab_size() == 300, tok.get_vocab_size()
    return save_checkpoint(tmp_path_factory.mktemp("target"), tokenizer=tok)


@pytest.fixture(scope="session")
def draft_ckpt(tmp_path_factory):
    """A smaller draft with the same vocabulary (1 layer, other weights)."""
    return save_checkpoint(tmp_path_factory.mktemp("draft"), hidden=32, layers=1, heads=2,
                           kv_heads=1, seed=1)


@pytest.fixture
def make_ckpt():
    return save_checkpoint


@pytest.fixture(autouse=True)
def _one_thread():
    """These models are a few hundred KB: per-op overhead dominates and a second OpenMP thread
    only adds barrier waits (several times slower on a shared 2-core runner)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
