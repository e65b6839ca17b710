"""Capture never changes what a user's step computes (issue 13, point 3).

Each step below is a shape of code users write around a verify step: in-place mutation of an
input, ops across the batch, inputs refilled in place between calls, state, writes into a
buffer, non-contiguous inputs. Each runs through torch.compile(backend="npuspec") at several
batch sizes, under the eager and inductor lowerings, with its token dims left unmarked
(Dynamo's automatic dynamic shapes) and marked (`mark_token_dim`), and is compared with eager
after every call: outputs, every input afterwards, and the module's state.
"""
import copy
import threading

import numpy as np
import pytest
import torch
from torch import nn

from npuspec.graphs import mark_token_dim

V, H = 11, 6
ORDER = (3, 1, 5, 2, 8, 1, 3)
LOWERINGS = ("eager", "inductor")


def _compile(fn, lowering):
    return torch.compile(fn, backend="npuspec", options={"lowering": lowering, "max_num_seqs": 8})


class Case:
    """make(B, seed) -> dict of inputs; fn(**inputs) the step; module: state to compare.
    rows: the inputs marked as token inputs (with `pads`, declared padding values); padded:
    whether a marked run may pad (row-separable), else only exact sizes replay."""

    def __init__(self, name, fn, make, module=None, rows=("x",), padded=True, pads=None):
        self.name, self.fn, self.make, self.module, self.rows = name, fn, make, module, rows
        self.padded, self.pads = padded, pads or {}


def _g(seed):
    return torch.Generator().manual_seed(seed)


def logits_temp(B, seed):
    g = _g(seed)
    return {"x": torch.randn(B, V, generator=g), "temp": torch.rand(B, generator=g) + 0.5}


def logits_only(B, seed):
    return {"x": torch.randn(B, V, generator=_g(seed))}


def logits_bias(B, seed):
    g = _g(seed)
    return {"x": torch.randn(B, V, generator=g), "bias": torch.randn(V, generator=g)}


def div_(x, temp):
    x.div_(temp[:, None])  # vllm-ascend's logits.div_(temperature)
    return x.argmax(-1)


def itruediv(x, temp):
    x /= temp[:, None]
    return x.softmax(-1)


def iadd_bias(x, bias):
    x += bias
    return x.sum(-1)


def mul_returned(x):
    return x.mul_(2)


def divide(x, temp):  # no mutation, but padding rows' temperature must stay a safe divisor
    return (x / temp[:, None]).log_softmax(-1)


def int_divide(x, temp):
    d = (temp * 4).long()  # >= 2 for real rows
    return (x * 100).long() // d[:, None]


def flip0(x):
    return x.flip(0) * 2


def softmax0(x):
    return x.softmax(dim=0)


def batch_mean(x):
    return x - x.mean(0)


def cumsum0(x):
    return x.cumsum(0)


def roll0(x):
    return torch.roll(x, 1, 0)


def row_ops(x, bias):  # row-separable: must be padded and replayed, and equal eager
    h = (x + bias).relu() @ torch.ones(V, H)
    return torch.cat([h, h.sum(-1, keepdim=True)], dim=1).softmax(-1).transpose(0, 1)


class Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        self.count += 1
        return x * self.count


class Writer(nn.Module):
    """Writes rows into its cache buffer at indices the caller chose."""

    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.randn(16, V, generator=_g(99)))

    def forward(self, x, slots):
        self.cache[slots] = x
        return self.cache.sum(0)


def writer_inputs(B, seed):
    g = _g(seed)
    return {"x": torch.randn(B, V, generator=g), "slots": torch.randperm(15, generator=g)[:B] + 1}


def write_into(x, slots, cache):  # the user's cache tensor passed as an input
    cache[slots] = x * 2
    return x.sum(-1)


def write_into_inputs(B, seed):
    d = writer_inputs(B, seed)
    d["cache"] = torch.randn(16, V, generator=_g(98))
    return d


class Gather(Writer):
    """Writes, then reads back by the same indices (a KV cache's write and gather)."""

    def forward(self, x, slots):
        self.cache[slots] = x
        return self.cache[slots] * 2 + x


def transposed(B, seed):
    return {"x": torch.randn(V, B, generator=_g(seed)).t()}


def strided(B, seed):
    return {"x": torch.randn(B, 2 * V, generator=_g(seed))[:, ::2]}


def scale_rows(x):
    return x * torch.arange(x.shape[1]) + 1


