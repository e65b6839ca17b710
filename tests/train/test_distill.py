"""Self-distilled training data (npuspec/train/distill.py, `train-draft --distill`): the
prompts avoid the held-out set, the answers are the engine's greedy ones, they are generated
once per settings, and the command trains on them."""
from __future__ import annotations

import json

import pytest

from npuspec import LLM, SamplingParams
from npuspec.cli_util.prompts import open_ended_requests
from npuspec.train import distill
from train_helpers import cli

EAGER = {"enforce_eager": True}  # the answers, not the compiled step, are the subject


def test_prompts_are_varied_seeded_and_never_held_out():
    a = distill.distill_prompts(200, seed=0)
    assert len(set(a)) == 200 and a == distill.distill_prompts(200, seed=0)
    assert a != distill.distill_prompts(200, seed=1)
    for kind, templates in distill.TEMPLATES.items():  # round-robin: every kind is drawn
        stems = [t.split("{s}")[0] for t in templates]
        assert any(p.startswith(tuple(stems)) for p in a), kind
    held = [" ".join(r["prompt"].lower().split()) for r in open_ended_requests()]
    total = int(str(pytest.raises(ValueError, distill.distill_prompts, 10 ** 6).value)
                .split("exceeds the ")[1].split()[0])
    for p in distill.distill_prompts(total, seed=0):  # every prompt the templates make
        q = " ".join(p.lower().split())
        assert not any(h in q or q in h for h in held), p
    with pytest.raises(ValueError, match=r"n=100000 exceeds the \d+ distinct prompts"):
        distill.distill_prompts(100000)


def test_answers_are_the_engines_greedy_ones_and_generated_once(tmp_path):
    prompts = distill.distill_prompts(3, seed=0)
    seqs = distill.generate("tiny", prompts, max_tokens=8, batch=3, llm_kwargs=EAGER)
    ref = LLM("tiny", enforce_eager=True).generate(prompts, SamplingParams(temperature=0,
                                                                          max_tokens=8))
    assert seqs == [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in ref]

    path = str(tmp_path / "distill.jsonl")
    settings = {"prompts": prompts, "max_tokens": 8}
    made = []

    def make():
        made.append(1)
        return seqs
    assert distill.load_or_generate(path, settings, make, log=lambda s: None) == seqs
    head = {}
    assert distill.load_or_generate(path, settings, make, log=lambda s: None,
                                    header=head) == seqs
    assert len(made) == 1  # the second call read the file
    assert head["settings"] == settings and head["seconds"] >= 0  # the generation's time
    distill.load_or_generate(path, {**settings, "max_tokens": 9}, make, log=lambda s: None)
    assert len(made) == 2  # other settings: generated again

    corpus = distill.distilled_corpus(seqs, sep_id=0, val_share=0.34)
    assert corpus.val.tolist() == seqs[-1] + [0]
    assert corpus.train.tolist() == seqs[0] + [0] + seqs[1] + [0]
    with pytest.raises(ValueError, match="at least 2"):
        distill.distilled_corpus(seqs[:1], sep_id=0)
    ten = [[i] for i in range(10)]  # validation: evenly spaced, the last included
    corpus = distill.distilled_corpus(ten, sep_id=-1, val_share=0.2)
    assert corpus.val.tolist() == [4, -1, 9, -1]
    assert corpus.train.tolist() == [x for i in range(10) if i not in (4, 9) for x in (i, -1)]


def test_train_draft_distill(tmp_path, monkeypatch, capsys):
    real = distill.generate
    monkeypatch.setattr(distill, "generate",
                        lambda *a, **kw: real(*a, **kw, llm_kwargs=EAGER))
    out = tmp_path / "e3"
    argv = ["--method", "eagle3", "--out", str(out), "--steps", "2", "--batch", "2",
            "--seq-len", "16", "--max-files", "4", "--eval-every", "0", "--eval-batches", "1",
            "--distill", "6", "--distill-tokens", "8", "--distill-batch", "6"]
    assert cli(argv) == 0, capsys.readouterr().err
    data = json.load(open(out / "train_recipe.json"))["data"]
    assert data["source"] == "self-distill" and data["sequences"] == 6
    assert data["mixed_with"]["pydoc_topics_tokens"] > 0
    lines = (out / "distill.jsonl").read_text().splitlines()
    assert len(lines) == 7 and json.loads(lines[0])["settings"]["max_tokens"] == 8
    assert cli(argv[:-6] + ["--distill", "100000"]) == 2
    assert "--distill" in capsys.readouterr().err
