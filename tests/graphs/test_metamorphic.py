"""Metamorphic suite (issue 34): verify steps wrapped in operations on their outputs equal eager.

Each verify step the backend fuses (tests/graphs/metamorphic_steps.py) is wrapped in
operations on its outputs that a pattern, the row-independence proof or the padding dispatcher
could get wrong: reductions over the batch (min, max, sum, mean, cumsum), flip and sort along
it, `torch.where` against a batch statistic, in-place writes (`+= 1`, `[0] = ...`, `clamp_`),
and an output returned with views of it. One compiled function is called at batch sizes
1..17 in a seeded random order, so Dynamo recompiles for dynamic shapes (unmarked) or one
graph serves every size with padding rows (`mark_token_dim`), under both lowerings, with
capture on and off. After every call the outputs must be `torch.equal` to eager's (the only
float outputs are means of small integers: exact on both sides), the outputs must share
storage exactly where eager's do (a view of an output stays a view of it), and every earlier
call's outputs must still hold their values (no output aliases a static buffer that a later
replay overwrites).

CI runs every wrapper (several in one compiled function), every lowering and both capture
settings on fewer sizes; `-m slow` runs the full cross product, one wrapper per compile.
"""
import random
import zlib

import pytest
import torch

from metamorphic_steps import CROSS, ROWWISE, STEP, STEPS, WRAPPERS, K, wrapped
from npuspec import counters
from npuspec.graphs import mark_token_dim

ALL_SIZES = tuple(range(1, 18))


def _sizes(name: str, sizes=ALL_SIZES) -> list:
    order = list(sizes)
    random.Random(zlib.crc32(name.encode())).shuffle(order)
    return order


@pytest.fixture(autouse=True)
def _recompile_room():
    """Unmarked, the batch sizes give a static graph, a dynamic one and B=1's: room for them
    and for the wrappers' own guards."""
    old = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    torch._dynamo.config.recompile_limit = old


def _compile(fn, lowering, capture):
    return torch.compile(fn, backend="npuspec", options={
        "lowering": lowering, "capture": capture, "max_num_seqs": 16,
        "speculative_config": {"method": "ngram", "num_speculative_tokens": K}})


def _shares(outs) -> list:
    """Which outputs share storage (eager: a view of an output shares it with the output)."""
    keys = [o.untyped_storage().data_ptr() if o.numel() else None for o in outs]
    return [[a is not None and a == b for b in keys] for a in keys]


def _check(got, want, where):
    assert isinstance(got, tuple) and len(got) == len(want), (where, type(got))
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype and g.shape == w.shape, (where, i, g, w)
        assert torch.equal(g, w), (where, i, g, w)


def run_case(step, wrappers, lowering, capture, marked, sizes, seed=0):
    """Call one compiled function at every size in `sizes`; compare each call with eager."""
    fn = wrapped(step, wrappers)
    f = _compile(fn, lowering, capture)
    before = counters.snapshot()
    kept = []
    for i, B in enumerate(sizes):
        args = step.make(B, seed * 1000 + i)
        want = fn(*[a.clone() for a in args])
        if marked:
            for a in args:
                mark_token_dim(a)
        got = f(*args)
        where = (fn.__name__, lowering, capture, marked, B)
        _check(got, want, where)
        assert _shares(got) == _shares(want), (where, "outputs alias other outputs as in eager")
        kept.append((got, tuple(w.clone() for w in want), where))
    for got, want, where in kept:  # no later call wrote into an earlier call's outputs
        _check(got, want, where + ("after every call",))
    d = counters.delta(before)
    # a verify pattern was fused (else this compared eager with eager)
    assert d.get("verify_patterns_matched", 0) >= 1, (fn.__name__, d)
    if capture and marked:  # one graph: the paths taken are known
        assert d.get("graph_replays", 0) == _replays(wrappers, sizes), (fn.__name__, d)


def _replays(wrappers, sizes) -> int:
    """Replays of one captured graph (max_num_seqs=16: requests 1, 2, 4, 8, 16 captured):
    a row-wise graph is padded to the next size, any other replays at those sizes only."""
    if all(w in ROWWISE for w in wrappers):
        return sum(B <= 16 for B in sizes)
    return sum(B in (1, 2, 4, 8, 16) for B in sizes)


# -- CI: every wrapper, every lowering, both capture settings, fewer compiles and sizes --------
# Several wrappers share one compiled function (each in-place one on its own call of the step).
# Captured, the cross-row wrappers make a graph that replays at exact sizes only and the
# row-wise ones a padded graph, so they are compiled apart; uncaptured, all together.
GROUPS = {"cross": CROSS, "rowwise": ROWWISE, "all": WRAPPERS}
# (step, wrappers, capture, marked). Marked: one graph for every size. Unmarked: Dynamo's
# static graph at B=3, B=1's own graph, and a dynamic one from B=6 on.
EAGER_CI = [("greedy_emit", "cross", True, True), ("greedy_emit", "rowwise", True, True),
            ("sample_step", "cross", True, True), ("sample_step", "rowwise", True, True),
            ("greedy_count", "all", True, False), ("onehot_step", "all", False, True),
            ("greedy_count", "all", False, False)]
# Inductor compiles take seconds each (and ~20 s to warm up); the second case hits Inductor's
# FX graph cache (capture does not change the lowered graph)
INDUCTOR_CI = [("greedy_emit", "all", True, True), ("greedy_emit", "all", False, True)]
# B=1; 6 pads to 8 requests; 17 is past the ladder's 16 (eager); 4 is a captured size
CI_SIZES = (3, 1, 6, 17, 4)


def _ids(cases):
    return [f"{s}-{g}-{'capture' if c else 'nocapture'}-{'marked' if m else 'auto'}"
            for s, g, c, m in cases]


@pytest.mark.parametrize("step,group,capture,marked", EAGER_CI, ids=_ids(EAGER_CI))
def test_wrapped_step_equals_eager_eager_lowering(step, group, capture, marked):
    run_case(STEP[step], GROUPS[group], "eager", capture, marked, CI_SIZES)


@pytest.mark.parametrize("step,group,capture,marked", INDUCTOR_CI, ids=_ids(INDUCTOR_CI))
def test_wrapped_step_equals_eager_inductor(step, group, capture, marked):
    run_case(STEP[step], GROUPS[group], "inductor", capture, marked, CI_SIZES)


def test_ci_covers_every_wrapper_lowering_and_capture_setting():
    for cases in (EAGER_CI, INDUCTOR_CI):
        assert {w for _, g, _, _ in cases for w in GROUPS[g]} == set(WRAPPERS)
        assert {c for _, _, c, _ in cases} == {True, False}
    assert set(CROSS) | set(ROWWISE) == set(WRAPPERS)


# -- slow: the full cross product, one wrapper per compile, B = 1..17 --------------------------
@pytest.mark.slow
@pytest.mark.parametrize("marked", [True, False], ids=["marked", "auto"])
@pytest.mark.parametrize("capture", [True, False], ids=["capture", "nocapture"])
@pytest.mark.parametrize("lowering", ["eager", "inductor"])
@pytest.mark.parametrize("wrapper", WRAPPERS, ids=[w.__name__ for w in WRAPPERS])
@pytest.mark.parametrize("step", STEPS, ids=[s.name for s in STEPS])
def test_full_cross_product(step, wrapper, lowering, capture, marked):
    name = f"{step.name}-{wrapper.__name__}-{lowering}-{capture}-{marked}"
    run_case(step, [wrapper], lowering, capture, marked, _sizes(name),
             seed=zlib.crc32(name.encode()) % 1000)