CASES = [
    Case("div_", div_, logits_temp, rows=("x", "temp")),
    Case("itruediv", itruediv, logits_temp, rows=("x", "temp")),
    Case("iadd_bias", iadd_bias, logits_bias),
    Case("mul_returned", mul_returned, logits_only),
    Case("divide", divide, logits_temp, rows=("x", "temp")),
    Case("int_divide", int_divide, logits_temp, rows=("x", "temp")),
    Case("flip0", flip0, logits_only, padded=False),
    Case("softmax0", softmax0, logits_only, padded=False),
    Case("batch_mean", batch_mean, logits_only, padded=False),
    Case("cumsum0", cumsum0, logits_only, padded=False),
    # marked, Dynamo breaks the graph at a roll over an unbacked dim: nothing is compiled
    Case("roll0", roll0, logits_only, padded=None),
    Case("row_ops", row_ops, logits_bias),
    Case("counter", None, logits_only, module=Counter),
    # a write at indices whose padding value is not declared: exact sizes only
    Case("writer", None, writer_inputs, module=Writer, rows=("x", "slots"), padded=False),
    Case("write_into", write_into, write_into_inputs, rows=("x", "slots"), padded=False),
    # declared: padding rows write the scratch row 0, which the caller never reads
    Case("gather_declared", None, writer_inputs, module=Gather, rows=("x", "slots"),
         pads={"slots": 0}),
    Case("write_into_declared", write_into, write_into_inputs, rows=("x", "slots"),
         pads={"slots": 0}),
    Case("transposed", scale_rows, transposed),
    Case("strided", scale_rows, strided),
]


def _close(a, b):
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, (a.shape, b.shape)
        if a.is_floating_point():
            return torch.allclose(a, b, atol=1e-5, rtol=1e-5, equal_nan=True)
        return torch.equal(a, b)
    return a == b


def _scratch_free(case, k, t):
    """The declared scratch row (padding rows write it) is not compared."""
    return t[1:] if case.pads and k == "cache" else t


def _run(case, lowering, marked, order=ORDER):
    if case.module is not None:
        mod = case.module()
        ref, fn = copy.deepcopy(mod), mod
    else:
        ref = fn = case.fn
    f = _compile(fn, lowering)
    for i, B in enumerate(order):
        inp = case.make(B, i)
        ref_inp = {k: v.clone() for k, v in inp.items()}
        want = ref(**ref_inp)
        if marked:
            for k in case.rows:
                mark_token_dim(inp[k], 0, pad=case.pads.get(k))
        got = f(**inp)
        assert _close(got, want), (case.name, B, got, want)
        for k in inp:
            a, b = _scratch_free(case, k, inp[k]), _scratch_free(case, k, ref_inp[k])
            assert _close(a, b), (case.name, B, k, a, b)
        if case.module is not None:
            for (n, a), (_, b) in zip(mod.named_buffers(), ref.named_buffers()):
                a, b = _scratch_free(case, n, a), _scratch_free(case, n, b)
                assert _close(a, b), (case.name, B, n, a, b)


def _inductor_fails_too(case) -> bool:
    f = torch.compile(case.fn, backend="inductor")
    try:
        for i, B in enumerate(ORDER):
            f(**case.make(B, i))
    except torch._dynamo.exc.BackendCompilerFailed:
        return True
    return False


@pytest.mark.parametrize("marked", [False, True], ids=["auto", "marked"])
@pytest.mark.parametrize("lowering", LOWERINGS)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_step_equals_eager(case, lowering, marked, fresh_dynamo, delta):
    try:
        _run(case, lowering, marked)
    except torch._dynamo.exc.BackendCompilerFailed as e:
        torch._dynamo.reset()
        if lowering == "inductor" and case.module is None and _inductor_fails_too(case):
            pytest.xfail(f"backend='inductor' fails on this step too: {str(e)[:200]}")
        raise
    d = delta()
    if marked and case.padded is not None:  # row-separable steps are padded (every call replays); the others are not
        assert ("eager_fallbacks" not in d) == case.padded, d
        if case.padded:
            assert d["graph_replays"] == len(ORDER), d


@pytest.mark.parametrize("lowering", LOWERINGS)
def test_refilled_inputs_are_never_stale(lowering, fresh_dynamo):
    """The caller reuses one tensor and refills it in place (numpy view, .data), so the
    tensor's version counter does not move: every call must still see the new values."""
    x = torch.zeros(4, V)
    w = torch.zeros(V)  # not a token input: copied whole
    f = _compile(lambda x, w: x * 2 + w, lowering)
    for i in range(4):
        x.numpy()[:] = np.random.default_rng(i).standard_normal((4, V))
        w.data.copy_(torch.full((V,), float(i)))
        mark_token_dim(x, 0)
        assert torch.equal(f(x, w), x * 2 + w), i


@pytest.mark.parametrize("lowering", LOWERINGS)
def test_two_threads_share_one_compiled_step(lowering, fresh_dynamo):
    f = _compile(lambda x, b: (x + b).softmax(-1) * x.sum(-1, keepdim=True), lowering)
    for B in (1, 2, 3, 5, 8):  # compile and capture first, on one thread
        x = torch.randn(B, V)
        mark_token_dim(x, 0)
        f(x, torch.ones(V))
    bad = []

    def work(seed):
        g = _g(seed)
        for j in range(150):
            B = int(torch.randint(1, 9, (1,), generator=g))
            x, b = torch.randn(B, V, generator=g), torch.randn(V, generator=g)
            want = (x + b).softmax(-1) * x.sum(-1, keepdim=True)
            mark_token_dim(x, 0)
            if not torch.allclose(f(x, b), want, atol=1e-5):
                bad.append((seed, j))

    ts = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not bad, f"{len(bad)} of 600 calls differ from eager"
