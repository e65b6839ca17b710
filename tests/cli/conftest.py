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
