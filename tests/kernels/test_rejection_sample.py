"""npuspec::rejection_sample: contract, exactness across implementations, every verify mode."""
from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from npuspec import counters
from npuspec.kernels import rejection_sample, synthetic_rates_from_length
from npuspec.kernels.verify import (_entropy_theta, conditional_rates, reference_row_stats,
                                    rejection_sample_reference)

HERE = os.path.dirname(os.path.abspath(__file__))


def make_case(B, K, V, seed, *, greedy_frac=0.3, none_frac=0.1, draft_probs=False,
              dtype=torch.float32, scale=3.0):
    """Random logits/drafts/draws; ~half the drafts are the target argmax so some get accepted."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, K + 1, V, generator=g) * scale).to(dtype)
    top = logits[:, :K].float().argmax(-1)
    x = torch.where(torch.rand(B, K, generator=g) < 0.5, top,
                    torch.randint(0, V, (B, K), generator=g))
    x[torch.rand(B, K, generator=g) < none_frac] = -1
    q = torch.softmax(torch.randn(B, K, V, generator=g) * 2, -1) if draft_probs else None
    t = torch.rand(B, generator=g) * 1.5 + 0.2
    t[torch.rand(B, generator=g) < greedy_frac] = 0.0
    u = torch.rand(B, K, dtype=torch.float64, generator=g).float()
    e = torch.empty(B, V).exponential_(generator=g)
    return logits, x, q, t, u, e


def check_layout(out, num, x):
    """Emitted prefix = accepted drafts, then one token; -1 after; never past a -1 draft."""
    B, K1 = out.shape
    assert out.dtype == torch.int32 and num.dtype == torch.int32
    assert ((num >= 1) & (num <= K1)).all(), num
    for b in range(B):
        n = int(num[b])
        assert torch.equal(out[b, :n - 1].long(), x[b, :n - 1]), (out[b], x[b])
        assert (out[b, :n] >= 0).all() and (out[b, n:] == -1).all(), out[b]
        neg = (x[b] < 0).nonzero()
        if len(neg):
            assert n - 1 <= int(neg[0]), (n, x[b])


# ----------------------------------------------------------------------------------------------
# Contract: custom op, fake impl, compile
# ----------------------------------------------------------------------------------------------

def test_op_is_registered_with_fake_impl():
    from torch._subclasses.fake_tensor import FakeTensorMode
    assert hasattr(torch.ops.npuspec, "rejection_sample")
    with FakeTensorMode():
        logits = torch.empty(3, 5, 11)
        x = torch.empty(3, 4, dtype=torch.int64)
        out, num = torch.ops.npuspec.rejection_sample(logits, x, None, torch.empty(3), None, None,
                                                      torch.empty(3, 4), torch.empty(3, 11),
                                                      False, None, None, None)
        assert out.shape == (3, 5) and out.dtype == torch.int32
        assert num.shape == (3,) and num.dtype == torch.int32


def test_compiles_fullgraph_and_matches_eager():
    logits, x, q, t, u, e = make_case(4, 3, 50, 0, draft_probs=True)

    def step(logits, x, q, t, u, e):
        return rejection_sample(logits, x, q, temperature=t, uniforms=u, exponentials=e,
                                block_verify=True)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for a, b in zip(compiled(logits, x, q, t, u, e), step(logits, x, q, t, u, e)):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------------------------
# Exactness: reference vs the fused CPU lowering (hypothesis), and vs Triton (interpreter)
# ----------------------------------------------------------------------------------------------

MODES = ["greedy", "standard", "standard_q", "block", "block_q", "entropy", "entropy_block",
         "synthetic", "topk_topp"]


def mode_kwargs(mode, K, t, q, B, V, g):
    kw = dict(temperature=t)
    if mode == "greedy":
        kw["temperature"] = None
    if mode in ("block", "block_q", "entropy_block"):
        kw["block_verify"] = True
    if mode in ("entropy", "entropy_block"):
        kw["entropy_verify"] = (0.9, 0.4)
    if mode == "synthetic":
        kw["synthetic_rates"] = torch.linspace(0.9, 0.2, K)
    if mode == "topk_topp":
        kw["top_k"] = torch.randint(-1, V + 2, (B,), generator=g)
        kw["top_p"] = torch.rand(B, generator=g) * 0.7 + 0.3
    use_q = mode.endswith("_q") or mode == "topk_topp"
    return kw, (q if use_q else None)


MAX_ELEMS = 3_000_000  # keeps one hypothesis example well under a second on 2 cores


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(B=st.integers(1, 257), K=st.integers(1, 15), V=st.sampled_from([7, 1000, 32000]),
       mode=st.sampled_from(MODES), seed=st.integers(0, 2 ** 16), bf16=st.booleans())
def test_reference_equals_cpu_lowering(B, K, V, mode, seed, bf16):
    B = max(1, min(B, MAX_ELEMS // ((K + 1) * V)))  # cap the size, keep the shape awkward
    logits, x, q, t, u, e = make_case(B, K, V, seed, draft_probs=True,
                                      dtype=torch.bfloat16 if bf16 else torch.float32)
    kw, qq = mode_kwargs(mode, K, t, q, B, V, torch.Generator().manual_seed(seed))
    ref = rejection_sample_reference(logits, x, qq, uniforms=u, exponentials=e, **kw)
    cpu = rejection_sample_reference(logits, x, qq, uniforms=u, exponentials=e, impl="cpu", **kw)
    op = rejection_sample(logits, x, qq, uniforms=u, exponentials=e, **kw)  # dispatcher: cpu
    for a, b, c in zip(ref, cpu, op):
        assert torch.equal(a, b) and torch.equal(a, c), (mode, a, b)
    check_layout(*ref, x)


def test_cpu_lowering_is_compiled_not_a_fallback():
    from npuspec.kernels import verify_cpu
    before = counters.snapshot()
    logits, x, q, t, u, e = make_case(3, 2, 100, 1)
    rejection_sample(logits, x, temperature=t, uniforms=u, exponentials=e)
    assert verify_cpu.available()
    assert counters.delta(before).get("eager_fallbacks", 0) == 0


def test_triton_interpreter_equals_reference():
    """The Triton kernel under TRITON_INTERPRET=1 (set before triton is imported: subprocess)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, os.path.join(HERE, "verify_triton_cases.py")], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "all equal" in r.stdout, r.stdout


