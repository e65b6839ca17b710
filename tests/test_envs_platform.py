"""npuspec.envs parses each NPUSPEC_* variable; npuspec.platform detects the device."""
import subprocess
import sys

import pytest

from npuspec import envs, platform


@pytest.mark.parametrize("value,expected", [("4,8,16,32", [4, 8, 16, 32]), ("5", [5]),
                                            (" 3 , 6 ", [3, 6])])
def test_capture_sizes_good(monkeypatch, value, expected):
    monkeypatch.setenv("NPUSPEC_CAPTURE_SIZES", value)
    assert envs.capture_sizes() == expected


@pytest.mark.parametrize("value", ["4,x", "0", "-3", "", "4,,8", "1.5", " "])
def test_capture_sizes_bad_quotes_variable(monkeypatch, value):
    monkeypatch.setenv("NPUSPEC_CAPTURE_SIZES", value)
    with pytest.raises(ValueError) as e:
        envs.capture_sizes()
    assert "NPUSPEC_CAPTURE_SIZES" in str(e.value) and repr(value) in str(e.value)


def test_unset_variables(monkeypatch):
    for name in envs.VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert envs.capture_sizes() is None and envs.cache_dir() is None
    assert envs.device() is None and envs.debug_dump() is None
    assert envs.cache_trusted_group() is None and envs.debug() is False
    assert envs.cache_lock_timeout() == 600.0


def test_paths_and_device(monkeypatch, tmp_path):
    monkeypatch.setenv("NPUSPEC_CACHE_DIR", str(tmp_path))
    assert envs.cache_dir() == str(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("NPUSPEC_DEBUG_DUMP", "~/dumps")
    assert envs.debug_dump() == str(tmp_path / "dumps") and (tmp_path / "dumps").is_dir()
    for bad_name in ("NPUSPEC_CACHE_DIR", "NPUSPEC_DEBUG_DUMP"):
        monkeypatch.setenv(bad_name, "")
        with pytest.raises(ValueError, match=bad_name):
            getattr(envs, {"NPUSPEC_CACHE_DIR": "cache_dir", "NPUSPEC_DEBUG_DUMP": "debug_dump"}[bad_name])()
    monkeypatch.setenv("NPUSPEC_DEVICE", "CPU")
    assert envs.device() == "cpu"
    monkeypatch.setenv("NPUSPEC_DEVICE", "tpu")
    with pytest.raises(ValueError, match="NPUSPEC_DEVICE='tpu'"):
        envs.device()


def test_debug_dump_that_cannot_be_created_is_named(monkeypatch):
    """Issue 34, item 5: it ended in BackendCompilerFailed ... FileNotFoundError mid-compile."""
    import torch
    bad = "/proc/npuspec-no-such-dir/dumps"  # /proc refuses new entries, even for root
    monkeypatch.setenv("NPUSPEC_DEBUG_DUMP", bad)
    with pytest.raises(ValueError, match=r"NPUSPEC_DEBUG_DUMP=.*cannot create"):
        envs.debug_dump()
    torch._dynamo.reset()
    f = torch.compile(lambda x: x.argmax(-1), backend="npuspec", options={"lowering": "eager"})
    with pytest.raises(ValueError, match="NPUSPEC_DEBUG_DUMP") as e:
        f(torch.randn(2, 3))
    assert type(e.value).__name__ == "BackendUserError"


def test_bool_and_float_vars(monkeypatch):
    monkeypatch.setenv("NPUSPEC_DEBUG", "yes")
    assert envs.debug() is True
    monkeypatch.setenv("NPUSPEC_DEBUG", "maybe")
    with pytest.raises(ValueError, match="NPUSPEC_DEBUG='maybe'"):
        envs.debug()
    monkeypatch.setenv("NPUSPEC_CACHE_LOCK_TIMEOUT", "2.5")
    assert envs.cache_lock_timeout() == 2.5
    monkeypatch.setenv("NPUSPEC_CACHE_LOCK_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="NPUSPEC_CACHE_LOCK_TIMEOUT='soon'"):
        envs.cache_lock_timeout()
    monkeypatch.setenv("NPUSPEC_CACHE_TRUSTED_GROUP", "")
    with pytest.raises(ValueError, match="NPUSPEC_CACHE_TRUSTED_GROUP"):
        envs.cache_trusted_group()


def test_envs_is_the_only_reader_of_npuspec_variables():
    import pathlib
    import re
    root = pathlib.Path(__file__).resolve().parents[1]
    offenders = []
    for d in ("npuspec", "passes", "kernels", "graphs"):
        for f in (root / d).rglob("*.py"):
            if f.name == "envs.py":
                continue
            text = f.read_text()
            if re.search(r"(os\.environ|os\.getenv)[^\n]*NPUSPEC_", text):
                offenders.append(str(f.relative_to(root)))
    assert not offenders, offenders


def test_cpu_platform(monkeypatch):
    monkeypatch.setenv("NPUSPEC_DEVICE", "cpu")
    p = platform.detect()
    assert (p.device, p.graph_runner) == ("cpu", "cpu")
    assert p.max_tokens_per_request == float("inf")
    p.check_tokens_per_request(100)


def test_forced_missing_devices_are_clear_errors(monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("NPUSPEC_DEVICE", "cuda")
    with pytest.raises(RuntimeError, match="NPUSPEC_DEVICE=cuda"):
        platform.detect()
    monkeypatch.setenv("NPUSPEC_DEVICE", "npu")
    with pytest.raises(RuntimeError, match="NPUSPEC_DEVICE=npu"):
        platform.detect()


def test_npu_limit_names_the_operator_limit():
    p = platform.Platform("npu", "acl", True, platform.NPU_MAX_TOKENS_PER_REQUEST)
    p.check_tokens_per_request(15)
    with pytest.raises(ValueError, match="K\\+1=17 exceeds the npu limit of 16"):
        p.check_tokens_per_request(16)


def test_broken_torch_npu_means_no_npu(tmp_path):
    # A torch_npu that raises on import (as it does without CANN) must not break detection.
    (tmp_path / "torch_npu").mkdir()
    (tmp_path / "torch_npu" / "__init__.py").write_text(
        "raise OSError('libhccl.so: cannot open shared object file')\n")
    code = ("from npuspec import platform; p = platform.detect(); "
            "assert p.device in ('cpu', 'cuda'), p; print(p.device)")
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    # torch_npu is only imported while probing for an NPU, never by importing npuspec.
    code = "import sys, npuspec, npuspec.kernels, npuspec.graphs, npuspec.passes; " \
           "assert 'torch_npu' not in sys.modules"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
