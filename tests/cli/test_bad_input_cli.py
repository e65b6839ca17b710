"""Bad input to the CLI and the NPUSPEC_* variables, by class (issue 16): the CLI answers a user
error with one line naming the value and the fix and exit status 2; a bad variable is refused
at the first entry point that reads it (`LLM`, the backend, the cache commands), with its name,
its value and the fix, and reaches torch.compile's caller as itself, not wrapped by Dynamo."""
import grp

import pytest
import torch

from npuspec import envs
from npuspec.cli import main


def _err_line(capsys) -> str:
    """The one error line of a user error (exit 2): no traceback, no 'internal error'."""
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and "internal error" not in err, err
    lines = [ln for ln in err.splitlines() if "error" in ln]
    assert len(lines) == 1, err
    return lines[0]


def _no_such_group() -> str:
    name = "npuspec-no-such-group"
    with pytest.raises(KeyError):
        grp.getgrnam(name)
    return name


# ---- the variables, parsed by npuspec.envs ------------------------------------------------

BAD_ENV = [  # (variable, value, what the message says): each names the variable and value too
    ("NPUSPEC_CACHE_LOCK_TIMEOUT", "inf", "finite number of seconds"),
    ("NPUSPEC_CACHE_LOCK_TIMEOUT", "nan", "finite number of seconds"),
    ("NPUSPEC_CACHE_LOCK_TIMEOUT", "-1", "finite number of seconds"),
    ("NPUSPEC_CACHE_LOCK_TIMEOUT", "1e400", "such as '86400'"),
    ("NPUSPEC_CACHE_LOCK_TIMEOUT", "soon", "number of seconds such as '600'"),
    ("NPUSPEC_CACHE_TRUSTED_GROUP", "99999999999999999999", "gid must be an integer"),
    ("NPUSPEC_CACHE_TRUSTED_GROUP", "-5", "gid must be an integer"),
    ("NPUSPEC_CACHE_TRUSTED_GROUP", None, "no such group"),  # None: _no_such_group()
    ("NPUSPEC_CACHE_DIR", "/etc/passwd", "is not a directory"),
    ("NPUSPEC_CACHE_DIR", "/etc/passwd/cache", "lies under /etc/passwd"),
    ("NPUSPEC_CACHE_DIR", "", "empty path"),
    ("NPUSPEC_DEVICE", "tpu", "must be one of npu, cuda, cpu"),
    ("NPUSPEC_CAPTURE_SIZES", "4,x", "is not an integer"),
    ("NPUSPEC_DEBUG", "maybe", "expected 1/0"),
    ("NPUSPEC_CPU_AMX", "tiles", "expected 1/0"),
]
ENV_IDS = [f"{n}={v}" for n, v, _ in BAD_ENV]


def _set(monkeypatch, name, value) -> str:
    value = _no_such_group() if value is None else value
    monkeypatch.setenv(name, value)
    return value


@pytest.mark.parametrize("name,value,what", BAD_ENV, ids=ENV_IDS)
def test_bad_variable_named_with_fix(monkeypatch, name, value, what):
    value = _set(monkeypatch, name, value)
    with pytest.raises(envs.EnvError) as ei:
        envs.check_all()
    msg = str(ei.value)
    assert f"{name}={value!r}" in msg and what in msg, msg
    assert "unset" in msg or "set it" in msg or "use" in msg, msg  # the fix


@pytest.mark.parametrize("name,value,want", [
    ("NPUSPEC_CACHE_LOCK_TIMEOUT", "0", 0.0), ("NPUSPEC_CACHE_LOCK_TIMEOUT", "86400", 86400.0),
    ("NPUSPEC_CACHE_TRUSTED_GROUP", "0", "0"), ("NPUSPEC_CACHE_TRUSTED_GROUP", "+0", "0"),
    ("NPUSPEC_CPU_AMX", "0", False), ("NPUSPEC_CPU_AMX", "on", True),
])
def test_good_variables_accepted(monkeypatch, name, value, want):
    monkeypatch.setenv(name, value)
    envs.check_all()
    assert envs.VARIABLES[name]() == want