# ----------------------------------------------------------------------------------------------
# Modes
# ----------------------------------------------------------------------------------------------

def test_greedy_accepts_matching_prefix_then_argmax():
    V = 10
    logits = torch.randn(2, 4, V)
    top = logits.argmax(-1)
    x = top[:, :3].clone()
    x[0, 1] = (top[0, 1] + 1) % V          # request 0: mismatch at position 1
    out, num = rejection_sample(logits, x)
    assert num.tolist() == [2, 4]
    assert out[0].tolist() == [top[0, 0], top[0, 1], -1, -1]
    assert out[1].tolist() == top[1].tolist()


def test_greedy_ties_take_lowest_index():
    logits = torch.zeros(1, 2, 6)
    logits[0, :, 2] = logits[0, :, 4] = 1.0
    out, num = rejection_sample(logits, torch.tensor([[4]]))
    assert out.tolist() == [[2, -1]] and num.tolist() == [1]


@pytest.mark.parametrize("K", range(1, 16))
def test_every_k_all_modes_layout(K):
    B, V = 6, 37
    logits, x, q, t, u, e = make_case(B, K, V, K, draft_probs=True)
    g = torch.Generator().manual_seed(K)
    for mode in MODES:
        kw, qq = mode_kwargs(mode, K, t, q, B, V, g)
        ref = rejection_sample_reference(logits, x, qq, uniforms=u, exponentials=e, **kw)
        cpu = rejection_sample(logits, x, qq, uniforms=u, exponentials=e, **kw)
        assert all(torch.equal(a, b) for a, b in zip(ref, cpu)), mode
        check_layout(*ref, x)


def test_minus_one_draft_emits_a_target_sample_and_stops():
    V, K, N = 5, 3, 20000
    logits = torch.randn(1, K + 1, V).expand(N, -1, -1).contiguous()
    x = torch.tensor([[1, -1, 2]]).expand(N, -1)
    q = torch.full((N, K, V), 1.0 / V)
    out, num = rejection_sample(logits, x, q, temperature=torch.ones(N))
    assert (num <= 2).all()
    # the token at the -1 position is drawn from p_2 alone (no residual, q ignored there)
    at = out[num == 2, 1].long()
    emp = torch.bincount(at, minlength=V).double() / len(at)
    p = torch.softmax(logits[0, 1].double(), -1)
    assert (emp - p).abs().max() < 4 * math.sqrt(0.25 / len(at)) + 1e-3, (emp, p)
    # greedy rows: the argmax at the -1 position
    out_g, num_g = rejection_sample(logits[:1], torch.tensor([[int(logits[0, 0].argmax()), -1, 2]]))
    assert num_g.tolist() == [2] and out_g[0, 1] == logits[0, 1].argmax()


