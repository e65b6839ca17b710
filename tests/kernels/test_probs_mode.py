"""rejection_sample(..., target_is_probs=True): the probability-input mode.

It takes the caller's finished target distribution p [B, K+1, V] and must return exactly what
the eager idiom computes from the same p, q, uniforms and exponentials: accept x_i iff
p(x_i)/q(x_i) >= u_i (one-hot: p(x_i) >= u_i), then argmax of max(p - q, 0) / E at the first
rejection (one-hot: p with x zeroed, / E), or argmax p / E at a -1 draft and the bonus row.
The independent spelling below walks each request with Python scalars-as-tensors; the op
computes the batch at once. They must be torch.equal."""
from __future__ import annotations

import pytest
import torch

import verify_lossless
from npuspec.kernels import rejection_sample
from npuspec.kernels.verify import rejection_sample_reference


def eager_probs_verify(p, x, q, u, e):
    """Request by request, position by position: the textbook standard verify on p."""
    B, K1, V = p.shape
    K = K1 - 1
    out = torch.full((B, K1), -1, dtype=torch.int32)
    num = torch.zeros(B, dtype=torch.int32)
    for b in range(B):
        n = 0
        while n < K and 0 <= int(x[b, n]) < V:
            xi = int(x[b, n])
            ratio = p[b, n, xi] if q is None else p[b, n, xi] / q[b, n, xi]
            if not bool(ratio >= u[b, n]):
                break
            out[b, n] = xi
            n += 1
        en = e[b] if e.dim() == 2 else e[b, n]
        if n < K and 0 <= int(x[b, n]) < V:        # rejected a real draft: the residual
            if q is None:
                r = p[b, n].clone()
                r[int(x[b, n])] = 0.0
            else:
                r = torch.clamp(p[b, n] - q[b, n], min=0)
        else:                                       # bonus row, or no draft here
            r = p[b, n]
        out[b, n] = int(torch.argmax(r / en))
        num[b] = n + 1
    return out, num


def make(B, K, V, seed, *, draft_probs, per_row_e=False, ties=True):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(B, K + 1, V, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(B, K, V, generator=g) + p[:, :K].log(), -1)
    q = q if draft_probs else None
    x = torch.where(torch.rand(B, K, generator=g) < 0.5, p[:, :K].argmax(-1),
                    torch.randint(0, V, (B, K), generator=g))
    x[torch.rand(B, K, generator=g) < 0.15] = -1
    u = torch.rand(B, K, dtype=torch.float64, generator=g).float()
    e = torch.empty((B, K + 1, V) if per_row_e else (B, V)).exponential_(generator=g)
    if ties:  # exact ties u == p/q must accept (>=), and q(x) = 0 < p(x) accepts (inf >= u)
        xs = x.clamp_min(0)[..., None]
        px = p[:, :K].gather(-1, xs).squeeze(-1)
        ratio = px if q is None else px / q.gather(-1, xs).squeeze(-1)
        tie = torch.rand(B, K, generator=g) < 0.2
        u = torch.where(tie, ratio, u)
        if q is not None:
            zero = (torch.rand(B, K, generator=g) < 0.1) & (x >= 0)
            q = q.scatter(-1, xs, torch.where(zero[..., None], 0.0, q.gather(-1, xs)))
    return p, x, q, u, e


@pytest.mark.parametrize("draft_probs", [False, True])
@pytest.mark.parametrize("per_row_e", [False, True])
def test_probs_mode_equals_eager_spelling(draft_probs, per_row_e):
    for seed in range(12):
        p, x, q, u, e = make(7, 4, 23, seed, draft_probs=draft_probs, per_row_e=per_row_e)
        want = eager_probs_verify(p, x, q, u, e)
        got = rejection_sample(p, x, q, target_is_probs=True, uniforms=u, exponentials=e)
        ref = rejection_sample_reference(p, x, q, target_is_probs=True, uniforms=u,
                                         exponentials=e)
        op = torch.ops.npuspec.rejection_sample(p, x, q, None, None, None, u, e, False, None,
                                                None, None, target_is_probs=True)
        for r in (got, ref, op):
            assert torch.equal(r[0], want[0]) and torch.equal(r[1], want[1]), (seed, r, want)


