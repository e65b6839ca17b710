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

from npuspec.models import AttnMetadata, load_model
from npuspec import train as td
from npuspec.models.draft_config import default_aux_layer_ids
from npuspec.models.draft_loading import load_draft

METHODS = ("eagle3", "eagle", "medusa", "mtp")


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return load_model("tiny")


@pytest.fixture(scope="module")
def corpus():
    from npuspec.models import load_tokenizer
    return td.stdlib_corpus(load_tokenizer("tiny"), max_files=12)


def _aux(method, tcfg):
    return default_aux_layer_ids(tcfg.num_layers) if method == "eagle3" else ()


def _randomize(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))


# ---- paged reference ---------------------------------------------------------------------------
BS = 4


def _meta(positions, seq_len, nblocks):
    table = torch.arange(1, nblocks, dtype=torch.int32)[None]             # block 0 is scratch
    slots = table[0, positions // BS].long() * BS + positions % BS
    return AttnMetadata(slots[None], table, torch.tensor([seq_len], dtype=torch.int32))


def _paged_first(module, ids, feats):
    """First pass over one sequence [1, T] on a fresh pool -> (logits, logit_h, next_h, cache)."""
    T = ids.shape[1]
    nb = T // BS + 3
    cache = module.allocate_paged_cache(nb, BS)
    pos = torch.arange(T)
    logit_h, next_h = module(ids, module.first_hidden(feats), pos[None], _meta(pos, T, nb), cache)
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
    _randomize(m)
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
            lh1, nh1 = m(step1[:, j:j + 1], nh[:, j:j + 1], pos[None], _meta(pos, j + 2, nb), cache)
            torch.testing.assert_close(dense[1][0][:, j:j + 1], lh1, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(dense[1][1][:, j:j + 1], nh1, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(m.logits(dense[1][0][:, j:j + 1]), m.logits(lh1),
                                       rtol=1e-4, atol=1e-4)


def test_dense_medusa_equals_forward(tiny):
    tcfg, target = tiny
    cfg = td.TrainConfig(method="medusa", steps=1, num_heads=3)
    torch.manual_seed(0)
    m = td.build_draft("medusa", tcfg, target, cfg).eval()
    _randomize(m)
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
class _Fixed:
    """One fixed batch, for the overfit check."""

    def __init__(self, data, B, N):
        self.b = data.sample(torch.Generator().manual_seed(5), B, N)
        self.info = {"source": "fixed"}

    def sample(self, gen, B, N):
        return self.b

    def eval_set(self, n, B, N):
        return [self.b]

    def token_counts(self, V):
        return torch.ones(V)


@pytest.mark.parametrize("method", METHODS)
def test_loss_goes_down_on_a_fixed_batch(tiny, corpus, method):
    tcfg, target = tiny
    cfg = td.TrainConfig(method=method, steps=20, batch=4, seq_len=32, lr=3e-3, warmup=2,
                         eval_every=0, eval_k=3, num_heads=3)
    data = _Fixed(td.CorpusData(target, corpus.train, corpus.val, _aux(method, tcfg)), 4, 33)
    r = td.train(target, data, cfg, log=lambda s: None)
    loss = r.history["loss"]
    assert len(loss) == 20
    assert loss[-1] < 0.8 * loss[0], loss
    assert 0 <= min(r.acceptance) and max(r.acceptance) <= 1 and r.acceptance_length >= 1


def _weights(module):
    return {k: v.clone() for k, v in module.state_dict().items()}


def test_resume_equals_uninterrupted_and_seeded(tiny, corpus, tmp_path):
    tcfg, target = tiny
    aux = _aux("eagle3", tcfg)
    data = td.CorpusData(target, corpus.train, corpus.val, aux)
    cfg = td.TrainConfig(method="eagle3", steps=6, batch=2, seq_len=16, eval_every=0,
                         save_every=3, eval_batches=1, ttt_steps=2, eval_k=2)
    quiet = dict(log=lambda s: None)
    a = td.train(target, data, cfg, str(tmp_path / "a"), **quiet)
    b = td.train(target, data, cfg, **quiet)                              # same seed, no state
    for k, v in _weights(a.module).items():
        assert torch.equal(v, b.module.state_dict()[k]), k
    part = td.train(target, data, cfg, str(tmp_path / "c"), stop_after=4, **quiet)
    assert part.steps == 4
    meta = json.load(open(tmp_path / "c" / "state.json"))
    assert meta["step"] == 4
    c = td.train(target, data, cfg, str(tmp_path / "c"), resume=True, **quiet)
    wa = _weights(a.module)
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
def _cli(argv):
    from npuspec.cli import main
    return main(["train-draft"] + argv)


@pytest.mark.parametrize("method", METHODS)
def test_cli_smoke_writes_a_loadable_draft(tiny, tmp_path, method, capsys):
    tcfg, target = tiny
    out = tmp_path / method
    if method == "mtp":  # the MTP layer goes into a copy of the target checkpoint
        from npuspec.models.loading import TINY_MODEL_DIR
        import shutil
        shutil.copytree(TINY_MODEL_DIR, out)
    extra = ["--draft-vocab-size", "512"] if method == "eagle3" else []
    rc = _cli(["--method", method, "--out", str(out), "--steps", "3", "--batch", "2",
               "--seq-len", "16", "--max-files", "8", "--eval-every", "0", "--eval-batches", "1",
               "--num-heads", "2", "--eval-k", "2"] + extra)
    assert rc == 0, capsys.readouterr().err
    recipe = json.load(open(out / "train_recipe.json"))
    assert recipe["steps"] == 3 and recipe["method"] == method and recipe["torch"]
    assert recipe["load_check"]["max_abs_diff"] == 0.0
    assert "train-draft" in recipe["command"] and recipe["data"]["source"] == "stdlib"
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
    assert _cli(["--method", "mtp", "--out", TINY_MODEL_DIR, "--steps", "1"]) == 2
    assert "refusing" in capsys.readouterr().err
    assert _cli(["--out", str(tmp_path / "x"), "--data", str(tmp_path / "none")]) == 2
    assert _cli(["--out", str(tmp_path / "x"), "--aux-layer-ids", "1,9"]) == 2
    assert _cli(["--out", str(tmp_path / "x"), "--resume", "--steps", "2", "--max-files", "4",
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
        assert _cli(argv) == 2
        assert "matplotlib" in capsys.readouterr().err and not png.exists()
        return
    assert _cli(argv) == 0
    assert png.stat().st_size > 1000


# ---- block drafters: DFlash, DSpark (npuspec/train/block.py) -------------------------------------
from npuspec.train import block as tb  # noqa: E402

BLOCK = ("dflash", "dspark")


def _block_draft(target, method, block_size=5, layers=2, aux=(2, 4)):
    cfg = td.TrainConfig(method=method, steps=1, block_size=block_size, draft_layers=layers)
    torch.manual_seed(0)
    m = td.build_draft(method, target.config, target, cfg, aux_ids=aux).eval()
    _randomize(m)
    return cfg, m


@pytest.mark.parametrize("method", BLOCK)
def test_block_dense_equals_paged(tiny, method):
    """The dense training forward over many anchors == the engine's paged path per anchor:
    DFlashContext writes positions < a, the draft's block forward, DFlashBlock's drafts."""
    from npuspec.spec_decode.dflash_step import DFlashBlock, DFlashContext

    tcfg, target = tiny
    cfg, m = _block_draft(target, method)
    S, N = cfg.block_size, 20
    ids = torch.randint(0, tcfg.vocab_size, (2, N), generator=torch.Generator().manual_seed(3))
    aux = m.aux_layer_ids
    with torch.no_grad():
        _, feats = target.forward_causal(ids, aux_ids=aux)
        anchors = torch.tensor([[1, 7, 12], [4, 9, 15]])    # blocks overlap each other's context
        dense = tb.dense_block(m, feats, ids, anchors)       # [2, 3, S, H]
        obj = tb.BlockObjective(m, target, cfg, torch.Generator())
        drafts, conf = obj.draft(feats, ids, anchors)
    table = torch.tensor([[3, 5, 1, 6, 2, 7, 8, 9]], dtype=torch.int32)   # scattered blocks
    slots = lambda p: table[0, p // BS].long() * BS + p % BS              # noqa: E731
    for b in range(2):
        for i in range(3):
            a = int(anchors[b, i])
            cache = m.allocate_paged_cache(10, BS)
            pos = torch.arange(a)[None]
            DFlashContext(m, cache)(feats[b:b + 1, :a], pos, slots(pos))
            bid = torch.tensor([[int(ids[b, a])] + [m.config.mask_token_id] * (S - 1)])
            bpos = torch.arange(a, a + S)[None]
            seq = torch.tensor([a + S], dtype=torch.int32)
            with torch.no_grad():
                h = m(bid, bpos, AttnMetadata(slots(bpos), table, seq), cache)
                toks, c = DFlashBlock(m, cache)(bid, bpos, slots(bpos), table, seq)
            torch.testing.assert_close(dense[b, i], h[0], rtol=0, atol=1e-5)
            assert torch.equal(drafts[b, i], toks[0])
            torch.testing.assert_close(conf[b, i], c[0], rtol=1e-5, atol=1e-6)
    # what the losses read equals what serving computes
    hk = dense[:, :, obj.off:]
    prev = torch.randint(0, tcfg.vocab_size, hk.shape[:3])
    if method == "dspark":
        torch.testing.assert_close(torch.sigmoid(tb.confidence_logit(m, hk, prev)),
                                   m.confidence(hk, prev))
    assert obj.K == (S - 1 if method == "dflash" else S)


@pytest.mark.parametrize("causal", [False, True])
def test_block_attention_matches_explicit_mask(causal):
    g = torch.Generator().manual_seed(0)
    B, T, n, S, Hq, Hkv, D = 2, 9, 3, 4, 4, 2, 8
    q = torch.randn(B, n * S, Hq, D, generator=g)
    kc, vc = torch.randn(B, T, Hkv, D, generator=g), torch.randn(B, T, Hkv, D, generator=g)
    kb, vb = (torch.randn(B, n * S, Hkv, D, generator=g) for _ in range(2))
    anchors = torch.tensor([[1, 4, 8], [2, 3, 6]])
    out = tb.block_attention(q, kc, vc, kb, vb, anchors, causal)
    # reference: one softmax over all T + n*S keys under an explicit boolean mask
    a = anchors.repeat_interleave(S, 1)
    ctx = torch.arange(T)[None, None] < a[:, :, None]
    blk = torch.arange(n).repeat_interleave(S)
    own = blk[:, None] == blk[None]
    if causal:
        own = own & (torch.arange(n * S)[:, None] >= torch.arange(n * S)[None])
    allowed = torch.cat([ctx, own[None].expand(B, -1, -1)], 2)[:, None]
    K = torch.cat([kc, kb], 1).repeat_interleave(Hq // Hkv, 2).transpose(1, 2)
    V = torch.cat([vc, vb], 1).repeat_interleave(Hq // Hkv, 2).transpose(1, 2)
    ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), K, V,
                                                           attn_mask=allowed)
    torch.testing.assert_close(out, ref.transpose(1, 2).reshape(B, n * S, Hq * D),
                               rtol=1e-5, atol=1e-5)


def test_sample_anchors():
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([30, 5, 2])
    anchors, keep = tb.sample_anchors(lengths, 6, g, last=1)
    a0 = anchors[0][keep[0]]
    assert keep[0].all() and a0.unique().numel() == 6 and int(a0.min()) >= 1
    assert int(a0.max()) <= 28
    assert sorted(anchors[1][keep[1]].tolist()) == [1, 2, 3]   # 1..len-2: the first label exists
    assert not keep[2].any()


def test_block_eval_is_serving_verification(tiny, corpus):
    """Drafts equal to the target's own greedy continuation are all accepted; a wrong draft k
    stops the block there (a_j = 0 for j >= k), as the engine's verify step does."""
    tcfg, target = tiny
    cfg, m = _block_draft(target, "dflash", block_size=5, layers=1, aux=(2,))
    cfg.eval_anchors = 3
    obj = tb.BlockObjective(m, target, cfg, torch.Generator())
    data = td.CorpusData(target, corpus.train, corpus.val, m.aux_layer_ids)
    b = data.eval_set(1, 2, 24)[0]
    anchors, keep = tb.sample_anchors(b.mask.sum(1), 3, torch.Generator().manual_seed(
        tb.EVAL_SEED), last=0)
    K = obj.K
    greedy = torch.zeros(2, 3, K, dtype=torch.long)
    with torch.no_grad():
        for r in range(2):
            for i in range(3):
                x = b.ids[r, :int(anchors[r, i]) + 1]
                for k in range(K):  # plain greedy decoding by the target, one token at a time
                    greedy[r, i, k] = target.forward_causal(x[None])[0, -1].argmax()
                    x = torch.cat([x, greedy[r, i, k:k + 1]])
    obj.draft = lambda feats, ids, an: (greedy.clone(), torch.ones(2, 3, K))
    acc, al = obj.evaluate([b])
    assert acc == [1.0] * K and al == 1.0 + K
    bad = greedy.clone()
    bad[:, :, 2] = (bad[:, :, 2] + 1) % tcfg.vocab_size
    obj.draft = lambda feats, ids, an: (bad, torch.ones(2, 3, K))
    acc, al = obj.evaluate([b])
    assert acc == [1.0, 1.0] + [0.0] * (K - 2) and al == 3.0
    assert obj.eval_info["conditional_acceptance"][:3] == [1.0, 1.0, 0.0]


@pytest.mark.parametrize("method", BLOCK)
def test_block_loss_goes_down_on_a_fixed_batch(tiny, corpus, method):
    tcfg, target = tiny
    aux = (2, 4)
    cfg = td.TrainConfig(method=method, steps=20, batch=4, seq_len=32, lr=3e-3, warmup=2,
                         eval_every=0, eval_batches=1, block_size=4, num_anchors=8,
                         eval_anchors=4)
    data = _Fixed(td.CorpusData(target, corpus.train, corpus.val, aux), 4, 33)
    r = td.train(target, data, cfg, aux_ids=aux, log=lambda s: None)
    loss = r.history["loss"]
    assert len(loss) == 20 and loss[-1] < 0.8 * loss[0], loss
    assert len(r.acceptance) == (3 if method == "dflash" else 4)
    assert all(0 <= a <= 1 for a in r.acceptance) and r.acceptance_length >= 1
    assert r.acceptance == sorted(r.acceptance, reverse=True)   # P(all of 1..k) only falls
    assert r.history["eval"][-1]["anchors"] == 16


def test_block_resume_equals_uninterrupted(tiny, corpus, tmp_path):
    tcfg, target = tiny
    aux = (2, 4)
    data = td.CorpusData(target, corpus.train, corpus.val, aux)
    cfg = td.TrainConfig(method="dspark", steps=4, batch=2, seq_len=16, eval_every=0,
                         save_every=2, eval_batches=1, block_size=3, num_anchors=4,
                         eval_anchors=2)
    quiet = dict(log=lambda s: None, aux_ids=aux)
    a = td.train(target, data, cfg, str(tmp_path / "a"), **quiet)
    td.train(target, data, cfg, str(tmp_path / "c"), stop_after=3, **quiet)
    c = td.train(target, data, cfg, str(tmp_path / "c"), resume=True, **quiet)
    wa = _weights(a.module)
    for k, v in c.module.state_dict().items():
        assert torch.equal(v, wa[k]), k
    assert c.history["loss"] == a.history["loss"]
    with pytest.raises(ValueError, match="num_anchors"):
        td.train(target, data, td.TrainConfig(**{**cfg.__dict__, "num_anchors": 5}),
                 str(tmp_path / "c"), resume=True, **quiet)


def test_block_config_errors():
    with pytest.raises(ValueError, match="block_size=1"):
        td.TrainConfig(method="dflash", block_size=1)
    with pytest.raises(ValueError, match="block_size=8 applies to methods dflash and dspark"):
        td.TrainConfig(method="eagle3", block_size=8)
    with pytest.raises(ValueError, match="gamma=0"):
        td.TrainConfig(method="dspark", gamma=0)
    c = td.TrainConfig(method="dspark")
    assert (c.block_size, c.positions, c.draft_layers) == (7, 7, 1)
    assert td.TrainConfig(method="dflash", block_size=8).positions == 7


@pytest.mark.parametrize("method", BLOCK)
def test_shipped_block_draft_loads_and_accepts(tiny, method):
    """The shipped heads (npuspec/models/tiny_drafts/{dflash,dspark}) load with load_draft and
    accept more than 1.3 tokens per round on held-out stdlib text (serving's verification)."""
    from npuspec.models import load_tokenizer
    from npuspec.models.loading import TINY_MODEL_DIR
    from npuspec.models.train_tiny import EOT, read_texts, stdlib_files

    tcfg, target = tiny
    d = os.path.join(os.path.dirname(TINY_MODEL_DIR), "tiny_drafts", method)
    m = load_draft(method, d, tcfg, target)
    recipe = json.load(open(os.path.join(d, "train_recipe.json")))
    assert recipe["method"] == method
    assert os.path.getsize(os.path.join(d, "model.safetensors")) < 3e6
    files = stdlib_files()
    held = files[-max(1, len(files) // 50):]   # stdlib_corpus's held-out files
    held = held[:2]
    tok = load_tokenizer("tiny")
    ids = []
    for enc in tok.encode_batch(read_texts(held)):
        ids += enc.ids + [tok.token_to_id(EOT)]
    data = td.CorpusData(target, torch.tensor(ids), torch.tensor(ids), m.aux_layer_ids)
    cfg = td.TrainConfig(method=method, block_size=m.config.block_size, eval_anchors=8)
    obj = tb.BlockObjective(m.float(), target, cfg, torch.Generator())
    acc, al = obj.evaluate(data.eval_set(2, 8, 129))
    assert al > 1.3, (acc, al)


@pytest.mark.parametrize("method", BLOCK)
def test_cli_block_drafts(tiny, tmp_path, method, capsys):
    tcfg, target = tiny
    out = tmp_path / method
    rc = _cli(["--method", method, "--out", str(out), "--steps", "2", "--batch", "2",
               "--seq-len", "16", "--max-files", "8", "--eval-every", "0", "--eval-batches", "1",
               "--block-size", "3", "--num-anchors", "4", "--eval-anchors", "2",
               "--aux-layer-ids", "2,4"])
    assert rc == 0, capsys.readouterr().err
    recipe = json.load(open(out / "train_recipe.json"))
    assert recipe["load_check"]["max_abs_diff"] == 0.0 and recipe["aux_layer_ids"] == [2, 4]
    K = 2 if method == "dflash" else 3
    assert recipe["speculative_config"]["num_speculative_tokens"] == K
    assert len(recipe["heldout_acceptance"]["per_position"]) == K
    assert recipe["heldout_acceptance"]["anchors"] == 4
    assert not os.path.isabs(recipe["target"])   # npuspec/models/tiny, not this machine's path
    d = load_draft(method, str(out), tcfg, target)
    assert d.config.block_size == 3 and d.aux_layer_ids == (2, 4)
    # a block-drafter flag with another method names the flag
    assert _cli(["--method", "eagle3", "--out", str(tmp_path / "x"), "--block-size", "8"]) == 2
    assert "--block-size" in capsys.readouterr().err
    assert _cli(["--method", "medusa", "--out", str(tmp_path / "x"), "--aux-layer-ids", "2"]) == 2
    assert "--aux-layer-ids" in capsys.readouterr().err
