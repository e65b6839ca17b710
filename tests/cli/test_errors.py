"""User errors: one line on stderr naming the flag/key, exit code 2, no traceback (unless --debug).
All of these fail in the pre-flight checks, before a model is loaded, so they are fast."""
import builtins
import sys

import pytest

from npuspec.cli import main

BAD_JSON = "{method: ngram}"
UNKNOWN_METHOD = '{"method": "ngarm", "num_speculative_tokens": 3}'


def _err(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("cmd", [["demo"], ["generate", "--prompt", "x"], ["tune"],
                                 ["plan", "--max-num-seqs", "4"], ["bench", "e2e"]])
def test_bad_json(cmd, config_dir, capsys):
    argv = cmd + ["--speculative-config", BAD_JSON]
    if cmd[0] != "plan":
        argv += ["--model", config_dir("m")]
    assert main(argv) == 2
    err = _err(capsys)
    assert "--speculative-config" in err and "not valid JSON" in err, err


@pytest.mark.parametrize("cmd", [["demo"], ["generate", "--prompt", "x"], ["plan"]])
def test_unknown_method(cmd, config_dir, capsys):
    argv = cmd + ["--speculative-config", UNKNOWN_METHOD]
    if cmd[0] != "plan":
        argv += ["--model", config_dir("m")]
    assert main(argv) == 2
    err = _err(capsys)
    assert "--speculative-config" in err and "method='ngarm'" in err and "did you mean 'ngram'" in err, err


def test_unknown_key_names_nearest(capsys):
    assert main(["plan", "--speculative-config",
                 '{"method": "ngram", "num_speculative_token": 3}']) == 2
    err = _err(capsys)
    assert "num_speculative_token" in err and "did you mean 'num_speculative_tokens'" in err


@pytest.mark.parametrize("cmd", [["demo"], ["generate", "--prompt", "x"], ["bench", "e2e"]])
def test_missing_model_path(cmd, tmp_path, capsys):
    assert main(cmd + ["--model", str(tmp_path / "nope")]) == 2
    err = _err(capsys)
    assert "--model" in err and "nope" in err and "not a directory" in err, err


def test_model_dir_without_config(tmp_path, capsys):
    assert main(["generate", "--prompt", "x", "--model", str(tmp_path)]) == 2
    err = _err(capsys)
    assert "--model" in err and "config.json" in err


def test_draft_with_other_vocabulary(config_dir, capsys):
    target, draft = config_dir("target", vocab_size=512), config_dir("draft", vocab_size=1000)
    spec = '{"method": "draft_model", "model": "%s", "num_speculative_tokens": 3}' % draft
    assert main(["generate", "--prompt", "x", "--model", target, "--speculative-config", spec]) == 2
    err = _err(capsys)
    assert "--speculative-config model" in err and "vocab_size=1000" in err and "vocab_size=512" in err, err


def test_missing_draft_path(config_dir, capsys):
    spec = '{"method": "draft_model", "model": "/nonexistent/draft", "num_speculative_tokens": 3}'
    assert main(["demo", "--model", config_dir("t"), "--speculative-config", spec]) == 2
    err = _err(capsys)
    assert "--speculative-config model" in err and "/nonexistent/draft" in err


def test_generate_needs_a_prompt(config_dir, capsys):
    assert main(["generate", "--model", config_dir("m")]) == 2
    assert "--prompt" in _err(capsys)


def test_argparse_errors_exit_2(capsys):
    assert main(["demo", "--max-tokens", "0"]) == 2
    assert "--max-tokens" in capsys.readouterr().err
    assert main(["frobnicate"]) == 2
    assert main(["bench", "e2e", "--max-tokens", "x"]) == 2


def test_debug_shows_the_exception(config_dir):
    with pytest.raises(ValueError, match="not valid JSON"):
        main(["--debug", "demo", "--model", config_dir("m"), "--speculative-config", BAD_JSON])
    with pytest.raises(ValueError, match="not valid JSON"):  # through the bench dispatcher too
        main(["bench", "e2e", "--debug", "--model", config_dir("m"), "--speculative-config", BAD_JSON])


def test_e2e_without_transformers(monkeypatch, config_dir, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    assert main(["bench", "e2e", "--model", config_dir("m")]) == 2
    err = _err(capsys)
    assert "transformers" in err and "pip install 'npuspec[hf]'" in err


def test_plot_without_matplotlib(monkeypatch, capsys, tmp_path):
    real_import = builtins.__import__

    def no_mpl(name, *a, **kw):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_mpl)
    assert main(["tune", "--acceptance", "0.5", "--plot", str(tmp_path / "x.png")]) == 2
    err = _err(capsys)
    assert "--plot" in err and "pip install 'npuspec[plot]'" in err


def test_internal_error_is_one_line_exit_1(monkeypatch, capsys, tmp_path):
    from npuspec.bench import tune

    def boom(*a, **kw):
        raise RuntimeError("kaboom")

    monkeypatch.setattr(tune, "tune_table", boom)
    lat = tmp_path / "lat.json"
    lat.write_text('{"1": 0.001, "8": 0.002}')
    assert main(["tune", "--acceptance", "0.5", "--latency-json", str(lat)]) == 1
    err = _err(capsys)
    assert "internal error: RuntimeError: kaboom" in err and "--debug" in err
