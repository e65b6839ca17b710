"""The installed package: namespace hygiene, the entry-point backend, option checks, counters."""
import logging
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

import npuspec
from npuspec import counters
from npuspec.compilation.backend import BackendOptions

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHECK_NAMESPACE = textwrap.dedent("""
    import importlib, sys
    for top in ("passes", "kernels", "graphs"):
        try:
            importlib.import_module(top)
        except ModuleNotFoundError:
            pass
        else:
            sys.exit(f"top-level module {top!r} is importable")
    import npuspec.passes, npuspec.kernels, npuspec.graphs
    print(npuspec.passes.__file__, npuspec.kernels.__file__, npuspec.graphs.__file__)
""")


def _run(code, cwd, env=None):
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_installed_namespace_of_this_environment(tmp_path):
    out = _run(CHECK_NAMESPACE, tmp_path)
    assert out.returncode == 0, out.stderr + out.stdout
    p, k, g = out.stdout.split()
    assert p.endswith(os.path.join("passes", "__init__.py"))
    assert k.endswith(os.path.join("kernels", "__init__.py"))
    assert g.endswith(os.path.join("graphs", "__init__.py"))


def test_regular_install_maps_the_same_namespace(tmp_path):
    # `pip install .` (not editable) into a private target: same names, nothing top-level.
    target = tmp_path / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                          str(target), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert pip.returncode == 0, pip.stderr[-2000:]
    assert sorted(p.name for p in target.iterdir() if p.name not in ("bin",) and not p.name.endswith(".dist-info")) == ["npuspec"]
    assert (target / "npuspec" / "passes" / "__init__.py").exists()
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = _run(CHECK_NAMESPACE, tmp_path, env)
    assert out.returncode == 0, out.stderr + out.stdout
    assert all(f.startswith(str(target)) for f in out.stdout.split()), out.stdout
    eps = (target / "npuspec-0.1.0.dist-info" / "entry_points.txt").read_text()
    assert "[torch_dynamo_backends]" in eps and "npuspec = npuspec.compilation.backend:npuspec_backend" in eps


FRESH = textwrap.dedent("""
    import sys, torch
    def step(logits, drafts):
        target = logits.argmax(-1)                        # [B, K+1]
        ok = (target[:, :-1] == drafts).int().cumprod(-1)  # [B, K]
        return ok.sum(-1), (logits.softmax(-1) * 2).sum(-1)
    g = torch.Generator().manual_seed(0)
    logits, drafts = torch.randn(3, 5, 11, generator=g), torch.randint(0, 11, (3, 4), generator=g)
    assert "npuspec" not in sys.modules
    out = torch.compile(step, backend="npuspec")(logits, drafts)
    ref = step(logits, drafts)
    assert "npuspec" in sys.modules  # loaded through the torch_dynamo_backends entry point
    assert torch.equal(out[0], ref[0]) and torch.allclose(out[1], ref[1]), (out, ref)
    print("OK")
""")


def test_fresh_process_finds_backend_by_entry_point(tmp_path):
    out = _run(FRESH, tmp_path)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
def test_results_equal_eager_and_lowering_is_logged(lowering, caplog):
    torch._dynamo.reset()

    def f(x, w):
        return torch.relu(x @ w).argmax(-1), (x * 3).sum()

    x, w = torch.randn(6, 8), torch.randn(8, 5)
    with caplog.at_level(logging.INFO, logger="npuspec.backend"):
        got = torch.compile(f, backend="npuspec", options={"lowering": lowering,
                                                          "capture": False})(x, w)
    ref = f(x, w)
    assert torch.equal(got[0], ref[0]) and torch.allclose(got[1], ref[1])
    assert f"lowered with {lowering}" in caplog.text


BAD_OPTIONS = [
    ({"lowerin": "eager"}, "lowering"),
    ({"lowering": "tvm"}, "lowering"),
    ({"lowering": "torchair"}, "torchair"),
    ({"capture": "always"}, "capture"),
    ({"capture": 1}, "capture"),
    ({"capture_sizes": [4, 0]}, "capture_sizes"),
    ({"capture_sizes": "4,8"}, "capture_sizes"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"cache_dir": 3}, "cache_dir"),
    ({"speculative_config": {"method": "ngram"}}, "num_speculative_tokens"),
]


@pytest.mark.parametrize("opts,key", BAD_OPTIONS)
def test_bad_options_are_named(opts, key):
    with pytest.raises(ValueError, match=key):
        BackendOptions.from_dict(opts)


def test_bad_option_through_torch_compile_names_it():
    torch._dynamo.reset()
    with pytest.raises(Exception, match="did you mean 'lowering'"):
        torch.compile(lambda x: x + 1, backend="npuspec", options={"lowerin": "eager"})(torch.ones(2))


def test_options_parse_speculative_config():
    o = BackendOptions.from_dict({"speculative_config": {"method": "ngram", "num_speculative_tokens": 3},
                                  "capture_sizes": [4, 8], "capture": "lazy", "max_num_seqs": 8})
    assert o.speculative_config.num_speculative_tokens == 3
    assert (o.capture_sizes, o.capture, o.max_num_seqs) == ((4, 8), "lazy", 8)


def test_counters_contract():
    counters.clear()
    for name in ("verify_patterns_matched", "graphs_captured", "graph_replays", "eager_fallbacks",
                 "cache_hits", "cache_misses", "cache_rejected"):
        assert counters[name] == 0
    before = counters.snapshot()
    counters.bump("graph_replays", 2)
    counters["cache_hits"] += 1
    assert counters.delta(before) == {"graph_replays": 2, "cache_hits": 1}
    counters.clear()
    assert counters["graph_replays"] == 0
    assert npuspec.counters is counters