def test_mixed_greedy_and_random_rows():
    B, K, V = 16, 4, 50
    logits, x, q, t, u, e = make_case(B, K, V, 3, greedy_frac=0.5)
    out, num = rejection_sample(logits, x, temperature=t, uniforms=u, exponentials=e)
    g_out, g_num = rejection_sample(logits, x)
    greedy = t == 0
    assert greedy.any() and (~greedy).any()
    assert torch.equal(out[greedy], g_out[greedy]) and torch.equal(num[greedy], g_num[greedy])


def test_top_k_one_and_tiny_top_p_behave_greedy():
    B, K, V = 32, 3, 40
    logits, x, q, t, u, e = make_case(B, K, V, 4, greedy_frac=0.0)
    g_out, g_num = rejection_sample(logits, x)
    for kw in (dict(top_k=torch.ones(B, dtype=torch.int64)), dict(top_p=torch.full((B,), 1e-4))):
        out, num = rejection_sample(logits, x, temperature=t, uniforms=u, exponentials=e, **kw)
        assert torch.equal(out, g_out) and torch.equal(num, g_num), kw


def test_top_k_samples_stay_in_top_k():
    N, V, k = 4000, 30, 5
    logits = torch.randn(1, 2, V).expand(N, -1, -1).contiguous()
    x = torch.full((N, 1), -1)
    out, _ = rejection_sample(logits, x, temperature=torch.ones(N),
                              top_k=torch.full((N,), k))
    allowed = set(logits[0, 0].topk(k).indices.tolist())
    assert set(out[:, 0].tolist()) == allowed  # every top-k token shows up, nothing else


def test_seeded_request_independent_of_batch():
    V, K = 200, 4
    g = torch.Generator().manual_seed(0)
    row = torch.randn(1, K + 1, V, generator=g)
    xr = torch.randint(0, V, (1, K), generator=g)
    results = []
    for B, pos in ((1, 0), (5, 3), (9, 7)):
        logits = torch.randn(B, K + 1, V, generator=g)
        x = torch.randint(0, V, (B, K), generator=g)
        logits[pos], x[pos] = row[0], xr[0]
        gens = {pos: torch.Generator().manual_seed(1234)}
        out, num = rejection_sample(logits, x, temperature=torch.full((B,), 0.8), generators=gens,
                                    block_verify=True)
        results.append((out[pos].tolist(), int(num[pos])))
    assert results[0] == results[1] == results[2]


def test_synthetic_rates_from_length_guide_example():
    assert synthetic_rates_from_length(3.4, 5) == pytest.approx([1, 1, 0.4, 0, 0])
    assert synthetic_rates_from_length(1.0, 3) == [0.0, 0.0, 0.0]
    assert synthetic_rates_from_length(4.0, 3) == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="synthetic_acceptance_length"):
        synthetic_rates_from_length(5.5, 3)
    c = conditional_rates(torch.tensor([0.8, 0.4, 0.0, 0.0]))
    assert c.tolist() == pytest.approx([0.8, 0.5, 0.0, 0.0])


@pytest.mark.parametrize("temperature", [None, 1.0])
def test_synthetic_mean_length_and_per_position_rates(temperature):
    N, K, V = 20000, 5, 16
    logits = torch.randn(N, K + 1, V)
    x = torch.randint(0, V, (N, K))
    t = None if temperature is None else torch.full((N,), temperature)
    rates = torch.tensor(synthetic_rates_from_length(3.4, K))
    out, num = rejection_sample(logits, x, temperature=t, synthetic_rates=rates)
    mean = num.double().mean().item()
    se = num.double().std().item() / math.sqrt(N)
    assert abs(mean - 3.4) < 4 * se + 1e-9, (mean, se)
    # the guide's per-position behaviour: P(position i accepted) = a_i
    a = torch.tensor([0.9, 0.7, 0.4, 0.4, 0.1])
    out, num = rejection_sample(logits, x, temperature=t, synthetic_rates=a)
    acc = num.long() - 1
    for i in range(K):
        frac = (acc >= i + 1).double().mean().item()
        assert abs(frac - a[i].item()) < 4 * math.sqrt(0.25 / N), (i, frac)


def test_entropy_alpha_zero_threshold_is_posterior_threshold():
    B, K, V = 64, 3, 100
    logits, x, q, t, u, e = make_case(B, K, V, 5, greedy_frac=0.0)
    st_ = reference_row_stats(logits, torch.cat([x, -torch.ones(B, 1, dtype=torch.int64)], 1),
                              None, t, None, e, None, random=True, entropy=True)
    theta = _entropy_theta(st_, K, (0.7, 0.0))
    assert torch.equal(theta, torch.full_like(theta, 0.7))
    # behaviourally: entropy verify with alpha 0 == standard verify with u scaled by the threshold
    a = rejection_sample(logits, x, temperature=t, uniforms=u, exponentials=e,
                         entropy_verify=(0.7, 0.0))
    b = rejection_sample(logits, x, temperature=t, uniforms=u * 0.7, exponentials=e)
    assert all(torch.equal(i, j) for i, j in zip(a, b))


