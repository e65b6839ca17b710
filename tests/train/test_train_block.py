"""npuspec train-draft for the block drafters, DFlash and DSpark (npuspec/train/block.py): the
dense training forward equals the paged serving forward, the block attention mask, anchors,
eval as serving verification, overfit, resume, config errors, the shipped drafts and the
command. The other methods: test_train_draft.py."""
from __future__ import annotations

import json
import os

import pytest
import torch

from npuspec import train as td
from npuspec.models import AttnMetadata
from npuspec.models.draft_loading import load_draft
from npuspec.train import block as tb
from train_helpers import BS, Fixed, cli, randomize, weights


BLOCK = ("dflash", "dspark")


def _block_draft(target, method, block_size=5, layers=2, aux=(2, 4)):
    cfg = td.TrainConfig(method=method, steps=1, block_size=block_size, draft_layers=layers)
    torch.manual_seed(0)
    m = td.build_draft(method, target.config, target, cfg, aux_ids=aux).eval()
    randomize(m)
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
    data = Fixed(td.CorpusData(target, corpus.train, corpus.val, aux), 4, 33)
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
    wa = weights(a.module)
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
    rc = cli(["--method", method, "--out", str(out), "--steps", "2", "--batch", "2",
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
    assert cli(["--method", "eagle3", "--out", str(tmp_path / "x"), "--block-size", "8"]) == 2
    assert "--block-size" in capsys.readouterr().err
    assert cli(["--method", "medusa", "--out", str(tmp_path / "x"), "--aux-layer-ids", "2"]) == 2
    assert "--aux-layer-ids" in capsys.readouterr().err