def test_cache_dir_that_does_not_exist_yet_is_accepted(monkeypatch, tmp_path):
    monkeypatch.setenv("NPUSPEC_CACHE_DIR", str(tmp_path / "new" / "cache"))
    assert envs.cache_dir() == str(tmp_path / "new" / "cache")


def test_a_value_is_checked_once(monkeypatch):
    calls = []
    real = grp.getgrnam
    monkeypatch.setattr(grp, "getgrnam", lambda n: calls.append(n) or real(n))
    name = grp.getgrgid(0).gr_name
    monkeypatch.setenv("NPUSPEC_CACHE_TRUSTED_GROUP", name)
    envs._parsed.pop(("NPUSPEC_CACHE_TRUSTED_GROUP", name), None)
    for _ in range(3):
        assert envs.cache_trusted_group() == name
    assert calls == [name]


@pytest.mark.parametrize("name,value,what", BAD_ENV[:10], ids=ENV_IDS[:10])
def test_bad_variable_fails_llm_before_loading(monkeypatch, name, value, what):
    from npuspec import LLM
    import npuspec.models
    value = _set(monkeypatch, name, value)
    monkeypatch.setattr(npuspec.models, "load_model", None)  # reached: a TypeError, not ours
    with pytest.raises(envs.EnvError, match=what):
        LLM("tiny", enforce_eager=True, max_model_len=64)


@pytest.mark.parametrize("name,value,what", BAD_ENV, ids=ENV_IDS)
def test_bad_variable_through_torch_compile_is_not_wrapped(monkeypatch, name, value, what):
    from npuspec.compilation.backend import BackendUserError
    value = _set(monkeypatch, name, value)
    torch._dynamo.reset()
    f = torch.compile(lambda x: x * 2 + 1, backend="npuspec",
                      options={"lowering": "eager", "capture": False})
    with pytest.raises(ValueError) as ei:
        f(torch.ones(3))
    assert isinstance(ei.value, BackendUserError), type(ei.value)
    assert not isinstance(ei.value, torch._dynamo.exc.BackendCompilerFailed)
    assert f"{name}={value!r}" in str(ei.value) and what in str(ei.value)
    torch._dynamo.reset()


def test_bad_option_through_torch_compile_is_not_wrapped():
    torch._dynamo.reset()
    f = torch.compile(lambda x: x + 1, backend="npuspec", options={"max_num_seqs": 0})
    with pytest.raises(ValueError, match=r"options\['max_num_seqs'\]=0.*integer >= 1") as ei:
        f(torch.ones(2))
    assert not isinstance(ei.value, torch._dynamo.exc.BackendCompilerFailed)
    torch._dynamo.reset()


@pytest.mark.parametrize("options,needles", [
    ([1], ["options=[1]", "must be a dict"]),
    ({"mode": "max-autotune"}, ["options['mode']", "torch.compile(..., mode=...)"]),
    ({"cache_dir": "/etc/passwd"}, ["options['cache_dir']='/etc/passwd'", "not a directory"]),
])
def test_bad_backend_options(options, needles):
    from npuspec.compilation.backend import BackendOptions
    with pytest.raises(ValueError) as ei:
        BackendOptions.from_dict(options)
    for n in needles:
        assert n in str(ei.value), str(ei.value)


def test_bad_backend_mode():
    from npuspec.compilation.backend import BackendOptions
    with pytest.raises(ValueError, match="mode='fastest' is not a torch.compile mode.*'default'"):
        BackendOptions.from_dict({}, mode="fastest")


# ---- the CLI: one line, exit 2 ----------------------------------------------------------

