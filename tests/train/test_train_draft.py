"""npuspec train-draft (npuspec/train, npuspec/cli/train_draft.py).

The dense training forward must equal the serving module's paged forward (else training and
serving disagree); resuming must reproduce the uninterrupted run bit for bit; each method's
output must load with load_draft.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from npuspec.models import load_model
from npuspec import train as td
from npuspec.models.draft_config import default_aux_layer_ids
from npuspec.models.draft_loading import load_draft
from train_helpers import BS, Fixed, cli, meta, randomize, weights

METHODS = ("eagle3", "eagle", "medusa", "mtp")


def _aux(method, tcfg):
    return default_aux_layer_ids(tcfg.num_layers) if method == "eagle3" else ()


# ---- paged reference ---------------------------------------------------------------------------
def _paged_first(module, ids, feats):
    """First pass over one sequence [1, T] on a fresh pool -> (logits, logit_h, next_h, cache)."""
    T = ids.shape[1]
    nb = T // BS + 3
    cache = module.allocate_paged_cache(nb, BS)
    pos = torch.arange(T)
    logit_h, next_h = module(ids, module.first_hidden(feats), pos[None], meta(pos, T, nb), cache)
    return module.logits(logit_h), logit_h, next_h, cache, nb


def _features(target, method, ids):
    aux = _aux(method, target.config)
    with torch.no_grad():
        _, feats = target.forward_causal(ids, aux_ids=aux, final=True)
    H = target.config.hidden_size
    return feats[..., :-H] if method == "eagle3" else feats[..., -H:]


@pytest.mark.parametrize("method", ["eagle3", "eagle", "mtp"])
def test_dense_equals_paged(tiny, method):
    tcfg, target = tiny
    cfg = td.TrainConfig(method=method, steps=1)
    torch.manual_seed(0)
    used = None
    if method == "eagle3":  # a truncated draft vocabulary, to check the d2t mapping too
        used = torch.sort(torch.randperm(tcfg.vocab_size)[:300]).values
    m = td.build_draft(method, tcfg, target, cfg, used).eval()
    randomize(m)
    T = 10
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, tcfg.vocab_size, (1, T + 2), generator=g)
    feats = _features(target, method, ids[:, :T])
    step0, step1 = ids[:, 1:T + 1], ids[:, 2:T + 2]
    with torch.no_grad():
        dense = td.dense_chain(m, [step0, step1], feats)
        logits, logit_h, next_h, cache, nb = _paged_first(m, step0, feats)
        torch.testing.assert_close(dense[0][0], logit_h, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(dense[0][1], next_h, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(m.logits(dense[0][0]), logits, rtol=1e-4, atol=1e-4)
        # the training logits (draft vocabulary) are the served ones at the mapped ids
        obj = td.ChainObjective(m, target, cfg)
        ld = obj._draft_logits(dense[0][0])
        ids_t = obj.used if method == "eagle3" else torch.arange(tcfg.vocab_size)
        torch.testing.assert_close(ld, logits[..., ids_t], rtol=1e-4, atol=1e-4)
        # TTT step 1 at row j == the chain step from row j's first pass (position j + 1)
        for j in range(T):
            _, _, nh, cache, nb = _paged_first(m, step0, feats)
            pos = torch.tensor([j + 1])
            lh1, nh1 = m(step1[:, j:j + 1], nh[:, j:j + 1], pos[None], meta(pos, j + 2, nb), cache)
            torch.testing.assert_close(dense[1][0][:, j:j + 1], lh1, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(dense[1][1][:, j:j + 1], nh1, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(m.logits(dense[1][0][:, j:j + 1]), m.logits(lh1),
                                       rtol=1e-4, atol=1e-4)


def test_dense_medusa_equals_forward(tiny):
    tcfg, target = tiny
    cfg = td.TrainConfig(method="medusa", steps=1, num_heads=3)
    torch.manual_seed(0)
    m = td.build_draft("medusa", tcfg, target, cfg).eval()
    randomize(m)
    ids = torch.randint(0, tcfg.vocab_size, (1, 6))
    h = _features(target, "medusa", ids)[0]                               # [T, H]
    with torch.no_grad():
        served = m(h)                                                     # [T, heads, V]
        dense = td.dense_medusa(m, h)
        for k in range(3):
            torch.testing.assert_close(torch.nn.functional.linear(dense[k], m.lm_heads[k].weight),
                                       served[:, k], rtol=1e-4, atol=1e-4)


def test_ttt_attention_matches_explicit_mask():
    # step s queries see the step-0 keys causally and the later steps' keys of their own row
    g = torch.Generator().manual_seed(0)
    B, T, Hq, Hkv, D = 2, 5, 4, 2, 8
    q = torch.randn(B, T, Hq, D, generator=g)
    ks = [torch.randn(B, T, Hkv, D, generator=g) for _ in range(3)]
    vs = [torch.randn(B, T, Hkv, D, generator=g) for _ in range(3)]
    out = td.ttt_attention(q, ks, vs)
    K = torch.cat(ks, 1).repeat_interleave(Hq // Hkv, 2)                  # [B, 3T, Hq, D]
    V = torch.cat(vs, 1).repeat_interleave(Hq // Hkv, 2)
    j = torch.arange(T)
    allowed = torch.cat([j[None, :] <= j[:, None]] + [torch.eye(T, dtype=torch.bool)] * 2, 1)
    s = torch.einsum("bqhd,bkhd->bhqk", q, K) / D ** 0.5
    p = s.masked_fill(~allowed, float("-inf")).softmax(-1)
    ref = torch.einsum("bhqk,bkhd->bqhd", p, V).reshape(B, T, Hq * D)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


# ---- training ------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", METHODS)
def test_loss_goes_down_on_a_fixed_batch(tiny, corpus, method):
    tcfg, target = tiny
    cfg = td.TrainConfig(method=method, steps=20, batch=4, seq_len=32, lr=3e-3, warmup=2,
                         eval_every=0, eval_k=3, num_heads=3)
    data = Fixed(td.CorpusData(target, corpus.train, corpus.val, _aux(method, tcfg)), 4, 33)
    r = td.train(target, data, cfg, log=lambda s: None)
    loss = r.history["loss"]
    assert len(loss) == 20
    assert loss[-1] < 0.8 * loss[0], loss
    assert 0 <= min(r.acceptance) and max(r.acceptance) <= 1 and r.acceptance_length >= 1


def test_resume_equals_uninterrupted_and_seeded(tiny, corpus, tmp_path):
    tcfg, target = tiny
    aux = _aux("eagle3", tcfg)
    data = td.CorpusData(target, corpus.train, corpus.val, aux)
    cfg = td.TrainConfig(method="eagle3", steps=6, batch=2, seq_len=16, eval_every=0,
                         save_every=3, eval_batches=1, ttt_steps=2, eval_k=2)
    quiet = dict(log=lambda s: None)
    a = td.train(target, data, cfg, str(tmp_path / "a"), **quiet)
    b = td.train(target, data, cfg, **quiet)                              # same seed, no state
    for k, v in weights(a.module).items():
        assert torch.equal(v, b.module.state_dict()[k]), k
    part = td.train(target, data, cfg, str(tmp_path / "c"), stop_after=4, **quiet)
    assert part.steps == 4
    meta = json.load(open(tmp_path / "c" / "state.json"))
    assert meta["step"] == 4
    c = td.train(target, data, cfg, str(tmp_path / "c"), resume=True, **quiet)
    wa = weights(a.module)
    for k, v in c.module.state_dict().items():
        assert torch.equal(v, wa[k]), k
    assert c.history["loss"] == a.history["loss"]
    # another seed gives other weights
    other = td.train(target, data, td.TrainConfig(**{**cfg.__dict__, "seed": 1}), **quiet)
    assert not torch.equal(other.module.fc.weight, a.module.fc.weight)
    # a changed schedule is refused on resume
    with pytest.raises(ValueError, match="lr"):
        td.train(target, data, td.TrainConfig(**{**cfg.__dict__, "lr": 1e-4}),
                 str(tmp_path / "c"), resume=True, **quiet)
    # the state holds no pickles
    assert sorted(os.listdir(tmp_path / "c")) == ["state.json", "state.safetensors"]


def test_draft_vocab_map():
    counts = torch.tensor([5, 0, 9, 9, 1, 7])
    used = td.draft_vocab(counts, 3)
    assert used.tolist() == [2, 3, 5]
    assert td.expected_acceptance_length([0.5, 0.5]) == 1.75


def test_train_from_hidden_states_files(tiny, corpus, tmp_path):
    from npuspec.spec_decode.extract_files import HiddenStatesWriter

    tcfg, target = tiny
    aux = default_aux_layer_ids(tcfg.num_layers)
    L = tcfg.num_layers
    kv = {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
          "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "hs")}}
    with HiddenStatesWriter(kv) as w:
        for i, n in enumerate((40, 30)):
            ids = corpus.train[i * 100:i * 100 + n].long()[None]
            with torch.no_grad():
                _, feats = target.forward_causal(ids, aux_ids=tuple(aux) + (L,))
            hs = feats[0].view(n, len(aux) + 1, tcfg.hidden_size)        # [T, layers, H]
            w.submit(f"req{i}", ids[0], hs)
    files = td.hidden_state_files(str(tmp_path / "hs"))
    assert len(files) == 2
    data = td.FileData(target, files, n_aux=len(aux))
    # the file path recomputes exactly what the target computes (whole files: N > T)
    b = data.sample(torch.Generator().manual_seed(0), 1, 50)
    assert 0 < int(b.mask.sum()) < 50 and not b.mask[0, -1]
    with torch.no_grad():
        lg, fin = target.forward_causal(b.ids[:, :int(b.mask.sum())], final=True)
    n = int(b.mask.sum())
    torch.testing.assert_close(b.logits[:, :n], lg, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(b.final[:, :n], fin, rtol=1e-4, atol=1e-5)
    cfg = td.TrainConfig(method="eagle3", steps=4, batch=2, seq_len=24, eval_every=0,
                         eval_batches=1, eval_k=2)
    r = td.train(target, data, cfg, log=lambda s: None)
    assert len(r.history["loss"]) == 4 and all(x == x for x in r.history["loss"])
    med = td.train(target, td.FileData(target, files), td.TrainConfig(
        method="medusa", steps=2, batch=2, seq_len=24, eval_every=0, eval_batches=1, num_heads=2),
        log=lambda s: None)
    assert len(med.acceptance) == 2
    with pytest.raises(ValueError, match="hidden_states has shape"):
        td.FileData(target, files, n_aux=2)


# ---- the command ---------------------------------------------------------------------------------
@pytest.mark.parametrize("method", METHODS)
def test_cli_smoke_writes_a_loadable_draft(tiny, tmp_path, method, capsys):
    tcfg, target = tiny
    out = tmp_path / method
    if method == "mtp":  # the MTP layer goes into a copy of the target checkpoint
        from npuspec.models.loading import TINY_MODEL_DIR
        import shutil
        shutil.copytree(TINY_MODEL_DIR, out)
    extra = ["--draft-vocab-size", "512"] if method == "eagle3" else []
    rc = cli(["--method", method, "--out", str(out), "--steps", "3", "--batch", "2",
               "--seq-len", "16", "--max-files", "8", "--eval-every", "0", "--eval-batches", "1",
               "--num-heads", "2", "--eval-k", "2"] + extra)
    assert rc == 0, capsys.readouterr().err
    recipe = json.load(open(out / "train_recipe.json"))
    assert recipe["steps"] == 3 and recipe["method"] == method and recipe["torch"]
    assert recipe["load_check"]["max_abs_diff"] == 0.0
    assert "train-draft" in recipe["command"] and recipe["data"]["source"] == "stdlib"
    if method != "mtp":  # what the head was trained for, checked when it is loaded
        from npuspec.models import load_tokenizer
        from npuspec.models.loading import tokenizer_fingerprint
        rec = json.load(open(out / "config.json"))["npuspec_target"]
        assert rec["tokenizer_sha256"] == tokenizer_fingerprint(load_tokenizer("tiny"))
        assert (rec["hidden_size"], rec["vocab_size"]) == (tcfg.hidden_size, tcfg.vocab_size)
    d = load_draft(method, str(out), tcfg, target)
    assert d.method == method
    if method == "eagle3":  # the top-512 vocabulary map survives the round trip
        assert d.config.draft_vocab_size == 512 and d.vocab_index is not None
        assert d.vocab_index.unique().numel() == 512
    if method == "mtp":
        cfg = json.load(open(out / "config.json"))
        assert cfg["num_nextn_predict_layers"] == 1
        assert os.path.isfile(out / "mtp.safetensors")
        _, t2 = load_model(str(out))  # the target still loads from the copy, unchanged
        assert torch.equal(t2.embed.weight, target.embed.weight)


def test_cli_errors(tmp_path, capsys):
    from npuspec.models.loading import TINY_MODEL_DIR
    assert cli(["--method", "mtp", "--out", TINY_MODEL_DIR, "--steps", "1"]) == 2
    assert "refusing" in capsys.readouterr().err
    assert cli(["--out", str(tmp_path / "x"), "--data", str(tmp_path / "none")]) == 2
    assert cli(["--out", str(tmp_path / "x"), "--aux-layer-ids", "1,9"]) == 2
    assert cli(["--out", str(tmp_path / "x"), "--resume", "--steps", "2", "--max-files", "4",
                 "--seq-len", "8"]) == 2
    assert "no checkpoint" in capsys.readouterr().err


def test_cli_plot(tmp_path, capsys):
    png = tmp_path / "curve.png"
    argv = ["--method", "eagle", "--out", str(tmp_path / "e"), "--steps", "2", "--batch", "2",
            "--seq-len", "16", "--max-files", "4", "--eval-every", "1", "--eval-batches", "1",
            "--plot", str(png)]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert cli(argv) == 2
        assert "matplotlib" in capsys.readouterr().err and not png.exists()
        return
    assert cli(argv) == 0
    assert png.stat().st_size > 1000


def test_an_interrupted_run_is_refused_with_the_command_that_finishes_it(tiny, tmp_path, capsys):
    """Issue 36, bad input: a directory where train-draft stopped before writing its draft
    (here --stop-after; a kill leaves the same) is refused by load_draft and by the engine,
    naming the step reached and the command that finishes it; that command then works."""
    from npuspec import LLM
    tcfg, target = tiny
    out = tmp_path / "eagle"
    argv = ["--method", "eagle", "--out", str(out), "--steps", "3", "--batch", "2",
            "--seq-len", "16", "--max-files", "4", "--eval-every", "0", "--eval-batches", "1",
            "--save-every", "1"]
    assert cli(argv + ["--stop-after", "2"]) == 0, capsys.readouterr().err
    assert not (out / "train_recipe.json").exists()
    with pytest.raises(ValueError, match=r"interrupted `npuspec train-draft` run \(checkpoint "
                                         r"at step 2 of 3\).*finish it with: npuspec "
                                         r"train-draft .*--resume") as e:
        load_draft("eagle", str(out), tcfg, target)
    cmd = str(e.value).split("finish it with: ")[1]
    assert "--stop-after" not in cmd and f"--out {out}" in cmd
    with pytest.raises(ValueError, match="step 2 of 3"):
        LLM("tiny", speculative_config={"method": "eagle", "model": str(out),
                                        "num_speculative_tokens": 2}, enforce_eager=True)
    assert cli(cmd.split()[2:]) == 0, capsys.readouterr().err  # the quoted command, as is
    assert load_draft("eagle", str(out), tcfg, target).method == "eagle"


def test_a_head_for_another_tokenizer_is_refused(tmp_path):
    """A head trained here records its target's tokenizer (config.json npuspec_target); the
    same vocabulary size with other tokens is refused, naming the key and both values."""
    import shutil
    from npuspec import LLM
    from npuspec.models import load_tokenizer
    from npuspec.models.loading import tokenizer_fingerprint
    from npuspec.spec_decode.heads import resolve_draft
    mine = tokenizer_fingerprint(load_tokenizer("tiny"))
    spec = {"method": "eagle", "num_speculative_tokens": 2}
    for sha, ok in ((mine, True), ("ab" * 32, False)):
        d = tmp_path / sha[:8]
        shutil.copytree(resolve_draft("tiny-eagle"), d)
        cfg = json.load(open(d / "config.json"))
        cfg["npuspec_target"] = {"name": "other-135m", "tokenizer_sha256": sha}
        json.dump(cfg, open(d / "config.json", "w"))
        if ok:
            LLM("tiny", speculative_config={**spec, "model": str(d)}, enforce_eager=True)
            continue
        with pytest.raises(ValueError, match=rf"npuspec_target.tokenizer_sha256={'ab' * 8}\.\.\. "
                                             rf"\(the tokenizer of other-135m.*the target's "
                                             rf"tokenizer has {mine[:16]}\.\.\."):
            LLM("tiny", speculative_config={**spec, "model": str(d)}, enforce_eager=True)
