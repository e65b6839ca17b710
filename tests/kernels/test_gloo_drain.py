"""gloo's worker thread frees a collective's tensors just after the caller's wait returns; a
free that needs the GIL while the interpreter finalizes aborts the process. `drain_gloo`
(called by the TP shutdown) waits until gloo has let go of the latest collectives' tensors."""
import torch
import torch.distributed as dist

from npuspec.kernels import collectives


def test_drain_waits_until_gloo_released_the_tensors(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    try:
        collectives.set_group(dist.group.WORLD)  # no shared memory: the ops go through gloo
        x = torch.randn(3, 4)
        gathered = collectives.tp_all_gather(x, 1)
        calls = [collectives._GLOO_HELD[-1]]  # a released call is pruned at the next one
        summed = collectives.tp_all_reduce(x)
        calls.append(collectives._GLOO_HELD[-1])
        assert torch.equal(gathered, x) and torch.equal(summed, x)
        held = [pair for call in calls for pair in call]
        assert len(held) == 3  # all_gather's input and its one part, all_reduce's buffer
        assert collectives.drain_gloo(timeout_s=30)
        assert not collectives._GLOO_HELD
        assert all(t._use_count() <= base for t, base in held)
    finally:
        collectives.set_group(None)
        collectives._GLOO_HELD.clear()
        dist.destroy_process_group()


def test_drain_gives_up_after_its_timeout():
    t = torch.zeros(2)
    collectives._GLOO_HELD.append(((t, 0),))  # a count that never drops to its base
    try:
        assert collectives.drain_gloo(timeout_s=0.05) is False
        assert not collectives._GLOO_HELD
    finally:
        collectives._GLOO_HELD.clear()
