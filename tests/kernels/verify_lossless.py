"""Statistical harness for the verify op: a tiny random "language model" over V tokens.

Target and draft distributions depend on the whole prefix (one table row per prefix), drafts are
sampled from the draft model, the op verifies them, and the positions after the emitted ones are
completed by plain target sampling (what the next decode steps would do). Lossless verification
means the (K+1)-token sequences are distributed exactly as target sampling.
"""
from __future__ import annotations

import torch

from npuspec.kernels.verify import rejection_sample_reference


def make_model(V: int, K: int, seed: int, sharp: float = 1.5):
    """Target logits per prefix depth d (rows indexed by the base-V prefix code) and draft probs."""
    g = torch.Generator().manual_seed(seed)
    target = [torch.randn(V ** d, V, generator=g) * sharp for d in range(K + 1)]
    # the draft resembles the target (so acceptance is neither ~0 nor ~1)
    draft = [torch.softmax(t * 0.7 + torch.randn(t.shape, generator=g), -1) for t in target[:K]]
    return target, draft


def _codes(tokens: torch.Tensor, V: int) -> torch.Tensor:
    """int64 [N, L+1]: base-V code of every prefix tokens[:, :d] for d = 0..L."""
    N, L = tokens.shape
    codes = [torch.zeros(N, dtype=torch.int64)]
    for d in range(L):
        codes.append(codes[-1] * V + tokens[:, d].clamp_min(0))
    return torch.stack(codes, 1)


def run(V: int, K: int, N: int, *, draft_probs: bool, block: bool, seed: int,
        impl: str = "reference"):
    """Returns (sequences int64 [N, K+1], accepted drafts [N], exact probability per cell)."""
    target, draft = make_model(V, K, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.empty(N, K, dtype=torch.int64)
    code = torch.zeros(N, dtype=torch.int64)
    for d in range(K):  # sample drafts from the draft model
        x[:, d] = torch.multinomial(draft[d][code], 1, generator=g).squeeze(1)
        code = code * V + x[:, d]
    c = _codes(x, V)                                                     # [N, K+1]
    logits = torch.stack([target[d][c[:, d]] for d in range(K + 1)], 1)  # [N, K+1, V]
    q = torch.stack([draft[d][c[:, d]] for d in range(K)], 1) if draft_probs else None
    u = torch.rand(N, K, dtype=torch.float64, generator=g).float()
    e = torch.empty(N, V).exponential_(generator=g)
    out, num = rejection_sample_reference(logits, x, q, temperature=torch.ones(N),
                                          block_verify=block, uniforms=u, exponentials=e,
                                          impl=impl)
    y = out.long()
    code = torch.zeros(N, dtype=torch.int64)
    for d in range(K + 1):  # complete the sequence by target sampling after the emitted tokens
        fill = d >= num.long()
        p = torch.softmax(target[d][code], -1)
        s = torch.multinomial(p, 1, generator=g).squeeze(1)
        y[:, d] = torch.where(fill, s, y[:, d])
        code = code * V + y[:, d]
    # exact probability of every full sequence
    probs = torch.ones(1, dtype=torch.float64)
    for d in range(K + 1):
        pd = torch.softmax(target[d].double(), -1)                       # [V^d, V]
        probs = (probs[:, None] * pd).reshape(-1)
    return y, num.long() - 1, probs


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0):
    """Pearson chi-square p-value; cells with expected count < min_expected are pooled."""
    n = counts.sum().double()
    exp = probs.double() * n
    small = exp < min_expected
    c = torch.cat([counts.double()[~small], counts.double()[small].sum().reshape(1)])
    ex = torch.cat([exp[~small], exp[small].sum().reshape(1)])
    keep = ex > 0
    c, ex = c[keep], ex[keep]
    stat = ((c - ex) ** 2 / ex).sum()
    df = c.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2)), \
        float(stat), df


def sequence_pvalue(V, K, N, *, draft_probs, block, seed, impl="reference"):
    y, acc, probs = run(V, K, N, draft_probs=draft_probs, block=block, seed=seed, impl=impl)
    code = _codes(y, V)[:, -1]
    counts = torch.bincount(code, minlength=V ** (K + 1))
    return chi_square_pvalue(counts, probs)[0], acc


def standard_acceptance_distribution(V: int, K: int, seed: int, draft_probs: bool):
    """Exact P(accepted drafts = n), n = 0..K, for standard verification (enumerating drafts)."""
    target, draft = make_model(V, K, seed)
    dist = torch.zeros(K + 1, dtype=torch.float64)

    def rec(d, code, pr, alive):
        if d == K:
            dist[K] += pr * alive
            return
        p = torch.softmax(target[d][code].double(), -1)
        q = draft[d][code].double()
        for v in range(V):
            if draft_probs:
                a = min(1.0, float(p[v] / q[v]))
            else:
                a = float(p[v])
            dist[d] += pr * q[v] * alive * (1 - a)
            rec(d + 1, code * V + v, pr * q[v], alive * a)

    rec(0, 0, 1.0, 1.0)
    return dist
