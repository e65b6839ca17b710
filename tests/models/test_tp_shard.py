"""Megatron sharding of DecoderLM (npuspec.models.tp) over a real gloo group of 2 ranks:
the sharded forward equals the whole model's, packed or not, with biases, an untied head and
a vocabulary the ranks do not divide; and the collectives ran (npuspec.kernels.collectives)."""
import dataclasses
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from npuspec.models.config import ModelConfig

QWEN2ISH = ModelConfig(vocab_size=1001, hidden_size=64, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=16, intermediate_size=96,
                       attention_bias=True, o_bias=True, mlp_bias=True,
                       tie_word_embeddings=False)


CASES = {"tiny": (None, False), "tiny-packed": (None, True),
         "biases-untied-v1001": (QWEN2ISH, False), "biases-untied-v1001-packed": (QWEN2ISH, True)}


def _rank(rank, world, init, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    from npuspec.kernels import collectives
    collectives.set_group(dist.group.WORLD)
    for name, (cfg, pack) in CASES.items():  # one pair of processes for every case
        torch.save(_case(rank, world, cfg, pack), os.path.join(out_dir, f"{name}.{rank}.pt"))
    # gloo's thread frees the last collective's tensors after wait() returns; a free while
    # the interpreter finalizes aborts the rank (SIGABRT, seen in CI): drain as TP shutdown does
    assert collectives.drain_gloo(timeout_s=30)
    collectives.set_group(None)
    dist.destroy_process_group()


def _case(rank, world, cfg, pack) -> dict:
    from npuspec.kernels import collectives
    from npuspec.models import load_model
    from npuspec.models.decoder import DecoderLM
    from npuspec.models.packing import pack_model
    from npuspec.models.tp import shard_model
    torch.manual_seed(0)  # the same weights and inputs on every rank
    if cfg is None:
        cfg, whole = load_model("tiny")
    else:
        whole = DecoderLM(cfg).eval()
        for p in whole.parameters():
            p.data.normal_(0, 0.2)
    ids = torch.randint(0, cfg.vocab_size, (3, 9))
    with torch.inference_mode():
        ref, ref_feats = whole.forward_causal(ids, aux_ids=(1,), final=True)
    shard = shard_model(whole, rank, world)
    if pack:
        pack_model(shard)
    collectives.reset_comm()
    with torch.inference_mode():
        out, feats = shard.forward_causal(ids, aux_ids=(1,), final=True)
    return {"ref": ref, "out": out, "ref_feats": ref_feats, "feats": feats,
            "comm": dict(collectives.COMM),
            "heads": shard.config.num_heads, "kv": shard.config.num_kv_heads}


@pytest.fixture(scope="module")
def results():
    """Every case's results per rank. Process start-up (spawn, import torch, gloo) is most of
    the cost, so the ranks run all cases in one start instead of one start per case."""
    world = 2
    with tempfile.TemporaryDirectory() as d:
        init = "file://" + os.path.join(d, "store")
        mp.start_processes(_rank, args=(world, init, d), nprocs=world, start_method="spawn")
        return {name: [torch.load(os.path.join(d, f"{name}.{r}.pt")) for r in range(world)]
                for name in CASES}


@pytest.mark.parametrize("case", list(CASES))
def test_sharded_forward_equals_whole(case, results):
    cfg, _ = CASES[case]
    res = results[case]
    r0, r1 = res
    for r in res:
        assert r["out"].shape == r["ref"].shape  # the padded vocabulary rows are cut off
        torch.testing.assert_close(r["out"], r["ref"], atol=5e-5, rtol=1e-4)
        torch.testing.assert_close(r["feats"], r["ref_feats"], atol=5e-5, rtol=1e-4)
        assert torch.equal(r["out"].argmax(-1), r["ref"].argmax(-1))
    # every rank ends with the same bits: the all-reduce and all-gather results are shared
    assert torch.equal(r0["out"], r1["out"]) and torch.equal(r0["feats"], r1["feats"])
    L = 4 if cfg is None else cfg.num_layers
    # per forward: the embedding, then attention and MLP of every layer; one gather of logits
    assert r0["comm"]["all_reduce"] == 1 + 2 * L, r0["comm"]
    assert r0["comm"]["all_gather"] == 1, r0["comm"]
    assert r0["heads"] == 2 and r0["kv"] == 1  # each rank holds half the heads


def test_indivisible_heads_name_the_field_and_the_choices():
    from npuspec.models.tp import check_shardable
    cfg = dataclasses.replace(QWEN2ISH, num_heads=6, num_kv_heads=3)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2: the model's "
                                         r"num_key_value_heads=3 is not divisible.*\[1, 3\]"):
        check_shardable(cfg, 2)
