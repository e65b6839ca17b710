"""Per-step dispatch overhead of npuspec's graph capture layer on this machine.

    python -m npuspec.bench.graphs [--repeats 200] [--lowering eager|inductor]

For each K in {1, 3, 7} and B in {1, 8, 64, 256} requests, a step shaped like a speculative
decode step (tokens and positions [B*(K+1)], slots [B], drafts [B, K], temperature [B] ->
tokens [B, K+1], num_emitted [B]) but with a deliberately tiny body, so the time left is
dispatch, not model:

- plain: torch.compile(step, backend="npuspec", options={"capture": False}) — the compiled call;
- captured: the same with capture=True — key lookup, pad/copy into the static buffers, replay
  (on CPU: the compiled call on the static buffers plus the copy into the static outputs),
  slice and copy out the real rows.

overhead_us = captured - plain: medians over 5 alternating rounds of each, in one run. All four B are capture sizes, so no
step pays for padding rows in the model. On a device, replay is one graph launch instead of
the compiled call, so this CPU figure bounds the host-side bookkeeping.
"""
from __future__ import annotations

import argparse
import logging

import torch

from npuspec.bench.table import median, median_time, print_table
from npuspec.graphs import mark_token_dim

BATCHES = (1, 8, 64, 256)
KS = (1, 3, 7)
ROUNDS = 5


def step(tokens, positions, slots, drafts, temperature):
    B, K = drafts.shape
    t = (tokens + positions).view(B, K + 1)
    out = torch.where(t % 3 == 0, -1, t).to(torch.int32)
    n = (drafts >= 0).sum(-1).to(torch.int32) + (temperature > 0).to(torch.int32) + slots.to(torch.int32) * 0
    return out, n


def inputs(B: int, K: int):
    g = torch.Generator().manual_seed(B * 31 + K)
    args = (torch.randint(0, 1000, (B * (K + 1),), generator=g),
            torch.arange(B * (K + 1)),
            torch.arange(B),
            torch.randint(-1, 1000, (B, K), generator=g),
            torch.rand(B, generator=g))
    for i, a in enumerate(args):  # flat [B*(K+1)] tokens are their own size group
        mark_token_dim(a, group="tokens" if i < 2 else "rows")
    return args


def compiled(capture, lowering: str, K: int):
    opts = {"capture": capture, "lowering": lowering, "max_num_seqs": 256,
            "speculative_config": {"method": "ngram", "num_speculative_tokens": K}}
    return torch.compile(step, backend="npuspec", options=opts)


def measure(B: int, K: int, lowering: str, repeats: int) -> dict:
    torch._dynamo.reset()
    args = inputs(B, K)
    plain, captured = compiled(False, lowering, K), compiled(True, lowering, K)
    warm = inputs(2, K)  # trace with B > 1 so one dynamic graph serves B = 1 too... except
    plain(*warm), captured(*warm)  # Dynamo's size-1 specialisation, handled by its own graph
    ref = step(*args)
    got = captured(*args)
    assert all(torch.equal(a, b) for a, b in zip(ref, got)), (B, K)
    # Alternate short rounds of the two so that load drift on a shared machine hits both.
    tp, tc = [], []
    for _ in range(ROUNDS):
        tp.append(median_time(lambda: plain(*args), repeats=repeats // ROUNDS, warmup=5))
        tc.append(median_time(lambda: captured(*args), repeats=repeats // ROUNDS, warmup=5))
    t_plain, t_cap = median(tp), median(tc)
    return {"K": K, "B": B, "tokens": B * (K + 1), "plain_us": t_plain * 1e6,
            "captured_us": t_cap * 1e6, "overhead_us": (t_cap - t_plain) * 1e6,
            "ratio": t_cap / t_plain}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=500)
    p.add_argument("--lowering", default="eager", choices=["eager", "inductor"])
    p.add_argument("--batches", type=int, nargs="*", default=list(BATCHES))
    p.add_argument("--ks", type=int, nargs="*", default=list(KS))
    a = p.parse_args(argv)
    logging.getLogger("npuspec").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    rows = [measure(B, K, a.lowering, a.repeats) for K in a.ks for B in a.batches]
    print_table(rows, ["K", "B", "tokens", "plain_us", "captured_us", "overhead_us", "ratio"],
                title=f"graph dispatch overhead per step (CPU runner, lowering={a.lowering}, "
                      f"medians of {a.repeats})")
    return rows


if __name__ == "__main__":
    main()
