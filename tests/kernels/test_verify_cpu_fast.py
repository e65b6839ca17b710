"""The CPU lowering's standard-verify fast path (`npuspec_standard_rows`) on the layouts that
exercise its online softmax: the max moving in every chunk, masked (-inf) chunks, a row whose
only finite logit is the draft, tails shorter than a vector, low-precision logits."""
from __future__ import annotations

import math

import pytest
import torch

from npuspec.kernels import verify_cpu
from npuspec.kernels.verify import _padded_drafts, rejection_sample_reference

pytestmark = pytest.mark.skipif(not verify_cpu.available(), reason="no C++ toolchain")


def _draws(B, K, V, seed):
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(B, K, dtype=torch.float64, generator=g).float()
    e = torch.empty(B, V).exponential_(generator=g)
    return g, u, e


def _layout(name, B, K, V, g):
    """float32 [B, K+1, V] logits with a named adversarial shape."""
    base = torch.randn(B, K + 1, V, generator=g)
    if name == "ramp":        # the running max moves in every chunk: every chunk is rescaled
        return base * 0.1 + torch.linspace(-30, 5, V)
    if name == "max_last":    # the max is the very last element, in the tail
        out = base * 2
        out[..., -1] = 20.0
        return out
    if name == "masked":      # most of each row is -inf: whole chunks contribute nothing
        out = torch.full((B, K + 1, V), -math.inf)
        keep = torch.randint(0, V, (B, K + 1, 3), generator=g)
        return out.scatter(-1, keep, base[..., :3] * 3)
    if name == "wide":        # logits 100 apart: exps underflow to 0 for most entries
        return base * 40
    return base * 3


def _drafts(logits, K, g):
    B, _, V = logits.shape
    top = logits[:, :K].argmax(-1)
    pick = torch.rand(B, K, generator=g) < 0.6                  # drawn first, as before
    x = torch.where(pick, top, torch.randint(0, V, (B, K), generator=g))
    x[torch.rand(B, K, generator=g) < 0.1] = -1
    return x


