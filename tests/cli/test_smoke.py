"""One smoke test per subcommand on tiny settings (in-process `main([...])`), the JSON schema of
`bench e2e --json`, demo output identity, and one run of the installed console script."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from npuspec.cli import BENCHES, COMMANDS, main
from npuspec.config import SpeculativeConfig

NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'


def test_help_everywhere(capsys):
    assert main(["--help"]) == 0
    assert "demo" in capsys.readouterr().out
    for cmd in list(COMMANDS) + ["bench"]:
        assert main([cmd, "--help"]) == 0, cmd
        assert "usage: npuspec " + cmd in capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(BENCHES))
def test_bench_help_dispatches(name, capsys):
    if importlib.util.find_spec(f"npuspec.bench.{name}") is None:
        pytest.skip(f"npuspec/bench/{name}.py is not in this tree yet")
    assert main(["bench", name, "--help"]) == 0
    assert "usage:" in capsys.readouterr().out


def test_cache_help(capsys):
    if importlib.util.find_spec("npuspec.cli.cache") is None:
        pytest.skip("npuspec/cli/cache.py is not in this tree yet")
    assert main(["cache", "--help"]) == 0
    assert "usage: npuspec cache" in capsys.readouterr().out


def test_generate(rand_ckpts, tmp_path, capsys):
    target, _ = rand_ckpts
    out = tmp_path / "gen.json"
    rc = main(["generate", "--model", target, "--prompt", "def add(a, b):", "--prompt", "import os",
               "--max-tokens", "8", "--speculative-config", NGRAM, "--enforce-eager", "--json", str(out)])
    assert rc == 0
    cap = capsys.readouterr()
    assert "def add(a, b):" in cap.out and "import os" in cap.out
    assert "tok/s" in cap.err
    doc = json.loads(out.read_text())
    assert [o["prompt"] for o in doc["outputs"]] == ["def add(a, b):", "import os"]
    assert all(1 <= len(o["token_ids"]) <= 8 for o in doc["outputs"])


def test_demo_identity(rand_ckpts, tmp_path, capsys):
    target, _ = rand_ckpts
    out = tmp_path / "demo.json"
    rc = main(["demo", "--model", target, "--max-tokens", "16", "--enforce-eager",
               "--speculative-config", NGRAM, "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "outputs identical: yes (4/4 prompts)" in text
    assert "speedup:" in text and "acceptance by position: 1:" in text
    doc = json.loads(out.read_text())
    assert doc["identical"] is True and len(doc["token_ids"]) == 4
    assert len(doc["acceptance_by_position"]) == 3


def test_demo_embedded_model(tiny_available, capsys):
    """The README's first command on the embedded model (eager and short, to fit the CI budget;
    the compiled run is test_demo_embedded_model_compiled, marked slow)."""
    rc = main(["demo", "--max-tokens", "8", "--no-text", "--enforce-eager"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "outputs identical: yes (4/4 prompts)" in text


@pytest.mark.parametrize("method", ["eagle3", "eagle", "medusa", "mtp", "dflash", "dspark"])
def test_demo_method_shipped_heads(method, tiny_available, capsys):
    """`npuspec demo --method M` runs the heads shipped for the embedded model, and they draft
    tokens the target accepts (trained heads: acceptance well above a random draft's ~0)."""
    rc = main(["demo", "--method", method, "--max-tokens", "24", "--no-text", "--enforce-eager"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "outputs identical: yes (4/4 prompts)" in text
    first = float(text.split("acceptance by position: 1: ")[1].split()[0])
    assert first > 0.2, text


@pytest.mark.slow
def test_demo_embedded_model_compiled(tiny_available, capsys):
    """`npuspec demo` exactly as the README runs it: compiled, captured, default settings."""
    rc = main(["demo", "--no-text"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "outputs identical: yes (4/4 prompts)" in text


E2E_ROW_KEYS = {"system": str, "method": str, "K": int, "tokens": int, "seconds": float,
                "warmup_seconds": float, "tokens_per_s": float, "vs_hf_greedy": float,
                "identical_prompts": int, "identical": bool, "identical_to_own_greedy": bool}


def check_e2e_schema(doc: dict, num_prompts: int, with_draft: bool) -> None:
    assert doc["schema"] == "npuspec.bench.e2e/1"
    for key, typ in {"command": str, "model": str, "num_speculative_tokens": int, "max_tokens": int,
                     "num_prompts": int, "repeats": int, "environment": dict, "rows": list,
                     "ratios": dict}.items():
        assert isinstance(doc[key], typ), key
    assert doc["num_prompts"] == num_prompts
    assert {"npuspec", "torch", "transformers", "python", "threads"} <= set(doc["environment"])
    for row in doc["rows"]:
        for key, typ in E2E_ROW_KEYS.items():
            assert isinstance(row[key], typ), (key, row)
        assert row["tokens_per_s"] == pytest.approx(row["tokens"] / row["seconds"])
        assert 0 <= row["identical_prompts"] <= num_prompts
        if row["system"] == "npuspec" and row["K"]:
            assert row["mean_acceptance_length"] >= 1.0
            assert len(row["acceptance_by_position"]) == row["K"]
    methods = [(r["system"], r["method"]) for r in doc["rows"]]
    want = [("hf", "greedy"), ("hf", "prompt lookup"), ("npuspec", "greedy"), ("npuspec", "ngram")]
    if with_draft:
        want += [("hf", "assisted"), ("npuspec", "draft_model")]
    assert sorted(methods) == sorted(want)
    assert doc["rows"][0]["identical"] is True  # HF greedy is the reference
    assert "npuspec ngram / HF prompt lookup" in doc["ratios"]
    assert ("npuspec draft_model / HF assisted" in doc["ratios"]) == with_draft


def test_bench_e2e_json(rand_ckpts, tmp_path, capsys):
    pytest.importorskip("transformers")
    target, draft = rand_ckpts
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps(["def add(a, b):\n    return a + b\n\ndef sub(a, b):\n",
                                   "for i in range(10):\n    print(i)\nfor j in range("]))
    out = tmp_path / "e2e.json"
    rc = main(["bench", "e2e", "--model", target, "--draft-model", draft, "--prompts", str(prompts),
               "--max-tokens", "8", "-k", "2", "--repeats", "1", "--enforce-eager", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "== bench e2e" in text and "npuspec ngram / HF prompt lookup" in text
    doc = json.loads(out.read_text())
    check_e2e_schema(doc, 2, with_draft=True)
    # greedy speculative decoding is lossless: each system's speculative rows equal its greedy
    # row (agreement across systems is reported, not asserted: fp32 kernels differ)
    assert all(r["identical_to_own_greedy"] for r in doc["rows"]), doc["rows"]


def test_plan(capsys):
    spec = ('{"method": "ngram", "num_speculative_tokens": 3, '
            '"num_speculative_tokens_per_batch_size": [[1, 4, 3], [5, 16, 1]]}')
    assert main(["plan", "--speculative-config", spec, "--max-num-seqs", "16"]) == 0
    cap = capsys.readouterr()
    assert "total graphs:" in cap.out and "warning" not in cap.out + cap.err
    assert main(["plan", "--speculative-config", spec, "--max-num-seqs", "16", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc["k"]) == {"1", "3"}
    assert all(s % 4 == 0 for s in doc["k"]["3"]["sizes"]) and all(s % 2 == 0 for s in doc["k"]["1"]["sizes"])
    assert doc["graphs"] == len(doc["k"]["1"]["sizes"]) + len(doc["k"]["3"]["sizes"])


def test_plan_warns_uncaptured(capsys):
    spec = '{"method": "ngram", "num_speculative_tokens": 3}'
    assert main(["plan", "--speculative-config", spec, "--max-num-seqs", "16", "--capture-sizes", "4,8"]) == 0
    err = capsys.readouterr().err
    assert "warning: K=3: batch sizes 3-16" in err and "run eagerly" in err


def test_tune_measured(rand_ckpts, tmp_path, capsys):
    """Measures acceptance and step latency through the engine, then writes a table."""
    target, _ = rand_ckpts
    out = tmp_path / "tune.json"
    rc = main(["tune", "--model", target, "--speculative-config", NGRAM, "--max-num-seqs", "2",
               "--max-tokens", "8", "--repeats", "1", "--enforce-eager", "--json", str(out)])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    doc = json.loads(out.read_text())
    cfg = SpeculativeConfig.from_dict(doc["speculative_config"])
    table = cfg.num_speculative_tokens_per_batch_size
    assert table[0][0] == 1 and table[-1][1] == 2
    assert len(doc["acceptance"]) == 3 and all(0 <= a <= 1 for a in doc["acceptance"])
    assert {int(t) for t in doc["latency_s"]} == {b * (k + 1) for b in (1, 2) for k in range(4)}


def test_console_script():
    exe = os.path.join(os.path.dirname(sys.executable), "npuspec")
    if not os.path.exists(exe):
        pytest.skip("the npuspec console script is not installed next to this python")
    r = subprocess.run([exe, "plan", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}',
                        "--max-num-seqs", "4"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "total graphs:" in r.stdout
    r = subprocess.run([exe, "plan", "--speculative-config", "{bad"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--speculative-config" in r.stderr and "Traceback" not in r.stderr
