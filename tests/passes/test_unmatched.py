"""A verify-like step that no pattern fused is named once, with its line (passes/unmatched.py);
fused steps and model forwards are not named. Outputs stay eager's either way."""
import inspect
import logging

import pytest
import torch

import test_near_miss as nm
from npuspec import _counters, counters
from npuspec.passes import unmatched


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(_counters, "_first", set())  # every line is new to each test
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _line_of(fn, text: str) -> int:
    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, ln in enumerate(lines) if text in ln)


def _run(fn, args, lowering="eager"):
    before = counters.snapshot()
    got = torch.compile(fn, backend="npuspec", options={"lowering": lowering})(*args)
    torch.manual_seed(0)
    return got, counters.delta(before)


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
@pytest.mark.parametrize("fn,count", [(nm.greedy_le, "cumprod"), (nm.greedy_cumsum_lt2, "cumsum"),
                                      (nm.greedy_wrong_dim, "cumprod")])
def test_an_unfused_verify_step_is_named_once_with_its_line(fn, count, lowering, caplog, no_fx_cache):
    args = nm._inputs(3)
    with caplog.at_level(logging.WARNING, logger="npuspec.passes"):
        got, d = _run(fn, args, lowering)
    assert d.get("verify_patterns_unmatched") == 1 and "verify_patterns_matched" not in d, d
    msgs = [r.getMessage() for r in caplog.records if "shape of a verify step" in r.getMessage()]
    assert len(msgs) == 1, msgs
    assert f"{nm.__file__}:{_line_of(fn, f'.{count}(')}" in msgs[0] and "docs/passes.md" in msgs[0]
    for g, e in zip(got, fn(*args)):
        assert torch.equal(g, e)
    # the same line again (a recompile): counted, not logged again
    torch._dynamo.reset()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="npuspec.passes"):
        _, d = _run(fn, args, lowering)
    assert d.get("verify_patterns_unmatched") == 1
    assert not [r for r in caplog.records if "shape of a verify step" in r.getMessage()]


def test_a_fused_step_is_not_named(caplog):
    with caplog.at_level(logging.WARNING, logger="npuspec.passes"):
        _, d = _run(nm.greedy_step, nm._inputs(4))
    assert d.get("verify_patterns_matched") == 1 and "verify_patterns_unmatched" not in d
    assert not [r for r in caplog.records if "shape of a verify step" in r.getMessage()]


def forward_like(x, w, mask):
    # attention-ish softmax, a position count from a mask comparison: no argmax, draw or gather
    pos = (mask > 0).long().cumsum(-1) - 1
    return torch.softmax(x @ w, -1), pos


def test_a_forward_with_counts_and_comparisons_is_not_named(caplog):
    args = (torch.randn(4, 8), torch.randn(8, 8), torch.ones(4, 8))
    with caplog.at_level(logging.WARNING, logger="npuspec.passes"):
        _, d = _run(forward_like, args)
    assert "verify_patterns_unmatched" not in d
    assert not caplog.records


def test_verify_like_counts_needs_a_comparison_near_the_count():
    def far(logits, drafts, p, q):  # an argmax, and a cumsum that no comparison is near
        return logits.argmax(-1), p.cumsum(-1).exp().sin().cos().tanh().sum(-1)

    gm = torch.fx.experimental.proxy_tensor.make_fx(far)(*nm._inputs(5))
    assert unmatched.verify_like_counts(gm.graph) == []
    gm = torch.fx.experimental.proxy_tensor.make_fx(nm.greedy_le)(*nm._inputs(5))
    assert [n.target for n in unmatched.verify_like_counts(gm.graph)] == [torch.ops.aten.cumprod.default]
