"""`npuspec bench hf --start`: cold and warm-started child processes on their own caches.

The child runs for real (eager: nothing to compile, so it is quick); the parent's table is
checked on children stubbed with known figures; the whole command on the embedded model,
compiles included, is a slow test."""
from __future__ import annotations

import json

import pytest

from npuspec.bench import hf, hf_start


def test_child_prints_its_first_runs_tokens_as_one_json_line(tiny_available, capsys):
    from npuspec.bench.common import encode
    from npuspec.bench.hf_runners import hf_runner, load_hf
    from npuspec.cli_util.prompts import chat_tokenizer, code_edit_prompts

    rc = hf.main(["--num-prompts", "2", "--max-tokens", "6", "--modes", "greedy",
                  hf_start.CHILD_FLAG, "eager:greedy"])
    out = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("{")]
    assert rc == 0 and len(out) == 1
    doc = json.loads(out[0])
    assert set(doc) == {"load_s", "first_s", "steady_s", "shorter_s", "first_own_s",
                        "shorter_own_s", "first_backend_s", "shorter_backend_s", "token_ids",
                        "shorter_ids", "tokens"}
    # eager: no backend, no compiler of its own
    assert doc["first_own_s"] == doc["shorter_own_s"] == doc["first_backend_s"] == 0.0
    assert doc["first_s"] > 0 and doc["steady_s"] > 0 and doc["shorter_s"] > 0
    # the same prompts and tokens as the parent's own (default) settings give in-process
    tok = chat_tokenizer(tiny_available)
    ids = encode(tiny_available, code_edit_prompts(tiny_available, tok), tok)[:2]
    ref = hf_runner(lambda: load_hf(tiny_available), ids, 6, [])()()
    assert len(doc["token_ids"]) == 2 and doc["tokens"] == sum(map(len, doc["token_ids"])) > 0
    assert doc["token_ids"] == [t[:len(d)] for t, d in zip(ref["token_ids"], doc["token_ids"])]
    # the new-lengths run answers every prompt without its first token
    short = hf_runner(lambda: load_hf(tiny_available), [x[1:] for x in ids], 6, [])()()
    assert doc["shorter_ids"] == short["token_ids"]


def test_child_argv_round_trips_the_parents_settings():
    p = hf.build_parser()
    args = p.parse_args(["--start", "--model", "/m", "--num-prompts", "3", "--max-tokens", "9",
                         "-k", "5", "--threads", "1", "--prompts", "f.txt"])
    again = p.parse_args(hf._child_argv(args, ["greedy", "static cache"]) + [hf_start.CHILD_FLAG, "eager:greedy"])
    for name in ("model", "num_prompts", "max_tokens", "k", "threads", "prompts", "draft_model"):
        assert getattr(again, name) == getattr(args, name), name
    assert again.modes == "greedy,static cache" and not again.start
    assert again.start_child == "eager:greedy"


def test_rows_per_mode_and_ratios_to_inductor(monkeypatch):
    figures = {"eager": [1.0], "inductor": [40.0, 8.0], "npuspec": [44.0, 6.0]}
    shorter = {"eager": 0.5, "inductor": 4.0, "npuspec": 5.0}
    backend = {"eager": 0.0, "inductor": 0.8, "npuspec": 1.0}
    own = {"eager": 0.0, "inductor": 0.0, "npuspec": 0.25}
    calls = []

    def spawn(argv, system, mode, cache):
        calls.append((system, mode, cache))
        n = sum(1 for c in calls if c[:2] == (system, mode)) - 1
        first = figures[system][n]
        toks = [[1, 2, 3]] if system != "npuspec" or mode == "greedy" else [[1, 2, 4]]
        return {"load_s": 0.5, "first_s": first, "steady_s": 0.25, "token_ids": toks,
                "shorter_s": shorter[system], "shorter_ids": [[1, 2]], "tokens": 3,
                "first_backend_s": 2.0, "shorter_backend_s": backend[system],
                "first_own_s": 0.1, "shorter_own_s": own[system]}

    monkeypatch.setattr(hf_start, "_spawn", spawn)

    class Bar:
        n = 0

        def update(self):
            self.n += 1

    bar = Bar()
    rows = hf_start.run_start([], ["greedy", "prompt lookup"], bar)
    assert bar.n == 10 and len(rows) == 6
    # a compiled system's two children share one cache directory, new for each mode
    caches = {(s, m): c for s, m, c in calls}
    assert len({c for s, m, c in calls}) == 6
    assert [c for s, m, c in calls if (s, m) == ("npuspec", "greedy")] == [caches[("npuspec", "greedy")]] * 2
    by = {(r["mode"], r["system"]): r for r in rows}
    r = by[("greedy", "npuspec")]
    assert (r["cold_first_s"], r["warm_first_s"]) == (44.0, 6.0)
    assert r["cold_vs_inductor"] == pytest.approx(1.1) and r["warm_vs_inductor"] == pytest.approx(0.75)
    assert by[("greedy", "eager")]["cold_vs_inductor"] == "-"
    assert r["new_lengths_s"] == 5.0 and r["new_lengths_vs_inductor"] == pytest.approx(1.25)
    assert r["new_lengths_backend_vs_inductor"] == pytest.approx(1.25)
    assert (r["new_lengths_own_s"], r["warm_own_s"], r["warm_backend_s"]) == (0.25, 0.1, 2.0)
    assert by[("greedy", "eager")]["new_lengths_backend_vs_inductor"] == "-"
    assert r["identical"] == 1 and by[("prompt lookup", "npuspec")]["identical"] == 0


@pytest.mark.slow
def test_start_on_the_embedded_model(tiny_available, tmp_path):
    out = tmp_path / "s.json"
    rc = hf.main(["--start", "--modes", "greedy", "--num-prompts", "1", "--max-tokens", "4",
                  "--json", str(out)])
    doc = json.loads(out.read_text())
    assert rc == 0
    assert [r["system"] for r in doc["rows"]] == ["eager", "inductor", "npuspec"]
    for r in doc["rows"][1:]:
        assert r["identical"] == 1 and r["cold_first_s"] > r["steady_s"]
        assert r["warm_backend_s"] > 0  # the warm child's compiles went through the backend
    assert doc["rows"][1]["warm_own_s"] == 0 < doc["rows"][2]["warm_own_s"]
