"""bench e2e's optional rows and flags: HF batched greedy (--max-num-seqs > 1), npuspec suffix
(--suffix), --dtype for the npuspec rows (and the weights-read bound in that dtype), and
--speculative-config from a file, including the K-per-batch-size table `npuspec tune` writes.
All on the embedded tiny model, eager, with the bandwidth stubbed (test_bench_e2e_json measures
the real one)."""
from __future__ import annotations

import json

import pytest

from npuspec.cli import main

PROMPTS = ["def add(a, b):\n    return a + b\n\ndef sub(a, b):\n",
           "for i in range(10):\n    print(i)\nfor j in range(",
           "class Queue:\n    def __init__(self):\n",
           "import os\nimport sys\n\nprint(",
           "x = [1, 2, 3]\ny = [1, 2, 3]\nz = ["]


@pytest.fixture
def prompts_file(tmp_path):
    p = tmp_path / "p.json"
    p.write_text(json.dumps(PROMPTS))
    return str(p)


@pytest.fixture
def stub_bandwidth(monkeypatch):
    import npuspec.bench.e2e as e2e

    monkeypatch.setattr(e2e, "measure_bandwidth", lambda *a, **k: 10e9)
    return e2e


def _row(doc, system, method):
    rows = [r for r in doc["rows"] if (r["system"], r["method"]) == (system, method)]
    assert len(rows) == 1, [(r["system"], r["method"]) for r in doc["rows"]]
    return rows[0]


def _run(args, tmp_path, capsys):
    out = tmp_path / "e2e.json"
    rc = main(["bench", "e2e", "--max-tokens", "8", "-k", "2", "--repeats", "1", "--enforce-eager",
               "--json", str(out)] + args)
    text = capsys.readouterr().out
    assert rc == 0, text
    return text, json.loads(out.read_text())


# ---- units ------------------------------------------------------------------------------------

def test_left_pad():
    from npuspec.bench.hf_runners import left_pad

    ids, mask = left_pad([[5, 6, 7], [8], [9, 10]], pad=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8], [0, 9, 10]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 1, 1]]


def test_spec_from_flag_reads_tune_json(tmp_path):
    """A file `npuspec tune --json` wrote ({"speculative_config": ..., "acceptance": ...}) is
    unwrapped; a bare config file and inline JSON pass through; the table validates."""
    from npuspec.bench.common import spec_from_flag
    from npuspec.cli_util import common

    cfg = {"method": "ngram", "num_speculative_tokens": 3,
           "num_speculative_tokens_per_batch_size": [[1, 1, 3], [2, 8, 1]]}
    tuned, bare = tmp_path / "tuned.json", tmp_path / "bare.json"
    tuned.write_text(json.dumps({"speculative_config": cfg, "acceptance": [0.5, 0.4, 0.3]}))
    bare.write_text(json.dumps(cfg))
    for value in (str(tuned), str(bare), json.dumps(cfg)):
        d = spec_from_flag(value)
        assert d == cfg
        sc = common.spec_config(d)
        assert sc.k_for_batch_size(1) == 3 and sc.k_for_batch_size(4) == 1
    assert spec_from_flag(None) is None and spec_from_flag("none") is None


def test_hf_batched_runner_batch_one_is_hf_greedy(tiny_available):
    """Batches of 1 have no padding, so they are plain HF greedy token for token; larger batches
    give every prompt 1..max_tokens tokens, cut at the first EOS."""
    pytest.importorskip("transformers")
    import functools

    from npuspec.bench.common import encode
    from npuspec.bench.hf_runners import hf_batched_runner, hf_runner, load_hf
    from npuspec.models.loading import read_model_config

    ids = encode(tiny_available, PROMPTS)
    eos = list(read_model_config(tiny_available).eos_token_ids)
    hf = functools.lru_cache(None)(lambda: load_hf(tiny_available))
    ref = hf_runner(hf, ids, 8, eos)()()
    one = hf_batched_runner(hf, ids, 8, eos, 1)()()
    assert one["token_ids"] == ref["token_ids"]
    three = hf_batched_runner(hf, ids, 8, eos, 3)()()
    assert len(three["token_ids"]) == len(PROMPTS)
    for out in three["token_ids"]:
        assert 1 <= len(out) <= 8
        assert not any(t in eos for t in out[:-1])
    assert three["tokens"] == sum(len(o) for o in three["token_ids"])


# ---- the CLI ----------------------------------------------------------------------------------