@pytest.mark.parametrize("name", ["ramp", "max_last", "masked", "wide", "plain"])
@pytest.mark.parametrize("V", [7, 2049, 5000])
@pytest.mark.parametrize("draft_probs", [False, True])
def test_fast_path_equals_reference(name, V, draft_probs):
    B, K = 48, 3
    g, u, e = _draws(B, K, V, V + len(name))
    logits = _layout(name, B, K, V, g)
    x = _drafts(logits, K, g)
    q = torch.softmax(torch.randn(B, K, V, generator=g) * 2, -1) if draft_probs else None
    t = torch.rand(B, generator=g) + 0.5
    t[::4] = 1.0            # t == 1 skips the division: both specialisations run
    t[1::7] = 0.0           # greedy rows inside a sampling batch
    kw = dict(temperature=t, uniforms=u, exponentials=e)
    ref = rejection_sample_reference(logits, x, q, **kw)
    cpu = rejection_sample_reference(logits, x, q, impl="cpu", **kw)
    assert torch.equal(ref[0], cpu[0]) and torch.equal(ref[1], cpu[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fast_path_low_precision_and_top_k_top_p(dtype):
    B, K, V = 40, 4, 3001
    g, u, e = _draws(B, K, V, 7)
    logits = (torch.randn(B, K + 1, V, generator=g) * 3).to(dtype)
    x = _drafts(logits.float(), K, g)
    t = torch.rand(B, generator=g) + 0.5
    kw = dict(temperature=t, top_k=torch.randint(0, 60, (B,), generator=g),
              top_p=torch.rand(B, generator=g) * 0.5 + 0.5, uniforms=u, exponentials=e)
    ref = rejection_sample_reference(logits, x, **kw)
    cpu = rejection_sample_reference(logits, x, impl="cpu", **kw)
    assert torch.equal(ref[0], cpu[0]) and torch.equal(ref[1], cpu[1])


def test_fast_path_is_taken_and_stops_at_the_emitting_row():
    """Rows after a request's emitting row are only checked for NaN/inf: their races stay 0."""
    B, K, V = 8, 4, 1000
    g, u, e = _draws(B, K, V, 3)
    logits = torch.randn(B, K + 1, V, generator=g)
    x = torch.randint(0, V, (B, K), generator=g)   # random drafts: row 0 rejects, mostly
    u.fill_(0.999)                                  # ... always, with these uniforms
    xpad = _padded_drafts(x, V)
    st = verify_cpu.cpu_row_stats(logits, xpad, None, torch.ones(B), None, e, None, random=True,
                                  entropy=False, early_exit=(u, torch.zeros(B, dtype=torch.bool)))
    assert (st.race_r[:, 0] >= 0).all() and (st.race_p[:, 1:] == 0).all()
    assert (st.race_r[:, 1:] == 0).all() and (st.px[:, 1:] == 0).all()
    assert torch.equal(st.rawmax, logits.amax(-1))  # every row still checked


@pytest.mark.parametrize("draft_probs", [False, True])
def test_kernel_emission_equals_the_decisions(draft_probs):
    """cpu_standard_verify decides and emits in C++; it must equal the reference decisions,
    and a request with a non-finite row emits nothing (as `_emit` does inside a graph)."""
    B, K, V = 64, 4, 3000
    g, u, e = _draws(B, K, V, 11)
    logits = _layout("plain", B, K, V, g)
    x = _drafts(logits, K, g)
    q = torch.softmax(torch.randn(B, K, V, generator=g) * 2, -1) if draft_probs else None
    t = torch.rand(B, generator=g) + 0.5
    t[1::5] = 0.0
    ref = rejection_sample_reference(logits, x, q, temperature=t, uniforms=u, exponentials=e)
    tt = torch.where(t > 0, t, 1.0)
    early = (u, ~(t > 0))
    out, num, rawmax = verify_cpu.cpu_standard_verify(logits, _padded_drafts(x, V), q, tt, None,
                                                      e, early)
    assert torch.equal(out, ref[0]) and torch.equal(num, ref[1])
    logits[3, K, 17] = math.nan                   # the bonus row: read by every request
    out, num, rawmax = verify_cpu.cpu_standard_verify(logits, _padded_drafts(x, V), q, tt, None,
                                                      e, early)
    assert rawmax[3, K].isnan() and num[3] == 0 and (out[3] == -1).all()
    assert torch.equal(out[4:], ref[0][4:]) and torch.equal(num[:3], ref[1][:3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("K", [0, 1, 4])
def test_all_greedy_step_takes_the_kernel_and_equals_the_reference(dtype, K, monkeypatch):
    """All-greedy, one-hot steps go to the kernel's greedy rows in one call (`_cpu_greedy`):
    the same tokens as the reference on ties, masked (-inf) vocab and -1 drafts."""
    from npuspec.kernels import verify as vf

    B, V = 12, 777
    g = torch.Generator().manual_seed(K * 10 + B)
    logits = (torch.randn(B, K + 1, V, generator=g) * 2).round()  # many ties: first max wins
    logits[:, :, 100:300] = -math.inf
    logits = logits.to(dtype)
    x = logits.float().argmax(-1)[:, :K].clone()
    if K:
        x[::3, -1] = (x[::3, -1] + 1) % V   # some requests reject their last draft
        x[1, 0] = -1                        # no draft: rejects
    calls = []
    real = vf._cpu_greedy
    monkeypatch.setattr(vf, "_cpu_greedy", lambda *a: calls.append(1) or real(*a))
    ref = rejection_sample_reference(logits, x)
    cpu = rejection_sample_reference(logits, x, impl="cpu")
    assert calls, "the all-greedy step did not take the kernel"
    assert torch.equal(ref[0], cpu[0]) and torch.equal(ref[1], cpu[1])
    bad = logits.clone()
    bad[3, K, 5] = float("nan")
    with pytest.raises(ValueError, match=rf"target_logits\[3, {K}\] contains NaN"):
        rejection_sample_reference(bad, x, impl="cpu")
