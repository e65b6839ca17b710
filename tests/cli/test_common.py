"""Argument helpers: --speculative-config parsing, prompt files, max_model_len fitting, progress."""
import io
import json

import pytest

from npuspec.cli_util import common
from npuspec.cli_util.errors import UsageError
from npuspec.cli_util.prompts import DEMO_PROMPTS, load_prompts


def test_spec_dict_inline_file_and_none(tmp_path):
    d = {"method": "ngram", "num_speculative_tokens": 3}
    assert common.spec_dict(json.dumps(d)) == d
    f = tmp_path / "spec.json"
    f.write_text(json.dumps(d))
    assert common.spec_dict(str(f)) == d
    for off in ("none", "", "null", "off"):
        assert common.spec_dict(off) is None
    with pytest.raises(UsageError, match="--speculative-config: must be a JSON object"):
        common.spec_dict("[1, 2]")


def test_spec_config_names_flag_and_key():
    with pytest.raises(UsageError) as e:
        common.spec_config('{"method": "ngram", "num_speculative_tokens": 0}')
    assert str(e.value).startswith("--speculative-config: ") and "num_speculative_tokens=0" in str(e.value)


def test_load_prompts_formats(tmp_path):
    assert load_prompts(None) == DEMO_PROMPTS
    (tmp_path / "a.txt").write_text("def f():\\n    return 1\nimport os\n\n")
    assert load_prompts(str(tmp_path / "a.txt")) == ["def f():\n    return 1", "import os"]
    (tmp_path / "b.json").write_text(json.dumps(["x = 1", "y = 2"]))
    assert load_prompts(str(tmp_path / "b.json")) == ["x = 1", "y = 2"]
    (tmp_path / "c.jsonl").write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    assert load_prompts(str(tmp_path / "c.jsonl")) == ["a", "b"]
    (tmp_path / "d.json").write_text('{"prompt": "a"}')
    with pytest.raises(UsageError, match="--prompts"):
        load_prompts(str(tmp_path / "d.json"))
    with pytest.raises(UsageError, match="--prompts: .* is not a file"):
        load_prompts(str(tmp_path / "missing.txt"))


def test_fit_max_model_len(config_dir):
    d = config_dir("m")  # max_position_embeddings 2048, no tokenizer
    assert common.fit_max_model_len(d, [[1] * 100], 50) == 192  # 100 + 50 + 16 -> 192
    assert common.fit_max_model_len(d, [[1] * 3000], 50) == 2048  # capped
    assert common.fit_max_model_len(d, ["text"], 50) is None  # no tokenizer to count with


def test_progress_only_draws_when_enabled(monkeypatch):
    buf = io.StringIO()
    monkeypatch.setattr("sys.stderr", buf)
    with common.Progress("x", 2, enabled=False) as bar:
        bar.update()
    assert buf.getvalue() == ""
    with common.Progress("demo", 2, enabled=True) as bar:
        bar.update()
    out = buf.getvalue()
    assert "\rdemo [" in out and "1/2" in out and "2/2" in out
    assert out.endswith("\n")
    assert common.Progress("y", 1).enabled is False  # stderr is not a TTY here
