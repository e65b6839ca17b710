"""`backend.own_seconds`: npuspec's compile-time seconds beside the lowering it shares with
Inductor (its keys, graph cache and capture wiring, plus its passes), which `npuspec bench hf
--start` reports for a warm process meeting new lengths (docs/graphs.md)."""
import time

import torch

from npuspec.compilation import backend, lowering
from npuspec.passes import manager


def greedy_step(logits, drafts):
    target = logits.argmax(dim=-1)                                       # [B, K+1]
    n = (drafts == target[:, :-1]).cumprod(dim=-1).sum(dim=-1)           # [B]
    return target, n


def _inputs():
    logits = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(0))
    return logits, logits[:, :4].argmax(-1)


def test_the_lowerings_time_is_left_out_and_the_passes_time_counted(monkeypatch):
    real = lowering.lower

    def slow_lower(gm, example_inputs, opts):  # a lowering that takes 0.3 s more
        time.sleep(0.3)
        return real(gm, example_inputs, opts)

    monkeypatch.setattr(lowering, "lower", slow_lower)
    torch._dynamo.reset()
    times, own, passes = dict(backend.TIMES), backend.own_seconds(), manager.TOTALS["seconds"]
    got = torch.compile(greedy_step, backend="npuspec",
                        options={"capture": False, "lowering": "eager"})(*_inputs())
    assert all(torch.equal(a, b) for a, b in zip(got, greedy_step(*_inputs())))
    assert backend.TIMES["graphs"] == times["graphs"] + 1
    in_backend = backend.TIMES["seconds"] - times["seconds"]
    in_lowering = backend.TIMES["lowering_seconds"] - times["lowering_seconds"]
    assert in_lowering >= 0.3 and in_backend >= in_lowering, (in_backend, in_lowering)
    d_passes = manager.TOTALS["seconds"] - passes
    d_own = backend.own_seconds() - own
    assert d_passes > 0, d_passes  # the eager lowering ran the verify passes
    assert abs(d_own - (in_backend - in_lowering + d_passes)) < 1e-9, d_own
    # the sleep is the lowering's: npuspec's own work outside it is this graph's keys and wiring
    assert in_backend - in_lowering < 0.3, (in_backend, in_lowering)