@pytest.mark.parametrize("value", ["nan", "inf", "-1", "1e400", "soon"])
def test_prune_older_than_must_be_finite(tmp_path, capsys, value):
    assert main(["cache", "prune", "--older-than", value, "--dir", str(tmp_path)]) == 2
    line = _err_line(capsys)
    assert "--older-than" in line and repr(value) in line and "finite number of days" in line


def test_prune_older_than_zero_accepted(tmp_path, capsys):
    assert main(["cache", "prune", "--older-than", "0", "--dir", str(tmp_path)]) == 0
    assert "pruned 0 entries" in capsys.readouterr().out


@pytest.mark.parametrize("name,value,what", [c for c in BAD_ENV if "CACHE" in c[0]],
                         ids=[i for i, c in zip(ENV_IDS, BAD_ENV) if "CACHE" in c[0]])
def test_cache_command_with_bad_variable(monkeypatch, tmp_path, capsys, name, value, what):
    value = _set(monkeypatch, name, value)
    argv = ["cache", "ls"] + ([] if name == "NPUSPEC_CACHE_DIR" else ["--dir", str(tmp_path)])
    assert main(argv) == 2
    line = _err_line(capsys)
    assert f"{name}={value!r}" in line and what in line, line


def test_device_npu_without_npu_is_a_user_error(monkeypatch, capsys):
    from npuspec.platform import _npu_available
    if _npu_available():
        pytest.skip("an NPU is present here")
    monkeypatch.setenv("NPUSPEC_DEVICE", "npu")
    assert main(["generate", "--prompt", "x", "--max-tokens", "2", "--enforce-eager"]) == 2
    line = _err_line(capsys)
    assert "NPUSPEC_DEVICE=npu" in line and "unset NPUSPEC_DEVICE" in line, line


BAD_GENERATE = [  # (extra argv, what the line names: the flag, the value, the fix)
    (["--temperature", "nan"], ["--temperature", "'nan'", "finite"]),
    (["--top-p", "inf"], ["--top-p", "'inf'", "finite"]),
    (["--top-p", "1e-300"], ["--top-p", "top_p=1e-300", "(0, 1]"]),
    (["--seed", str(2**70), "--temperature", "1"], ["--seed", str(2**70), "2**64"]),
    (["--json", "/nonexistent/dir/out.json"], ["--json", "/nonexistent/dir", "existing"]),
    (["--max-num-seqs", str(10**9)], ["KV cache needs", "max_num_seqs (=1000000000", "fit"]),
]


@pytest.mark.parametrize("extra,needles", BAD_GENERATE, ids=[" ".join(c[0]) for c in BAD_GENERATE])
def test_bad_generate_flags(capsys, extra, needles):
    assert main(["generate", "--prompt", "x", "--max-tokens", "2", "--enforce-eager"] + extra) == 2
    line = _err_line(capsys)
    for n in needles:
        assert n in line, (n, line)


def test_plan_max_num_seqs_bounded(capsys):
    spec = '{"method": "ngram", "num_speculative_tokens": 3}'
    assert main(["plan", "--speculative-config", spec, "--max-num-seqs", str(10**9)]) == 2
    line = _err_line(capsys)
    assert "--max-num-seqs" in line and "1000000000" in line and "65536" in line, line


def test_prompts_file_not_utf8(tmp_path, capsys):
    p = tmp_path / "p.txt"
    p.write_bytes(b"\xff\xfe def f(\n")
    assert main(["generate", "--prompts", str(p), "--max-tokens", "2", "--enforce-eager"]) == 2
    line = _err_line(capsys)
    assert "--prompts" in line and str(p) in line and "UTF-8" in line, line


def test_generate_with_big_seed_in_range_accepted(capsys):
    argv = ["generate", "--prompt", "def f(", "--max-tokens", "3", "--enforce-eager",
            "--temperature", "1", "--seed", str(2**64 - 1), "--only-new"]
    assert main(argv) == 0
    first = capsys.readouterr().out
    assert main(argv) == 0
    assert capsys.readouterr().out == first  # seeded: the same text again
