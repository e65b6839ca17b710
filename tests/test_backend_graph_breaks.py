"""Graph breaks in a user's step are reported once, naming the line
(npuspec/compilation/graph_breaks.py); every piece still computes what eager does."""
import inspect
import logging

import torch

from npuspec import counters


def _line_of(fn, text):
    src, start = inspect.getsourcelines(fn)
    return start + next(i for i, ln in enumerate(src) if text in ln)


def nonzero_step(p, q, u):
    ratio = p / q
    rejected = (u > ratio).nonzero()          # data-dependent shape: Dynamo breaks here
    return ratio.sum() + rejected.shape[0]


def branch_step(p, q, u):
    n = (u <= p / q).long().cumprod(-1).sum(-1)
    if n.sum() > 3:                           # branching on a tensor's value
        return n + 1
    return n


def clean_step(p, q, u):
    return (u <= p / q).long().cumprod(-1).sum(-1)


def _args():
    g = torch.Generator().manual_seed(0)
    return torch.rand(3, 4, generator=g) + 0.1, torch.rand(3, 4, generator=g) + 0.1, torch.rand(3, 4, generator=g)


def _compile(fn):
    torch._dynamo.reset()
    return torch.compile(fn, backend="npuspec", options={"lowering": "eager", "capture": False})


def test_a_break_is_reported_once_with_its_line(caplog):
    for fn, marker, why in ((nonzero_step, ".nonzero()", "Dynamic shape operator"),
                            (branch_step, "if n.sum() > 3", "branching on a tensor")):
        before = counters.snapshot()
        with caplog.at_level(logging.WARNING, logger="npuspec"):
            caplog.clear()
            cf = _compile(fn)
            for _ in range(2):
                assert torch.equal(cf(*_args()), fn(*_args()))
        site = f"{__file__}:{_line_of(fn, marker)}"
        msgs = [r.getMessage() for r in caplog.records if "breaks the graph" in r.getMessage()]
        assert len(msgs) == 1 and site in msgs[0] and why in msgs[0], (site, msgs)
        assert counters.delta(before).get("graph_breaks") == 1
        with caplog.at_level(logging.WARNING, logger="npuspec"):  # a recompile: not again
            caplog.clear()
            _compile(fn)(*_args())
        assert not [r for r in caplog.records if "breaks the graph" in r.getMessage()]


def test_a_step_without_breaks_says_nothing(caplog):
    before = counters.snapshot()
    with caplog.at_level(logging.WARNING, logger="npuspec"):
        assert torch.equal(_compile(clean_step)(*_args()), clean_step(*_args()))
    assert "breaks the graph" not in caplog.text
    assert "graph_breaks" not in counters.delta(before)