def test_batched_greedy_and_suffix_rows(tiny_available, prompts_file, stub_bandwidth, tmp_path, capsys):
    pytest.importorskip("transformers")
    text, doc = _run(["--prompts", prompts_file, "--max-num-seqs", "3", "--suffix"], tmp_path, capsys)
    n = len(PROMPTS)
    assert doc["max_num_seqs"] == 3 and doc["hf_batch_size"] == 3
    methods = sorted((r["system"], r["method"]) for r in doc["rows"])
    assert methods == sorted([("hf", "greedy"), ("hf", "prompt lookup"), ("hf", "batched greedy"),
                              ("npuspec", "greedy"), ("npuspec", "ngram"), ("npuspec", "suffix")])
    batched = _row(doc, "hf", "batched greedy")
    assert batched["K"] == 0 and n <= batched["tokens"] <= n * 8
    assert 0 <= batched["identical_prompts"] <= n  # reported, not asserted: padding may move fp32 logits
    assert batched["tokens_per_s"] == pytest.approx(batched["tokens"] / batched["seconds"])
    suffix = _row(doc, "npuspec", "suffix")
    assert suffix["K"] == 2 and suffix["mean_acceptance_length"] >= 1.0
    assert suffix["identical_to_own_greedy"] is True  # greedy speculation is lossless
    assert doc["npuspec_suffix_config"] == {"method": "suffix", "num_speculative_tokens": 2}
    for name in ("npuspec ngram / HF batched greedy", "npuspec greedy / HF batched greedy",
                 "npuspec suffix / HF prompt lookup"):
        assert name in doc["ratios"] and f"{name}: " in text, name
    assert "left-padded batches of up to 3 prompts" in text
    assert all(r["identical_to_own_greedy"] for r in doc["rows"]), doc["rows"]


def test_dtype_bfloat16_and_tuned_table(tiny_available, prompts_file, stub_bandwidth, tmp_path, capsys):
    """npuspec rows in bfloat16 (the bound counts 2 bytes per weight; HF stays float32), with
    the ngram row's config read from a tune --json file holding a K-per-batch-size table."""
    pytest.importorskip("transformers")
    from npuspec.models.loading import read_model_config

    cfg = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
           "num_speculative_tokens_per_batch_size": [[1, 1, 3], [2, 2, 1]]}
    tuned = tmp_path / "tuned.json"
    tuned.write_text(json.dumps({"speculative_config": cfg, "acceptance": [0.5, 0.4, 0.3]}))
    text, doc = _run(["--prompts", prompts_file, "--dtype", "bfloat16", "--max-num-seqs", "2",
                      "--speculative-config", str(tuned)], tmp_path, capsys)
    assert doc["dtype"] == "bfloat16" and doc["hf_dtype"] == "float32"
    b = doc["weights_read_bound"]
    want = stub_bandwidth.weight_read_bytes(read_model_config(tiny_available), 2)
    assert b["weight_bytes"] == want and b["dtype"] == "bfloat16"
    assert want * 2 == stub_bandwidth.weight_read_bytes(read_model_config(tiny_available))
    assert b["tokens_per_s"] == pytest.approx(10e9 / want)
    assert "npuspec bfloat16 (HF float32)" in text and "MB of bfloat16 weights" in text
    assert doc["npuspec_speculative_config"] == cfg
    assert "K per batch size: batch 1: K=3, batch 2: K=1" in text
    ngram = _row(doc, "npuspec", "ngram")
    assert ngram["K"] == 3 and ngram["identical_to_own_greedy"] is True
    _row(doc, "hf", "batched greedy")


def test_max_model_len_flag(tiny_available, prompts_file, stub_bandwidth, tmp_path, capsys):
    """npuspec rows run at the engine's default max_model_len unless told; 'fit' and a number
    are passed through (attention reads the live length, so the default costs no speed)."""
    pytest.importorskip("transformers")
    from npuspec.bench import e2e

    assert e2e._max_model_len("fit") == "fit" and e2e._max_model_len("96") == 96
    with pytest.raises(Exception):
        e2e._max_model_len("0")
    text, doc = _run(["--prompts", prompts_file, "--max-model-len", "96"], tmp_path, capsys)
    assert doc["max_model_len"] == 96 and "npuspec max_model_len: 96" in text
    assert all(r["identical_to_own_greedy"] for r in doc["rows"]), doc["rows"]
    text, doc = _run(["--prompts", prompts_file], tmp_path, capsys)
    assert doc["max_model_len"] is None and "max_model_len: the engine's default" in text


@pytest.mark.parametrize("rotate,want", [
    (False, "abc abc abc abc"), (True, "abc bca cab abc")])
def test_interleaved_rounds_rotate(rotate, want):
    """`rotate=True` (bench hf): round i starts at row i, so no row always follows the same
    one; without it every round runs in the rows' order."""
    from npuspec.bench.common import Runner, run_interleaved

    seen = []

    def setup(name):
        return lambda: (lambda: seen.append(name) or {"tokens": 1})

    rows = [Runner(n, "m", 0, setup(n)) for n in "abc"]
    run_interleaved(rows, 4, rotate=rotate)
    got = "".join(seen)[3:]  # after the warm-ups (in row order)
    assert " ".join(got[i:i + 3] for i in range(0, 12, 3)) == want
    assert all(len(r.times) == 4 for r in rows)
