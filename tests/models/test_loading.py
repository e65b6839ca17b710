"""Config parsing, checkpoint loading errors, cache shapes and torch.compile-ability of the step."""
import json

import pytest
import torch

from npuspec.models import KVCache, ModelConfig, DecoderLM, load_model, load_tokenizer
from npuspec.models.loading import hf_to_npuspec, npuspec_to_hf

HF_CFG = {"model_type": "llama", "vocab_size": 50, "hidden_size": 32, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 48,
          "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "eos_token_id": [3, 4], "bos_token_id": 1,
          "rope_parameters": {"rope_type": "default", "rope_theta": 1234.0}}


def small_model(seed=0, **over):
    torch.manual_seed(seed)
    cfg = ModelConfig.from_hf_dict({**HF_CFG, **over})
    model = DecoderLM(cfg)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return cfg, model.eval().requires_grad_(False)


def save_checkpoint(path, cfg_dict, model):
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg_dict))
    save_file({k: v.contiguous() for k, v in npuspec_to_hf(model.state_dict(), model.config).items()},
              str(path / "model.safetensors"))


def test_config_from_hf_dict():
    cfg = ModelConfig.from_hf_dict(HF_CFG)
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.rope_theta, cfg.eos_token_ids) == (8, 2, 1234.0, (3, 4))
    # older checkpoints: top-level rope_theta, no rope_parameters
    old = {k: v for k, v in HF_CFG.items() if k != "rope_parameters"}
    assert ModelConfig.from_hf_dict({**old, "rope_theta": 99.0, "rope_scaling": None}).rope_theta == 99.0
    q3 = ModelConfig.from_hf_dict({**HF_CFG, "model_type": "qwen3"})
    assert q3.qk_norm and q3.head_dim == 128  # Qwen3Config's default head_dim
    q2 = ModelConfig.from_hf_dict({**HF_CFG, "model_type": "qwen2"})
    assert q2.attention_bias and not q2.o_bias
    assert ModelConfig.from_hf_dict({**HF_CFG, "eos_token_id": None}).eos_token_ids == ()


@pytest.mark.parametrize("over, key", [
    ({"model_type": "gpt2"}, "model_type"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope_type"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_scaling"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"vocab_size": None}, "vocab_size"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    # issue 34, item 5: these ended in torch's "Dimension size must be non-negative" and kin
    ({"num_hidden_layers": -1}, "num_hidden_layers=-1 must be a positive integer"),
    ({"hidden_size": 0}, "hidden_size=0"),
    ({"intermediate_size": 2.5}, "intermediate_size=2.5"),
    ({"num_key_value_heads": -2}, "num_key_value_heads=-2"),
    ({"head_dim": 7}, "head_dim=7 must be even"),
    ({"vocab_size": True}, "vocab_size=True"),
    ({"max_position_embeddings": 0}, "max_position_embeddings=0"),
    ({"rms_norm_eps": -1.0}, "rms_norm_eps=-1.0"),
    ({"rope_theta": 0, "rope_parameters": None}, "rope_theta=0"),
])
def test_config_errors_name_the_key(over, key):
    with pytest.raises(ValueError, match=key):
        ModelConfig.from_hf_dict({**HF_CFG, **over})


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_model(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(HF_CFG))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(str(tmp_path))
    assert load_tokenizer(str(tmp_path)) is None


def test_load_mismatched_weights(tmp_path):
    cfg, model = small_model()
    save_checkpoint(tmp_path / "a", {**HF_CFG, "intermediate_size": 64}, model)
    with pytest.raises(ValueError, match="intermediate|shape"):
        load_model(str(tmp_path / "a"))
    save_checkpoint(tmp_path / "b", {**HF_CFG, "attention_bias": True}, model)
    with pytest.raises(ValueError, match="missing"):
        load_model(str(tmp_path / "b"))


def test_roundtrip_and_sharded_load(tmp_path):
    from safetensors.torch import save_file

    cfg, model = small_model()
    hf = npuspec_to_hf(model.state_dict(), cfg)
    assert "model.layers.1.self_attn.k_proj.weight" in hf and "lm_head.weight" in hf
    names = sorted(hf)
    tmp_path.joinpath("config.json").write_text(json.dumps(HF_CFG))
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2:])):  # two shards
        save_file({k: hf[k].contiguous() for k in part}, str(tmp_path / f"model-0000{i + 1}-of-00002.safetensors"))
    _, loaded = load_model(str(tmp_path))
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    assert set(hf_to_npuspec(hf, cfg)) == set(model.state_dict()) - {"inv_freq"}


