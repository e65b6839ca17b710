"""`npuspec bench methods`: several prompt sets in one run, one engine per method for all of
them, each set's ratios against its own no-speculation row, the JSON and the plot. The engines
run uncompiled here: the subject is the benchmark's bookkeeping, not the compiled step."""
import json

import pytest

from npuspec._counters import counters
from npuspec.bench import common as bench_common
from npuspec.bench import methods


def test_two_prompt_sets_one_engine_per_method(tmp_path, monkeypatch, capsys):
    built = []
    real = bench_common.make_llm

    def make_llm(model, spec, *a, **kw):
        built.append(spec)
        llm = real(model, spec, *a[:2], True, *a[3:], **kw)  # enforce_eager
        if spec and spec["method"] == "suffix":  # one step of each pass "fell back"
            gen = llm.generate

            def generate(*args, **kwargs):
                counters.bump("eager_fallbacks")
                return gen(*args, **kwargs)
            llm.generate = generate
        return llm
    monkeypatch.setattr(bench_common, "make_llm", make_llm)
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("def fib(n):\nimport os\n")
    b.write_text("The quick brown fox\n")
    js, png = tmp_path / "m.json", tmp_path / "m.png"
    hybrid = {"method": "eagle3", "model": "tiny-eagle3", "num_speculative_tokens": 3,
              "enable_suffix_decoding": True, "suffix_min_score": 0.0}
    argv = ["--methods", "ngram,suffix,hybrid", "--prompts", f"{a},{b}", "--max-tokens", "8",
            "--repeats", "1", "--json", str(js), "--threads", "1",
            "--spec", f"hybrid={json.dumps(hybrid)}"]
    try:
        import matplotlib  # noqa: F401
        argv += ["--plot", str(png)]
    except ImportError:
        png = None
    assert methods.main(argv) == 0
    assert len(built) == 4  # none, ngram, suffix, hybrid: each built once for both sets
    rows = json.loads(js.read_text())["rows"]
    assert [(r["prompt set"], r["method"]) for r in rows] == [
        (str(a), m) for m in ("none", "ngram", "suffix", "hybrid")] + [
        (str(b), m) for m in ("none", "ngram", "suffix", "hybrid")]
    for r in rows:
        assert r["same as none"] == r["prompts"] == (2 if r["prompt set"] == str(a) else 1)
        assert r["eager fallbacks"] == (r["method"] == "suffix"), r  # per pass, per row
        if r["method"] == "hybrid":  # suffix / model / none request-steps of the pass
            picks = [int(x) for x in r["picks"].split("/")]
            assert len(picks) == 3 and sum(picks) > 0, r
        else:
            assert r["picks"] == "-", r
        if r["method"] == "none":
            assert r["× none"] == 1.0
            assert r["draft % round"] == "-"  # nothing drafts
        else:  # n-gram and suffix draft on the host: a share of the round, not all of it
            assert 0 < r["draft % round"] < 100 and r["draft ÷ verify"] > 0
    assert "prompt sets" in capsys.readouterr().out
    if png is not None:
        assert png.stat().st_size > 1000


def test_a_set_named_twice_is_refused(tmp_path):
    from npuspec.cli_util.errors import UsageError
    p = tmp_path / "a.txt"
    p.write_text("x\n")
    with pytest.raises(UsageError, match="names a prompt set twice"):
        methods.main(["--prompts", f"{p},{p}", "--methods", "ngram"])