def test_entropy_acceptance_rises_with_alpha():
    N, K, V = 4000, 3, 64
    logits, x, q, t, u, e = make_case(N, K, V, 6, greedy_frac=0.0, none_frac=0.0, scale=1.0)
    means = []
    for alpha in (0.0, 0.3, 1.0, 3.0):
        _, num = rejection_sample(logits, x, temperature=torch.ones(N), uniforms=u,
                                  exponentials=e, entropy_verify=(1.0, alpha))
        means.append(num.double().mean().item())
    assert all(b > a for a, b in zip(means, means[1:])), means


# ----------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("impl", ["reference", "cpu"])
def test_non_finite_logits_raise(bad, impl):
    logits, x, q, t, u, e = make_case(3, 2, 20, 7)
    logits[1, 2, 5] = bad
    with pytest.raises(ValueError, match=r"target_logits\[1, 2\].*NaN or \+inf"):
        rejection_sample_reference(logits, x, temperature=t, uniforms=u, exponentials=e,
                                   impl=impl)
    with pytest.raises(ValueError, match="NaN"):
        rejection_sample(logits, x)  # greedy too: never a silent argmax of NaN


def test_minus_inf_logits_are_masked_tokens_never_sampled():
    N, V = 3000, 8
    logits = torch.randn(1, 2, V).expand(N, -1, -1).contiguous()
    logits[:, :, 3] = -math.inf
    out, num = rejection_sample(logits, torch.full((N, 1), 3), temperature=torch.ones(N))
    assert (num == 1).all() and not (out[:, 0] == 3).any()


def test_bad_shapes_name_the_argument():
    logits = torch.randn(2, 4, 10)
    with pytest.raises(ValueError, match="draft_token_ids"):
        rejection_sample(logits, torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(logits, torch.zeros(2, 3, dtype=torch.int64), torch.rand(2, 3, 9))
    with pytest.raises(ValueError, match="temperature"):
        rejection_sample(logits, torch.zeros(2, 3, dtype=torch.int64), temperature=torch.ones(3))
    with pytest.raises(ValueError, match="block_verify"):
        rejection_sample(logits, torch.zeros(2, 3, dtype=torch.int64), temperature=torch.ones(2),
                         synthetic_rates=torch.ones(3), block_verify=True)
    with pytest.raises(ValueError, match="posterior_threshold"):
        rejection_sample(logits, torch.zeros(2, 3, dtype=torch.int64), temperature=torch.ones(2),
                         entropy_verify=(1.5, 0.4))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_on_cuda_equals_reference():
    """The compiled Triton kernel on the GPU against the CPU reference (torch.equal)."""
    r = subprocess.run([sys.executable, os.path.join(HERE, "verify_triton_cases.py"), "cuda"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "all equal" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]


def test_no_drafts_k0_and_single_token_vocab():
    logits = torch.randn(3, 1, 10)
    x = torch.empty(3, 0, dtype=torch.int64)
    out, num = rejection_sample(logits, x)
    assert out[:, 0].tolist() == logits[:, 0].argmax(-1).tolist() and num.tolist() == [1, 1, 1]
    out, num = rejection_sample(logits, x, temperature=torch.ones(3), block_verify=True)
    assert num.tolist() == [1, 1, 1] and (out >= 0).all()
    out, num = rejection_sample(torch.randn(2, 3, 1), torch.zeros(2, 2, dtype=torch.int64),
                                temperature=torch.ones(2))
    assert out.tolist() == [[0, 0, 0]] * 2 and num.tolist() == [3, 3]


@pytest.mark.parametrize("impl", ["reference", "cpu"])
def test_bad_values_name_the_argument(impl):
    logits, x, q, t, u, e = make_case(3, 2, 20, 8)
    bad_t = t.clone()
    bad_t[0] = -1.0
    with pytest.raises(ValueError, match="temperature"):
        rejection_sample_reference(logits, x, temperature=bad_t, impl=impl)
    with pytest.raises(ValueError, match="top_p"):
        rejection_sample_reference(logits, x, temperature=t, top_p=torch.tensor([0.5, 0.0, 1.0]),
                                   impl=impl)
    bad_x = x.clone()
    bad_x[1, 0] = 20
    with pytest.raises(ValueError, match="draft_token_ids"):
        rejection_sample_reference(logits, bad_x, temperature=t, impl=impl)