def test_dtype_and_cache_shapes(tmp_path):
    cfg, model = small_model()
    save_checkpoint(tmp_path, HF_CFG, model)
    _, m16 = load_model(str(tmp_path), dtype=torch.bfloat16)
    assert m16.embed.weight.dtype == torch.bfloat16 and m16.inv_freq.dtype == torch.float32
    cache = m16.allocate_cache(3, 16)
    assert isinstance(cache, KVCache) and cache.k.shape == (2, 3, 2, 16, 8) and cache.k.dtype == torch.bfloat16
    assert (cache.num_slots, cache.max_len) == (3, 16)
    out = m16(torch.tensor([[1, 2]]), torch.tensor([[0, 1]]), torch.tensor([0]), cache)
    assert out.dtype == torch.float32 and out.shape == (1, 2, 50)


def test_cache_is_only_written_at_slot_and_position():
    _, model = small_model()
    cache = model.allocate_cache(3, 10)
    model(torch.tensor([[5, 6], [7, 8]]), torch.tensor([[3, 4], [0, 1]]), torch.tensor([2, 0]), cache)
    written = cache.k.abs().sum(dim=(0, 2, 4)) != 0  # [S, M]
    expect = torch.zeros(3, 10, dtype=torch.bool)
    expect[2, 3:5] = True
    expect[0, 0:2] = True
    assert torch.equal(written, expect)


def test_slot_cache_left_padding_writes_scratch_and_matches_unpadded():
    """Left padding (position -1) writes the pool's scratch block only; real tokens get the
    logits of an unpadded call (the draft_model drafter's batched catch-up relies on it)."""
    _, model = small_model()
    a, b = model.allocate_cache(2, 12), model.allocate_cache(2, 12)
    out = model(torch.tensor([[5, 6, 7], [0, 0, 9]]), torch.tensor([[0, 1, 2], [-1, -1, 0]]),
                torch.tensor([0, 1]), a)  # [2, 3, V]
    ref0 = model(torch.tensor([[5, 6, 7]]), torch.tensor([[0, 1, 2]]), torch.tensor([0]), b)
    ref1 = model(torch.tensor([[9]]), torch.tensor([[0]]), torch.tensor([1]), b)
    torch.testing.assert_close(out[0], ref0[0])
    torch.testing.assert_close(out[1, -1], ref1[0, -1])
    torch.testing.assert_close(a.k, b.k)  # the slots hold the same K/V
    torch.testing.assert_close(a.v, b.v)
    bs = a.pool.block_size
    assert a.pool.k[:, :bs].abs().sum() > 0 and b.pool.k[:, :bs].abs().sum() == 0


def test_compiled_step_matches_eager():
    """The step traces as one graph (fullgraph) and writes the cache the same way as eager."""
    _, model = small_model()
    ids = torch.tensor([[1, 2, 3], [4, 5, 6], [0, 0, 0]])
    pos = torch.tensor([[4, 5, 6], [0, 1, 2], [0, 1, 2]])
    slots = torch.tensor([1, 0, 2])
    ca, cb = model.allocate_cache(3, 12), model.allocate_cache(3, 12)
    for c in (ca, cb):  # stale garbage everywhere: the mask must hide it
        c.k.normal_(generator=torch.Generator().manual_seed(3))
        c.v.normal_(generator=torch.Generator().manual_seed(4))
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    ref = model(ids, pos, slots, ca)
    out = compiled(ids, pos, slots, cb)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(cb.k, ca.k)
    torch.testing.assert_close(cb.v, ca.v)


@pytest.mark.slow
def test_inductor_step_updates_cache_in_place():
    """With Inductor the compiled step matches eager and mutates the caller's cache tensor."""
    _, model = small_model()
    ids, pos, slots = torch.tensor([[1, 2]]), torch.tensor([[7, 8]]), torch.tensor([1])
    ca, cb = model.allocate_cache(2, 12), model.allocate_cache(2, 12)
    ptr = cb.k.data_ptr()
    out = torch.compile(model, fullgraph=True)(ids, pos, slots, cb)
    torch.testing.assert_close(out, model(ids, pos, slots, ca))
    assert cb.k.data_ptr() == ptr
    torch.testing.assert_close(cb.k, ca.k)
