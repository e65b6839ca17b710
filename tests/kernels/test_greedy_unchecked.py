"""rejection_sample(..., checks=False): the greedy step exactly as the eager idiom computes it
on every input (what the passes' greedy replacements call), where the default refuses NaN or
+inf logits, rows of only -inf and draft ids outside [-1, V) with a ValueError."""
import contextlib

import pytest
import torch

from npuspec.kernels import native_cpu, rejection_sample
from npuspec.kernels.verify import greedy_as_written_ref


def eager_greedy(logits, drafts):
    target = logits.argmax(dim=-1)
    n = (drafts == target[:, :-1]).cumprod(-1).sum(-1)
    pos = torch.arange(target.shape[1])
    return torch.where(pos[None, :] <= n[:, None], target, -1), n


def _nasty(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, 5, 17, generator=g)
    drafts = logits.argmax(-1)[:, :4].clone()
    logits[0, 1, 3] = float("nan")                  # NaN wins torch.argmax
    logits[1, 0, 2] = float("inf")
    logits[1, 0, 9] = float("inf")                  # two +inf: the first
    logits[2, 2] = float("-inf")                    # argmax 0
    logits[3, 4, 5] = float("nan")                  # in the bonus row
    drafts[4, 1] = 99                               # outside [-1, V): never equal
    drafts[5, 0] = -1
    return logits, drafts


@pytest.mark.parametrize("native", [False, True])
def test_unchecked_greedy_is_the_eager_idiom(native):
    if native and not native_cpu.install():
        pytest.skip("the native ops did not build")
    ctx = native_cpu.bypassed() if not native else contextlib.nullcontext()
    with ctx:
        for seed in range(4):
            logits, drafts = _nasty(seed)
            out, num = rejection_sample(logits, drafts, checks=False)
            want_out, want_n = eager_greedy(logits, drafts)
            assert torch.equal(out.long(), want_out) and torch.equal(num.long() - 1, want_n)
            ref = greedy_as_written_ref(logits, drafts)
            assert torch.equal(out, ref[0]) and torch.equal(num, ref[1])
            with pytest.raises(ValueError, match="NaN or \\+inf"):
                rejection_sample(logits, drafts)


def test_finite_inputs_keep_the_checked_result():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 4, 40, generator=g)
    drafts = logits.argmax(-1)[:, :3].clone()
    drafts[1, 1] = 0
    a, b = rejection_sample(logits, drafts, checks=False), rejection_sample(logits, drafts)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("kw,match", [
    (dict(temperature=torch.ones(2)), "checks=False with temperature"),
    (dict(draft_probs=torch.ones(2, 2, 7) / 7), "checks=False with draft_probs"),
    (dict(block_verify=True), "greedy step only"),
    (dict(top_k=torch.tensor([3, 3])), "checks=False with top_k"),
])
def test_unchecked_is_greedy_only(kw, match):
    logits, drafts = torch.randn(2, 3, 7), torch.zeros(2, 2, dtype=torch.long)
    with pytest.raises(ValueError, match=match):
        rejection_sample(logits, drafts, checks=False, **kw)
