"""HF transformers' generate() with the forward compiled by the npuspec backend (issue 13,
point 1): prompt lookup, assisted generation with a draft model, and the static cache give
eager's tokens. The embedded checkpoint loads with AutoModelForCausalLM.

The eager lowering keeps CI's compile time down; the Inductor lowering is what
`npuspec bench hf` measures (docs/graphs.md, "HF transformers").
"""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from npuspec import counters  # noqa: E402
from npuspec.models import TINY_MODEL_DIR  # noqa: E402

PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n"


def _load():
    """The checkpoint's first layer only: Dynamo and AOT autograd trace HF's forward once per
    recompile (six graphs for prompt lookup), in time proportional to the layers, and the
    depth proves nothing about generate()'s modes (4 layers: ~70 s on two cores, 1: ~25 s)."""
    transformers.logging.set_verbosity_error()
    m = transformers.AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR, dtype=torch.float32,
                                                          num_hidden_layers=1)
    assert len(m.model.layers) == 1
    return m.eval()


def test_generate_modes_equal_eager(fresh_dynamo):
    # HF's forward is one code object for every model: allow its recompiles (cache lengths,
    # candidate lengths), as a user compiling it would. config.patch, not monkeypatch, whose
    # undo deletes the key from Dynamo's config module for every later test
    with torch._dynamo.config.patch(recompile_limit=64):
        _generate_modes_equal_eager()


def _generate_modes_equal_eager():
    tok = transformers.AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    m, draft = _load(), _load()
    modes = {"prompt_lookup": {"prompt_lookup_num_tokens": 4},
             "static_cache": {"cache_implementation": "static"},
             "assisted": {"assistant_model": draft}}
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    want = {k: m.generate(ids, **kw, **extra) for k, extra in modes.items()}
    fallbacks = counters["eager_fallbacks"]
    m.forward = torch.compile(m.forward, backend="npuspec", options={"lowering": "eager"})
    for k, extra in modes.items():
        for _ in range(2):  # compile, then warm
            assert torch.equal(m.generate(ids, **kw, **extra), want[k]), k
    assert counters["eager_fallbacks"] == fallbacks
