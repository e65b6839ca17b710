"""Counters tell the truth on warm starts (issue 13, point 5): on an Inductor FX-graph cache
hit the passes do not run, and the counts the cold compile recorded are replayed."""
import pytest
import torch

from npuspec import counters
from npuspec.passes import InductorVerifyPass

V, K = 17, 4


def greedy_step(target_logits, draft_token_ids):
    """vLLM's greedy spelling (tests/passes/test_corpus.py::vllm_style)."""
    target = target_logits.argmax(-1)
    acc = (target[:, :K] == draft_token_ids).int().cumprod(1)
    return acc.sum(1), target


@pytest.fixture
def inductor_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    with torch._inductor.config.patch(fx_graph_cache=True, force_disable_caches=False):
        yield tmp_path


def _compile_and_count(fn, args):
    torch._dynamo.reset()
    before, runs = counters.snapshot(), InductorVerifyPass.runs
    f = torch.compile(fn, backend="npuspec", options={"lowering": "inductor", "capture": False})
    out = f(*args)
    return out, counters.delta(before), InductorVerifyPass.runs - runs


def test_warm_start_replays_the_match_counts(inductor_dir):
    g = torch.Generator().manual_seed(0)
    logits, drafts = torch.randn(3, K + 1, V, generator=g), torch.randint(0, V, (3, K), generator=g)
    want = greedy_step(logits, drafts)
    cold, d_cold, runs_cold = _compile_and_count(greedy_step, (logits, drafts))
    warm, d_warm, runs_warm = _compile_and_count(greedy_step, (logits, drafts))
    assert runs_cold == 1 and runs_warm == 0  # the second compile hit Inductor's cache
    assert d_cold.get("verify_patterns_matched", 0) >= 1, d_cold
    matched = {k: v for k, v in d_cold.items() if k.startswith("verify_patterns_matched")}
    assert {k: d_warm.get(k) for k in matched} == matched, (d_cold, d_warm)
    for o in (cold, warm):
        assert all(torch.equal(a, b) for a, b in zip(o, want))
    files = list((inductor_dir / "npuspec-pass-counts").glob("*.json"))
    assert len(files) == 1


def test_unreadable_counts_are_not_replayed(inductor_dir):
    g = torch.Generator().manual_seed(1)
    args = (torch.randn(2, K + 1, V, generator=g), torch.randint(0, V, (2, K), generator=g))
    _compile_and_count(greedy_step, args)
    (f,) = (inductor_dir / "npuspec-pass-counts").glob("*.json")
    f.write_text('{"verify_patterns_matched": "lots", "other": 5}')
    _, d_warm, runs = _compile_and_count(greedy_step, args)
    assert runs == 0 and "verify_patterns_matched" not in d_warm and "other" not in d_warm


def test_warm_start_at_another_batch_size_replays_the_counts(inductor_dir):
    """A dynamic batch dim: Inductor's cache key has its symbol, so a graph compiled first at
    B=3 is a hit for one first called at B=5. The counts were keyed on the first call's
    sizes and came back 0 there (issue 34, found by tests/graphs/test_metamorphic.py)."""
    g = torch.Generator().manual_seed(2)
    counts = []
    for b in (3, 5):
        args = (torch.randn(b, K + 1, V, generator=g), torch.randint(0, V, (b, K), generator=g))
        for a in args:
            torch._dynamo.mark_dynamic(a, 0)
        out, d, runs = _compile_and_count(greedy_step, args)
        assert all(torch.equal(x, y) for x, y in zip(out, greedy_step(*args)))
        counts.append((runs, d.get("verify_patterns_matched.greedy_accept", 0)))
    assert counts == [(1, 1), (0, 1)]  # cold: the passes ran; warm: a hit, counts replayed
