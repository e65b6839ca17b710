"""The field corpus's shapes, entry record and input makers (field_corpus.py)."""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

B, K, V = 4, 5, 29
RAGGED = [5, 3, 5, 2]          # drafts per request for the ragged (vLLM v1, vllm-ascend) entries
PLACEHOLDER = -1


@dataclasses.dataclass(frozen=True)
class Entry:
    name: str
    source: str
    fn: Callable
    make: Callable[[int], tuple]
    kind: str
    breaks: bool


# ============================================================================================
# inputs
# ============================================================================================
def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _dists(seed, b=B, k=K, v=V, zero_token0=False):
    """target logits [b, k+1, v], draft logits [b, k, v] (correlated), their softmaxes, and
    draft ids [b, k] drawn from the draft distribution."""
    g = _gen(seed)
    t_logits = torch.randn(b, k + 1, v, generator=g) * 2
    d_logits = 0.7 * t_logits[:, :k] + torch.randn(b, k, v, generator=g)
    if zero_token0:  # feifeibear's `sample` raises when it draws token 0
        t_logits[..., 0] = float("-inf")
        d_logits[..., 0] = float("-inf")
    p, q = t_logits.softmax(-1), d_logits.softmax(-1)
    ids = torch.multinomial(q.reshape(-1, v), 1, generator=g).view(b, k)
    return g, t_logits, d_logits, p, q, ids


def _greedy_drafts(target_ids, g, v=V):
    """Drafts equal to the target's choices up to a per-row cut (row 0: all of them), then a
    different token at the cut and random ones after it."""
    b, k = target_ids.shape
    drafts = target_ids.clone()
    cuts = [k, 0, 2, k - 1, 1, 3]
    for i in range(b):
        c = cuts[i % len(cuts)]
        if c < k:
            drafts[i, c] = (target_ids[i, c] + 1) % v
            drafts[i, c + 1:] = torch.randint(0, v, (k - c - 1,), generator=g)
    return drafts


def _ragged(seed, zero_token0=False):
    """Per-request distributions flattened to the ragged layout: rows [N, V] for the N drafted
    positions (N = sum(RAGGED)), `cu_num_draft_tokens` [B] (inclusive cumsum)."""
    g, t_logits, d_logits, p, q, ids = _dists(seed, zero_token0=zero_token0)
    sel = [(i, j) for i, n in enumerate(RAGGED) for j in range(n)]
    rows_i = torch.tensor([i for i, _ in sel])
    rows_j = torch.tensor([j for _, j in sel])
    cu = torch.tensor(RAGGED).cumsum(0)
    return dict(g=g, t_logits=t_logits, d_logits=d_logits, p=p, q=q, ids=ids, cu=cu,
                flat_t_logits=t_logits[rows_i, rows_j].contiguous(),
                flat_q=q[rows_i, rows_j].contiguous(), flat_ids=ids[rows_i, rows_j].contiguous(),
                bonus=torch.randint(0, V, (B, 1), generator=g, dtype=torch.int32))  # int32 ids