def test_probs_mode_edge_rows():
    """All accepted (bonus row), a -1 first draft, K = 0, and q(x) = 0 < p(x) (accepted)."""
    B, K, V = 3, 2, 5
    p = torch.softmax(torch.randn(B, K + 1, V, generator=torch.Generator().manual_seed(0)), -1)
    q = torch.full((B, K, V), 1.0 / V)
    x = torch.tensor([[1, 2], [-1, 3], [4, 0]])
    q[2, 0, 4] = 0.0                                 # p/q = inf at x = 4: accepted
    u = torch.tensor([[0.0, 0.0], [0.0, 0.0], [0.5, 2.0e9]])
    e = torch.ones(B, V)
    out, num = rejection_sample(p, x, q, target_is_probs=True, uniforms=u, exponentials=e)
    assert num.tolist() == [3, 1, 2]
    assert out[0, :2].tolist() == [1, 2] and out[0, 2] == p[0, 2].argmax()
    assert out[1, 0] == p[1, 0].argmax() and out[1, 1:].tolist() == [-1, -1]
    assert out[2, 0] == 4 and out[2, 1] == torch.clamp(p[2, 1] - q[2, 1], min=0).argmax()
    o0, n0 = rejection_sample(p[:, :1], x[:, :0], q[:, :0], target_is_probs=True,
                              uniforms=u[:, :0], exponentials=e)
    assert n0.tolist() == [1, 1, 1] and torch.equal(o0[:, 0].long(), p[:, 0].argmax(-1))


def test_probs_mode_compiles_fullgraph():
    p, x, q, u, e = make(4, 3, 17, 5, draft_probs=True)

    def f(p, x, q, u, e):
        return torch.ops.npuspec.rejection_sample(p, x, q, None, None, None, u, e, False, None,
                                                  None, None, target_is_probs=True)

    got = torch.compile(f, fullgraph=True, backend="aot_eager")(p, x, q, u, e)
    want = eager_probs_verify(p, x, q, u, e)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("kw,name", [({"temperature": torch.ones(2)}, "temperature"),
                                     ({"top_k": torch.ones(2)}, "top_k"),
                                     ({"top_p": torch.ones(2)}, "top_p"),
                                     ({"entropy_verify": (0.9, 0.1)}, "entropy_verify"),
                                     ({"synthetic_rates": torch.ones(2)}, "synthetic_rates"),
                                     ({"block_verify": True}, "block_verify"),
                                     ({"exponentials": torch.ones(2, 2, 7)}, "exponentials")])
def test_probs_mode_refuses_what_it_cannot_apply(kw, name):
    p, x = torch.softmax(torch.randn(2, 3, 7), -1), torch.zeros(2, 2, dtype=torch.long)
    with pytest.raises(ValueError, match=name):
        rejection_sample(p, x, target_is_probs=True, **kw)


def test_probs_mode_seeded_rows_use_their_generator():
    """A seeded row draws its uniforms, then its exponentials, from its own generator, whatever
    the default generator's state."""
    from npuspec.kernels.verify import draw_exponentials, draw_uniforms
    p, x, q, _, _ = make(3, 3, 13, 2, draft_probs=True, ties=False)
    outs = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        outs.append(rejection_sample(p, x, q, target_is_probs=True,
                                     generators={1: torch.Generator().manual_seed(9)}))
    g = torch.Generator().manual_seed(9)
    u = draw_uniforms(3, 3, "cpu", {1: g})
    e = draw_exponentials(3, 13, "cpu", {1: g})
    want = eager_probs_verify(p, x, q, u, e)
    for out, num in outs:
        assert torch.equal(out[1], want[0][1]) and num[1] == want[1][1]


@pytest.mark.parametrize("draft_probs", [False, True])
def test_probs_mode_lossless_reduced(monkeypatch, draft_probs):
    """The sequence-level chi-square test of test_verify_lossless, with p = softmax(logits)
    handed to the op in probability mode."""
    def via_probs(logits, x, q, *, temperature, block_verify, uniforms, exponentials, impl):
        assert not block_verify
        return rejection_sample_reference(torch.softmax(logits / temperature[:, None, None], -1),
                                          x, q, target_is_probs=True, uniforms=uniforms,
                                          exponentials=exponentials)

    monkeypatch.setattr(verify_lossless, "rejection_sample_reference", via_probs)
    pv, _ = verify_lossless.sequence_pvalue(5, 2, 30_000, draft_probs=draft_probs, block=False,
                                            seed=23)
    assert pv > 1e-3, pv
