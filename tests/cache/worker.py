"""One process of the cache tests: compile a tiny speculative verify step through the npuspec
backend with a cache directory, compare with eager, and write what happened as JSON.

    python tests/cache/worker.py OUT.json CACHE_DIR LOWERING [--barrier DIR N] [--slow S] [--shapes N] [--passes JSON]

--barrier: once imported, mark DIR and wait until N workers have (so that concurrent workers
           really start together, as soon as the slowest is ready rather than at a fixed time).
--slow:  seconds added to every lowering (makes a compile long enough for others to wait on it).
--shapes: how many different batch sizes to compile (one cache key each).
"""
import argparse
import json
import os
import sys
import time


def step(x, w1, w2, drafts):
    h = (x @ w1).relu()
    logits = h @ w2                               # [B, K+1, V]
    target = logits.argmax(-1)                    # [B, K+1]
    accepted = (target[:, :-1] == drafts).int().cumprod(-1).sum(-1)  # [B]
    return target, accepted


def _barrier(d: str, n: int, timeout: float = 300.0) -> None:
    os.makedirs(d, exist_ok=True)
    open(os.path.join(d, str(os.getpid())), "w").close()
    t0 = time.monotonic()
    while len(os.listdir(d)) < n:
        assert time.monotonic() - t0 < timeout, (d, os.listdir(d), n)
        time.sleep(0.01)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("cache_dir")
    ap.add_argument("lowering")
    ap.add_argument("--barrier", nargs=2, default=None, metavar=("DIR", "N"))
    ap.add_argument("--slow", type=float, default=0.0)
    ap.add_argument("--shapes", type=int, default=1)
    ap.add_argument("--passes", default=None,
                    help="JSON list: pass uuids to key with (the test computes them once, so "
                         "processes started minutes apart agree even while passes/ is edited)")
    a = ap.parse_args()

    import torch
    from torch._dynamo.utils import counters as dynamo_counters

    import npuspec.compilation.lowering
    from npuspec import counters

    if a.passes is not None:
        import npuspec.compilation.cache_keys as cache_keys
        pinned = tuple(json.loads(a.passes))
        cache_keys.pass_uuids = lambda: pinned

    if a.slow:
        inner = npuspec.compilation.lowering.LOWERINGS[a.lowering]

        def slow_lower(gm, example_inputs, opts):
            time.sleep(a.slow)
            return inner(gm, example_inputs, opts)

        npuspec.compilation.lowering.LOWERINGS[a.lowering] = slow_lower

    torch.manual_seed(0)
    K, D, V = 3, 16, 32
    w1, w2 = torch.randn(D, D), torch.randn(D, V)
    f = torch.compile(step, backend="npuspec", dynamic=False,
                      options={"cache_dir": a.cache_dir, "lowering": a.lowering, "capture": False})
    if a.barrier:
        _barrier(a.barrier[0], int(a.barrier[1]))
    from npuspec.compilation.cache import current

    equal, keys = True, []
    t0 = time.perf_counter()
    for b in range(1, a.shapes + 1):
        x, d = torch.randn(b, K + 1, D), torch.randint(0, V, (b, K))
        got, want = f(x, w1, w2, d), step(x, w1, w2, d)
        equal &= all(torch.equal(g, w) for g, w in zip(got, want))
        keys.append(current().key)  # the cache key of the graph just compiled
    secs = time.perf_counter() - t0
    res = {"equal": equal, "seconds": secs, "counters": counters.snapshot(), "keys": keys,
           "inductor": dict(dynamo_counters["inductor"]),
           "aot": dict(dynamo_counters["aot_autograd"]), "pid": os.getpid()}
    with open(a.out, "w") as fh:
        json.dump(res, fh)


if __name__ == "__main__":
    sys.exit(main())
