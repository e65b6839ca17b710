"""kernels/shm_collectives.py between real processes: the all-reduce equals the rank-order
sum bit for bit on every rank, the all-gather equals the concatenation, across many
back-to-back ops of changing sizes (the two data halves alternate); tensors it does not take
(bf16, over its size limit) go through gloo, counted; a peer that never arrives is reported
through `alive()` instead of a hang."""
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from npuspec.kernels import shm_collectives

pytestmark = pytest.mark.skipif(not shm_collectives.available(), reason="no C++ toolchain")
CAP = 1 << 16


def _rank(rank, world, d, out_dir):
    torch.set_num_threads(1)
    from npuspec._counters import counters
    from npuspec.kernels import collectives
    dist.init_process_group("gloo", init_method="file://" + os.path.join(d, "store"),
                            rank=rank, world_size=world)
    shm = shm_collectives.ShmComm(os.path.join(d, "shm"), rank, world, CAP, create=False,
                                  alive=lambda: None, timeout=60)
    collectives.set_group(dist.group.WORLD, shm)
    g = torch.Generator().manual_seed(rank)
    sent, got = [], []
    for i in range(40):  # sizes change every op; the data halves alternate
        shape = (1 + i % 3, 1 + (7 * i) % 50)
        x = torch.randn(shape, generator=g)
        sent.append(x)
        op = torch.ops.npuspec.tp_all_reduce if i % 2 else \
            (lambda t: torch.ops.npuspec.tp_all_gather(t, world))
        got.append(op(x))
    before = counters.snapshot()
    big = torch.ones(CAP // 4 + 1)  # one element over the limit
    half = torch.ones(8, dtype=torch.bfloat16)
    fell = [torch.ops.npuspec.tp_all_reduce(big), torch.ops.npuspec.tp_all_reduce(half)]
    torch.save({"sent": sent, "got": got, "fell": fell, "shm": collectives.COMM["shm"],
                "fallbacks": counters.delta(before).get("tp_shm_fallbacks", 0)},
               os.path.join(out_dir, f"{rank}.pt"))
    assert collectives.drain_gloo(timeout_s=30)  # the fallbacks went through gloo's thread
    collectives.set_group(None)
    shm.close()
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_shm_collectives_equal_their_references_on_every_rank(world):
    with tempfile.TemporaryDirectory() as d:
        shm = shm_collectives.ShmComm(os.path.join(d, "shm"), 0, world, CAP, create=True,
                                      alive=None, timeout=1)
        try:
            mp.start_processes(_rank, args=(world, d, d), nprocs=world, start_method="spawn")
        finally:
            shm.close()
        res = [torch.load(os.path.join(d, f"{r}.pt")) for r in range(world)]
    for i in range(40):
        parts = [r["sent"][i] for r in res]
        ref = (shm_collectives.all_reduce_reference(parts) if i % 2
               else torch.cat(parts, dim=-1))
        for r in res:
            assert torch.equal(r["got"][i], ref), i  # the same bits on every rank
    for r in res:
        assert r["shm"] == 40
        assert r["fallbacks"] == 2  # the oversized and the bf16 tensor took gloo
        assert torch.equal(r["fell"][0], torch.full((CAP // 4 + 1,), float(world)))
        assert torch.equal(r["fell"][1], torch.full((8,), float(world), dtype=torch.bfloat16))


def test_a_peer_that_never_arrives_is_reported_by_alive_not_waited_for():
    with tempfile.TemporaryDirectory() as d:
        calls = []

        def alive():
            calls.append(1)
            if len(calls) >= 3:
                raise RuntimeError("peer rank 1 is gone")

        shm = shm_collectives.ShmComm(os.path.join(d, "shm"), 0, 2, CAP, create=True,
                                      alive=alive, timeout=600)
        with pytest.raises(RuntimeError, match="peer rank 1 is gone"):
            shm.all_reduce(torch.ones(4))  # rank 1 never posts
        shm.close()
    assert len(calls) == 3  # checked every 50 ms wait, not after the 600 s timeout
